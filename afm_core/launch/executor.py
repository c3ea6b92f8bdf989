"""A submitit executor from the ``cluster`` config group (``conf/cluster/{local,slurm}.yaml``).

- ``cluster=local``: :class:`submitit.LocalExecutor` on this machine, one process per rank
  (``tp * pp * cp * cluster.dp`` tasks), with submitit's timeout signal and requeue-on-exit-code loop.
- ``cluster=slurm``: :class:`submitit.SlurmExecutor`; ``sbatch`` gets ``--nodes``, ``--ntasks-per-node`` (one task
  per rank), ``--gpus-per-node``, ``--cpus-per-task``, ``--mem``, ``--time`` (minutes), ``--account``, ``--qos``,
  ``--constraint``, ``--exclusive``, ``--signal=USR2@signal_delay_s``, ``--requeue`` (so the job can be requeued
  after preemption or timeout even where the site's ``JobRequeue`` is 0) and any ``additional_parameters``; the
  ``setup`` lines run in the batch script before ``srun``; ``cluster.srun_args`` are added to ``srun``'s own
  (``--kill-on-bad-exit=1``). ``cluster.container_image`` runs every rank in a container: pyxis/enroot or
  apptainer/singularity (:func:`container_command`). With ``nodes > 1`` the ranks span the nodes
  (``srun`` places ``tasks_per_node`` of them on each, block-wise); rank 0's node is ``MASTER_ADDR``.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import submitit

CLUSTERS = ("local", "slurm")


class ClusterConfigError(ValueError):
    """A ``cluster`` or ``parallel`` value cannot be used (names the field and its config file)."""


def _field(cluster: Mapping[str, Any], key: str) -> Any:
    if key not in cluster:
        raise ClusterConfigError(f"conf/cluster/{cluster.get('name')}.yaml: missing field cluster.{key}")
    return cluster[key]


def _positive_int(cluster: Mapping[str, Any], key: str) -> int:
    value = _field(cluster, key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ClusterConfigError(
            f"conf/cluster/{cluster['name']}.yaml: cluster.{key} must be a positive integer, got {value!r}"
        )
    return value


def world_size(cluster: Mapping[str, Any], parallel: Mapping[str, Any]) -> int:
    """Ranks of the job: ``tp * pp * cp * cluster.dp`` locally, ``nodes * tasks_per_node`` on Slurm.

    Raises:
        ClusterConfigError: unknown ``cluster.name``, a non-positive size, or (Slurm) a world size that is not a
            multiple of ``tp * pp * cp``.
    """
    name = cluster.get("name")
    if name not in CLUSTERS:
        raise ClusterConfigError(f"cluster.name must be one of {CLUSTERS}, got {name!r}")
    model_parallel = int(parallel.get("tp", 1)) * int(parallel.get("pp", 1)) * int(parallel.get("cp", 1))
    if name == "local":
        return model_parallel * _positive_int(cluster, "dp")
    size = _positive_int(cluster, "nodes") * _positive_int(cluster, "tasks_per_node")
    if size % model_parallel:
        raise ClusterConfigError(
            f"conf/cluster/slurm.yaml: cluster.nodes * cluster.tasks_per_node = {size} ranks is not a multiple of "
            f"parallel.tp * parallel.pp * parallel.cp = {model_parallel}"
        )
    return size


def visible_gpus() -> int:
    """GPUs this process may use: the ``CUDA_VISIBLE_DEVICES`` entries if set, else the NVIDIA driver's count.

    Read from the environment and ``/proc/driver/nvidia/gpus`` (not ``torch.cuda``: importing torch costs seconds
    in a process that only submits).
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    gpus = Path("/proc/driver/nvidia/gpus")
    return len(list(gpus.iterdir())) if gpus.is_dir() else 0


def container_command(cluster: Mapping[str, Any]) -> tuple[str | None, list[str]]:
    """How each rank's command runs in ``cluster.container_image``: ``(python, srun args)``.

    - no image: ``(None, [])``: submitit's default, the submitter's ``sys.executable``.
    - ``container_runtime=pyxis`` (NVIDIA pyxis + enroot): ``srun --container-image=IMAGE
      --container-mounts=SRC:DST,...`` and the image's ``container_python`` (github.com/NVIDIA/pyxis, "Usage").
    - ``apptainer`` / ``singularity``: the rank's python becomes ``apptainer exec [--nv] [--bind SRC:DST,...]
      IMAGE python`` (submitit's ``SlurmExecutor(python=...)``, added for singularity: facebookincubator/submitit
      PR 1729); ``--nv`` when the job has GPUs.

    The run dir, the submitit folder and the code must be visible at the same paths inside the image: mount them
    (``cluster.container_mounts=[/scratch:/scratch]``), or install the code in the image (``docker/Dockerfile``).

    Raises:
        ClusterConfigError: an unknown ``container_runtime``, or mounts without an image.
    """
    image = cluster.get("container_image")
    mounts = [str(m) for m in cluster.get("container_mounts") or []]
    if not image:
        if mounts:
            raise ClusterConfigError("cluster.container_mounts needs cluster.container_image")
        return None, []
    runtime, python = cluster.get("container_runtime", "pyxis"), str(cluster.get("container_python", "python"))
    if runtime == "pyxis":
        return python, [f"--container-image={image}", *([f"--container-mounts={','.join(mounts)}"] if mounts else [])]
    if runtime in ("apptainer", "singularity"):
        gpu = ["--nv"] if cluster.get("gpus_per_node") else []
        binds = ["--bind", ",".join(mounts)] if mounts else []
        return shlex.join([runtime, "exec", *gpu, *binds, str(image), *shlex.split(python)]), []
    raise ClusterConfigError(f"cluster.container_runtime={runtime!r}: one of pyxis, apptainer, singularity")


def make_executor(
    cluster: Mapping[str, Any], parallel: Mapping[str, Any], folder: str | Path, job_name: str
) -> submitit.Executor:
    """The executor for ``cluster``, writing submitit's pickles and the ranks' logs into ``folder``.

    Args:
        cluster: the ``cluster`` config group (resolved mapping).
        parallel: the ``parallel`` config group (``tp``, ``pp``, ``cp``).
        folder: submitit folder (may hold ``%j``/``%A``/``%a`` patterns); logs are
            ``<folder>/<job id>_<rank>_log.{out,err}``.
        job_name: the Slurm job name.
    Raises:
        ClusterConfigError: see :func:`world_size`; ``cluster.nodes > 1`` with ``cluster=local``.
    """
    ranks = world_size(cluster, parallel)
    if cluster["name"] == "local":
        gpus = cluster.get("gpus_per_node", "auto")
        executor = submitit.LocalExecutor(folder=folder, max_num_timeout=_field(cluster, "max_num_timeout"))
        executor.update_parameters(
            tasks_per_node=ranks,
            gpus_per_node=visible_gpus() if gpus == "auto" else int(gpus),
            timeout_min=_field(cluster, "timeout_min"),
            signal_delay_s=_field(cluster, "signal_delay_s"),
            setup=list(cluster.get("setup") or []),
        )
        return executor

    python, container_args = container_command(cluster)
    executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=_field(cluster, "max_num_timeout"), python=python)
    params: dict[str, Any] = {
        "job_name": job_name,
        "partition": cluster.get("partition"),
        "nodes": cluster["nodes"],
        "ntasks_per_node": cluster["tasks_per_node"],
        "gpus_per_node": cluster.get("gpus_per_node") or None,  # --gpus-per-node=0 is rejected on GPU-less sites
        "cpus_per_task": cluster.get("cpus_per_task"),
        "mem": cluster.get("mem"),
        "time": _positive_int(cluster, "time"),
        "account": cluster.get("account"),
        "qos": cluster.get("qos"),
        "constraint": cluster.get("constraint"),
        "exclusive": True if cluster.get("exclusive") else None,
        "signal_delay_s": _field(cluster, "signal_delay_s"),
        "array_parallelism": _positive_int(cluster, "array_parallelism"),
        "additional_parameters": {"requeue": True, **dict(cluster.get("additional_parameters") or {})},
        "setup": list(cluster.get("setup") or []) or None,
        # One rank failing ends the step: the others would wait for it in a collective until the timeout.
        "srun_args": ["--kill-on-bad-exit=1", *container_args, *list(cluster.get("srun_args") or [])],
    }
    executor.update_parameters(**{k: v for k, v in params.items() if v is not None})
    return executor
