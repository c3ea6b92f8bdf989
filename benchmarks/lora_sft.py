"""LoRA SFT against the full fine-tune on this machine, side by side: held-out masked loss before and after, and
the peak resident set of each job's process tree.

    .venv/bin/python -m benchmarks.lora_sft                        # make demo's defaults, 20 steps, rank 16
    .venv/bin/python -m benchmarks.lora_sft --steps 5 --out runs/bench/lora_sft.json
    .venv/bin/python -m benchmarks.lora_sft --only lora -- trainer.seq_length=512  # jobs.sft overrides after --
    .venv/bin/python -m benchmarks.lora_sft --combine full.json lora.json            # two --only runs' --out files

Each variant is one ``python -m jobs.sft`` (``make demo``'s defaults: SmolLM2-135M on the converted CoA traces,
1024-token packed sequences, global batch 2, held-out eval at step 0 and at the end) in a subprocess of its own,
one after the other, never at once:

* ``full``: every parameter trained, ``optim.lr`` / ``optim.min_lr`` as ``conf/sft.yaml`` (2e-4 / 2e-5);
* ``lora``: ``model.lora.rank=16`` (alpha 32 on ``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``),
  the base frozen, at 10x the learning rates (2e-3 / 2e-4: the ratio of the best LoRA rate to the best full
  fine-tuning rate in Schulman et al. 2025, "LoRA Without Regret", Thinking Machines).

Peak memory: the job's process tree (``jobs.sft``, the submitit processes it starts, their children) sampled
every ``--interval`` seconds with psutil, the largest sum of the members' proportional set sizes (``tree_peak``:
PSS, so pages a forked child shares with its parent count once, where a sum of RSS counts them in each), and
the largest ``VmHWM`` of one member (``rank_peak``: the kernel's own high-water mark of its resident set, the
training rank's, exact between samples). Both include the interpreter, torch, the data and the HF export at the end. The held-out
losses are the ones the job prints (``held-out masked loss: A -> B``: token-mean cross entropy over the masked
targets of ``trainer.eval_sequences`` held-out packed sequences). RSS does not depend on the load of the machine;
wall time does (printed with the load average, not compared).

Nothing here asserts: it prints both rows and the ratios LoRA / full (and ``--out`` writes them as JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from afm_core.utils.atomic import atomic_write_text
from afm_core.utils.paths import repo_root

GIB = 2**30
LOSS_LINE = re.compile(r"held-out masked loss: ([\d.]+) -> ([\d.]+)")
#: The LoRA learning rates: 10x conf/sft.yaml's full fine-tune rates (module docstring).
LORA_LR, LORA_MIN_LR = 2.0e-3, 2.0e-4


def variants(rank: int, steps: int) -> dict[str, list[str]]:
    """The ``jobs.sft`` overrides of each variant (module docstring)."""
    common = [f"trainer.max_steps={steps}"]
    return {
        "full": common,
        "lora": [*common, f"model.lora.rank={rank}", f"optim.lr={LORA_LR}", f"optim.min_lr={LORA_MIN_LR}"],
    }


def _proc_kb(path: str, field: str) -> int:
    """A ``field: N kB`` line of a ``/proc`` file, in bytes; 0 when the process is gone."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _hwm_bytes(pid: int) -> int:
    """``VmHWM`` of a process (bytes), 0 when it is gone."""
    return _proc_kb(f"/proc/{pid}/status", "VmHWM")


def _pss_bytes(pid: int) -> int:
    """The proportional set size of a process (``/proc/PID/smaps_rollup``: each shared page divided among the
    processes that map it, so a tree's sum counts a forked child's inherited pages once), 0 when it is gone."""
    return _proc_kb(f"/proc/{pid}/smaps_rollup", "Pss")


def run_job(name: str, overrides: list[str], run_dir: Path, interval: float) -> dict[str, Any]:
    """One ``jobs.sft`` with ``overrides`` into ``run_dir``: its held-out losses, peak RSS of the process tree,
    the training rank's VmHWM, wall seconds.

    Raises:
        RuntimeError: the job failed or printed no held-out losses (the tail of its output in the message).
    """
    cmd = [sys.executable, "-m", "jobs.sft", *overrides, f"hydra.run.dir={run_dir}"]
    print(f"[lora_sft] {name}: {' '.join(cmd[1:])}", flush=True)
    log = run_dir.with_suffix(".log")
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=repo_root(), stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(repo_root())})  # fmt: skip
        root = psutil.Process(proc.pid)
        tree_peak, at_peak, hwm = 0, 0, dict[int, int]()
        while proc.poll() is None:
            members = [root]
            try:
                members += root.children(recursive=True)
            except psutil.Error:
                pass
            sizes = {}
            for member in members:
                sizes[member.pid] = _pss_bytes(member.pid)
                hwm[member.pid] = max(hwm.get(member.pid, 0), _hwm_bytes(member.pid))
            if sum(sizes.values()) > tree_peak:
                tree_peak, at_peak = sum(sizes.values()), len(sizes)
            time.sleep(interval)
    wall = time.perf_counter() - start
    text = log.read_text()
    found = LOSS_LINE.findall(text)
    if proc.returncode or not found:
        raise RuntimeError(f"{name}: jobs.sft exited {proc.returncode}, no held-out losses:\n{text[-3000:]}")
    before, after = (float(v) for v in found[-1])
    return {
        "overrides": overrides,
        "eval_loss_before": before,
        "eval_loss_after": after,
        "eval_loss_drop": 1 - after / before,
        "tree_peak_pss_bytes": tree_peak,
        "tree_processes_at_peak": at_peak,
        "rank_peak_rss_bytes": max(hwm.values(), default=0),
        "wall_s": wall,
        "log": str(log),
    }


def report(results: dict[str, Any]) -> None:
    """Print the rows of ``results["runs"]`` and, with both variants, set and print ``results["ratios"]``."""
    print(f"\n{'variant':8} {'held-out loss':>20} {'drop':>7} {'tree peak PSS':>14} {'rank VmHWM':>11} {'wall':>7}")
    for name, r in results["runs"].items():
        print(
            f"{name:8} {r['eval_loss_before']:9.4f} -> {r['eval_loss_after']:7.4f} {r['eval_loss_drop']:7.1%} "
            f"{r['tree_peak_pss_bytes'] / GIB:10.2f} GiB {r['rank_peak_rss_bytes'] / GIB:7.2f} GiB {r['wall_s']:6.0f} s"
        )
    runs = results["runs"]
    if {"full", "lora"} <= runs.keys():
        full, lora = runs["full"], runs["lora"]
        results["ratios"] = {
            "tree_peak_pss": lora["tree_peak_pss_bytes"] / full["tree_peak_pss_bytes"],
            "rank_peak_rss": lora["rank_peak_rss_bytes"] / full["rank_peak_rss_bytes"],
        }
        print(
            f"LoRA / full: tree peak PSS {results['ratios']['tree_peak_pss']:.2f}x, rank VmHWM "
            f"{results['ratios']['rank_peak_rss']:.2f}x; held-out loss drop {lora['eval_loss_drop']:.1%} (LoRA) vs "
            f"{full['eval_loss_drop']:.1%} (full)"
        )
    la = results["load_average_end"]
    print(
        f"load average at the end: {la[0]:.1f} {la[1]:.1f} {la[2]:.1f} on {results['cpus']} CPUs (wall time is not comparable under load)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="trainer.max_steps of each job (make demo: 20)")
    parser.add_argument("--rank", type=int, default=16, help="model.lora.rank of the LoRA job")
    parser.add_argument("--only", choices=("full", "lora"), help="run one variant")
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between RSS samples")
    parser.add_argument("--workdir", type=Path, help="run dirs here (default: a temporary folder, removed)")
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    parser.add_argument("--combine", type=Path, nargs="+", help="print the table of earlier --out files together")
    args, extra = parser.parse_known_args(argv)
    if args.combine:  # e.g. --only full and --only lora run at different times
        parts = [json.loads(path.read_text()) for path in args.combine]
        combined = {**parts[-1], "runs": {k: v for part in parts for k, v in part["runs"].items()}}
        report(combined)
        return 0
    extra = [x for x in extra if x != "--"]
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="lora_sft_")
    workdir = args.workdir or Path(tmp.name)  # type: ignore[union-attr]
    workdir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"load_average_start": os.getloadavg(), "cpus": os.cpu_count(), "runs": {}}
    try:
        for name, overrides in variants(args.rank, args.steps).items():
            if args.only and name != args.only:
                continue
            results["runs"][name] = run_job(name, [*overrides, *extra], workdir / name, args.interval)
    finally:
        if tmp is not None:
            tmp.cleanup()
    results["load_average_end"] = os.getloadavg()
    report(results)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out, json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
