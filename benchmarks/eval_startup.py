"""Where the wall time of a small ``python -m jobs.eval`` goes, phase by phase, across all its processes.

    python -m benchmarks.eval_startup                       # tiny-llama, 4 records x k=1, 48 tokens (as the test)
    python -m benchmarks.eval_startup --model smollm2-135m  # the embedded default model
    python -m benchmarks.eval_startup --repeat 3 --out runs/bench/eval_startup.json
    python -m benchmarks.eval_startup +engine.in_process=true    # more overrides of jobs.eval

Runs the command of ``tests/eval/test_eval_job.py::test_benchmark_files_alone_evaluate_only_those_files_listed_
before_the_start`` (a 4-record GSM8K-style jsonl file, ``eval.k=1 eval.max_response_tokens=48
engine.max_model_len=1024 tools.cache=null``; the sandbox is started for the code tool) and times it from outside
(wall seconds to the submitter's exit; CPU seconds of the whole process tree, each process's last reading while
the tree is polled every 0.2 s: a process killed by its parent, as vLLM's process manager kills an engine core
that does not exit in time, is counted too, which ``RUSAGE_CHILDREN`` misses when no one reaps it).

The phases come from a probe loaded into every Python process of the job (a ``sitecustomize`` on a temporary
``PYTHONPATH`` entry: the submitter, submitit's controller and rank, the tool servers, vLLM's engine core and
worker): it logs unix times when named functions begin and end (:data:`PROBED`), wrapping each once its module is
imported, and when each process is created. Nothing in the job changes; the probe costs a dictionary lookup per
import. A phase that did not happen (e.g. no separate vLLM worker process) shows as ``-``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from afm_core.utils.paths import repo_root
from benchmarks.json_out import write_out

#: ``module: [function or Class.method, ...]`` timed in every process of the job.
PROBED = {
    "afm_core.launch.submit": ["submit"],
    "afm_core.eval.runner": ["run_eval", "evaluate_samples"],
    "afm_core.tools.launcher": ["ServerGroup.stop"],
    "afm_core.models.hf_checkpoint": ["ensure_hf_checkpoint"],
    "afm_core.rollout.factory": ["load_tokenizer", "build_engine"],
    "afm_core.eval.report": ["write_report"],
    "vllm.v1.engine.async_llm": ["AsyncLLM.__init__"],
    "vllm.v1.engine.core": ["EngineCore.__init__", "EngineCore._initialize_kv_caches"],
    "vllm.v1.executor.multiproc_executor": ["WorkerProc.__init__"],
}

PROBE = """
import atexit, functools, importlib.abc, inspect, json, os, sys, time
LOG, PROBED = os.environ["AFM_PHASE_LOG"], json.loads(os.environ["AFM_PHASE_PROBED"])
def log(what):
    with open(LOG, "a") as f:
        f.write(json.dumps([time.time(), os.getpid(), what]) + "\\n")
try:
    import psutil
    log("created " + str(psutil.Process().create_time()) + " " + " ".join(sys.orig_argv[1:4]))
except Exception:
    pass
atexit.register(log, "atexit")
def wrap(owner, name, label):
    raw = owner.__dict__.get(name)
    if raw is None or not callable(raw):
        return
    if inspect.iscoroutinefunction(raw):
        async def timed(*a, **k):
            log("begin " + label)
            try:
                return await raw(*a, **k)
            finally:
                log("end " + label)
    else:
        def timed(*a, **k):
            log("begin " + label)
            try:
                return raw(*a, **k)
            finally:
                log("end " + label)
    setattr(owner, name, functools.wraps(raw)(timed))
class Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner
    def create_module(self, spec):
        return self.inner.create_module(spec)
    def exec_module(self, module):
        self.inner.exec_module(module)
        for target in PROBED[module.__name__]:
            *path, name = target.split(".")
            owner = module
            for part in path:
                owner = getattr(owner, part, None)
            if owner is not None:  # an older checkout may lack it
                wrap(owner, name, module.__name__.rpartition(".")[2] + "." + target)
class Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in PROBED:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else finder.find_spec(name, path, target)
            if spec is not None:
                spec.loader = Loader(spec.loader)
                return spec
        return None
sys.meta_path.insert(0, Finder())
"""

#: ``(phase, from, to)``: the first (``begin``) or last (``end``) log entry of a probed function, or ``start`` (the
#: command's launch), ``exit`` (its end), ``core`` / ``worker`` (creation of vLLM's engine-core / worker process).
PHASES = [
    ("submitter: interpreter, imports, compose, check, plan", "start", "begin submit.submit"),
    ("submitit controller + rank start, imports", "begin submit.submit", "begin runner.run_eval"),
    ("benchmarks, tool servers started", "begin runner.run_eval", "begin hf_checkpoint.ensure_hf_checkpoint"),
    ("HF checkpoint check (imports transformers, torch)", "begin hf_checkpoint.ensure_hf_checkpoint",
     "end hf_checkpoint.ensure_hf_checkpoint"),
    ("tokenizer", "begin factory.load_tokenizer", "end factory.load_tokenizer"),
    ("engine: vLLM import + config in the rank", "begin factory.build_engine", "begin async_llm.AsyncLLM.__init__"),
    ("engine: engine-core process start, imports", "begin async_llm.AsyncLLM.__init__",
     "begin core.EngineCore.__init__"),
    ("engine: executor + worker init, model load", "begin core.EngineCore.__init__",
     "begin core.EngineCore._initialize_kv_caches"),
    ("  of which a separate worker process's start, imports", "worker",
     "begin multiproc_executor.WorkerProc.__init__"),
    ("engine: KV cache, warmup", "begin core.EngineCore._initialize_kv_caches",
     "end core.EngineCore._initialize_kv_caches"),
    ("engine: rest of init, handshake", "end core.EngineCore._initialize_kv_caches", "end factory.build_engine"),
    ("tool servers: wait after the engine", "end factory.build_engine", "begin runner.evaluate_samples"),
    ("evaluation (agent loop, grading)", "begin runner.evaluate_samples", "end runner.evaluate_samples"),
    ("engine shutdown (and the tool pool's, graders')", "end runner.evaluate_samples",
     "begin launcher.ServerGroup.stop"),
    ("tool servers stop", "begin launcher.ServerGroup.stop", "end launcher.ServerGroup.stop"),
    ("report (metrics, report.md, eval.png)", "begin report.write_report", "end report.write_report"),
    ("rank exit, submitter collects the result", "end runner.run_eval", "end submit.submit"),
    ("submitter exit", "end submit.submit", "exit"),
]  # fmt: skip


def write_tasks(path: Path, n: int = 4) -> None:
    """``n`` GSM8K-style records in the AFM/verl RL layout (as ``tests/eval/test_eval_job.py`` writes them)."""
    rows = [{"data_source": "gsm8k", "ability": "math", "extra_info": {"index": str(i), "split": "test"},
             "prompt": [{"role": "user", "content": f"Solve it with <code> and give <answer>\\boxed{{}}</answer>."
                         f"\n\nQuestion: What is {i} + {i}?"}],
             "reward_model": {"ground_truth": str(2 * i), "style": "rule"}} for i in range(n)]  # fmt: skip
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def marks(log: Path, start: float, end: float) -> dict[str, float]:
    """Seconds from ``start`` of each mark: first ``begin``, last ``end``, and the vLLM process creations."""
    out = {"start": 0.0, "exit": end - start}
    for line in log.read_text().splitlines():
        t, _, what = json.loads(line)
        if what.startswith("created "):
            created, argv = float(what.split()[1]), what.split(" ", 2)[2]
            if "spawn_main" in argv:  # vLLM's engine core, then (mp executor) its worker
                out["worker" if "core" in out else "core"] = created - start
            continue
        if (what.startswith("begin ") and what not in out) or what.startswith("end "):
            out[what] = t - start
    return out


def run_once(model: str, work: Path, overrides: list[str]) -> dict:
    """One ``jobs.eval`` run: ``{"wall_s", "cpu_s", "load_before", "load_after", "phases": {phase: s or None}}``."""
    tasks, log, probe = work / "my.jsonl", work / "phases.jsonl", work / "probe"
    write_tasks(tasks)
    probe.mkdir(exist_ok=True)
    (probe / "sitecustomize.py").write_text(PROBE)
    log.unlink(missing_ok=True)
    env = {**os.environ, "AFM_PHASE_LOG": str(log), "AFM_PHASE_PROBED": json.dumps(PROBED),
           "PYTHONPATH": os.pathsep.join([str(repo_root()), str(probe), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    run_dir = work / f"run-{time.time_ns()}"
    cmd = [sys.executable, "-m", "jobs.eval", f"model={model}", f"benchmark_files=[{tasks}]", "eval.k=1",
           "eval.max_response_tokens=48", "engine.max_model_len=1024", f"hydra.run.dir={run_dir}", "tools.cache=null",
           *overrides]  # fmt: skip
    load_before, cpu = os.getloadavg()[0], {}
    start = time.time()
    with open(work / "stdout.txt", "w") as out, open(work / "stderr.txt", "w") as err:
        job = subprocess.Popen(cmd, cwd=repo_root(), env=env, stdout=out, stderr=err)
        root = psutil.Process(job.pid)
        while job.poll() is None:
            for proc in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    times = proc.cpu_times()
                    cpu[proc.pid] = times.user + times.system
            time.sleep(0.2)
    end = time.time()
    if job.returncode != 0:
        raise SystemExit(f"jobs.eval failed ({job.returncode}):\n{(work / 'stderr.txt').read_text()[-3000:]}")
    at = marks(log, start, end)
    phases = {name: round(at[b] - at[a], 2) if a in at and b in at else None for name, a, b in PHASES}
    return {"wall_s": round(end - start, 2), "load_before": load_before, "load_after": os.getloadavg()[0],
            "cpu_s": round(sum(cpu.values()), 1),
            "phases": phases}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-llama", help="model preset (conf/model/)")
    parser.add_argument("--repeat", type=int, default=1, help="runs, one after the other")
    parser.add_argument("--out", type=Path, help="also write the runs as JSON here")
    parser.add_argument("overrides", nargs="*", help="more Hydra overrides of jobs.eval")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="eval-startup-") as tmp:
        runs = [run_once(args.model, Path(tmp), args.overrides) for _ in range(args.repeat)]
    width = max(len(name) for name, _, _ in PHASES)
    print(f"jobs.eval, 4 records x k=1, {args.model} {' '.join(args.overrides)}: seconds per phase, one column per run")
    for name, _, _ in PHASES:
        cells = ["-" if r["phases"][name] is None else f"{r['phases'][name]:.2f}" for r in runs]
        print(f"  {name:<{width}}  " + "  ".join(f"{c:>6}" for c in cells))
    print(f"  {'wall':<{width}}  " + "  ".join(f"{r['wall_s']:>6.2f}" for r in runs))
    print(f"  {'CPU (all processes)':<{width}}  " + "  ".join(f"{r['cpu_s']:>6.1f}" for r in runs))
    print(f"  {'load average before / after':<{width}}  "
          + "  ".join(f"{r['load_before']:.1f}/{r['load_after']:.1f}" for r in runs))  # fmt: skip
    write_out(args.out, {"model": args.model, "overrides": args.overrides, "runs": runs})


if __name__ == "__main__":
    main()
