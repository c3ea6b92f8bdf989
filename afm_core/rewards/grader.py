"""Pick and run the grader of a task: by its ``grader`` meta key, else by ``data_source`` / ``ability``.

Upstream AFM picks the scorer by ``data_source`` (``verl/verl/workers/reward_manager/afm.py``); here the
families are ``math`` (math-verify), ``code`` (sandbox tests), ``qa`` (exact match / F1) and ``judge``
(an LLM judge); :func:`grader_kind` maps a data source or ability to one of them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from afm_core.rewards.base import Grade
from afm_core.rewards.code import SandboxClient, grade_code, task_tests
from afm_core.rewards.format import grade_format
from afm_core.rewards.judge import LLMJudge
from afm_core.rewards.math import grade_math
from afm_core.rewards.qa import grade_qa
from afm_core.utils.plugins import build_plugin

GRADER_KINDS = ("math", "code", "qa", "judge")

_MATH_SOURCES = ("math", "aime", "amc", "gsm8k", "gms8k", "olympiad", "dapo", "numina", "deepscaler")
_CODE_SOURCES = ("livecodebench", "humaneval", "mbpp", "codecontests", "code", "taco", "apps", "leetcode")
_QA_SOURCES = ("hotpotqa", "nq", "triviaqa", "2wiki", "musique", "bamboogle", "popqa", "mhqa", "qa")


def grader_kind(data_source: str, ability: str | None = None) -> str:
    """``math``, ``code``, ``qa`` or ``judge`` for a data source (substring match, case-insensitive), then the
    ability (``math``, ``coding``/``code``, ``qa``/``mhqa``, ``web``); unknown sources go to the judge."""
    source = data_source.lower()
    for kind, keys in (("code", _CODE_SOURCES), ("math", _MATH_SOURCES), ("qa", _QA_SOURCES)):
        if any(key in source for key in keys):
            return kind
    ability = (ability or "").lower()
    if ability in ("math",):
        return "math"
    if ability in ("code", "coding"):
        return "code"
    if ability in ("qa", "mhqa"):
        return "qa"
    return "judge"


@dataclass
class Graders:
    """The graders of a run: the sandbox client for code tests and an optional LLM judge.

    ``judge=None``: judge-graded tasks fall back to exact match (``qa``), with reason prefix ``em_fallback``.
    """

    sandbox: SandboxClient | None = None
    judge: LLMJudge | None = None
    custom: Callable[..., Any] | None = None

    async def grade(
        self, kind: str, response: str, *, gold: str, question: str = "", meta: dict[str, Any] | None = None
    ) -> Grade:
        """Grade ``response`` with grader ``kind`` (one of :data:`GRADER_KINDS`), or with :attr:`custom` when set:
        a plug-in reward ``custom(response, *, gold, question, meta, kind) -> Grade | float`` (sync or async),
        which grades every task (verl's ``custom_reward_function``) and may call the built-in graders itself.
        A plug-in that raises gives a grader-error grade (score 0) naming the exception.

        Raises:
            ValueError: an unknown kind.
        """
        if self.custom is not None:
            return await self._custom(kind, response, gold=gold, question=question, meta=meta or {})
        if kind == "math":
            return grade_math(response, gold)
        if kind == "qa":
            return grade_qa(response, gold)
        if kind == "code":
            if self.sandbox is None:
                return Grade(0.0, "grader_error", error=True, extra={"message": "no sandbox configured"})
            return await grade_code(self.sandbox, response, task_tests(meta or {}))
        if kind == "judge":
            if self.judge is None:
                grade = grade_qa(response, gold)
                return Grade(grade.score, grade.reason, extra={**(grade.extra or {}), "judge": "em_fallback"})
            return await self.judge.grade(response, question, gold)
        raise ValueError(f"unknown grader {kind!r}; known: {', '.join(GRADER_KINDS)}")

    async def _custom(self, kind: str, response: str, **fields: Any) -> Grade:
        assert self.custom is not None
        try:
            result = self.custom(response, kind=kind, **fields)
            if inspect.isawaitable(result):
                result = await result
        except Exception as err:  # user code: its failure is this sample's grader error, not the job's
            return Grade(0.0, "grader_error", error=True, extra={"message": f"{type(err).__name__}: {err}"})
        if isinstance(result, Grade):
            return result
        if isinstance(result, bool) or not isinstance(result, (int, float)):
            return Grade(0.0, "grader_error", error=True,
                         extra={"message": f"reward_fn returned {result!r}, expected a Grade or a number"})  # fmt: skip
        return Grade(float(result), "custom")

    @staticmethod
    def format(response: str) -> Grade:
        return grade_format(response)

    async def close(self) -> None:
        if self.sandbox is not None:
            await self.sandbox.close()
        if self.judge is not None:
            await self.judge.close()


def custom_reward(entry: Any, key: str = "reward_fn") -> Callable[..., Any] | None:
    """The plug-in reward of a config entry ``{_target_: pkg.mod.fn | file.py:fn, **kwargs}`` (kwargs bound), or
    None for a null entry (:mod:`afm_core.utils.plugins`).

    Raises:
        afm_core.utils.plugins.PluginError: the target cannot be imported.
    """
    if not entry:
        return None
    return build_plugin(entry, key, _partial_=True)
