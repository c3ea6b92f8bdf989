"""R1-Searcher rollouts -> CoA trajectories (task ``mhqa``).

Source: RUCAIBox/R1-Searcher ``data/eval_results/*.jsonl``: ``{question, answer (gold), pred_ans,
gen_text_store, gpt4o_output, ...}``. ``gen_text_store`` is the model's whole generation: reasoning,
``<|begin_of_query|> q <|end_of_query|>`` search calls each followed by the retrieved
``<|begin_of_documents|> ... <|end_of_documents|>``, then ``</think>`` and ``<answer> a </answer>``.

Mapping: the reasoning between calls -> ``<think>``; each query -> ``<wiki_search>``; the retrieved
documents -> ``<observation>``; the answer -> ``<answer>``. Correct when the predicted answer exactly
matches the gold one after HotpotQA normalization, or when the file's GPT-4o judge said ``True``;
otherwise rejected as ``wrong_answer``.

Rejection reasons: ``empty_tool_call``, ``missing_documents``, ``no_answer``, ``wrong_answer``.
"""

from __future__ import annotations

import re
from typing import Any

from afm_core.coa.trajectory import Step, Trajectory
from afm_core.data.converters.answer_check import text_exact_match
from afm_core.data.converters.base import Converter, Rejected, kept_trajectory
from afm_core.data.io import Where, require

_CALL_RE = re.compile(
    r"<\|begin_of_query\|>(.*?)<\|end_of_query\|>\s*(?:<\|begin_of_documents\|>(.*?)<\|end_of_documents\|>)?",
    re.DOTALL,
)
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _think(text: str) -> list[Step]:
    text = text.replace("<think>", "").replace("</think>", "").strip()
    return [Step("think", text)] if text else []


def convert_record(where: Where, record: dict[str, Any]) -> Trajectory:
    """One R1-Searcher record -> one trajectory.

    Raises:
        Rejected: see the module docstring for the reasons.
        DataFormatError: a missing or mistyped ``question``/``answer``/``gen_text_store`` field.
    """
    question = require(record, "question", str, where).strip()
    gold = require(record, "answer", str, where).strip()
    text = require(record, "gen_text_store", str, where)
    judge = str(record.get("gpt4o_output", "")).strip()
    steps: list[Step] = []
    pos = 0
    for call in _CALL_RE.finditer(text):
        steps += _think(text[pos : call.start()])
        query, documents = call.group(1).strip(), call.group(2)
        if not query:
            raise Rejected("empty_tool_call", f"empty query at char {call.start()}")
        if documents is None:
            raise Rejected("missing_documents", f"query {query!r} has no retrieved documents")
        steps += [Step("wiki_search", query), Step("observation", documents)]
        pos = call.end()
    answers = list(_ANSWER_RE.finditer(text, pos))
    if not answers:
        raise Rejected("no_answer", "no <answer>...</answer> after the last search")
    prediction = answers[-1].group(1).strip()
    steps += _think(text[pos : answers[-1].start()])
    exact = text_exact_match(prediction, gold)
    if not (exact or judge == "True"):
        raise Rejected("wrong_answer", f"predicted {prediction!r}, gold {gold!r}")
    steps.append(Step("answer", prediction))
    source_id = f"{where.path.stem}:{where.line}"
    return kept_trajectory(
        "r1searcher",
        "mhqa",
        source_id,
        question,
        steps,
        gold,
        {"file": where.path.name, "exact_match": exact, "gpt4o_judge": judge},
    )


R1SEARCHER = Converter(
    name="r1searcher",
    files=("trajectories/r1searcher/hotpotqa_qwen.jsonl",),
    convert_record=convert_record,
)
