"""Acting: generation engines (vLLM in-process, OpenAI-compatible remote) and the one CoA agent loop.

- :class:`~afm_core.rollout.agent_loop.AgentLoop`: trajectories with tool calls → :class:`Rollout`.
- :class:`~afm_core.rollout.engine.GenerationEngine`: the token-in/token-out engine interface;
  :func:`~afm_core.rollout.factory.build_engine` picks vLLM or a remote server from config.
"""

from afm_core.rollout.agent_loop import AgentConfig, AgentLoop, observation_error_kind, sample_seed
from afm_core.rollout.engine import EngineDead, EngineError, Generation, GenerationEngine, SamplingConfig
from afm_core.rollout.types import AgentTask, FinishReason, Rollout, ToolCallRecord

__all__ = [
    "AgentConfig", "AgentLoop", "AgentTask", "EngineDead", "EngineError", "FinishReason", "Generation", "GenerationEngine",
    "Rollout", "SamplingConfig", "ToolCallRecord", "observation_error_kind", "sample_seed",
]  # fmt: skip
