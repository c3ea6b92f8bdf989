"""The on-disk protocol of training checkpoints, shared by both SFT engines, ``jobs.status`` and ``jobs.export``'s
checks (no torch import).

Layout of ``RUN_DIR/checkpoints/``::

    step_00000100/           a complete checkpoint: the engine's files, then COMPLETE
        COMPLETE             JSON {step, layout, engine, time, bytes, write_s, nodes}; written last
    .tmp-step_00000200/      a save in progress (or killed): ignored, removed by the next save

A save stages everything in ``.tmp-step_N`` (:func:`stage_checkpoint`), then rank 0 publishes it
(:func:`publish_checkpoint`): ``COMPLETE`` written and fsynced, the directory renamed to ``step_N``, the oldest
complete checkpoints beyond ``keep_last`` removed. A crash at any point leaves the previous complete checkpoint
as the latest one. What an engine writes inside is its own (:mod:`afm_core.engine.checkpoint` for Megatron,
:mod:`afm_core.train.deepspeed_engine` for DeepSpeed); ``COMPLETE``'s ``engine`` field says which.
"""

from __future__ import annotations

import errno
import json
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from afm_core.utils.atomic import atomic_write_json, fsync_dir

COMPLETE_MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_TMP_PREFIX = ".tmp-"


def checkpoint_dir_name(step: int) -> str:
    """``step_{step:08d}``."""
    return f"step_{step:08d}"


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """The complete checkpoints under ``root`` as ``(step, path)``, oldest first (partial ones ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and (path / COMPLETE_MARKER).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_complete_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint with the highest step under ``root``, or None."""
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def staging_dir(root: str | Path, step: int) -> Path:
    """``root/.tmp-step_N``: where checkpoint ``step`` is written before :func:`publish_checkpoint`."""
    return Path(root) / f"{_TMP_PREFIX}{checkpoint_dir_name(step)}"


def directory_bytes(path: str | Path) -> int:
    """Bytes of the regular files under ``path``, recursively."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def check_free_space(root: str | Path, step: int) -> None:
    """Fail before a save that the file system of ``root`` cannot hold: a full disk otherwise surfaces as an
    engine's cryptic write error (``torch.save``: "unexpected pos ...") halfway through the staging dir. The
    estimate is the size of the latest complete checkpoint (a job's checkpoints are the same size); with none
    yet, nothing is checked.

    Raises:
        OSError: ``errno.ENOSPC``, naming ``root``, the bytes free and needed; nothing was written and the
            latest complete checkpoint is untouched.
    """
    latest = latest_complete_checkpoint(root)
    if latest is None:
        return
    needed, free = directory_bytes(latest), shutil.disk_usage(root).free
    if free < needed:
        raise OSError(
            errno.ENOSPC,
            f"no space for checkpoint {checkpoint_dir_name(step)}: {free / 2**30:.2f} GiB free, {latest.name} took "
            f"{needed / 2**30:.2f} GiB. Nothing was written; {latest.name} is still the latest complete checkpoint. "
            "Free space on this file system, or lower trainer.keep_last",
            str(root),
        )


def on_rank0(is_rank0: bool, fn: Callable[[], Any]) -> None:
    """Run ``fn`` on rank 0 and tell every rank how it went (a collective: every rank calls it; it also acts as a
    barrier). An exception of ``fn`` is raised on every rank, as ``OSError`` with its errno when it is one
    (``ENOSPC`` from :func:`check_free_space`), else ``RuntimeError``: the other ranks would otherwise wait at the
    next barrier for a rank 0 that has left, until the collective timeout (hours for RL jobs).
    """
    import torch.distributed as dist  # here: jobs.status reads checkpoints with this module, without torch

    failure: list[Any] = [None]
    if is_rank0:
        try:
            fn()
        except Exception as err:  # reported to every rank, re-raised here below
            failure = [
                (getattr(err, "errno", None) if isinstance(err, OSError) else None, f"{type(err).__name__}: {err}")
            ]
            if not dist.is_initialized():
                raise
    if dist.is_initialized():
        dist.broadcast_object_list(failure, src=0)
    if failure[0] is not None:
        code, message = failure[0]
        if code is not None:
            raise OSError(code, f"rank 0: {message}")
        raise RuntimeError(f"rank 0: {message}")


def stage_checkpoint(root: str | Path, step: int) -> Path:
    """Rank 0, before a save: create ``root``, remove staging dirs of killed saves, check the free space
    (:func:`check_free_space`); returns :func:`staging_dir` (not created: the engine's writer creates it).

    Raises:
        OSError: ``errno.ENOSPC`` from :func:`check_free_space`.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f"{_TMP_PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)
    check_free_space(root, step)
    return staging_dir(root, step)


def publish_checkpoint(
    root: str | Path,
    step: int,
    *,
    layout: dict[str, int],
    engine: str,
    keep_last: int,
    started: float | None = None,
    nodes: int = 1,
) -> Path:
    """Rank 0, once every rank has written into :func:`staging_dir`: make it the complete checkpoint ``step_N``.

    Writes ``COMPLETE`` (``{step, layout, engine, time, bytes, write_s, nodes}``: time in unix seconds, the
    checkpoint's bytes, the seconds since ``started`` (unix time when the save began, None: not measured) and the
    number of nodes that wrote it; :func:`measured_write_speed` reads them) atomically, fsyncs, replaces an earlier
    ``step_N`` (a re-run of a finished job), renames, fsyncs ``root``, then keeps only the last ``keep_last``
    complete checkpoints.

    Returns:
        ``root/step_N``.
    """
    root = Path(root)
    temp, final = staging_dir(root, step), root / checkpoint_dir_name(step)
    now = time.time()
    marker = {"step": step, "layout": layout, "engine": engine, "time": now, "bytes": directory_bytes(temp)}
    marker.update(write_s=None if started is None else round(now - started, 3), nodes=nodes)
    atomic_write_json(temp / COMPLETE_MARKER, marker)
    fsync_dir(temp)
    if final.exists():
        shutil.rmtree(final)
    temp.rename(final)
    fsync_dir(root)
    for _, old in complete_checkpoints(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def measured_write_speed(root: str | Path) -> dict[str, Any] | None:
    """How fast this job's file system took its latest complete checkpoint under ``root`` (a resumed or requeued
    run): ``{"gb_s_per_node", "bytes", "write_s", "nodes", "checkpoint"}`` (GB = 1e9 bytes; the write time runs from
    the start of the save to its ``COMPLETE`` marker, so it includes the ranks' barrier), or None when there is no
    checkpoint or it was written before the markers held the measurement."""
    found = complete_checkpoints(root)
    if not found:
        return None
    marker = read_marker(found[-1][1])
    if not marker.get("write_s") or not marker.get("bytes"):
        return None
    nodes = int(marker.get("nodes") or 1)
    speed = marker["bytes"] / marker["write_s"] / 1e9 / nodes
    return {
        "gb_s_per_node": speed,
        "bytes": marker["bytes"],
        "write_s": marker["write_s"],
        "nodes": nodes,
        "checkpoint": found[-1][1].name,
    }


def read_marker(path: str | Path) -> dict[str, Any]:
    """The ``COMPLETE`` marker of checkpoint ``path``.

    Raises:
        FileNotFoundError: ``path`` is not a complete checkpoint.
    """
    marker = Path(path) / COMPLETE_MARKER
    if not marker.is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {COMPLETE_MARKER} marker)")
    return json.loads(marker.read_text())


def marker_engine(marker: dict[str, Any]) -> str:
    """The engine that wrote a checkpoint: its ``COMPLETE`` marker's ``engine`` (``megatron`` for markers written
    before the field existed)."""
    return str(marker.get("engine", "megatron"))


def find_resume_checkpoint(run_dir: str | Path, resume_from: str | Path | None) -> Path | None:
    """The checkpoint a run resumes from: the latest complete one in ``run_dir/checkpoints`` (a requeued or
    restarted run), else the latest complete one of the ``resume_from`` run dir, else None (a fresh run).

    Raises:
        FileNotFoundError: ``resume_from`` is set but holds no complete checkpoint.
    """
    own = latest_complete_checkpoint(Path(run_dir) / "checkpoints")
    if own is not None or resume_from is None:
        return own
    other = latest_complete_checkpoint(Path(resume_from) / "checkpoints")
    if other is None:
        raise FileNotFoundError(f"resume={resume_from}: no complete checkpoint in {Path(resume_from) / 'checkpoints'}")
    return other


class ExportError(ValueError):
    """The checkpoint cannot be exported (incomplete, absent, another engine's); the message says what to do."""


def find_checkpoint(run_dir: str | Path, step: int | None) -> Path:
    """``RUN_DIR/checkpoints/step_N`` for ``step`` (None: the latest complete one).

    Raises:
        ExportError: no such complete checkpoint; names the complete steps there are, and says when ``step_N`` is
            a save that was interrupted (no ``COMPLETE`` marker) or still being staged.
    """
    root = Path(run_dir) / "checkpoints"
    steps = [s for s, _ in complete_checkpoints(root)]
    have = f"complete checkpoints in {root}: {', '.join(map(str, steps)) or 'none'}"
    if step is None:
        if not steps:
            raise ExportError(f"nothing to export: {have}")
        return complete_checkpoints(root)[-1][1]
    path = root / checkpoint_dir_name(step)
    if path.is_dir() and not (path / COMPLETE_MARKER).is_file():
        raise ExportError(f"{path} is incomplete (no {COMPLETE_MARKER} marker: its save did not finish); {have}")
    if (root / f".tmp-{checkpoint_dir_name(step)}").is_dir() and not path.is_dir():
        raise ExportError(f"checkpoint {step} of {run_dir} is incomplete (still staged in .tmp-{path.name}); {have}")
    if step not in steps:
        raise ExportError(f"step={step}: no checkpoint of that step; {have}")
    return path
