"""Leave no process behind: a submitter stopped by SIGTERM or Ctrl-C stops the processes it started and waits for
them, bounded.

A local job (``cluster=local``) is submitit's controller (``python -m submitit.local._local``), a child of the
submitting process, with one process per rank under it and the ranks' own children (an engine's workers, tool
servers). submitit's ``LocalJob.cancel`` only sends SIGINT to the controller, which passes it on to the ranks and
SIGKILLs them a second later (facebookincubator/submitit, ``submitit/local/local.py``, ``Controller.kill_tasks``);
nothing waits for that, so the submitter used to exit while its job still ran, and a rank's children outlive a
SIGKILLed rank. A pipeline stage (``python -m jobs.<job>`` under ``jobs.pipeline``) is a child the same way.

:func:`stop_children_on_interrupt` guards the part of a submitter that starts such children and waits for them.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import psutil

#: Seconds the children have to exit after the SIGINT (submitit's controller takes about one to stop its ranks).
STOP_GRACE_S = 15.0
#: Seconds what is left has after SIGTERM, then after SIGKILL.
_TERM_S, _KILL_S = 3.0, 5.0
#: The longest :func:`stop_process_trees` takes: a submitter that waits for another gives it this long.
STOP_BOUND_S = STOP_GRACE_S + _TERM_S + _KILL_S


@contextmanager
def stop_children_on_interrupt(grace_s: float = STOP_GRACE_S) -> Iterator[None]:
    """Run the body with SIGTERM raising ``KeyboardInterrupt`` as SIGINT does; on ``KeyboardInterrupt``, stop the
    children this process started inside the body, with their descendants (:func:`stop_process_trees`), then
    re-raise. Children it had before are left alone. Signal handlers are the main thread's: elsewhere only the
    ``KeyboardInterrupt`` part applies."""
    me = psutil.Process()
    before = set(me.children())
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt) if main else None
    try:
        yield
    except KeyboardInterrupt:
        started = [child for child in me.children() if child not in before]
        if started:
            print(
                f"\n[afm] interrupted: stopping {len(started)} child process(es) and theirs (at most "
                f"{grace_s + _TERM_S + _KILL_S:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
            _without_interrupts(main, lambda: stop_process_trees(started, grace_s))
        raise
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)


def stop_process_trees(roots: Iterable[psutil.Process], grace_s: float = STOP_GRACE_S) -> list[psutil.Process]:
    """SIGINT to each of ``roots`` (each passes it on: submitit's controller to its ranks, a stage's submitter to
    its job), up to ``grace_s`` for them to exit, then SIGTERM to what is left of their trees (children orphaned on
    the way included: they are collected while their parents live), SIGKILL after 3 s more, and up to 5 s for
    that. Returns the processes that needed SIGTERM or SIGKILL."""
    roots = list(roots)
    tree = set(roots) | _descendants(roots)  # before the SIGINT: a root may exit at once and orphan its children
    _signal(roots, signal.SIGINT)
    deadline = time.monotonic() + grace_s
    while (living := [root for root in roots if _alive(root)]) and time.monotonic() < deadline:
        tree |= _descendants(living)  # before a rank dies and its children are handed to init
        time.sleep(0.1)
    tree |= _descendants(tree)
    left = [proc for proc in tree if _alive(proc)]
    _signal(left, signal.SIGTERM)
    _, still = psutil.wait_procs(left, timeout=_TERM_S)
    _signal(still, signal.SIGKILL)
    psutil.wait_procs(still, timeout=_KILL_S)
    return left


def _descendants(procs: Iterable[psutil.Process]) -> set[psutil.Process]:
    found: set[psutil.Process] = set()
    for proc in procs:
        try:
            found.update(proc.children(recursive=True))
        except psutil.Error:  # exited meanwhile
            pass
    return found


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal(procs: Iterable[psutil.Process], signum: int) -> None:
    for proc in procs:
        try:
            proc.send_signal(signum)
        except psutil.Error:
            pass


def _without_interrupts(main: bool, action: Any) -> None:
    """Run ``action()`` with SIGINT and SIGTERM ignored (main thread): a second Ctrl-C would cut the stopping short
    and leave the rest running; it ends within its own bound anyway."""
    if not main:
        action()
        return
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        action()
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    """SIGTERM (``kill``, a scheduler stopping the submitter) stops the children as Ctrl-C does."""
    raise KeyboardInterrupt
