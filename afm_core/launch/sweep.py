"""Hydra multirun on Slurm as ONE job array: ``python -m jobs.sft cluster=slurm -m optim.lr=1e-5,2e-5,4e-5``.

Hydra's basic launcher runs the app once per sweep member, in this process; each member gets its own run dir
(``hydra.sweep.dir/<hydra.job.num>``). With :class:`SlurmArraySweep` registered as a Hydra callback
(``conf/hydra/callbacks/slurm_array.yaml``, selected by ``cluster=slurm``), :func:`afm_core.launch.submit`
does not submit a member but hands its job to this module; when the multirun ends, all members are submitted
together by ``executor.submit_array`` as one ``sbatch --array=0-(N-1)%array_parallelism``. The ranks of member
``i`` log to ``SWEEP_DIR/logs/<array id>_i_<rank>_log.{out,err}`` (one submitit folder per array); its run dir
``SWEEP_DIR/i`` gets ``logs/job.json`` (pointing there) and ``logs/events.jsonl``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from afm_core.launch.distributed import without_rendezvous_env
from afm_core.launch.executor import ClusterConfigError, make_executor
from afm_core.launch.records import job_record, write_job_record
from afm_core.launch.requeue import RequeueableJob


@dataclass
class ArrayMember:
    """One sweep member waiting for the array submission."""

    job: RequeueableJob
    job_name: str
    world_size: int

    @property
    def run_dir(self) -> Path:
        return Path(self.job.cfg["run_dir"])


_members: list[ArrayMember] | None = None  # set between on_multirun_start and on_multirun_end


def collecting() -> bool:
    """True while a Slurm multirun collects its members (inside :class:`SlurmArraySweep`)."""
    return _members is not None


def _resources(member: ArrayMember) -> str:
    return json.dumps({"cluster": member.job.cfg["cluster"], "world_size": member.world_size}, sort_keys=True)


def add_member(member: ArrayMember) -> None:
    """Queue one member for the array (only while :func:`collecting`).

    Raises:
        ClusterConfigError: it asks for other resources than the first member (one array has one request).
    """
    if _members is None:
        raise RuntimeError("add_member outside a Slurm multirun")
    if _members and _resources(member) != _resources(_members[0]):
        raise ClusterConfigError(
            "the sweep changes cluster.* or the number of ranks between members; one job array needs one "
            "resource request: sweep those values in separate runs"
        )
    _members.append(member)


def submit_array(members: list[ArrayMember], sweep_dir: Path) -> list[Any]:
    """Submit ``members`` as one Slurm job array logging to ``sweep_dir/logs``; write each member's
    ``logs/job.json``; return the jobs."""
    first = members[0]
    folder = sweep_dir / "logs"
    executor = make_executor(first.job.cfg["cluster"], first.job.cfg["parallel"], folder, first.job_name)
    with without_rendezvous_env():  # as afm_core.launch.submit: inherited rendezvous variables stay here
        jobs = executor.submit_array([m.job for m in members])
    for member, job in zip(members, jobs):
        write_job_record(member.run_dir / "logs", job_record(job, member.job_name, "slurm", member.world_size))
    return jobs


class SlurmArraySweep(Callback):
    """Hydra callback: collect the members of a multirun, then submit them as one Slurm job array.

    With ``cluster.wait=true`` it blocks until every member ends and prints their results.
    """

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        global _members
        _members = []

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        global _members
        members, _members = _members or [], None
        if not members:
            return
        sweep_dir = Path(str(config.hydra.sweep.dir)).absolute()
        try:
            jobs = submit_array(members, sweep_dir)
        except Exception as err:  # Hydra turns callback exceptions into warnings: fail the command instead
            print(
                f"error: submitting the sweep as a Slurm job array failed: {type(err).__name__}: {err}", file=sys.stderr
            )
            raise SystemExit(1) from err
        array_id = str(jobs[0].job_id).split("_")[0]
        cluster = members[0].job.cfg["cluster"]
        print(
            f"Submitted Slurm job array {array_id}: {len(jobs)} members, at most {cluster['array_parallelism']} "
            f"at once, {members[0].world_size} rank(s) each"
        )
        for member, job in zip(members, jobs):
            print(f"  {job.job_id}  {member.run_dir}")
        print(f"  follow: python -m jobs.status {sweep_dir} --follow\n  logs:   {sweep_dir / 'logs'}")
        if cluster.get("wait"):
            for member, job in zip(members, jobs):
                print(f"{job.job_id} {member.run_dir}: {json.dumps(job.results()[0], default=str)}")
