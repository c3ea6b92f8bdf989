"""A chain of training stages, each a job of its own, each stage's HF export the next stage's model.

``python -m jobs.pipeline recipe=autocoa_demo`` reads ``stages`` (``conf/pipeline.yaml``, a recipe fills it)::

    stages:
      - {name: sft_stage1, job: sft, recipe: autocoa_stage1, overrides: [trainer.max_steps=12]}
      - {name: rl_stage1, job: rl, recipe: autocoa_rl_stage1, overrides: []}

and runs them in order. Stage ``i`` is the stage's own entry point, ``python -m jobs.<job>`` (so it is submitted
through submitit on ``cluster=local|slurm`` and checkpoints, requeues and resumes exactly as when run by hand), with
``hydra.run.dir=RUN_DIR/<i>_<name>``, ``recipe=<recipe>``, the pipeline's ``overrides`` (every stage), the stage's
``overrides``, the pipeline's cluster settings, ``cluster.wait=true`` and, from the second stage on,
``model.hf_path=<the previous stage's RUN_DIR/hf>`` (the HF export every SFT and RL run writes when it completes).

Resume: a chain holds ``RUN_DIR/pipeline.lock`` (``flock``) while it runs, so a second chain on the same run dir
fails at once. ``RUN_DIR/pipeline.json`` records each finished stage (its spec, command, run dir, export, seconds, load
average), written atomically after the stage's export exists. Running the pipeline again on the same run dir
(``hydra.run.dir=RUN_DIR``) skips the finished stages and starts the first unfinished one in its own run dir again,
where the stage's job resumes from its latest complete checkpoint: the chain continues at the stage and step where
it stopped. A finished stage whose spec has changed since is an error (its successors were trained from it).

Before the first stage runs, every stage's config is composed (and an SFT stage's checked against its schema), so a
bad override fails at once, not hours later. At the end ``RUN_DIR/summary.md`` / ``summary.json`` hold each stage's
wall time and headline metrics (:func:`stage_metrics`).
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

from afm_core.utils.atomic import atomic_write_json, atomic_write_text

JOBS = {"sft": "jobs.sft", "rl": "jobs.rl"}
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
        job: ``sft`` or ``rl``.
        recipe: a ``conf/recipe`` name, or None.
        overrides: Hydra overrides of this stage.
    """

    name: str
    job: str
    recipe: str | None = None
    overrides: tuple[str, ...] = ()


def parse_stages(stages: Sequence[Mapping[str, Any]] | None) -> list[StageSpec]:
    """The ``stages`` list of the config as :class:`StageSpec` s.

    Raises:
        ValueError: no stage, an unknown key or job, a missing or duplicate name (names ``stages[i]``).
    """
    if not stages:
        raise ValueError("stages: the pipeline has no stage (pick a recipe, e.g. recipe=autocoa_demo)")
    specs, seen = [], set()
    for i, entry in enumerate(stages):
        where = f"stages[{i}]"
        unknown = set(entry) - {"name", "job", "recipe", "overrides"}
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; expected name, job, recipe, overrides")
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
        specs.append(StageSpec(name, job, entry.get("recipe"), tuple(overrides)))
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
    spec: StageSpec, directory: Path, *, common: Sequence[str], cluster: Sequence[str], model_hf_path: str | None
) -> list[str]:
    """The Hydra overrides of one stage's job (module docstring), in the order they apply."""
    out = [f"hydra.run.dir={directory}"]
    if spec.recipe:
        out.append(f"recipe={spec.recipe}")
    out += [*common, *spec.overrides, *cluster]
    if model_hf_path is not None:
        out.append(f"model.hf_path={model_hf_path}")
    return out


def stage_command(spec: StageSpec, overrides: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", JOBS[spec.job], *overrides]


def run_subprocess(command: list[str]) -> int:
    """Run a stage's job in the foreground from the repository root (its output goes to this process's stdout and
    stderr; the job's own logs to its run dir); returns the exit status."""
    from afm_core.utils.paths import repo_root

    print(f"[pipeline] $ {' '.join(command)}", flush=True)
    return subprocess.call(command, cwd=repo_root())


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
    """Run (or continue) the chain of ``cfg`` (``run_dir``, ``stages``, ``overrides``, ``cluster``).

    Args:
        runner: runs one stage's command and returns its exit status (default: a foreground subprocess).
        check: called with each stage and its overrides before anything runs (config composition and schema).
    Returns:
        ``{"run_dir", "stages": [{name, job, run_dir, hf_dir, seconds, skipped, metrics...}], "hf_dir"}``.
    Raises:
        PipelineError: a stage's job failed (its exit status and run dir named) or left no ``hf/`` export.
        ValueError: a bad ``stages`` list.
    """
    run_dir = Path(cfg["run_dir"]).absolute()
    specs = parse_stages(cfg.get("stages"))
    common = list(cfg.get("overrides") or [])
    cluster = cluster_overrides(cfg["cluster"])
    if check is not None:
        for i, spec in enumerate(specs):
            check(spec, stage_overrides(spec, stage_dir(run_dir, i, spec), common=common, cluster=cluster,
                                        model_hf_path=None if i == 0 else "/previous/stage/hf"))  # fmt: skip
    run_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive(run_dir / LOCK_FILE):
        return _run_stages(run_dir, specs, common, cluster, runner)


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
    run_dir: Path, specs: list[StageSpec], common: list[str], cluster: list[str], runner: Callable[[list[str]], int]
) -> dict[str, Any]:
    state = PipelineState(run_dir)
    previous_hf: str | None = None
    results = []
    for i, spec in enumerate(specs):
        directory = stage_dir(run_dir, i, spec)
        done = state.finished(spec)
        if done is not None:
            print(f"[pipeline] stage {i} {spec.name}: finished before ({done['hf_dir']}), skipped", flush=True)
            previous_hf = done["hf_dir"]
            results.append({**done, "skipped": True})
            continue
        overrides = stage_overrides(spec, directory, common=common, cluster=cluster, model_hf_path=previous_hf)
        command = stage_command(spec, overrides)
        resuming = (directory / "checkpoints").is_dir()
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
        hf_dir = directory / "hf"
        if not (hf_dir / "config.json").is_file():
            raise PipelineError(f"stage {i} {spec.name} ended without an HF export in {hf_dir} (stopped early?)")
        record = {
            "name": spec.name,
            "job": spec.job,
            "index": i,
            "run_dir": str(directory),
            "hf_dir": str(hf_dir),
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
        previous_hf = str(hf_dir)
    summary = {"run_dir": str(run_dir), "stages": results, "hf_dir": previous_hf}
    atomic_write_json(run_dir / "summary.json", summary)
    atomic_write_text(run_dir / "summary.md", summary_table(results))
    print(summary_table(results), flush=True)
    return summary


def stage_metrics(job: str, directory: Path) -> dict[str, Any]:
    """Headline metrics of a finished stage from its ``metrics.jsonl``.

    SFT: held-out loss at the first and the last eval (and, for the contrastive objective, held-out preference
    accuracy and margin); RL: first and last rollout step's reward, accuracy, format validity, tool calls per
    trajectory, and the simulated observations written.
    """
    from afm_core.train.metrics import read_metrics

    path = directory / "metrics.jsonl"
    if not path.is_file():
        return {}
    records = read_metrics(path)
    out: dict[str, Any] = {}
    if job == "sft":
        evals = [r for r in records if r.get("split") == "eval"]
        train = [r for r in records if r.get("split") == "train"]
        if evals:
            first, last = evals[0], evals[-1]
            out.update(steps=last["step"], eval_loss=[first["loss"], last["loss"]])
            if "pref_acc" in last:
                out.update(pref_acc=[first["pref_acc"], last["pref_acc"]], margin=[first["margin"], last["margin"]])
                out["eval_pairs"] = last.get("pairs")
        if train:
            out["train_s"] = round(train[-1].get("elapsed_s", 0.0), 1)
        return out
    steps = [r for r in records if r.get("split") == "train"]
    if steps:
        first, last = steps[0], steps[-1]
        out["steps"] = last["step"]
        for key in ("reward_mean_generated", "accuracy", "format_ok", "tool_calls_per_traj"):
            if key in last:
                out[key] = [first[key], last[key]]
        sim = [((r.get("tool_metrics") or {}).get("simulated") or {}).get("calls", 0) for r in steps]
        if any(sim):
            out["simulated_observations"] = sum(sim)
        out["environment"] = last.get("environment")
    return out


def summary_table(results: Sequence[Mapping[str, Any]]) -> str:
    """A markdown table: one row per stage with its wall time, load average and headline metrics."""

    def pair(value: Any) -> str:
        if isinstance(value, list) and len(value) == 2:
            return " -> ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in value)
        return "" if value is None else str(value)

    lines = [
        "| stage | job | steps | wall (s) | load 1-min (start/end) | metrics (first -> last) |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        m = dict(r.get("metrics") or {})
        steps = m.pop("steps", "")
        m.pop("train_s", None)
        shown = "; ".join(f"{k} {pair(v)}" for k, v in m.items() if v is not None)
        load = f"{r['loadavg_before'][0]:.1f} / {r['loadavg_after'][0]:.1f}" if r.get("loadavg_before") else ""
        lines.append(f"| {r['name']} | {r['job']} | {steps} | {r['seconds']:.0f} | {load} | {shown} |")
    return "\n".join(lines) + "\n"
