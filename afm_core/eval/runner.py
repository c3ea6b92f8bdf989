"""The evaluation job body (``python -m jobs.eval``): benchmarks → agent-loop samples → grades → metrics.

Read like the algorithm::

    benchmarks = load presets + user files           # afm_core.eval.benchmarks
    todo = every (problem, sample) not yet in samples.jsonl
    with tool servers, engine, tool pool:             # started here, or reached through an addresses file
        for each finished trajectory: grade it, append one line to samples.jsonl
    metrics.json, report.md, eval.png from samples.jsonl

Resumable: ``samples.jsonl`` is the checkpoint. On ``SIGUSR2`` (Slurm preemption or time limit) or
Ctrl-C the run stops taking new samples; graded samples are on disk, in-flight ones are dropped and
redone on restart. Sampling seeds are per (problem, sample), so a resumed run draws the same samples.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from afm_core.eval.benchmarks import SAMPLING_KEYS, Benchmark, load_sources
from afm_core.eval.metrics import benchmark_metrics, double_check_score
from afm_core.eval.report import write_report
from afm_core.eval.samples import SampleWriter, check_sample_settings, read_samples, sample_key, samples_todo
from afm_core.rewards import Grade, Graders, LLMJudge, SandboxClient, normalize_answer
from afm_core.rewards.base import extract_answer
from afm_core.rewards.code import extract_program
from afm_core.rewards.grader import custom_reward
from afm_core.rewards.math import _normalize as normalize_math
from afm_core.rollout import AgentConfig, AgentLoop, AgentTask, Rollout, SamplingConfig
from afm_core.rollout.agent_loop import sample_seed
from afm_core.tools.job_servers import needed_servers, reachable_tools_cfg, tool_servers
from afm_core.utils.aio import run_with_tools
from afm_core.utils.atomic import atomic_write_json
from afm_core.utils.run_config import open_run
from afm_core.utils.tracking import log_results

log = logging.getLogger(__name__)

_stop_requested = False


def request_stop() -> None:
    """Stop taking new samples and return (signal-safe: sets a flag). The job's preemption hook."""
    global _stop_requested
    _stop_requested = True


def benchmark_settings(eval_cfg: Mapping[str, Any], bench: Benchmark) -> dict[str, Any]:
    """The run's ``eval.*`` defaults, overridden by the benchmark preset's settings, overridden by
    ``eval.per_benchmark.<name>`` (e.g. ``eval.per_benchmark.humaneval.limit=null``).

    Raises:
        ValueError: an unknown key under ``eval.per_benchmark.<name>``.
    """
    overrides = dict((eval_cfg.get("per_benchmark") or {}).get(bench.name) or {})
    unknown = sorted(set(overrides) - set(SAMPLING_KEYS))
    if unknown:
        raise ValueError(
            f"eval.per_benchmark.{bench.name}.{unknown[0]}: unknown setting; known: {', '.join(SAMPLING_KEYS)}"
        )
    return {**{key: eval_cfg.get(key) for key in SAMPLING_KEYS}, **bench.settings, **overrides}


#: The presets run when neither ``benchmarks`` nor ``benchmark_files`` is set.
DEFAULT_BENCHMARKS = ("gsm8k_test",)


def preset_names(cfg: Mapping[str, Any]) -> list[str]:
    """``benchmarks`` as given; when null, :data:`DEFAULT_BENCHMARKS` unless ``benchmark_files`` is set (a user
    who brings a file evaluates that file only)."""
    names = cfg.get("benchmarks")
    if names is None:
        return [] if cfg.get("benchmark_files") else list(DEFAULT_BENCHMARKS)
    return list(names)


def load_benchmarks(cfg: Mapping[str, Any]) -> list[Benchmark]:
    """Presets (:func:`preset_names`) then user files (``benchmark_files``), each cut to its ``limit``.

    Raises:
        ValueError: no benchmark, an unknown preset, or two benchmarks with the same name.
        FileNotFoundError: a benchmark file or a preset's data file is absent.
    """
    benchmarks = load_sources(
        preset_names(cfg),
        cfg.get("benchmark_files"),
        cfg.get("data_dir"),
        empty="nothing to evaluate: set benchmarks=[gsm8k_test,...] and/or benchmark_files=[my.parquet]",
    )
    for bench in benchmarks:
        limit = benchmark_settings(cfg["eval"], bench).get("limit")
        if limit is not None:
            bench.tasks = bench.tasks[: int(limit)]
    return benchmarks


def describe_plan(cfg: Mapping[str, Any], benchmarks: list[Benchmark]) -> str:
    """What an eval will run, one line per benchmark: problems, samples per problem (``k``) and samples, where
    the problems come from, and the records skipped as malformed; printed before the engine starts."""
    rows = []
    for bench in benchmarks:
        k = int(benchmark_settings(cfg["eval"], bench)["k"])
        skipped = f", {len(bench.skipped)} malformed records skipped" if bench.skipped else ""
        rows.append(f"  {bench.name}: {len(bench.tasks)} problems x k={k} = {len(bench.tasks) * k} samples "
                    f"({bench.source}{skipped})")  # fmt: skip
    problems = sum(len(b.tasks) for b in benchmarks)
    total = sum(len(b.tasks) * int(benchmark_settings(cfg["eval"], b)["k"]) for b in benchmarks)
    head = f"[eval] will run {len(benchmarks)} benchmark(s), {problems} problems, {total} samples:"
    return "\n".join([head, *rows])


def answer_key(grader: str, response: str) -> str | None:
    """The final answer normalised for majority voting (math: LaTeX-light form; QA: SQuAD form; code: program)."""
    answer = extract_answer(response)
    if not answer:
        return None
    if grader == "math":
        return normalize_math(answer)
    if grader == "code":
        return " ".join(extract_program(answer).split())
    return normalize_answer(answer.split("|")[0])


def sample_record(rollout: Rollout, grade: Grade) -> dict[str, Any]:
    """The ``samples.jsonl`` line of a graded trajectory."""
    meta = rollout.task.meta
    return {
        "benchmark": meta["benchmark"],
        "problem_id": str(meta["problem_id"]),
        "sample": rollout.sample,
        "score": grade.score,
        "reason": grade.reason,
        "grader_error": grade.error,
        "grade": grade.extra or {},
        "finish_reason": rollout.finish_reason.value,
        "num_tool_calls": len(rollout.tool_calls),
        "tool_errors": rollout.num_tool_errors,
        "tool_calls": [{"name": c.name, "error": c.error, "seconds": round(c.seconds, 3)} for c in rollout.tool_calls],
        "turns": rollout.turns,
        "response_tokens": len(rollout.response_ids),
        "generated_tokens": rollout.num_generated_tokens,
        "seconds": round(rollout.seconds, 3),
        "format_valid": not rollout.format_issues,
        "double_check": double_check_score(rollout.response_text),
        "answer_key": answer_key(meta["grader"], rollout.response_text),
        "level": meta.get("level") or "",
        "error": rollout.error,
        "response": rollout.response_text,
    }


def _needed_servers(benchmarks: list[Benchmark], tools_cfg: Mapping[str, Any]) -> list[str]:
    return needed_servers(
        {t.task for b in benchmarks for t in b.tasks},
        {t.meta["grader"] for b in benchmarks for t in b.tasks if t.meta.get("grader")},
        tools_cfg,
    )


async def evaluate_samples(engine: Any, tokenizer: Any, pool: Any, graders: Graders, benchmarks: list[Benchmark],
                           eval_cfg: Mapping[str, Any], todo: list[tuple[AgentTask, int]],
                           on_record: Callable[[dict[str, Any]], Any], *, stop: Callable[[], bool] = lambda: False,
                           progress: bool = True) -> None:  # fmt: skip
    """Run the ``todo`` (task, sample index) pairs through the agent loop on ``engine`` (any
    :class:`~afm_core.rollout.engine.GenerationEngine`: the job's own, or an RL job's colocated engine with the live
    weights), ``eval_cfg.concurrency`` at once, grade each trajectory and hand its ``samples.jsonl`` record
    (:func:`sample_record`) to ``on_record`` as it finishes. Each benchmark samples with its own settings
    (:func:`benchmark_settings`); ``eval_cfg.seed`` is the base of the per-sample seeds (GPU: per request; vLLM-CPU
    draws from ``engine.seed``). ``stop()`` true: no new sample starts."""
    from tqdm import tqdm

    seed_base = int(eval_cfg.get("seed") or 0)

    loops: dict[str, AgentLoop] = {}
    for bench in benchmarks:
        s = benchmark_settings(eval_cfg, bench)
        agent = AgentConfig(max_turns=int(eval_cfg["max_turns"]), max_tool_calls=int(s["max_tool_calls"]),
                            max_response_tokens=int(s["max_response_tokens"]), timeout_s=eval_cfg.get("timeout_s"))  # fmt: skip
        sampling = SamplingConfig(temperature=float(s["temperature"]), top_p=float(s["top_p"]),
                                  max_tokens=int(s["max_response_tokens"]))  # fmt: skip
        loops[bench.name] = AgentLoop(engine, tokenizer, pool, agent, sampling)
    slots = asyncio.Semaphore(int(eval_cfg["concurrency"]))
    bar = tqdm(total=len(todo), desc="eval", unit="sample", dynamic_ncols=True, disable=not progress)

    async def one(task: AgentTask, sample: int) -> None:
        async with slots:
            if stop():
                return
            rollout = await loops[task.meta["benchmark"]].run(
                task, sample, seed=sample_seed(task.id, sample, seed_base)
            )
            grade = await graders.grade(task.meta["grader"], rollout.response_text, gold=task.answer,
                                        question=task.question, meta=task.meta)  # fmt: skip
            on_record(sample_record(rollout, grade))
            bar.update(1)

    try:
        await asyncio.gather(*(one(task, sample) for task, sample in todo))
    finally:
        bar.close()


async def validate(engine: Any, tokenizer: Any, pool: Any, graders: Graders, benchmarks: list[Benchmark],
                   eval_cfg: Mapping[str, Any]) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Every problem of ``benchmarks`` x its ``k`` through :func:`evaluate_samples` on ``engine`` (validation
    during RL: the colocated engine with the live weights, nothing reloaded), without a run dir; returns
    ``{benchmark: metrics}`` as in ``metrics.json`` (:func:`afm_core.eval.metrics.benchmark_metrics`)."""
    records: list[dict[str, Any]] = []
    todo = samples_todo(benchmarks, lambda bench: int(benchmark_settings(eval_cfg, bench)["k"]))
    await evaluate_samples(engine, tokenizer, pool, graders, benchmarks, eval_cfg, todo, records.append, progress=False)
    return {b.name: benchmark_metrics([r for r in records if r["benchmark"] == b.name],
                                      int(benchmark_settings(eval_cfg, b)["k"])) for b in benchmarks}  # fmt: skip


async def _evaluate(cfg: Mapping[str, Any], benchmarks: list[Benchmark], todo: list[tuple[AgentTask, int]],
                    writer: SampleWriter, server_urls: Callable[[], dict[str, str]]) -> dict[str, Any]:  # fmt: skip
    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
    from afm_core.rollout.factory import build_engine, load_tokenizer
    from afm_core.tools.registry import build_tool_pool

    ev = cfg["eval"]
    hf_dir = ensure_hf_checkpoint(cfg["model"])
    tokenizer = load_tokenizer(hf_dir)
    engine = await build_engine(cfg["engine"], hf_dir, tokenizer)  # the tool servers start meanwhile
    try:
        urls = server_urls()
        tools_cfg = reachable_tools_cfg(cfg["tools"], urls)
        pool = build_tool_pool(tools_cfg, addresses=dict(urls)) if tools_cfg["tools"] else None
        judge_cfg = cfg.get("judge") or {}
        graders = Graders(
            custom=custom_reward(cfg.get("reward_fn")),
            sandbox=SandboxClient(urls["sandbox"], timeout_s=float(ev["test_timeout_s"]))
            if "sandbox" in urls
            else None,
            judge=LLMJudge(judge_cfg["url"], judge_cfg["model"], judge_cfg.get("api_key_env"))
            if judge_cfg.get("url")
            else None,
        )
    except BaseException:
        await engine.close()
        raise

    async def run_benchmark_items() -> None:
        await evaluate_samples(engine, tokenizer, pool, graders, benchmarks, ev, todo, writer.write,
                               stop=lambda: _stop_requested)  # fmt: skip

    return await run_with_tools(
        run_benchmark_items, pool, lambda: _stop_requested, "the samples in flight", close=(graders.close, engine.close)
    )


#: What a benchmark's samples depend on (:func:`benchmark_settings`); ``k`` and ``limit`` only say how many.
_SAMPLE_KEYS = tuple(key for key in SAMPLING_KEYS if key not in ("k", "limit"))


def sample_settings(cfg: Mapping[str, Any], benchmarks: list[Benchmark]) -> dict[str, Any]:
    """What decides a sample of this eval: the model, the engine's seed and dtype, ``eval.seed`` and
    ``eval.max_turns``, and each benchmark's sampling settings (:func:`check_sample_settings
    <afm_core.eval.samples.check_sample_settings>` guards a resumed run with it)."""
    engine = cfg.get("engine") or {}
    per_benchmark = {b.name: benchmark_settings(cfg["eval"], b) for b in benchmarks}
    return {
        "model": cfg["model"].get("hf_path") or cfg["model"].get("name"),
        "engine": {"seed": engine.get("seed"), "dtype": engine.get("dtype")},
        "eval": {"seed": cfg["eval"].get("seed") or 0, "max_turns": cfg["eval"].get("max_turns")},
        "benchmarks": {name: {key: s.get(key) for key in _SAMPLE_KEYS} for name, s in per_benchmark.items()},
    }


def check_resume(cfg: Mapping[str, Any], benchmarks: list[Benchmark], *, record: bool = False) -> set[Any]:
    """The sample keys already in ``cfg.run_dir/samples.jsonl``; with some, the run's :func:`sample_settings` must
    be those they were drawn under (``jobs.eval`` checks before the queue, :func:`run_eval` again and records them).

    Raises:
        ValueError: the settings differ (names the file and each field).
    """
    run_dir = Path(cfg["run_dir"])
    done = {sample_key(r) for r in read_samples(run_dir / "samples.jsonl")}
    check_sample_settings(run_dir, sample_settings(cfg, benchmarks), resuming=bool(done), record=record)
    return done


def run_eval(cfg: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    """Evaluate ``cfg.model`` on the presets (:func:`preset_names`) + ``cfg.benchmark_files`` into ``cfg.run_dir``.

    Returns:
        ``{"metrics": {benchmark: {...}}, "stopped_early": bool, "samples": int, ...}``.

    Raises:
        ValueError: bad benchmark settings (names the key); a run dir whose samples were drawn under other
            settings (:func:`sample_settings`: another model, seed, temperature, ...).
    """
    global _stop_requested
    _stop_requested = False
    cfg, run_dir = open_run(cfg)
    benchmarks = load_benchmarks(cfg)
    samples_path = run_dir / "samples.jsonl"
    done = check_resume(cfg, benchmarks, record=True)
    todo = samples_todo(benchmarks, lambda bench: int(benchmark_settings(cfg["eval"], bench)["k"]), done)
    skipped = {b.name: b.skipped for b in benchmarks if b.skipped}
    total = sum(len(b.tasks) * int(benchmark_settings(cfg["eval"], b)["k"]) for b in benchmarks)
    print(describe_plan(cfg, benchmarks), flush=True)
    print(f"[eval] {', '.join(f'{b.name} ({len(b.tasks)})' for b in benchmarks)}: {total} samples, "
          f"{total - len(todo)} already done, {len(todo)} to run; skipped records: "
          f"{sum(map(len, skipped.values()))}; run dir {run_dir}", flush=True)  # fmt: skip
    info: dict[str, Any] = {}
    if todo:
        writer = SampleWriter(samples_path)
        try:
            with tool_servers(
                _needed_servers(benchmarks, cfg["tools"]), run_dir / "logs" / "tool_servers",
                addresses_file=cfg["tools"]["addresses_file"], **cfg["tool_servers"], data_dir=cfg.get("data_dir"),
            ) as server_urls:  # fmt: skip
                info = asyncio.run(_evaluate(cfg, benchmarks, todo, writer, server_urls))
        finally:
            writer.close()
    records = read_samples(samples_path)
    metrics = {}
    for bench in benchmarks:
        k = int(benchmark_settings(cfg["eval"], bench)["k"])
        mine = [r for r in records if r["benchmark"] == bench.name]
        metrics[bench.name] = {**benchmark_metrics(mine, k), "skipped_records": len(bench.skipped)}
    model = cfg["model"].get("hf_path") or cfg["model"]["name"]
    write_report(run_dir, metrics, {"model": model, "engine": cfg["engine"].get("backend"),
                                    "temperature": cfg["eval"]["temperature"], "samples": len(records)})  # fmt: skip
    if info.get("tool_metrics"):
        atomic_write_json(run_dir / "tool_metrics.json", info["tool_metrics"])
    if skipped:
        atomic_write_json(run_dir / "skipped_records.json", skipped)
    complete = len(records) >= total
    log_results(run_dir, cfg.get("logger") or ["console"], "eval",
                {f"eval/{name}": values for name, values in metrics.items()},
                config=cfg, tracking=cfg.get("tracking"))  # fmt: skip
    summary = {"metrics": metrics, "samples": len(records), "total": total, "stopped_early": _stop_requested and not complete,
               "seconds": round(info.get("seconds", 0.0), 1), "run_dir": str(run_dir), "skipped_records": skipped}  # fmt: skip
    return summary
