"""Start-up cost of the jobs' processes: wall and CPU seconds to each one's first useful line, and its top imports.

    .venv/bin/python -m benchmarks.startup                                  # the working tree, every entry point once
    .venv/bin/python -m benchmarks.startup --entries sft plan --repeat 2    # some entry points, twice each
    .venv/bin/python -m benchmarks.startup --rev d3e7e1b HEAD --repeat 2    # two commits side by side, ABBA x 2
    .venv/bin/python -m benchmarks.startup --rev d3e7e1b HEAD --entries sft --warmup 1 --no-imports  # a rank's start
    .venv/bin/python -m benchmarks.startup --json runs/bench/startup.json --no-imports
    .venv/bin/python -m benchmarks.startup --suite -- tests/test_config.py -q    # a suite's CPU: start-up vs the rest

Entry points (``--entries``), each run as a user runs it, from the repository root (or, with ``--rev``, from a
``git worktree`` of that commit sharing this venv, ``$AFM_SHARED_DATA`` and ``$AFM_CACHE``), at the smallest real
settings the tests use:

- ``status``: ``python -m jobs.status --help``; useful line: its exit (the help printed).
- ``plan``: ``python -m jobs.plan recipe=afm_web_sft_32b``; useful line: its exit (the plan table printed).
- ``sft``: ``python -m jobs.sft`` with tiny-llama on a 120-trajectory slice of the real traces (the job tests'
  ``TINY`` settings, ``trainer.max_steps=1``); useful line: the rank's first ``metrics.jsonl`` train record. Its
  rows: the whole job (submitter, submitit's controller, the rank) and the **training rank** alone (from the rank
  process's creation to its first step).
- ``rl``: ``python -m jobs.rl recipe=rl_smoke trainer.max_steps=1`` (tiny-llama, in-process vLLM engine); useful
  line: the first rollout step's ``metrics.jsonl`` record; rows: the job, the RL rank.
- ``eval``: ``python -m jobs.eval`` on 4 GSM8K-style records, k=1, 48 tokens (``benchmarks/eval_startup.py``'s
  command, tiny-llama); useful line: the first graded sample (``samples.jsonl``); rows: the job, and the **vLLM
  engine core** process alone (from its creation to the end of ``EngineCore.__init__``: model loaded, KV cache
  allocated, ready for requests).

How it is measured: a probe (a ``sitecustomize`` on a temporary ``PYTHONPATH`` entry, standard library only) in
every Python process of the job logs the process's creation time (from ``/proc/self/stat``, i.e. before the
interpreter starts), the unix time and the process's CPU seconds (``time.process_time``, all threads) when the marked
functions are called, and the CPU spent in imports (around ``importlib._bootstrap._find_and_load``, outermost imports
only). A job is stopped (SIGTERM, then SIGKILL of what is left) once its useful line is logged. Wall seconds of a
job row: from this script's ``Popen`` to the mark; CPU seconds: the sum over the job's process tree (polled every
0.1 s with psutil: each process's last reading before the mark; the marking process's own reading is exact). A
process row (training rank, engine core) counts that process alone, from its creation: interpreter start, imports,
model and data set-up, the first step (whose own compute is in it: a few seconds at tiny-llama's size). ``status``
and ``plan`` rows: wall to exit, CPU from ``wait4`` (the process and its reaped children). "imports CPU": the CPU
seconds the process spent importing up to its mark (status, plan: to its exit); "job function called at": wall
seconds from the rank's creation to the call of ``run_sft`` / ``run_rl`` / ``run_eval`` (interpreter, submitit,
unpickling the job); the rest of a rank's row is that function's imports, set-up and first step.

The imports table comes from one more run per entry point (and commit) under ``PYTHONPROFILEIMPORTTIME=1`` (each
process's stderr into a file of its own, so processes that share a stderr are not mixed): its timings are not in
the first table (importtime costs a little). Listed per row: the process's total import time (the sum of its
outermost imports) and its imports with the largest cumulative time among those that cross a package boundary
(the module importing it is of another top-level package, or none: an import run by a function or the script): e.g. ``torch._inductor``
pulled in by ``megatron.core.fusions``; cumulative times nest (``megatron.core`` includes the ``torch`` it imports).

``--suite -- PYTEST_ARGS``: runs ``python -m pytest PYTEST_ARGS`` with the probe and reports, over every Python
process it starts (pytest, its xdist workers, every process the tests start, forked children too), the CPU seconds
spent in interpreter start (before ``sitecustomize``) and imports, against the rest (test bodies, the jobs' work);
and the tests whose processes cost the most start-up (a process belongs to the test named by
``PYTEST_CURRENT_TEST`` in the environment it inherited). Not counted: processes started with an environment
without the probe's ``PYTHONPATH``, non-Python processes (``bwrap``, Slurm), and the CPU of processes that ended
without running their exit hooks (killed: the count is printed).

``--rev A B``: each commit in a detached ``git worktree`` (in the scratch dir, removed after; its ``afm_core`` checked
to be the one imported), runs in the order A B B A per ``--repeat`` block (A B C C B A for three commits), so all
see the same drift of the machine's load; the table adds the ratio B / A of the median walls and CPU (each later
commit's against the first). ``--warmup N``: N untimed runs per entry point
and commit first (the first run after a while reads the wheels' shared libraries from disk). Each worktree's
``afm_core`` and ``jobs`` are byte-compiled before the runs (a fresh checkout would compile them in its first run).

Nothing here asserts a timing. Record the load (printed) with the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: ``module: [function or Class.method, ...]`` whose calls are marked (first begin and first end per process).
PROBED = {
    "afm_core.utils.tracking": ["MetricsLog.write"],
    "afm_core.eval.samples": ["SampleWriter.write"],
    "afm_core.train.sft": ["run_sft"],
    "afm_core.rl.driver": ["run_rl"],
    "afm_core.eval.runner": ["run_eval"],
    "vllm.v1.engine.core": ["EngineCore.__init__"],
}

PROBE = r"""
import json, os, sys, time
_LOG = os.environ.get("AFM_STARTUP_LOG")
if _LOG:
    import importlib._bootstrap as _bootstrap
    _cpu0 = time.process_time()  # the interpreter's start, before this file ran
    _state = {"depth": 0, "imports": 0.0, "done": set()}

    def _write(*row):
        with open(_LOG, "a") as f:
            f.write(json.dumps(row) + "\n")

    def _created():
        try:
            with open("/proc/self/stat") as f:
                ticks = int(f.read().rsplit(")", 1)[1].split()[19])
            since = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
            return time.time() - since
        except Exception:
            return time.time()

    _stderr_dir = os.environ.get("AFM_STARTUP_STDERR_DIR")
    if _stderr_dir:  # the importtime pass: this process's stderr (its import log) in a file of its own
        _fd = os.open(os.path.join(_stderr_dir, f"{os.getpid()}.err"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(_fd, 2)
        os.close(_fd)
    _write("created", os.getpid(), os.getppid(), _created(), time.time(), _cpu0, sys.orig_argv[:8],
           os.environ.get("PYTEST_CURRENT_TEST"), False)

    _find_and_load = _bootstrap._find_and_load

    def _timed_find_and_load(name, import_):
        if _state["depth"]:
            return _find_and_load(name, import_)
        _state["depth"] += 1
        start = time.process_time()
        try:
            return _find_and_load(name, import_)
        finally:
            _state["imports"] += time.process_time() - start
            _state["depth"] -= 1

    _bootstrap._find_and_load = _timed_find_and_load

    def _exit_record():
        _write("exit", os.getpid(), time.time(), time.process_time(), _state["imports"], _cpu0)

    def _forked():
        global _cpu0
        _cpu0 = 0.0
        _state.update(depth=0, imports=0.0, done=set())
        _write("created", os.getpid(), os.getppid(), time.time(), time.time(), 0.0, sys.orig_argv[:8],
               os.environ.get("PYTEST_CURRENT_TEST"), True)

    os.register_at_fork(after_in_child=_forked)
    import atexit
    atexit.register(_exit_record)
    _os_exit = os._exit

    def _exit(code):  # multiprocessing's forked children leave through os._exit, past atexit
        try:
            _exit_record()
        finally:
            _os_exit(code)

    os._exit = _exit

    def _mark(what):
        if what not in _state["done"]:
            _state["done"].add(what)
            _write("mark", os.getpid(), time.time(), time.process_time(), _state["imports"], what)

    _PROBED = json.loads(os.environ.get("AFM_STARTUP_PROBED", "{}"))
    if _PROBED:
        def _wrap(owner, name, label):
            raw = owner.__dict__.get(name)
            if raw is None or not callable(raw):
                return

            def timed(*a, **k):
                record = next((x for x in a if isinstance(x, dict)), None)
                tag = label + (":" + str(record.get("split")) if record is not None and "split" in record else "")
                _mark("begin " + tag)
                try:
                    return raw(*a, **k)
                finally:
                    _mark("end " + tag)

            timed.__wrapped__, timed.__name__, timed.__qualname__ = raw, raw.__name__, raw.__qualname__
            timed.__doc__ = raw.__doc__
            setattr(owner, name, timed)

        class _Loader:  # no importlib.abc: the probe imports nothing the process would not
            def __init__(self, inner):
                self.inner = inner

            def __getattr__(self, name):
                return getattr(self.inner, name)

            def create_module(self, spec):
                return self.inner.create_module(spec)

            def exec_module(self, module):
                self.inner.exec_module(module)
                for target in _PROBED[module.__name__]:
                    *path, name = target.split(".")
                    owner = module
                    for part in path:
                        owner = getattr(owner, part, None)
                    if owner is not None:  # an older checkout may lack it
                        _wrap(owner, name, target)

        class _Finder:
            def find_spec(self, name, path, target=None):
                if name not in _PROBED:
                    return None
                for finder in sys.meta_path:
                    find = None if finder is self else getattr(finder, "find_spec", None)
                    spec = None if find is None else find(name, path, target)
                    if spec is not None:
                        spec.loader = _Loader(spec.loader)
                        return spec
                return None

        sys.meta_path.insert(0, _Finder())
"""


def _sft_argv(work: Path) -> list[str]:
    """``jobs.sft`` at the tests' size (``tests/slurm/tiny_sft.py``'s ``TINY``: tiny-llama on a 120-trajectory slice
    of the real traces), one step; imported here, not at the top, so the harness itself stays on the stdlib."""
    from tests.slurm.tiny_sft import TINY

    return ["jobs.sft", *TINY, "trainer.max_steps=1", f"hydra.run.dir={work / 'run'}"]


@dataclass
class Entry:
    """One entry point: its command (``work``: a scratch dir) and what ends its start-up."""

    name: str
    label: str
    argv: Any  # Callable[[Path], list[str]]
    until: str | None  # a mark ("begin X" / "end X"), None: the process's exit
    useful: str
    process_rows: list[tuple[str, str, str]] = field(default_factory=list)  # (row label, mark, useful line)


def _eval_argv(work: Path) -> list[str]:
    from benchmarks.eval_startup import write_tasks

    tasks = work / "my.jsonl"
    write_tasks(tasks)
    return ["jobs.eval", "model=tiny-llama", f"benchmark_files=[{tasks}]", "eval.k=1", "eval.max_response_tokens=48",
            "engine.max_model_len=1024", f"hydra.run.dir={work / 'run'}", "tools.cache=null"]  # fmt: skip


ENTRIES = {
    "status": Entry("status", "jobs.status --help", lambda w: ["jobs.status", "--help"], None, "exit (help printed)"),
    "plan": Entry("plan", "jobs.plan recipe=afm_web_sft_32b",
                  lambda w: ["jobs.plan", "recipe=afm_web_sft_32b", f"plan.out={w / 'plan.json'}"], None,
                  "exit (plan printed)"),
    "sft": Entry("sft", "jobs.sft (tiny-llama, 1 step)",
                 _sft_argv,
                 "begin MetricsLog.write:train", "first train step logged",
                 [("training rank (jobs.sft)", "begin MetricsLog.write:train", "first step logged")]),
    "rl": Entry("rl", "jobs.rl recipe=rl_smoke (1 step)",
                lambda w: ["jobs.rl", "recipe=rl_smoke", "trainer.max_steps=1", "tools.cache=null",
                           f"hydra.run.dir={w / 'run'}"],
                "begin MetricsLog.write:train", "first rollout step logged",
                [("RL rank (jobs.rl, in-process vLLM)", "begin MetricsLog.write:train", "first rollout step logged")]),
    "eval": Entry("eval", "jobs.eval (4 records, tiny-llama)", _eval_argv, "begin SampleWriter.write",
                  "first sample graded",
                  [("eval rank (jobs.eval)", "begin SampleWriter.write", "first sample graded"),
                   ("vLLM engine core (jobs.eval)", "end EngineCore.__init__", "engine ready (EngineCore.__init__)")]),
}  # fmt: skip


def read_log(path: Path) -> list[list[Any]]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            rows.append(json.loads(line))
    return rows


def probe_env(work: Path, tree: Path, log: Path, stderr_dir: Path | None = None) -> dict[str, str]:
    """The environment of a measured command: the probe and ``tree`` first on ``PYTHONPATH``."""
    from afm_core.utils.paths import cache_dir, shared_data_dir

    probe = work / "probe"
    probe.mkdir(exist_ok=True)
    (probe / "sitecustomize.py").write_text(PROBE)
    env = {**os.environ, "AFM_STARTUP_LOG": str(log), "AFM_STARTUP_PROBED": json.dumps(PROBED),
           "AFM_SHARED_DATA": str(shared_data_dir()), "AFM_CACHE": str(cache_dir()),
           "PYTHONPATH": os.pathsep.join(p for p in [str(probe), str(tree), os.environ.get("PYTHONPATH", "")] if p)}  # fmt: skip
    if stderr_dir is not None:
        env.update(AFM_STARTUP_STDERR_DIR=str(stderr_dir), PYTHONPROFILEIMPORTTIME="1")
    return env


def _stop_tree(job: subprocess.Popen, seen: dict[int, Any]) -> None:
    """SIGTERM the submitter (it stops what it started), then SIGKILL what is left of the tree it made."""
    import psutil

    if job.poll() is None:
        job.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            job.wait(timeout=60)
    for proc in seen.values():
        with contextlib.suppress(psutil.Error):
            if proc.is_running():
                proc.kill()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(job.pid, signal.SIGKILL)  # its own session: the group is this job's
    with contextlib.suppress(subprocess.TimeoutExpired):
        job.wait(timeout=30)


def run_entry(entry: Entry, tree: Path, work: Path, timeout_s: float, imports: bool = False) -> dict[str, Any]:
    """One run of ``entry`` from ``tree``: the job row and its process rows (``{"rows": {label: {...}}}``)."""
    import psutil

    work.mkdir(parents=True, exist_ok=True)
    log = work / "probe.jsonl"
    stderr_dir = work / "stderr" if imports else None
    if stderr_dir is not None:
        stderr_dir.mkdir(exist_ok=True)
    env = probe_env(work, tree, log, stderr_dir)
    cmd = [sys.executable, "-m", *entry.argv(work)]
    load_before = os.getloadavg()[0]
    seen: dict[int, psutil.Process] = {}
    cpu: dict[int, list[tuple[float, float]]] = defaultdict(list)
    mark = None
    with open(work / "stdout.txt", "w") as out, open(work / "stderr.txt", "w") as err:
        start = time.time()
        job = subprocess.Popen(cmd, cwd=tree, env=env, stdout=out, stderr=err, start_new_session=True)
        root = psutil.Process(job.pid)
        seen[job.pid] = root
        try:
            if entry.until is None:
                _, status, usage = os.wait4(job.pid, 0)
                end = time.time()
                job.returncode = os.waitstatus_to_exitcode(status)
                mark = {"t": end, "cpu": usage.ru_utime + usage.ru_stime}
            while mark is None:
                if time.time() - start > timeout_s:
                    raise SystemExit(f"{entry.label}: no '{entry.until}' in {timeout_s:.0f} s; see {work}")
                now = time.time()
                with contextlib.suppress(psutil.Error):
                    for proc in root.children(recursive=True):
                        seen.setdefault(proc.pid, proc)
                for pid, proc in seen.items():
                    with contextlib.suppress(psutil.Error):
                        times = proc.cpu_times()
                        cpu[pid].append((now, times.user + times.system))
                found = [r for r in read_log(log) if r[0] == "mark" and r[5] == entry.until]
                if found:
                    _, pid, t, own, imp, _ = found[0]
                    mark = {"t": t, "pid": pid, "cpu_own": own}
                    break
                if job.poll() is not None:
                    raise SystemExit(f"{entry.label} exited ({job.returncode}) before '{entry.until}':\n"
                                     f"{(work / 'stderr.txt').read_text()[-3000:]}")  # fmt: skip
                time.sleep(0.1)
        finally:
            _stop_tree(job, seen)
    records = read_log(log)
    if entry.until is None:
        if job.returncode not in (0, 1):  # jobs.plan: 1 = does not fit
            raise SystemExit(f"{entry.label} failed ({job.returncode}):\n{(work / 'stderr.txt').read_text()[-3000:]}")
        exits = {r[1]: r for r in records if r[0] == "exit"}
        ex = exits.get(job.pid)
        job_row = {"wall_s": mark["t"] - start, "cpu_s": mark["cpu"], "imports_cpu_s": ex[4] if ex else None,
                   "pid": job.pid}  # fmt: skip
    else:
        total = 0.0
        for pid, readings in cpu.items():
            if pid == mark["pid"]:
                total += mark["cpu_own"]
                continue
            before = [c for t, c in readings if t <= mark["t"]]
            total += before[-1] if before else 0.0
        job_row = {"wall_s": mark["t"] - start, "cpu_s": total, "imports_cpu_s": None, "pid": job.pid}
    rows = {entry.label: job_row}
    created = {r[1]: r for r in records if r[0] == "created"}
    for label, what, _ in entry.process_rows:
        hits = [r for r in records if r[0] == "mark" and r[5] == what]
        if not hits:
            rows[label] = None
            continue
        _, pid, t, own, imp, _ = hits[0]
        began = next((r for r in records if r[0] == "mark" and r[1] == pid and r[5].startswith("begin run_")), None)
        birth = created[pid][3] if pid in created else t
        rows[label] = {"wall_s": t - birth, "cpu_s": own, "imports_cpu_s": imp, "pid": pid,
                       "interpreter_cpu_s": created[pid][5] if pid in created else None,
                       "fn_begins_s": began[2] - birth if began else None}  # fmt: skip
    result = {"rows": rows, "load_before": load_before, "load_after": os.getloadavg()[0], "start": start}
    if stderr_dir is not None:
        result["imports"] = {label: import_report(stderr_dir / f"{row['pid']}.err")
                             for label, row in rows.items() if row is not None}  # fmt: skip
    return result


def parse_importtime(text: str) -> list[dict[str, Any]]:
    """``-X importtime`` lines -> ``[{"module", "self_s", "cum_s", "depth", "parent"}]`` in log order (a module's
    line follows those of what it imported; its parent is the next line of smaller depth)."""
    nodes: list[dict[str, Any]] = []
    pending: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for line in text.splitlines():
        if not line.startswith("import time:") or "imported package" in line:
            continue
        head, cum_us, raw = line.split("|", 2)
        depth = (len(raw) - len(raw.lstrip(" ")) - 1) // 2  # "| " then two spaces per level
        node = {
            "module": raw.strip(),
            "self_s": int(head.split(":")[1]) / 1e6,
            "cum_s": int(cum_us) / 1e6,
            "depth": depth,
            "parent": None,
        }
        for child in pending.pop(depth + 1, []):
            child["parent"] = node["module"]
        pending[depth].append(node)
        nodes.append(node)
    return nodes


def import_report(path: Path, top: int = 8) -> dict[str, Any]:
    """A process's import log: total seconds (outermost imports) and its ``top`` imports across package lines."""
    nodes = parse_importtime(path.read_text(errors="replace")) if path.is_file() else []

    def package(module: str | None) -> str | None:
        return None if module is None else module.split(".")[0]

    crossing = [n for n in nodes if package(n["parent"]) != package(n["module"])]
    crossing.sort(key=lambda n: -n["cum_s"])
    return {"total_s": sum(n["cum_s"] for n in nodes if n["parent"] is None), "modules": len(nodes),
            "top": [{k: n[k] for k in ("module", "cum_s", "parent")} for n in crossing[:top]]}  # fmt: skip


@contextlib.contextmanager
def worktrees(revs: list[str], base: Path):
    """``{rev: tree}``: the working tree itself for no rev, else a detached ``git worktree`` per commit (removed after)."""
    from afm_core.utils.paths import repo_root

    if not revs:
        yield {"working tree": repo_root()}
        return
    made: dict[str, Path] = {}
    try:
        for rev in revs:
            sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=repo_root(), capture_output=True,
                                 text=True, check=True).stdout.strip()  # fmt: skip
            tree = base / f"tree-{sha}"
            if tree not in made.values():
                subprocess.run(["git", "worktree", "add", "--detach", str(tree), sha], cwd=repo_root(),
                               check=True, capture_output=True)  # fmt: skip
            made[f"{rev} ({sha})" if rev != sha else sha] = tree
        for tree in set(made.values()):  # bytecode now, as the working tree has it, not in the first timed run
            subprocess.run([sys.executable, "-m", "compileall", "-q", "afm_core", "jobs"], cwd=tree, check=True,
                           capture_output=True)  # fmt: skip
        for tree in made.values():  # the tree's afm_core is the one imported, not the venv's editable install
            where = subprocess.run([sys.executable, "-c", "import afm_core; print(afm_core.__file__)"], cwd=tree,
                                   env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True,
                                   check=True).stdout.strip()  # fmt: skip
            if not Path(where).is_relative_to(tree):
                raise SystemExit(f"{tree}: afm_core imports from {where}")
        yield made
    finally:
        for tree in set(made.values()):
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=repo_root(), capture_output=True)


@contextlib.contextmanager
def _scratch(work: Path | None):
    """``work`` (kept: the runs' logs, for a failed run) or a temporary directory (removed)."""
    if work is not None:
        work.mkdir(parents=True, exist_ok=True)
        yield str(work.absolute())
        return
    with tempfile.TemporaryDirectory(prefix="afm-startup-") as tmp:
        os.chmod(tmp, 0o755)  # the sandbox's jails (another user inside bwrap) read the worktree's sandbox/ from here
        yield tmp


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every entry point, each commit in ABBA order per block (A B C C B A for three); then the importtime runs."""
    out: dict[str, Any] = {"revs": [], "runs": [], "imports": []}
    with _scratch(args.work) as tmp, worktrees(args.rev, Path(tmp)) as trees:
        out["revs"] = list(trees)
        names = list(trees)
        n = 0
        for entry in (ENTRIES[e] for e in args.entries):
            for rev in names * args.warmup:  # untimed: first-use costs (page cache, token cache, checkpoint)
                n += 1
                run_entry(entry, trees[rev], Path(tmp) / f"run{n}", args.timeout)
            for _ in range(args.repeat):
                order = names if len(names) < 2 else names + names[::-1]  # ABBA; A B C C B A for three
                for rev in order:
                    n += 1
                    result = run_entry(entry, trees[rev], Path(tmp) / f"run{n}", args.timeout)
                    result.update(entry=entry.name, rev=rev)
                    out["runs"].append(result)
                    _progress(result)
            if args.imports:
                for rev in names:
                    n += 1
                    result = run_entry(entry, trees[rev], Path(tmp) / f"run{n}", args.timeout, imports=True)
                    out["imports"].append({"entry": entry.name, "rev": rev, "imports": result["imports"]})
    return out


def _progress(result: dict[str, Any]) -> None:
    cells = [f"{label}: {row['wall_s']:.2f} s wall, {row['cpu_s']:.1f} s CPU" for label, row in result["rows"].items()
             if row is not None]  # fmt: skip
    print(f"  [{result['rev']}] {'; '.join(cells)} (load {result['load_before']:.1f})", file=sys.stderr, flush=True)


def _median(values: list[float]) -> float | None:
    import statistics

    return statistics.median(values) if values else None


def render(out: dict[str, Any], console: Any) -> None:
    from rich.markup import escape
    from rich.table import Table

    revs = out["revs"]
    table = Table(title="start-up to the first useful line: median over runs (all runs), seconds")
    table.add_column("entry point / process")
    table.add_column("first useful line")
    for rev in revs:
        table.add_column(f"wall {rev}", justify="right")
        table.add_column(f"CPU {rev}", justify="right")
        table.add_column(f"imports CPU {rev}", justify="right")
        table.add_column(f"job function called at {rev}", justify="right")
    for rev in revs[1:]:  # each later commit against the first
        table.add_column(f"wall {rev} / {revs[0]}", justify="right")
        table.add_column(f"CPU {rev} / {revs[0]}", justify="right")
    for entry in (ENTRIES[e] for e in dict.fromkeys(r["entry"] for r in out["runs"])):
        for label, useful in [(entry.label, entry.useful), *[(lab, use) for lab, _, use in entry.process_rows]]:
            cells, walls, cpus = [], [], []
            for rev in revs:
                rows = [r["rows"].get(label) for r in out["runs"] if r["entry"] == entry.name and r["rev"] == rev]
                rows = [r for r in rows if r is not None]
                wall, cpu = [r["wall_s"] for r in rows], [r["cpu_s"] for r in rows]
                imp = [r["imports_cpu_s"] for r in rows if r.get("imports_cpu_s") is not None]
                walls.append(_median(wall))
                cpus.append(_median(cpu))
                called = [r["fn_begins_s"] for r in rows if r.get("fn_begins_s") is not None]
                cells += [_cell(wall), _cell(cpu), _cell(imp), _cell(called)]
            for i in range(1, len(revs)):
                cells += [f"{a[i] / a[0]:.2f}" if a[0] and a[i] else "-" for a in (walls, cpus)]
            table.add_row(label, useful, *cells)
    console.print(table)
    loads = [r["load_before"] for r in out["runs"]] + [r["load_after"] for r in out["runs"]]
    if loads:
        console.print(f"load average (1 min) before/after the runs: {min(loads):.1f}-{max(loads):.1f}; "
                      f"{os.cpu_count()} CPUs")  # fmt: skip
    for item in out["imports"]:
        for label, report in item["imports"].items():
            imports = Table(title=escape(f"{label} [{item['rev']}]: {report['modules']} modules, "
                                  f"{report['total_s']:.2f} s of imports (importtime, wall)"))  # fmt: skip
            imports.add_column("import (crossing a package line)")
            imports.add_column("cumulative s", justify="right")
            imports.add_column("imported by")
            for row in report["top"]:
                imports.add_row(row["module"], f"{row['cum_s']:.2f}", row["parent"] or "(a function or the script)")
            console.print(imports)


def _cell(values: list[float]) -> str:
    if not values:
        return "-"
    med = _median(values)
    return f"{med:.2f}" if len(values) == 1 else f"{med:.2f} ({', '.join(f'{v:.1f}' for v in values)})"


def suite(args: argparse.Namespace) -> dict[str, Any]:
    """``pytest args.pytest`` under the probe, per commit: CPU in interpreter start + imports vs the rest."""
    out: dict[str, Any] = {"revs": [], "suites": []}
    pytest_args = [a for a in args.pytest if a != "--"]
    with _scratch(args.work) as tmp, worktrees(args.rev, Path(tmp)) as trees:
        out["revs"] = list(trees)
        for i, (rev, tree) in enumerate(trees.items()):
            work = Path(tmp) / f"suite{i}"
            work.mkdir()
            log = work / "probe.jsonl"
            env = probe_env(work, tree, log)
            env["AFM_STARTUP_PROBED"] = "{}"
            load_before, start = os.getloadavg()[0], time.time()
            done = subprocess.run([sys.executable, "-m", "pytest", *pytest_args], cwd=tree, env=env, check=False)
            wall = time.time() - start
            out["suites"].append({"rev": rev, "wall_s": wall, "returncode": done.returncode,
                                  "load_before": load_before, "load_after": os.getloadavg()[0],
                                  **suite_report(read_log(log))})  # fmt: skip
    return out


def suite_report(records: list[list[Any]], top: int = 12) -> dict[str, Any]:
    """Per group (pytest's own processes, processes started by tests, forked children): processes, CPU seconds in
    interpreter start, in imports, and the rest; the tests whose processes spent the most in start-up."""
    created = {r[1]: r for r in records if r[0] == "created"}
    exits = {r[1]: r for r in records if r[0] == "exit"}
    groups: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    tests: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for pid, c in created.items():
        test, forked = c[7], c[8]
        group = "forked children" if forked else ("started by tests" if test else "pytest and its workers")
        g = groups[group]
        g["processes"] += 1
        e = exits.get(pid)
        if e is None:
            g["no exit record"] += 1
            continue
        total, imports, interp = e[3], e[4], e[5]
        g["interpreter start"] += interp
        g["imports"] += imports
        g["rest"] += max(0.0, total - interp - imports)
        if test:
            name = test.rsplit(" (", 1)[0]
            t = tests[name]
            t["processes"] += 1
            t["start-up"] += interp + imports
            t["rest"] += max(0.0, total - interp - imports)
    ranked = sorted(tests.items(), key=lambda kv: -kv[1]["start-up"])
    return {"groups": {k: dict(v) for k, v in groups.items()},
            "tests": [{"test": k, **v} for k, v in ranked[:top]], "tests_with_processes": len(tests)}  # fmt: skip


def render_suite(out: dict[str, Any], console: Any) -> None:
    from rich.markup import escape
    from rich.table import Table

    for item in out["suites"]:
        table = Table(title=escape(f"suite [{item['rev']}]: {item['wall_s']:.0f} s wall, pytest exit {item['returncode']}, "
                            f"load {item['load_before']:.1f}/{item['load_after']:.1f}: CPU seconds of its Python processes"))  # fmt: skip
        for column in (
            "processes",
            "group",
            "no exit record",
            "interpreter start",
            "imports",
            "start-up share",
            "rest",
        ):
            table.add_column(column, justify="left" if column == "group" else "right")
        sums: dict[str, float] = defaultdict(float)
        for name, g in item["groups"].items():
            for k, v in g.items():
                sums[k] += v
            table.add_row(*_suite_cells(name, g))
        table.add_row(*_suite_cells("all", sums))
        console.print(table)
        tests = Table(title=f"tests whose processes spent the most CPU in start-up (of {item['tests_with_processes']} "
                            "that start processes)")  # fmt: skip
        for column in ("test", "processes", "start-up CPU s", "rest CPU s"):
            tests.add_column(column, justify="left" if column == "test" else "right")
        for t in item["tests"]:
            tests.add_row(t["test"], f"{t['processes']:.0f}", f"{t['start-up']:.1f}", f"{t['rest']:.1f}")
        console.print(tests)


def _suite_cells(name: str, g: dict[str, float]) -> list[str]:
    start = g.get("interpreter start", 0.0) + g.get("imports", 0.0)
    whole = start + g.get("rest", 0.0)
    return [f"{g.get('processes', 0):.0f}", name, f"{g.get('no exit record', 0):.0f}",
            f"{g.get('interpreter start', 0.0):.1f}", f"{g.get('imports', 0.0):.1f}",
            f"{start / whole:.0%}" if whole else "-", f"{g.get('rest', 0.0):.1f}"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", nargs="+", choices=list(ENTRIES), default=list(ENTRIES))
    parser.add_argument("--rev", nargs="+", default=[], help="commits to measure side by side (git worktrees); "
                        "none: the working tree as it is")  # fmt: skip
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="blocks of runs per entry point: one run each, or with 2+ commits A B B A (A B C C B A, ...)",
    )
    parser.add_argument("--warmup", type=int, default=0, help="untimed runs per entry point and commit first")
    parser.add_argument("--no-imports", dest="imports", action="store_false", help="skip the importtime runs")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run to its useful line")
    parser.add_argument("--work", type=Path, default=None, help="keep the runs' files here (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write the runs as JSON here")
    parser.add_argument("--suite", action="store_true", help="run pytest with the arguments after --")
    parser.add_argument("pytest", nargs=argparse.REMAINDER, help="pytest's arguments (with --suite)")
    args = parser.parse_args()
    from rich.console import Console

    console = Console(width=200) if not sys.stdout.isatty() else Console()
    if args.suite:
        out = suite(args)
        render_suite(out, console)
    else:
        out = measure(args)
        render(out, console)
    out["cpu_count"], out["python"] = os.cpu_count(), sys.version.split()[0]
    if args.json is not None:
        from afm_core.utils.atomic import atomic_write_json

        args.json.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(args.json, out)


if __name__ == "__main__":
    main()
