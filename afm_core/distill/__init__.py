"""Multi-agent distillation: a MAS of teacher roles with real tools -> recorded runs -> CoA trajectories.

- :class:`~afm_core.distill.teacher.Teacher`: one chat model (an OpenAI-compatible endpoint, or the job's engine
  through the chat template).
- :class:`~afm_core.distill.mas.MultiAgentSystem`: planner, thinking agent, tool agents, reflection, verifier;
  one run -> one record.
- :func:`~afm_core.distill.convert.convert_run`: a record -> one CoA :class:`~afm_core.coa.Trajectory`.
- :func:`~afm_core.distill.runner.run_distill`: the job (``python -m jobs.distill``); the SFT filters are
  :mod:`afm_core.data.filters`.
"""

from afm_core.config.eval import MASConfig
from afm_core.distill.convert import NotConverted, convert_run, convert_runs
from afm_core.distill.mas import MultiAgentSystem, RoleTeacher
from afm_core.distill.teacher import ChatEndpointTeacher, ChatReply, ChatSampling, EngineTeacher, Teacher

__all__ = [
    "ChatEndpointTeacher", "ChatReply", "ChatSampling", "EngineTeacher", "MASConfig", "MultiAgentSystem",
    "NotConverted", "RoleTeacher", "Teacher", "convert_run", "convert_runs",
]  # fmt: skip
