"""Atomic writes: a file or a directory is either complete at its final path or absent.

Every helper writes into a temporary sibling (same directory, hence same filesystem), flushes and
fsyncs it, then publishes it with ``os.replace`` (an atomic rename on POSIX) and fsyncs the parent
directory so the rename itself survives a crash. On any exception the temporary is removed and the
previous content at the final path, if any, is left untouched.

Temporaries are named ``.<name>.<random>.tmp`` so that readers globbing for ``*.parquet`` or
``checkpoint_*`` never see them. They are created with mode 0o666 / 0o777 minus the umask (like
``open``/``mkdir``), not ``tempfile``'s private 0o600 / 0o700.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


def _temp_sibling(path: Path) -> Path:
    return path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so that renames and creations inside it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on a clean exit it replaces ``path`` atomically.

    For writers that want a file name rather than a handle (``pyarrow.parquet.write_table``,
    ``torch.save``). The temporary does not exist when yielded; the writer must create it.

    Raises:
        FileNotFoundError: the body did not create the temporary file.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    temp = _temp_sibling(final)
    try:
        yield temp
        fd = os.open(temp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, final)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_dir(final.parent)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO[Any]]:
    """Open a temporary sibling of ``path`` for writing; on a clean exit it replaces ``path``.

    Args:
        path: final file path; parent directories are created.
        mode: ``"w"`` (text) or ``"wb"`` (bytes).
        encoding: text encoding (ignored for ``"wb"``).

    Raises:
        ValueError: ``mode`` is not ``"w"`` or ``"wb"``.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open: mode must be 'w' or 'wb', got {mode!r}")
    with atomic_path(path) as temp:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with open(fd, mode, encoding=None if mode == "wb" else encoding) as handle:
            yield handle
            handle.flush()


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    with atomic_open(path, "wb") as handle:
        handle.write(data)


def atomic_write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> None:
    """Write ``text`` to ``path`` atomically."""
    with atomic_open(path, "w", encoding=encoding) as handle:
        handle.write(text)


def atomic_write_json(path: str | os.PathLike[str], obj: Any, indent: int | None = 2) -> None:
    """Write ``obj`` as UTF-8 JSON (keys in insertion order, non-ASCII kept) to ``path`` atomically."""
    atomic_write_text(path, json.dumps(obj, indent=indent, ensure_ascii=False) + "\n")


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield an empty temporary directory next to ``path``; on a clean exit it becomes ``path``.

    Everything written inside is fsynced, then the directory is renamed onto ``path``. An existing
    ``path`` is first renamed aside and deleted after the swap, so readers see the old complete
    directory, then (after a window of two renames) the new complete one, never a partial one. On
    an exception the temporary directory is deleted and ``path`` is left as it was.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    temp = _temp_sibling(final)
    os.mkdir(temp, 0o777)
    old = None
    try:
        yield temp
        _fsync_tree(temp)
        if final.exists():
            old = _temp_sibling(final)
            os.rename(final, old)
        os.rename(temp, final)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        if old is not None and not final.exists():
            os.rename(old, final)  # put the previous complete directory back
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
