"""A chain of stages, each a job of its own, each training stage's HF export the next stages' model.

``python -m jobs.pipeline recipe=autocoa_demo`` reads ``stages`` (``conf/pipeline.yaml``, a recipe fills it)::

    stages:
      - {name: sft_stage1, job: sft, recipe: autocoa_stage1, overrides: [trainer.max_steps=12]}
      - {name: rl_stage1, job: rl, recipe: autocoa_rl_stage1, overrides: []}
      - {name: after, job: eval, overrides: ["benchmark_files=[@{slice}/rl_data.parquet]"]}

and runs them in order. Stage ``i`` is the stage's own entry point, ``python -m jobs.<job>`` (so it is submitted
through submitit on ``cluster=local|slurm`` and checkpoints, requeues and resumes exactly as when run by hand), with
``hydra.run.dir=RUN_DIR/<i>_<name>``, ``recipe=<recipe>``, the pipeline's ``overrides`` (every stage), the stage's
``overrides``, the pipeline's ``job_overrides[<job>]`` (every stage of that job, e.g. a test's tiny sizes), the
pipeline's cluster settings, ``cluster.wait=true`` and ``model.hf_path=<RUN_DIR/hf of a training
stage>``: the stage named by the stage's ``model`` key, else the last training stage (``sft``, ``rl``) before it
(none before the first). ``@{name}`` in an override is the run dir of the earlier stage ``name`` (an ``eval`` or
``filter_rl`` stage reads what another wrote: ``rl_data.parquet``, ``samples.jsonl``). A training stage is finished
when its HF export exists, an ``eval`` stage when its ``metrics.json`` does, a ``filter_rl`` stage when its
``filter_report.json`` does.

Resume: a chain holds ``RUN_DIR/pipeline.lock`` (``flock``) while it runs, so a second chain on the same run dir
fails at once. ``RUN_DIR/pipeline.json`` records each finished stage (its spec, command, run dir, export, seconds, load
average), written atomically after the stage's export exists. Running the pipeline again on the same run dir
(``hydra.run.dir=RUN_DIR``) skips the finished stages and starts the first unfinished one in its own run dir again,
where the stage's job resumes from its latest complete checkpoint: the chain continues at the stage and step where
it stopped. A finished stage whose spec has changed since is an error (its successors were trained from it).

Before the first stage runs, every stage's config is composed (and an SFT stage's checked against its schema), so a
bad override fails at once, not hours later. At the end ``RUN_DIR/summary.md`` / ``summary.json`` hold each stage's
wall time and headline metrics (:mod:`afm_core.launch.pipeline_report`); a ``report`` (a dotted path of a function
``report(run_dir, stages) -> dict``, e.g. :func:`afm_core.rl.demo.rl_demo_report`) adds its keys to ``summary.json``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from afm_core.launch.pipeline_report import report_function, stage_metrics, summary_table
from afm_core.launch.teardown import STOP_BOUND_S, stop_children_on_interrupt
from afm_core.utils.atomic import atomic_write_json, atomic_write_text
from afm_core.utils.paths import repo_root

JOBS = {"sft": "jobs.sft", "rl": "jobs.rl", "eval": "jobs.eval", "filter_rl": "jobs.filter_rl"}
TRAINING_JOBS = ("sft", "rl")
# What a finished stage leaves in its run dir (training stages: the HF export's config.json).
FINISHED_MARKER = {
    "sft": "hf/config.json",
    "rl": "hf/config.json",
    "eval": "metrics.json",
    "filter_rl": "filter_report.json",
}
_STAGE_REF_RE = re.compile(r"@\{([A-Za-z0-9][A-Za-z0-9_.-]*)\}")
STATE_FILE = "pipeline.json"
LOCK_FILE = "pipeline.lock"
STATE_VERSION = 1
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class PipelineError(RuntimeError):
    """A stage failed, finished without an export, or the recorded chain no longer matches the config."""


@dataclass(frozen=True)
class StageSpec:
    """One stage: ``python -m jobs.<job> recipe=<recipe> <overrides>``.

    Attributes:
        name: unique in the chain; names the stage's run dir ``<i>_<name>``.
        job: ``sft``, ``rl``, ``eval`` or ``filter_rl``.
        recipe: a ``conf/recipe`` name, or None.
        overrides: Hydra overrides of this stage; ``@{name}`` is an earlier stage's run dir.
        model: the earlier training stage whose HF export is this stage's model; None: the last one before it.
    """

    name: str
    job: str
    recipe: str | None = None
    overrides: tuple[str, ...] = ()
    model: str | None = None


def parse_stages(stages: Sequence[Mapping[str, Any]] | None) -> list[StageSpec]:
    """The ``stages`` list of the config as :class:`StageSpec` s.

    Raises:
        ValueError: no stage, an unknown key or job, a missing or duplicate name (names ``stages[i]``).
    """
    if not stages:
        raise ValueError("stages: the pipeline has no stage (pick a recipe, e.g. recipe=autocoa_demo)")
    specs: list[StageSpec] = []
    seen: set[str] = set()
    for i, entry in enumerate(stages):
        where = f"stages[{i}]"
        unknown = set(entry) - {"name", "job", "recipe", "overrides", "model"}
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; expected name, job, recipe, overrides, model")
        name = entry.get("name")
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ValueError(f"{where}.name={name!r}: letters, digits, '_', '-' and '.' only")
        if name in seen:
            raise ValueError(f"{where}.name={name!r}: another stage has this name")
        seen.add(name)
        job = entry.get("job")
        if job not in JOBS:
            raise ValueError(f"{where}.job={job!r}: expected one of {', '.join(JOBS)}")
        overrides = entry.get("overrides") or []
        if not all(isinstance(o, str) for o in overrides):
            raise ValueError(f"{where}.overrides: a list of Hydra override strings")
        for ref in (r for o in overrides for r in _STAGE_REF_RE.findall(o)):
            if ref not in seen - {name}:
                raise ValueError(f"{where}.overrides: @{{{ref}}} names no earlier stage")
        model = entry.get("model")
        trained = {s.name for s in specs if s.job in TRAINING_JOBS}
        if model is not None and model not in trained:
            raise ValueError(f"{where}.model={model!r}: not an earlier training stage ({', '.join(sorted(trained))})")
        specs.append(StageSpec(name, job, entry.get("recipe"), tuple(overrides), model))
    return specs


def _override_value(value: Any) -> str:
    """A config value as Hydra override text (JSON: quoted strings, lists, null, true/false)."""
    if isinstance(value, str):
        return json.dumps(value) if (not value or re.search(r"[\s,\[\]{}()='\"]", value)) else value
    return json.dumps(value)


def cluster_overrides(cluster: Mapping[str, Any]) -> list[str]:
    """``cluster=<name>`` and ``cluster.<key>=<value>`` for every key of the pipeline's cluster group, with
    ``cluster.wait=true`` (the chain waits for each stage)."""
    out = [f"cluster={cluster['name']}"]
    out += [f"cluster.{key}={_override_value(value)}" for key, value in cluster.items() if key not in ("name", "wait")]
    return [*out, "cluster.wait=true"]


def stage_dir(run_dir: Path, index: int, spec: StageSpec) -> Path:
    return run_dir / f"{index}_{spec.name}"


def stage_overrides(
    spec: StageSpec,
    directory: Path,
    *,
    common: Sequence[str],
    cluster: Sequence[str],
    model_hf_path: str | None,
    stage_dirs: Mapping[str, Path] | None = None,
    per_job: Sequence[str] = (),
) -> list[str]:
    """The Hydra overrides of one stage's job (module docstring), in the order they apply; ``@{name}`` becomes
    ``stage_dirs[name]``."""
    out = [f"hydra.run.dir={directory}"]
    if spec.recipe:
        out.append(f"recipe={spec.recipe}")
    dirs = stage_dirs or {}
    own = [_STAGE_REF_RE.sub(lambda m: str(dirs.get(m.group(1), m.group(0))), o) for o in spec.overrides]
    out += [*common, *own, *per_job, *cluster]
    if model_hf_path is not None:
        out.append(f"model.hf_path={model_hf_path}")
    return out


def stage_command(spec: StageSpec, overrides: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", JOBS[spec.job], *overrides]


def run_subprocess(command: list[str]) -> int:
    """Run a stage's job in the foreground from the repository root (its output goes to this process's stdout and
    stderr; the job's own logs to its run dir); returns the exit status. SIGTERM or Ctrl-C passes SIGINT on to the
    stage, which stops its own job, and waits for it (bounded: :mod:`afm_core.launch.teardown`)."""
    print(f"[pipeline] $ {' '.join(command)}", flush=True)
    with stop_children_on_interrupt(grace_s=STOP_BOUND_S + 5.0):  # the stage's own teardown first
        return subprocess.Popen(command, cwd=repo_root()).wait()


class PipelineState:
    """``RUN_DIR/pipeline.json``: the finished stages, rewritten atomically after each one."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / STATE_FILE
        self.data: dict[str, Any] = {"version": STATE_VERSION, "stages": {}}
        if self.path.is_file():
            self.data = json.loads(self.path.read_text(encoding="utf-8"))
            if self.data.get("version") != STATE_VERSION:
                raise PipelineError(f"{self.path}: version {self.data.get('version')}, expected {STATE_VERSION}")

    def finished(self, spec: StageSpec) -> dict[str, Any] | None:
        """The record of ``spec`` if it finished.

        Raises:
            PipelineError: it finished with another spec.
        """
        record = self.data["stages"].get(spec.name)
        if record is None:
            return None
        if record["spec"] != _spec_dict(spec):
            raise PipelineError(
                f"{self.path}: stage {spec.name!r} finished as {record['spec']}, but the config now says "
                f"{_spec_dict(spec)}; start a new run dir (the later stages were trained from the finished one)"
            )
        return record

    def record(self, spec: StageSpec, record: dict[str, Any]) -> None:
        self.data["stages"][spec.name] = {"spec": _spec_dict(spec), **record}
        atomic_write_json(self.path, self.data)


def _spec_dict(spec: StageSpec) -> dict[str, Any]:
    return {**asdict(spec), "overrides": list(spec.overrides)}


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_pipeline(
    cfg: Mapping[str, Any],
    *,
    runner: Callable[[list[str]], int] = run_subprocess,
    check: Callable[[StageSpec, list[str]], None] | None = None,
) -> dict[str, Any]:
    """Run (or continue) the chain of ``cfg`` (``run_dir``, ``stages``, ``overrides``, ``job_overrides``,
    ``cluster``, ``report``).

    Args:
        runner: runs one stage's command and returns its exit status (default: a foreground subprocess).
        check: called with each stage and its overrides before anything runs (config composition and schema).
    Returns:
        ``{"run_dir", "stages": [{name, job, run_dir, hf_dir, seconds, skipped, metrics...}], "hf_dir"}`` and the
        keys of ``report``'s result.
    Raises:
        PipelineError: a stage's job failed (its exit status and run dir named) or left no output (``hf/``,
            ``metrics.json``, ``filter_report.json``).
        ValueError: a bad ``stages`` list.
    """
    run_dir = Path(cfg["run_dir"]).absolute()
    specs = parse_stages(cfg.get("stages"))
    common = list(cfg.get("overrides") or [])
    per_job = {job: list(values or []) for job, values in dict(cfg.get("job_overrides") or {}).items()}
    unknown = sorted(set(per_job) - set(JOBS))
    if unknown:
        raise ValueError(f"job_overrides.{unknown[0]}: not a job ({', '.join(JOBS)})")
    cluster = cluster_overrides(cfg["cluster"])
    dirs = {spec.name: stage_dir(run_dir, i, spec) for i, spec in enumerate(specs)}
    if check is not None:
        for i, spec in enumerate(specs):
            model = None if _model_stage(specs, i) is None else "/previous/stage/hf"
            check(spec, stage_overrides(spec, dirs[spec.name], common=common, cluster=cluster, model_hf_path=model,
                                        stage_dirs=dirs, per_job=per_job.get(spec.job, ())))  # fmt: skip
    run_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive(run_dir / LOCK_FILE):
        return _run_stages(run_dir, specs, common, cluster, runner, cfg.get("report"), per_job)


def _model_stage(specs: Sequence[StageSpec], index: int) -> str | None:
    """The training stage whose export is stage ``index``'s model (its ``model`` key, else the last one before)."""
    if specs[index].model is not None:
        return specs[index].model
    return next((s.name for s in reversed(specs[:index]) if s.job in TRAINING_JOBS), None)


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` for the chain's lifetime.

    Raises:
        PipelineError: another pipeline holds it (two chains must not train into the same stage run dirs).
    """
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PipelineError(f"another pipeline is running on {path.parent} (it holds {path})") from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _run_stages(
    run_dir: Path,
    specs: list[StageSpec],
    common: list[str],
    cluster: list[str],
    runner: Callable[[list[str]], int],
    report: str | None = None,
    per_job: Mapping[str, Sequence[str]] | None = None,
) -> dict[str, Any]:
    state = PipelineState(run_dir)
    dirs = {spec.name: stage_dir(run_dir, i, spec) for i, spec in enumerate(specs)}
    exports: dict[str, str] = {}
    results = []
    for i, spec in enumerate(specs):
        directory = dirs[spec.name]
        done = state.finished(spec)
        if done is not None:
            print(f"[pipeline] stage {i} {spec.name}: finished before ({done['run_dir']}), skipped", flush=True)
            if done.get("hf_dir"):
                exports[spec.name] = done["hf_dir"]
            results.append({**done, "skipped": True})
            continue
        model = _model_stage(specs, i)
        overrides = stage_overrides(spec, directory, common=common, cluster=cluster,
                                    model_hf_path=exports[model] if model else None, stage_dirs=dirs,
                                    per_job=(per_job or {}).get(spec.job, ()))  # fmt: skip
        command = stage_command(spec, overrides)
        resuming = (directory / "checkpoints").is_dir() or (directory / "samples.jsonl").is_file()
        print(
            f"[pipeline] stage {i} {spec.name} ({spec.job}, recipe {spec.recipe}): "
            f"{'resuming in' if resuming else 'starting'} {directory}",
            flush=True,
        )
        load_before, start = _loadavg(), time.perf_counter()
        status = runner(command)
        seconds = time.perf_counter() - start
        if status != 0:
            raise PipelineError(
                f"stage {i} {spec.name} failed (exit status {status}); its run dir is {directory}. Run the pipeline "
                f"again with hydra.run.dir={run_dir} to resume it there"
            )
        marker = directory / FINISHED_MARKER[spec.job]
        if not marker.is_file():
            what = "an HF export" if spec.job in TRAINING_JOBS else marker.name
            raise PipelineError(f"stage {i} {spec.name} ended without {what} in {marker.parent} (stopped early?)")
        hf_dir = str(directory / "hf") if spec.job in TRAINING_JOBS else None
        record = {
            "name": spec.name,
            "job": spec.job,
            "index": i,
            "run_dir": str(directory),
            "hf_dir": hf_dir,
            "command": command,
            "seconds": round(seconds, 1),
            "resumed": resuming,
            "loadavg_before": load_before,
            "loadavg_after": _loadavg(),
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "metrics": stage_metrics(spec.job, directory),
        }
        state.record(spec, record)
        results.append({**record, "skipped": False})
        if hf_dir is not None:
            exports[spec.name] = hf_dir
    last_training = next((s.name for s in reversed(specs) if s.job in TRAINING_JOBS), None)
    summary: dict[str, Any] = {"run_dir": str(run_dir), "stages": results, "hf_dir": exports.get(last_training or "")}
    if report:
        summary.update(report_function(report)(run_dir, results))
    atomic_write_json(run_dir / "summary.json", summary)
    atomic_write_text(run_dir / "summary.md", summary_table(results))
    print(summary_table(results), flush=True)
    return summary
