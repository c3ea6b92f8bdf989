"""The sbatch script of ``recipe=afm_web_sft_32b`` (4 nodes x 8 GPUs) against its recorded copy, without a cluster.

Any change of resources (nodes, GPUs, tasks, CPUs, time, signal, requeue, srun flags) shows up as a line diff,
so it is a deliberate decision, never silent drift. Pattern: submitit's ``submitit/slurm/test_slurm.py``
(``test_make_sbatch_string`` with ``_sbatch_test_record.txt``). To accept a deliberate change:
``AFM_UPDATE_GOLDEN=1 python -m pytest tests/slurm/test_sbatch_golden.py`` and commit the file.
"""

from __future__ import annotations

import difflib
import os
import shlex
import sys
from pathlib import Path

import pytest
import submitit
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from afm_core.config import register_schemas
from afm_core.launch.executor import make_executor
from afm_core.utils.paths import repo_root

GOLDEN = Path(__file__).with_name("afm_web_sft_32b.sbatch")
RUN_DIR = "/scratch/RUN_DIR"  # stands for the run dir (the submitter's absolute path)


def sbatch_script(*overrides: str) -> str:
    """The batch script ``python -m jobs.sft *overrides`` would submit (the submitter's python replaced by ``python``).

    Call it with submitit's ``srun`` probe answered (see :func:`no_srun_needed`): the script is generated, never
    submitted, so no Slurm has to be installed.
    """
    register_schemas()
    with initialize_config_dir(config_dir=str(repo_root() / "conf"), version_base="1.3"):
        cfg = compose(config_name="sft", overrides=list(overrides))
    cluster = OmegaConf.to_container(cfg.cluster, resolve=True)
    parallel = OmegaConf.to_container(cfg.parallel, resolve=True)
    executor = make_executor(cluster, parallel, f"{RUN_DIR}/logs", "sft")
    text = executor._make_submission_file_text(executor._submitit_command_str, uid="golden")
    return text.replace(shlex.quote(sys.executable), "python")


@pytest.fixture(autouse=True)
def no_srun_needed(monkeypatch):
    """submitit's ``SlurmExecutor`` refuses to exist where ``srun`` is not on PATH (``SlurmExecutor.affinity``);
    its own tests mock the cluster the same way (``submitit/slurm/test_slurm.py``: ``mocked_slurm``)."""
    monkeypatch.setattr(submitit.SlurmExecutor, "affinity", classmethod(lambda cls: 1))


def assert_matches_recorded(script: str, golden: Path) -> None:
    if os.environ.get("AFM_UPDATE_GOLDEN") == "1":
        golden.write_text(script)
    recorded = golden.read_text()
    diff = "".join(difflib.unified_diff(recorded.splitlines(True), script.splitlines(True), str(golden), "generated"))
    assert not diff, (
        f"the sbatch script {golden.name} changed:\n{diff}\nIf deliberate: "
        f"AFM_UPDATE_GOLDEN=1 {Path(sys.executable).name} -m pytest {Path(__file__).name}"
    )


def test_web_sft_32b_sbatch_script_matches_the_recorded_one():
    script = sbatch_script("recipe=afm_web_sft_32b")
    assert_matches_recorded(script, GOLDEN)
    for line in (
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --time=2880",
        "#SBATCH --signal=USR2@120",
        "#SBATCH --requeue",
    ):
        assert line in script.splitlines()


CONTAINER = ("recipe=afm_web_sft_32b", "cluster.container_mounts=[/scratch:/scratch,/models:/models:ro]",
             "cluster.srun_args=['--cpu-bind=none','--mpi=pmix']")  # fmt: skip


def test_a_pyxis_container_job_runs_srun_with_the_image_mounts_and_extra_srun_args():
    script = sbatch_script(*CONTAINER, "cluster.container_image='nvcr.io#afm/afm:gpu'")
    assert_matches_recorded(script, GOLDEN.with_name("afm_web_sft_32b_pyxis.sbatch"))
    srun = script.splitlines()[-1]
    assert ("--kill-on-bad-exit=1 '--container-image=nvcr.io#afm/afm:gpu' "  # quoted: # starts a shell comment
            "--container-mounts=/scratch:/scratch,/models:/models:ro --cpu-bind=none --mpi=pmix "
            "python -u -m submitit.core._submit /scratch/RUN_DIR/logs") in srun  # fmt: skip


def test_an_apptainer_container_job_runs_each_rank_through_apptainer_exec_with_gpus_and_binds():
    script = sbatch_script(*CONTAINER, "cluster.container_image=/images/afm.sif", "cluster.container_runtime=apptainer")
    assert_matches_recorded(script, GOLDEN.with_name("afm_web_sft_32b_apptainer.sbatch"))
    srun = script.splitlines()[-1]
    assert ("--kill-on-bad-exit=1 --cpu-bind=none --mpi=pmix apptainer exec --nv --bind "
            "/scratch:/scratch,/models:/models:ro /images/afm.sif python -u -m submitit.core._submit") in srun  # fmt: skip


@pytest.mark.parametrize(
    "override, message",
    [("cluster.container_runtime=docker", "cluster.container_runtime='docker': one of pyxis, apptainer, singularity"),
     ("cluster.container_mounts=[/a:/a]", "cluster.container_mounts=\\['/a:/a'\\]: mounts need cluster.container_image"),
     ("+cluster.container=afm.sif", "cluster.container: Key 'container' not in 'SlurmClusterConfig'")],
)  # fmt: skip
def test_bad_container_settings_and_unknown_cluster_keys_fail_before_the_queue(override, message):
    from afm_core.config import ConfigError, check_config
    from afm_core.config.sft import SFTConfig

    register_schemas()
    with initialize_config_dir(config_dir=str(repo_root() / "conf"), version_base="1.3"):
        cfg = compose(config_name="sft", overrides=["cluster=slurm", "run_dir=/tmp/x", override])
    with pytest.raises(ConfigError, match=message):
        check_config(cfg, SFTConfig)
