"""RL data filtering by pass rate (``python -m jobs.filter_rl``): sample each candidate prompt N times with the
model, keep the hard ones, never an SFT question, write AFM/verl RL parquet and a report of the counts.

The AFM paper's RL data section (arXiv 2508.13167): the web agent samples N=32 answers per query, computes
``r_q = (1/N) sum_i EM(a_i, y_gt)`` and keeps ``r_q <= 0.3`` (easier queries are solvable without real tool use
or by parametric recall), then draws at random among them, excluding every SFT query; the code agent samples 8
times and drops the queries solved in all 8. Upstream ships no code for this step (its online counterpart is
DAPO's group filter).

Read like the algorithm::

    candidates = eval presets (``benchmarks``) + AFM/verl RL files (``benchmark_files``), each cut to eval.limit
    drop those whose question (normalised: afm_core.data.schema.task_id) is an SFT question, and duplicates
    RUN_DIR/candidates.parquet  <- the rest, in the AFM/verl RL layout (extra_info.index = "<benchmark>:<id>")
    RUN_DIR/samples.jsonl       <- jobs.eval's run on it: eval.k samples per prompt through the one agent loop,
                                   real tools and graders (afm_core.eval.runner.run_eval; resumable: finished
                                   samples are never redone)
    r_q = the share of a prompt's samples graded correct (score >= 1, as eval's pass@k)
    keep  min_pass_rate <= r_q <= max_pass_rate  (and r_q < 1 with drop_all_correct), then at most
          sample_size of them at random (seeded)
    filter.out (default RUN_DIR/rl_data.parquet)  <- the kept rows, extra_info + pass_rate, correct, samples
    RUN_DIR/filter_report.json  <- counts at every stage, per benchmark, and the pass-rate histogram

Code tasks carry their tests in ``reward_model.ground_truth`` (``{"inputs", "outputs"}`` or ``{"functional"}``,
:func:`afm_core.rewards.code.code_tests_from_ground_truth`); a task's own import prefix (MBPP
``test_imports``) goes at the head of its functional test code.
"""

from __future__ import annotations

import json
import logging
import random
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from afm_core.config.eval import FilterConfig, FilterRLConfig
from afm_core.data.formats import RLTask, write_rl_tasks
from afm_core.data.schema import read_prepared, task_id
from afm_core.eval.benchmarks import load_file
from afm_core.eval.runner import eval_benchmarks, run_eval
from afm_core.eval.samples import read_samples
from afm_core.utils.atomic import atomic_write_json
from afm_core.utils.run_config import open_run

log = logging.getLogger(__name__)

CANDIDATES = "candidates"  # the candidates file's stem: the benchmark name of every sample in samples.jsonl
CORRECT = 1.0  # a sample is correct at this score or above (eval's pass@k)


# ----------------------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------------------
def sft_question_ids(paths: Iterable[str | Path]) -> dict[str, str]:
    """``{task_id(question): file}`` of the questions of prepared SFT parquet files (``jobs.prepare_data``
    output: ``train.parquet`` / ``heldout.parquet``; a directory means both).

    Raises:
        FileNotFoundError: a path that does not exist, or a directory without ``train.parquet``.
        afm_core.data.io.DataFormatError: a file that is not a prepared parquet (names the column).
    """
    files: list[Path] = []
    for entry in paths:
        path = Path(entry).expanduser()
        if path.is_dir():
            if not (path / "train.parquet").is_file():
                raise FileNotFoundError(f"filter.sft_data: {path} holds no train.parquet (a jobs.prepare_data dir)")
            files += [p for p in (path / "train.parquet", path / "heldout.parquet") if p.is_file()]
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"filter.sft_data: {path} does not exist")
    ids: dict[str, str] = {}
    for file in files:
        for question in read_prepared(file).column("question").to_pylist():
            ids.setdefault(task_id(question), str(file))
    return ids


def rl_task_of(task: Any, benchmark: str) -> RLTask:
    """The AFM/verl RL row of an eval task (:class:`afm_core.rollout.AgentTask`), read back by
    :func:`afm_core.eval.benchmarks.load_file` as the same task: same prompt, grader, answer or tests.

    ``data_source`` is the task's own (RL files) or its benchmark's name (presets: ``gsm8k_test`` -> math);
    ``extra_info`` holds ``index`` (``"<benchmark>:<problem id>"``), ``question``, ``answer``, ``benchmark``.
    """
    meta = task.meta
    data_source = str(meta.get("data_source") or benchmark)
    ground_truth = task.answer
    if meta.get("grader") == "code":
        tests = meta["tests"]
        if tests["kind"] == "stdio":
            ground_truth = json.dumps({"inputs": tests["inputs"], "outputs": tests["outputs"]})
        else:
            prefix = tests.get("prefix") or ""
            ground_truth = json.dumps({"functional": (prefix + "\n" if prefix.strip() else "") + tests["test_code"]})
    prompt = ([{"role": "system", "content": task.system}] if task.system else []) + [
        {"role": "user", "content": task.prompt}
    ]
    extra = {"index": f"{benchmark}:{meta['problem_id']}", "question": task.question, "answer": task.answer,
             "benchmark": benchmark, "level": str(meta.get("level") or "")}  # fmt: skip
    return RLTask(data_source, prompt, ground_truth, extra, ability=meta.get("ability") or task.task)


def select_candidates(benchmarks: Sequence[Any], sft_ids: Mapping[str, str]) -> tuple[list[RLTask], dict[str, Any]]:
    """The candidate RL rows: every task whose normalised question is neither an SFT question nor seen before.

    Returns:
        ``(rows, counts)``: counts ``loaded``, ``sft_overlap``, ``duplicates``, ``candidates`` and per benchmark.
    """
    rows: list[RLTask] = []
    seen: set[str] = set()
    counts: Counter[str] = Counter()
    per: dict[str, Counter[str]] = {}
    for bench in benchmarks:
        mine = per.setdefault(bench.name, Counter())
        for task in bench.tasks:
            key = task_id(task.question)
            counts["loaded"] += 1
            mine["loaded"] += 1
            if key in sft_ids:
                counts["sft_overlap"] += 1
                mine["sft_overlap"] += 1
            elif key in seen:
                counts["duplicates"] += 1
                mine["duplicates"] += 1
            else:
                seen.add(key)
                rows.append(rl_task_of(task, bench.name))
                mine["candidates"] += 1
    counts["candidates"] = len(rows)
    return rows, {**{k: counts[k] for k in ("loaded", "sft_overlap", "duplicates", "candidates")},
                  "per_benchmark": {name: dict(c) for name, c in per.items()}}  # fmt: skip


# ----------------------------------------------------------------------------------------------------------
# The decision
# ----------------------------------------------------------------------------------------------------------
def pass_rates(records: Iterable[Mapping[str, Any]], k: int) -> dict[str, tuple[int, int]]:
    """``{problem id: (correct samples, samples)}`` of the problems with all ``k`` samples in ``records``
    (``samples.jsonl`` lines: ``problem_id``, ``sample``, ``score``)."""
    seen: dict[str, dict[int, float]] = {}
    for r in records:
        seen.setdefault(str(r["problem_id"]), {})[int(r["sample"])] = float(r["score"])
    out = {}
    for problem, scores in seen.items():
        done = [scores[i] for i in range(k) if i in scores]
        if len(done) == k:
            out[problem] = (sum(s >= CORRECT for s in done), k)
    return out


def decide(correct: int, samples: int, rule: FilterConfig) -> str:
    """``kept`` or why not: ``too_easy`` (r_q > ``max_pass_rate``), ``all_correct`` (``drop_all_correct`` and
    every sample correct), ``too_hard`` (r_q < ``min_pass_rate``)."""
    rate = correct / samples
    if rule.drop_all_correct and correct == samples:
        return "all_correct"
    if rule.max_pass_rate is not None and rate > rule.max_pass_rate + 1e-12:
        return "too_easy"
    if rule.min_pass_rate is not None and rate < rule.min_pass_rate - 1e-12:
        return "too_hard"
    return "kept"


def histogram(rates: Mapping[str, tuple[int, int]], k: int) -> dict[str, int]:
    """Problems per number of correct samples, ``"0/k"`` ... ``"k/k"``."""
    counts = Counter(c for c, _ in rates.values())
    return {f"{c}/{k}": counts.get(c, 0) for c in range(k + 1)}


def report_table(report: Mapping[str, Any]) -> str:
    """The report's counts as a markdown table (one row per benchmark, then the total)."""
    cols = ("loaded", "sft_overlap", "duplicates", "candidates", "sampled", "too_easy", "all_correct", "too_hard",
            "kept", "written")  # fmt: skip
    lines = ["| benchmark | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for name, counts in [*report["per_benchmark"].items(), ("total", report["counts"])]:
        lines.append(f"| {name} | " + " | ".join(str(counts.get(c, 0)) for c in cols) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# The job
# ----------------------------------------------------------------------------------------------------------
def run_filter(config: FilterRLConfig) -> dict[str, Any]:
    """Filter ``config.benchmarks`` + ``config.benchmark_files`` by pass rate into ``config.filter.out`` (see the
    module docstring; the rule's values are checked by :class:`~afm_core.config.eval.FilterConfig`). Every rank of
    the job calls it; it runs on one.

    Returns:
        ``{"stopped_early", "out", "counts", "report", "run_dir", ...}``; on a stop (preemption) nothing is
        written but the samples, and ``stopped_early`` is True.
    Raises:
        ValueError: no candidate left.
        FileNotFoundError: a missing input or SFT file.
    """
    run_dir = open_run(config.run_dir)
    rule = config.filter
    k = config.eval.k
    sft_ids = sft_question_ids(rule.sft_data)
    rows, counts = select_candidates(eval_benchmarks(config), sft_ids)
    if not rows:
        raise ValueError(f"no candidate prompt left ({counts}): check benchmarks / benchmark_files / filter.sft_data")
    candidates_path = run_dir / f"{CANDIDATES}.parquet"
    write_rl_tasks(candidates_path, rows)
    print(f"[filter_rl] {counts['candidates']} candidate prompts ({counts['loaded']} loaded, {counts['sft_overlap']} "
          f"SFT questions and {counts['duplicates']} duplicates dropped) x {k} samples", flush=True)  # fmt: skip

    on_candidates = replace(config, benchmarks=[], benchmark_files=[str(candidates_path)],
                            eval=replace(config.eval, limit=None, per_benchmark={}))  # fmt: skip
    summary = run_eval(on_candidates)
    if summary["stopped_early"]:
        return {
            "stopped_early": True,
            "samples": summary["samples"],
            "total": summary["total"],
            "run_dir": str(run_dir),
        }

    rates = pass_rates((r for r in read_samples(run_dir / "samples.jsonl") if r["benchmark"] == CANDIDATES), k)
    decisions: Counter[str] = Counter()
    per = {name: dict(c) for name, c in counts["per_benchmark"].items()}
    kept: list[RLTask] = []
    for row in rows:
        index = row.index
        if index not in rates:  # cannot happen after a complete eval; counted rather than guessed
            decisions["unsampled"] += 1
            continue
        correct, n = rates[index]
        verdict = decide(correct, n, rule)
        decisions[verdict] += 1
        bench = per[row.extra_info["benchmark"]]
        bench["sampled"] = bench.get("sampled", 0) + 1
        bench[verdict] = bench.get(verdict, 0) + 1
        if verdict == "kept":
            row.extra_info.update(pass_rate=correct / n, correct=correct, samples=n)
            kept.append(row)
    chosen = kept
    if rule.sample_size is not None and len(kept) > rule.sample_size:
        order = {row.index: i for i, row in enumerate(kept)}
        chosen = random.Random(rule.seed).sample(kept, rule.sample_size)
        chosen.sort(key=lambda row: order[row.index])
    for row in chosen:
        bench = per[row.extra_info["benchmark"]]
        bench["written"] = bench.get("written", 0) + 1
    leaked = [row.index for row in chosen if task_id(row.extra_info["question"]) in sft_ids]
    if leaked:  # select_candidates excluded them: a failure here is a bug, never a silent overlap
        raise RuntimeError(f"{len(leaked)} filtered prompts are SFT questions: {leaked[:5]}")
    out: Path | None = Path(rule.out or run_dir / "rl_data.parquet")
    if chosen:
        assert out is not None
        out.parent.mkdir(parents=True, exist_ok=True)
        write_rl_tasks(out, chosen)
        load_file(out)  # what the RL job will read: fails loudly if the layout is off
    else:
        log.warning("no prompt passed the filter: nothing written (see %s)", run_dir / "filter_report.json")
        out = None

    report = {
        "rule": {
            key: getattr(rule, key)
            for key in ("max_pass_rate", "min_pass_rate", "drop_all_correct", "sample_size", "seed")
        },
        "samples_per_prompt": k,
        "temperature": config.eval.temperature,
        "model": config.model_name,
        "sft_data": [str(p) for p in rule.sft_data],
        "sft_questions": len(sft_ids),
        "counts": {
            **{key: counts[key] for key in ("loaded", "sft_overlap", "duplicates", "candidates")},
            "sampled": sum(decisions.values()) - decisions["unsampled"],
            **dict(decisions),
            "written": len(chosen),
        },
        "per_benchmark": per,
        "pass_rate_histogram": histogram({r.index: rates[r.index] for r in rows if r.index in rates}, k),
        "out": str(out) if out else None,
    }
    atomic_write_json(run_dir / "filter_report.json", report)
    return {"stopped_early": False, "out": report["out"], "counts": report["counts"], "report": report,
            "samples": summary["samples"], "run_dir": str(run_dir)}  # fmt: skip
