"""Status of submitted runs: ``python -m jobs.status [RUN_DIR|SWEEP_DIR|DIR] [--follow]``.

Prints a table of the runs at or under the path (default ``runs/``): Slurm state (sacct), step, last train and
held-out loss (metrics.jsonl), last complete checkpoint, restarts (requeues), the nodes of the latest start.
``--follow`` on one run streams its rank-0 log until the job ends; on several runs it refreshes the table until
all have ended.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rich import box
from rich.console import Console
from rich.live import Live
from rich.table import Table

from afm_core.launch.follow import LogTail
from afm_core.launch.status import RunStatus, collect

STATE_STYLES = {"COMPLETED": "green", "RUNNING": "cyan", "PENDING": "yellow", "REQUEUED": "yellow"}


def _num(value: float | None, fmt: str = ".4f") -> str:
    return "-" if value is None else format(value, fmt)


def table(rows: list[RunStatus], root: Path) -> Table:
    """A rich table with one line per run (checkpoint: the step of the newest complete one)."""
    out = Table(title=f"runs under {root}", box=box.SIMPLE_HEAD, pad_edge=False)
    for column in ("run", "job", "state", "step", "loss", "eval@step", "ckpt", "requeues", "nodes"):
        out.add_column(column, no_wrap=True, justify="left" if column in ("run", "job", "state", "nodes") else "right")
    for row in rows:
        name = (
            str(row.run_dir.relative_to(root))
            if row.run_dir != root and row.run_dir.is_relative_to(root)
            else str(row.run_dir)
        )
        step = "-" if row.step is None else f"{row.step}/{row.max_steps or '?'}"
        evals = "-" if row.eval_loss is None else f"{row.eval_loss:.4f}@{row.eval_step}"
        checkpoint = "-" if row.checkpoint is None else str(int(row.checkpoint.rpartition("_")[2]))
        style = STATE_STYLES.get(row.state, "red" if row.finished else "")
        out.add_row(
            name,
            f"{row.cluster}:{row.job_id}",
            f"[{style}]{row.state}[/]" if style else row.state,
            step,
            _num(row.train_loss),
            evals,
            checkpoint,
            str(row.restarts),
            row.nodes or "-",
        )
    return out


def follow_run(path: Path, poll_s: float = 1.0, state_every_s: float = 5.0) -> RunStatus:
    """Stream one run's rank-0 stdout/stderr until its job ends; returns its final status."""
    row = collect(path)[0]
    tail = LogTail([(row.stdout, sys.stdout.buffer), (row.stderr, sys.stderr.buffer)])
    checked = time.monotonic()
    while not row.finished:
        tail.pump()
        time.sleep(poll_s)
        if time.monotonic() - checked >= state_every_s:
            row, checked = collect(path)[0], time.monotonic()
    tail.pump()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.status", description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", default="runs", help="a run dir, a sweep dir, or a tree of runs")
    parser.add_argument(
        "--follow",
        action="store_true",
        help="stream one run's log / refresh the table until all end; exit 0 if all completed, else 2",
    )
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between refreshes with --follow")
    args = parser.parse_args(argv)
    root = Path(args.path).absolute()
    # Piped (logs, CI): rich would assume 80 columns and cut cells; the table is only as wide as its content.
    console = Console() if sys.stdout.isatty() else Console(width=250)
    rows = collect(root)
    if not rows:
        console.print(f"no runs under {root} (a run has logs/job.json)")
        return 1
    if args.follow and len(rows) == 1:
        rows = [follow_run(rows[0].run_dir, state_every_s=args.interval)]
        console.print(table(rows, root))
    elif args.follow:
        with Live(table(rows, root), console=console, auto_refresh=False) as live:
            while not all(r.finished for r in rows):
                time.sleep(args.interval)
                rows = collect(root)
                live.update(table(rows, root), refresh=True)
    else:
        console.print(table(rows, root))
        return 0
    return 0 if all(r.state == "COMPLETED" for r in rows) else 2


if __name__ == "__main__":
    sys.exit(main())
