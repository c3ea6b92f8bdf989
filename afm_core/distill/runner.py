"""The distillation job body (``python -m jobs.distill``): tasks -> MAS runs -> CoA trajectories -> SFT filters.

Read like the algorithm::

    tasks = benchmark presets + files, first distill.limit of each          # afm_core.eval.benchmarks
    todo = every (task, sample) not yet in runs.jsonl
    with tool servers, teachers (the job's engine and/or chat endpoints), tool pool, graders:
        for each run (distill.concurrency at once): MAS run -> convert -> grade -> append to runs.jsonl
    trajectories.jsonl = every run converted                              # afm_core.distill.convert
    sft_data/ = prepare(data: sources.trajectories = trajectories.jsonl, filters)   # afm_core.data.prepare / filters
    report.json, filters.png

Resumable: ``runs.jsonl`` (one record per finished run, :mod:`afm_core.distill.mas`) is the checkpoint; a
restarted job skips the runs it holds, and refuses to add runs drawn under other settings (:func:`check_resume`).
On ``SIGUSR2`` (Slurm preemption) or Ctrl-C it stops taking new runs; runs in flight are dropped and redone on
restart. Concurrency: ``distill.concurrency`` runs in flight, each teacher's ``concurrency`` requests, and each
tool's limits in the ToolPool (``tools.tools.<name>.limits``).

``sft_data/`` is the layout ``jobs.prepare_data`` writes, and its ``report.json`` records the data config, so
``python -m jobs.sft data=distill data.sources.trajectories.path=RUN/trajectories.jsonl data.out_dir=RUN/sft_data``
trains on it as it is.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tqdm import tqdm

from afm_core.coa.grammar import validate_steps
from afm_core.config.data import DataConfig
from afm_core.config.eval import DistillConfig, RoleConfig
from afm_core.data.filters import DataFilters, build_graders
from afm_core.data.prepare import prepare, read_report
from afm_core.data.trajectory_checks import grade_trajectory
from afm_core.distill.convert import NotConverted, convert_run, convert_runs
from afm_core.distill.mas import MultiAgentSystem, RoleTeacher
from afm_core.distill.roles import ROLES
from afm_core.distill.teacher import ChatSampling, Teacher, build_teacher, teacher_sampling
from afm_core.eval.benchmarks import Benchmark, load_sources
from afm_core.eval.runner import job_tool_servers
from afm_core.eval.samples import SampleKey, SampleWriter, check_sample_settings, read_samples, sample_key, samples_todo
from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
from afm_core.rollout import AgentTask
from afm_core.rollout.factory import build_engine, load_tokenizer
from afm_core.tools.job_servers import needed_servers, reachable_tools_cfg
from afm_core.tools.registry import build_tool_pool
from afm_core.utils.aio import run_with_tools
from afm_core.utils.atomic import atomic_path, atomic_write_json
from afm_core.utils.run_config import open_run
from afm_core.utils.tracking import log_results

log = logging.getLogger(__name__)

RUNS_FILE = "runs.jsonl"
TRAJECTORIES_FILE = "trajectories.jsonl"
REPORT_FILE = "report.json"
SFT_DIR = "sft_data"

_stop_requested = False


def request_stop() -> None:
    """Stop taking new runs and return (signal-safe: sets a flag). The job's preemption hook."""
    global _stop_requested
    _stop_requested = True


def load_tasks(config: DistillConfig) -> list[Benchmark]:
    """Benchmark presets (``benchmarks``) then files (``benchmark_files``), each cut to ``distill.limit``.

    Raises:
        ValueError: no task source, or two with the same name.
    """
    benchmarks = load_sources(
        config.benchmarks,
        config.benchmark_files,
        config.data_dir,
        empty="no tasks: set benchmarks=[gsm8k_train,...] and/or benchmark_files=[my_tasks.parquet]",
    )
    limit = config.distill.limit
    for bench in benchmarks:
        if limit is not None:
            bench.tasks = bench.tasks[:limit]
    return benchmarks


def role_specs(config: DistillConfig) -> dict[str, RoleConfig]:
    """``roles``, one per role of :data:`afm_core.distill.roles.ROLES` (each names a teacher of ``teachers``:
    :class:`~afm_core.config.eval.DistillConfig` checks that).

    Raises:
        ValueError: a missing or unknown role (named).
    """
    if unknown := sorted(set(config.roles) - set(ROLES)):
        raise ValueError(f"roles.{unknown[0]}: unknown role; roles: {', '.join(ROLES)}")
    if missing := [role for role in ROLES if role not in config.roles]:
        raise ValueError(f"roles.{missing[0]}.teacher: None is not in teachers ({sorted(config.teachers)})")
    return {role: config.roles[role] for role in ROLES}


def _needs_engine(config: DistillConfig, specs: Mapping[str, RoleConfig]) -> bool:
    return any(config.teachers[str(s.teacher)].backend == "engine" for s in specs.values())


def role_sampling(config: DistillConfig, spec: RoleConfig) -> ChatSampling:
    """A role's sampling: its teacher's, with the role's own ``max_tokens`` / ``temperature`` where set."""
    return teacher_sampling(config.teachers[str(spec.teacher)], temperature=spec.temperature,
                            max_tokens=spec.max_tokens)  # fmt: skip


def distill_settings(config: DistillConfig) -> dict[str, Any]:
    """What decides a run of this distillation (:func:`check_resume` guards ``runs.jsonl`` with it): each role's
    teacher, that teacher's backend and model (the job's ``model`` for ``backend=engine``) and the role's sampling;
    the MAS limits (``mas``: tool calls, steps, re-plans, observation characters, ...); the engine's seed and
    dtype when a role uses it. Not here: what only says how a teacher is reached (its URL, key, concurrency,
    timeouts, retries) and how many runs there are (``distill.limit``, ``distill.samples``: raising them on a
    resume adds runs); the per-run seed follows from the task and sample (:func:`afm_core.rollout.sample_seed`).

    Raises:
        ValueError: bad teachers, roles or MAS settings (the key is named).
    """
    specs = role_specs(config)
    roles = {}
    for role, spec in specs.items():
        teacher = config.teachers[str(spec.teacher)]
        sampling = role_sampling(config, spec)
        roles[role] = {
            "teacher": spec.teacher,
            "backend": teacher.backend,
            "model": config.model_name if teacher.backend == "engine" else teacher.model,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_tokens": sampling.max_tokens,
        }
    engine = config.engine
    return {
        "roles": roles,
        "mas": asdict(config.mas),
        "engine": {"seed": engine.get("seed"), "dtype": engine.get("dtype")} if _needs_engine(config, specs) else None,
    }


def check_resume(config: DistillConfig, *, record: bool = False) -> set[SampleKey]:
    """The runs already in ``run_dir/runs.jsonl``; with some, the job's :func:`distill_settings` must be those
    they were drawn under, else the converted trajectories would mix the two. The check is eval's
    (:func:`afm_core.eval.samples.check_sample_settings`, ``sample_settings.json`` beside the log); ``jobs.distill``
    checks before the queue, :func:`run_distill` again and records the settings.

    Raises:
        ValueError: the settings differ (names the file and each field, old -> new); bad teachers, roles or MAS
            settings.
    """
    run_dir = Path(config.run_dir)
    done = {sample_key(r) for r in read_samples(run_dir / RUNS_FILE)}
    check_sample_settings(run_dir, distill_settings(config), resuming=bool(done), record=record, what="runs")
    return done


def _data_cfg(data: DataConfig, run_dir: Path) -> dict[str, Any]:
    """The data config of ``sft_data/`` (as :func:`afm_core.data.prepare.prepare` reads it): the ``data`` group with
    ``sources.trajectories`` = this run's trajectories."""
    return {**asdict(data), "sources": {"trajectories": {"limit": None, "path": str(run_dir / TRAJECTORIES_FILE)}},
            "out_dir": data.out_dir or str(run_dir / SFT_DIR)}  # fmt: skip


async def _distill(config: DistillConfig, todo: list[tuple[AgentTask, int]], writer: SampleWriter,
                   server_urls: Callable[[], dict[str, str]]) -> dict[str, Any]:  # fmt: skip
    specs = role_specs(config)
    filters = DataFilters.from_config(config.data.filters)
    engine, tokenizer = None, None
    if _needs_engine(config, specs):
        hf_dir = ensure_hf_checkpoint(asdict(config.model))
        tokenizer = load_tokenizer(hf_dir)
        engine = await build_engine(config.engine, hf_dir, tokenizer)  # the tool servers start meanwhile
    try:
        urls = server_urls()
    except BaseException:
        if engine is not None:
            await engine.close()
        raise
    teachers: dict[str, Teacher] = {name: build_teacher(name, spec, engine, tokenizer)
                                    for name, spec in config.teachers.items()}  # fmt: skip
    role_teachers = {role: RoleTeacher(teachers[str(spec.teacher)], role_sampling(config, spec))
                     for role, spec in specs.items()}  # fmt: skip
    reachable = reachable_tools_cfg(asdict(config.tools), urls)  # the tool layer's mapping
    pool = build_tool_pool(reachable, addresses=dict(urls)) if reachable["tools"] else None
    graders = build_graders(filters, urls.get("sandbox"))
    mas = MultiAgentSystem(role_teachers, pool, config.mas)
    verification = config.distill.verification
    counts: Counter[str] = Counter()

    async def one(task: AgentTask, sample: int, slots: asyncio.Semaphore, bar: Any) -> None:
        async with slots:
            if _stop_requested:
                return
            record = await mas.run(task, sample)
            record["grade"] = None
            try:
                trajectory = convert_run(record, verification=verification)
                record["grade"] = await grade_trajectory(trajectory, graders, filters.qa_min_f1)
            except NotConverted as err:
                record["not_converted"] = err.reason
            writer.write(record)
            counts["runs"] += 1
            counts["correct"] += bool(record["grade"] and record["grade"]["correct"])
            counts["tool_calls"] += record["tool_calls"]
            bar.set_postfix(correct=counts["correct"], tools=f"{counts['tool_calls'] / counts['runs']:.1f}/run")
            bar.update(1)

    async def all_runs() -> None:
        slots = asyncio.Semaphore(config.distill.concurrency)
        bar = tqdm(total=len(todo), desc="distill", unit="run", dynamic_ncols=True)
        try:
            await asyncio.gather(*(one(task, sample, slots, bar) for task, sample in todo))
        finally:
            bar.close()

    closers = [graders.close, *(teacher.close for teacher in teachers.values())]
    if engine is not None:
        closers.append(engine.close)
    return await run_with_tools(all_runs, pool, lambda: _stop_requested, "the runs in flight", close=closers)


def usage(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per role: calls, failed calls, prompt and completion tokens, seconds; per tool: calls, errors, seconds."""
    roles: dict[str, Counter[str]] = defaultdict(Counter)
    tools: dict[str, Counter[str]] = defaultdict(Counter)
    for record in records:
        for event in record["events"]:
            if event["kind"] == "tool_call":
                entry = tools[event["tool"]]
                entry["calls"] += 1
                entry["errors"] += event.get("error") is not None
                entry["seconds"] += event["seconds"]
            else:
                entry = roles[event["role"]]
                entry["calls"] += 1
                entry["errors"] += event.get("error") is not None
                entry["prompt_tokens"] += event.get("prompt_tokens") or 0
                entry["completion_tokens"] += event.get("completion_tokens") or 0
                entry["seconds"] += event["seconds"]
    rounded = lambda c: {k: round(v, 1) if isinstance(v, float) else v for k, v in c.items()}  # noqa: E731
    return {"roles": {r: rounded(c) for r, c in sorted(roles.items())},
            "tools": {t: rounded(c) for t, c in sorted(tools.items())}}  # fmt: skip


def plot_filters(filters_report: Mapping[str, Any], png_path: Path) -> None:
    """The filter funnel: trajectories entering the filters, kept after each stage, and train rows after upsampling."""
    import matplotlib  # here: only the plot needs it (jobs.distill imports this module to check a resume)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = filters_report["stages"]
    labels = ["converted"] + [f"after {s['name']}" for s in stages] + ["rows (train+heldout, upsampled)"]
    values = [filters_report["input"]] + [s["kept"] for s in stages] + [filters_report["kept"]
                                                                          + filters_report["upsampled_rows"]]  # fmt: skip
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(labels) + 1))
    ax.barh(range(len(labels)), values, color="tab:blue")
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    for i, value in enumerate(values):
        ax.text(value, i, f" {value}", va="center")
    ax.set_xlabel("trajectories")
    ax.set_title("SFT filters (arXiv 2508.13167): kept after each stage")
    fig.tight_layout()
    with atomic_path(png_path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)


def _run_order(record: Mapping[str, Any]) -> tuple[str, int, str, int]:
    """Runs sorted by source, then problem id (numbers in numeric order), then sample: a file order that does not
    depend on which concurrent run finished first."""
    pid = str(record["problem_id"])
    return record["benchmark"], len(pid), pid, int(record["sample"])


def finish(config: DistillConfig, run_dir: Path, info: Mapping[str, Any]) -> dict[str, Any]:
    """Convert every recorded run (in :func:`_run_order`), write ``trajectories.jsonl``, filter and split into
    ``sft_data/``, and write ``report.json`` and ``filters.png``; returns the report."""
    records = sorted(read_samples(run_dir / RUNS_FILE), key=_run_order)
    trajectories, not_converted = convert_runs(records, verification=config.distill.verification)
    with atomic_path(run_dir / TRAJECTORIES_FILE) as tmp:
        tmp.write_text("".join(json.dumps(t.to_dict(), ensure_ascii=False) + "\n" for t in trajectories),
                       encoding="utf-8")  # fmt: skip
    data_cfg = _data_cfg(config.data, run_dir)
    sft_dir = prepare(data_cfg)
    prepared = read_report(sft_dir) or {}
    by_bench: dict[str, Counter[str]] = defaultdict(Counter)
    for record in records:
        entry = by_bench[record["benchmark"]]
        entry["runs"] += 1
        entry["correct"] += bool(record.get("grade") and record["grade"].get("correct"))
        entry["tool_calls"] += record["tool_calls"]
        entry[f"finish_{record['finish']}"] += 1
    report = {
        "runs": len(records),
        "by_benchmark": {name: dict(c) for name, c in sorted(by_bench.items())},
        "converted": len(trajectories),
        "not_converted": dict(sorted(not_converted.items())),
        "failing_validator": sum(bool(validate_steps(t.steps)) for t in trajectories),
        "graded_correct": sum(t.correct is True for t in trajectories),
        "grader_errors": sum(bool((t.meta.get("grade") or {}).get("error")) for t in trajectories),
        "replans": dict(sorted(Counter(r.get("replans", 0) for r in records).items())),
        "filters": prepared.get("filters"),
        "split": prepared.get("split"),
        "usage": usage(records),
        "tool_metrics": info.get("tool_metrics") or None,
        "seconds_this_job": round(info.get("seconds", 0.0), 1),
        "run_seconds_total": round(sum(r["seconds"] for r in records), 1),
        "sft_data": str(sft_dir),
        "sft_command": f"python -m jobs.sft data=distill data.sources.trajectories.path={run_dir / TRAJECTORIES_FILE} "
        f"data.out_dir={sft_dir}",
    }
    atomic_write_json(run_dir / REPORT_FILE, report)
    if report["filters"]:
        plot_filters(report["filters"], run_dir / "filters.png")
    return report


def run_distill(config: DistillConfig) -> dict[str, Any]:
    """Distill ``config.benchmarks`` + ``config.benchmark_files`` into ``config.run_dir`` (see the module
    docstring).

    Returns:
        The report (``report.json``) with ``stopped_early`` and ``total`` added.

    Raises:
        ValueError: bad teachers, roles, MAS or filter settings (the key is named); a run dir whose runs were drawn
            under other settings (:func:`check_resume`).
    """
    global _stop_requested
    _stop_requested = False
    run_dir = open_run(config.run_dir)
    done = check_resume(config, record=True)  # checks the roles too
    benchmarks = load_tasks(config)
    samples = config.distill.samples
    runs_path = run_dir / RUNS_FILE
    todo = samples_todo(benchmarks, lambda _: samples, done)
    total = sum(len(b.tasks) for b in benchmarks) * samples
    print(f"[distill] {', '.join(f'{b.name} ({len(b.tasks)})' for b in benchmarks)} x {samples} sample(s): "
          f"{total} runs, {total - len(todo)} already done, {len(todo)} to run; run dir {run_dir}", flush=True)  # fmt: skip
    info: dict[str, Any] = {}
    if todo:
        families = {t.task for b in benchmarks for t in b.tasks}
        graders = {str(t.meta.get("grader")) for b in benchmarks for t in b.tasks}
        writer = SampleWriter(runs_path)
        try:
            names = needed_servers(families, graders, asdict(config.tools))  # the tool layer's mapping
            with job_tool_servers(config, names, run_dir / "logs" / "tool_servers") as server_urls:
                info = asyncio.run(_distill(config, todo, writer, server_urls))
        finally:
            writer.close()
    report = finish(config, run_dir, info)
    log_results(run_dir, config.logger or ["console"], "distill", {"distill": report}, config=asdict(config),
                tracking=asdict(config.tracking))  # fmt: skip
    return {**report, "total": total, "stopped_early": _stop_requested and report["runs"] < total}
