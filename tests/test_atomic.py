"""Atomic file and directory writes: complete or absent, never partial, no temporaries left."""

import json
import os

import pytest

from afm_core.utils.atomic import atomic_dir, atomic_open, atomic_path, atomic_write_json, atomic_write_text


def test_files(tmp_path):
    path = tmp_path / "sub" / "a.json"
    atomic_write_json(path, {"x": "é"})
    assert json.loads(path.read_text(encoding="utf-8")) == {"x": "é"}
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    atomic_write_text(path, "new")
    assert path.read_text() == "new"
    with pytest.raises(RuntimeError):
        with atomic_open(path, "w") as handle:
            handle.write("partial")
            raise RuntimeError("crash")
    assert path.read_text() == "new"
    assert sorted(p.name for p in path.parent.iterdir()) == ["a.json"]
    with atomic_path(tmp_path / "b.bin") as temp:
        temp.write_bytes(b"\x00\x01")
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    with pytest.raises(ValueError, match="mode"):
        with atomic_open(path, "a"):
            pass


def test_directory(tmp_path):
    target = tmp_path / "out"
    with atomic_dir(target) as temp:
        (temp / "x.txt").write_text("1")
        assert not target.exists()
    assert (target / "x.txt").read_text() == "1"
    with atomic_dir(target) as temp:
        (temp / "y.txt").write_text("2")
    assert sorted(p.name for p in target.iterdir()) == ["y.txt"]
    with pytest.raises(RuntimeError):
        with atomic_dir(target) as temp:
            (temp / "z.txt").write_text("3")
            raise RuntimeError("crash")
    assert sorted(p.name for p in target.iterdir()) == ["y.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with pytest.raises(RuntimeError):
        with atomic_dir(tmp_path / "never"):
            raise RuntimeError("crash")
    assert not (tmp_path / "never").exists()


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask
