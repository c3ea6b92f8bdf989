"""The schema of the RL job's ``engine`` group (``conf/engine/vllm.yaml``, the recipes' ``engine:`` overrides): the
vLLM engine each rank of ``jobs.rl`` runs beside its trainer (:class:`afm_core.rollout.vllm_settings.VLLMConfig`
less what the colocation imposes at run time: ``in_process``, ``distributed_executor_backend``,
``enable_sleep_mode``, ``afm_core.rl.colocation.Colocation.engine_overrides``)."""

from __future__ import annotations

from dataclasses import dataclass

from afm_core.config.checks import at_least_one, require
from afm_core.rollout.vllm_settings import VLLMSettings


@dataclass
class VLLMEngineConfig(VLLMSettings):
    """``engine`` of the RL job (``backend: vllm``): the engine's settings
    (:class:`afm_core.rollout.vllm_settings.VLLMSettings`, declared there once) and the backend, which must be vLLM.

    Raises:
        ConfigError: ``backend`` other than ``vllm`` (the RL engine runs in the job: the trainer's weights are
            synced into it), ``tensor_parallel_size`` or ``max_model_len`` < 1, ``gpu_memory_utilization`` not in
            ``(0, 1]``.
    """

    backend: str = "vllm"

    def __post_init__(self) -> None:
        require(
            self.backend == "vllm",
            "engine.backend",
            self.backend,
            "vllm: the RL job's engine runs in its ranks, the trainer's weights synced into it",
        )
        at_least_one("engine.tensor_parallel_size", self.tensor_parallel_size)
        util = self.gpu_memory_utilization
        require(0 < util <= 1, "engine.gpu_memory_utilization", util, "in (0, 1]")
        at_least_one("engine.max_model_len", self.max_model_len)
