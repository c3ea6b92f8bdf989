"""The schemas of ``conf/cluster/{local,slurm}.yaml``, picked by ``cluster.name``.

The job's data-parallel size follows from the cluster: ``cluster.dp`` locally (``tp * pp * dp`` processes), and
``nodes * tasks_per_node / (tp * pp)`` on Slurm (see :mod:`afm_core.launch.executor`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

from afm_core.config.checks import ConfigError, instantiate, require

#: ``cluster.gpu_memory_gb``'s default (GB, as sold: H100/A100 80GB); ``jobs.plan`` gives a local job's verdict for it.
DEFAULT_GPU_MEMORY_GB = 80
#: ``cluster.container_runtime``: pyxis/enroot (``srun --container-image``), or apptainer/singularity (``exec``).
CONTAINER_RUNTIMES = ("pyxis", "apptainer", "singularity")


def _check_common(cluster: LocalClusterConfig | SlurmClusterConfig) -> None:
    """The checks both cluster schemas share (the USR2 lead and the requeue count)."""
    require(cluster.signal_delay_s >= 0, "cluster.signal_delay_s", cluster.signal_delay_s, "seconds >= 0")
    require(cluster.max_num_timeout >= 0, "cluster.max_num_timeout", cluster.max_num_timeout, "an integer >= 0")


@dataclass
class LocalClusterConfig:
    name: str = "local"
    dp: int = 1
    gpus_per_node: Any = "auto"
    timeout_min: int = 600
    signal_delay_s: int = 120
    max_num_timeout: int = 3
    wait: bool = True
    setup: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        require(self.dp >= 1, "cluster.dp", self.dp, "data-parallel ranks, an integer >= 1")
        gpus = self.gpus_per_node
        require(
            gpus == "auto" or (isinstance(gpus, int) and not isinstance(gpus, bool) and gpus >= 0),
            "cluster.gpus_per_node",
            gpus,
            "auto or an integer >= 0",
        )
        require(self.timeout_min >= 1, "cluster.timeout_min", self.timeout_min, "minutes >= 1")
        _check_common(self)

    def data_parallel(self, model_parallel: int) -> int:
        return self.dp


@dataclass
class SlurmClusterConfig:
    name: str = "slurm"
    partition: str | None = None
    nodes: int = 1
    tasks_per_node: int = 1
    gpus_per_node: int = 0
    gpu_memory_gb: float = DEFAULT_GPU_MEMORY_GB
    checkpoint_write_gb_s: float | None = None
    cpus_per_task: int = 1
    mem: str | None = None
    time: int = 60
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclusive: bool = False
    array_parallelism: int = 16
    additional_parameters: dict[str, Any] = field(default_factory=dict)
    setup: list[str] = field(default_factory=list)
    wait: bool = False
    signal_delay_s: int = 120
    max_num_timeout: int = 3
    srun_args: list[str] = field(default_factory=list)
    container_image: str | None = None
    container_mounts: list[str] = field(default_factory=list)
    container_runtime: str = "pyxis"
    container_python: str = "python"

    def __post_init__(self) -> None:
        for key in ("nodes", "tasks_per_node", "cpus_per_task", "time", "array_parallelism"):
            require(getattr(self, key) >= 1, f"cluster.{key}", getattr(self, key), "an integer >= 1")
        require(self.gpus_per_node >= 0, "cluster.gpus_per_node", self.gpus_per_node, "an integer >= 0")
        require(
            self.container_runtime in CONTAINER_RUNTIMES,
            "cluster.container_runtime",
            self.container_runtime,
            f"one of {', '.join(CONTAINER_RUNTIMES)}",
        )
        require(
            self.container_image is not None or not self.container_mounts,
            "cluster.container_mounts",
            self.container_mounts,
            "mounts need cluster.container_image",
        )
        for mount in self.container_mounts:
            require(
                bool(mount) and "," not in mount,
                "cluster.container_mounts",
                self.container_mounts,
                "one SRC[:DST[:FLAGS]] per entry, no commas",
            )
        require(self.gpu_memory_gb > 0, "cluster.gpu_memory_gb", self.gpu_memory_gb, "a positive number")
        speed = self.checkpoint_write_gb_s
        require(speed is None or speed > 0, "cluster.checkpoint_write_gb_s", speed, "a positive number or null")
        _check_common(self)

    def data_parallel(self, model_parallel: int) -> int:
        ranks = self.nodes * self.tasks_per_node
        require(
            ranks % model_parallel == 0,
            "cluster.tasks_per_node",
            self.tasks_per_node,
            f"cluster.nodes * cluster.tasks_per_node = {ranks} ranks must be a multiple of "
            f"parallel.tp * parallel.pp = {model_parallel}",
        )
        return ranks // model_parallel


CLUSTER_SCHEMAS = {"local": LocalClusterConfig, "slurm": SlurmClusterConfig}
ClusterConfig = LocalClusterConfig | SlurmClusterConfig


def cluster_schema(cluster: Any) -> ClusterConfig:
    """The ``cluster`` group (plain dict or already checked) as the schema its ``name`` picks, checked.

    Raises:
        ConfigError: an unknown ``cluster.name``, an unknown key, a wrong type or a value out of range.
    """
    if isinstance(cluster, (LocalClusterConfig, SlurmClusterConfig)):
        return cluster
    name = cluster.get("name") if isinstance(cluster, dict) else None
    if name not in CLUSTER_SCHEMAS:
        raise ConfigError(f"cluster.name={name!r}: one of {', '.join(CLUSTER_SCHEMAS)} (conf/cluster/<name>.yaml)")
    return cast(ClusterConfig, instantiate(CLUSTER_SCHEMAS[name], cluster, prefix="cluster."))
