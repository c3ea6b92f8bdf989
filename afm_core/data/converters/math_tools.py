"""The shared shape of the answer-with-calculator converters (:mod:`.gsm8k`, :mod:`.tora`): a worked math solution
whose tool calls (GSM8K's ``<<expr=result>>`` annotations, ToRA's python programs) become ``<code>`` calls with
their ``<observation>``, the prose between them ``<think>`` blocks, and the final answer ``<answer>\\boxed{}``
(kept with :func:`afm_core.data.converters.base.kept_trajectory`)."""

from __future__ import annotations

import re
from collections.abc import Callable

from afm_core.coa.observations import executed_output_observation
from afm_core.coa.parse import format_code_query
from afm_core.coa.trajectory import Step


def code_call(program: str, output: str) -> list[Step]:
    """A ``<code>`` call of ``program`` and its ``<observation>`` of ``output``, written as the live code tool
    writes them (:mod:`afm_core.coa.observations`)."""
    return [Step("code", format_code_query(program)), Step("observation", executed_output_observation(output))]


def steps_around_calls(
    solution: str, calls: re.Pattern[str], call_steps: Callable[[re.Match[str]], list[Step]]
) -> tuple[list[Step], str]:
    """The solution's prose before each match of ``calls`` as a ``<think>`` step (when not blank) followed by
    ``call_steps(match)``; returns those steps and the text after the last match (unstripped)."""
    steps: list[Step] = []
    pos = 0
    for match in calls.finditer(solution):
        if prose := solution[pos : match.start()].strip():
            steps.append(Step("think", prose))
        steps += call_steps(match)
        pos = match.end()
    return steps, solution[pos:]
