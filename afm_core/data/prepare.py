"""Prepare the SFT data: convert real traces to CoA trajectories, filter, split, write parquet.

``prepare(data_cfg)`` writes ``out_dir`` = ``{train.parquet, heldout.parquet, report.json}``
atomically (a complete directory or none); ``ensure_prepared(data_cfg)`` does so only when the
directory is missing or was prepared from another config. ``data_cfg`` is the ``data`` config group
(``conf/data/coa_traces.yaml``):

* ``sources``: converter name -> ``{limit, path}``: at most ``limit`` trajectories (null: all) from ``path``
  (the user's own file or glob, e.g. ``data.sources.r1searcher.path=my_rollouts.jsonl``; null: the
  converter's files under ``shared_dir``), see :mod:`afm_core.data.converters`; a bare number is a limit;
* ``shared_dir``: the real data folder (null: :func:`~afm_core.utils.paths.shared_data_dir`);
* ``out_dir``: where to write (null: ``$AFM_CACHE/data/<name>``);
* ``heldout_fraction``, ``split_seed``: the held-out split, by question (see :func:`split_by_task`);
* ``filters`` (optional): overrides of :class:`~afm_core.data.filters.DataFilters` (``preset: paper``: the
  AFM paper's SFT filters, :mod:`afm_core.data.filters`; default: drop known-wrong trajectories and duplicates).

The parquet schema is :data:`afm_core.data.schema.PREPARED_SCHEMA`. ``report.json`` holds the
config it was prepared from (``config``), per-source conversion counts and rejections by reason
(``sources``), filter drops by reason and each filter stage's input/kept/dropped counts (``filters``), the
split sizes (``split``) and the schema.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
import random
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from afm_core.coa.trajectory import Trajectory
from afm_core.data.converters import CONVERTERS
from afm_core.data.converters.base import Conversion
from afm_core.data.filters import (  # noqa: F401 - DataFilters, filter_trajectories: re-exported
    DataFilters,
    filter_trajectories,
    filters_report,
    run_filters,
    upsampled_rows,
)
from afm_core.data.formats import alpaca_converter, rl_task_from_trajectory, to_alpaca, write_rl_tasks
from afm_core.data.schema import PREPARED_SCHEMA, read_prepared, row_trajectory, task_id, write_prepared
from afm_core.data.trajectory_checks import is_error_correction  # noqa: F401 - re-exported
from afm_core.utils.atomic import atomic_dir
from afm_core.utils.paths import cache_dir, shared_data_dir

FORMAT_VERSION = 3  # 2: ToRA answers checked with math-verify; 3: code observations in the code tool's format
"""Bumped whenever converters, rendering or the schema change, so that cached data is re-prepared."""

INPUT_FORMATS = ("converters", "llamafactory")
EXPORT_FORMATS = ("llamafactory", "afm_rl")
REPORT_FILE = "report.json"
SPLITS = ("train", "heldout")


# --------------------------------------------------------------------------------------------------
# Split


def split_by_task(
    trajectories: Sequence[Trajectory], heldout_fraction: float, seed: int
) -> tuple[list[Trajectory], list[Trajectory]]:
    """Split into ``(train, heldout)`` by question, so that no question is in both.

    The distinct :func:`~afm_core.data.schema.task_id` values are sorted, shuffled with
    ``random.Random(seed)``, and the first ``round(fraction * n)`` of them (at least 1 and at most
    ``n - 1`` when ``0 < fraction < 1`` and ``n >= 2``) are held out. Deterministic for a given input
    and seed; both outputs keep the input order.

    Raises:
        ValueError: ``heldout_fraction`` outside [0, 1].
    """
    if not 0.0 <= heldout_fraction <= 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1], got {heldout_fraction}")
    ids = sorted({task_id(t.question) for t in trajectories})
    random.Random(seed).shuffle(ids)
    count = round(heldout_fraction * len(ids))
    if 0.0 < heldout_fraction < 1.0 and len(ids) >= 2:
        count = min(max(count, 1), len(ids) - 1)
    heldout_ids = set(ids[:count])
    train = [t for t in trajectories if task_id(t.question) not in heldout_ids]
    heldout = [t for t in trajectories if task_id(t.question) in heldout_ids]
    return train, heldout


# --------------------------------------------------------------------------------------------------
# Config


def _plain(node: Mapping[str, Any] | None) -> Any:
    """An OmegaConf node as plain dicts and lists (interpolations resolved); a plain mapping, or None, as is."""
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=True)
    return node


@dataclass(frozen=True)
class PrepareInput:
    """Where the trajectories come from.

    Attributes:
        format: ``"converters"`` (the real traces named in ``data.sources``) or ``"llamafactory"``
            (an alpaca JSON file of CoA trajectories).
        path: the alpaca JSON file (llamafactory only).
        task: task family of the imported records (llamafactory only; None: inferred).
    """

    format: str = "converters"
    path: str | None = None
    task: str | None = None

    def __post_init__(self) -> None:
        if self.format not in INPUT_FORMATS:
            raise ValueError(f"input.format must be one of {INPUT_FORMATS}, got {self.format!r}")
        if self.format == "llamafactory" and not self.path:
            raise ValueError("input.format=llamafactory needs input.path (an alpaca JSON file)")
        if self.path:
            object.__setattr__(self, "path", str(Path(self.path).expanduser().resolve()))


def resolve_out_dir(data_cfg: Mapping[str, Any]) -> Path:
    """``data_cfg.out_dir``, or ``$AFM_CACHE/data/<data_cfg.name>`` when it is null."""
    data = _plain(data_cfg)
    out_dir = data.get("out_dir")
    if out_dir:
        return Path(out_dir).expanduser()
    return cache_dir() / "data" / str(data.get("name") or "coa_traces")


def normalize_sources(sources: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """``data.sources`` as ``{converter: {"limit": int | None, "path": str | None}}``; a bare number (or null)
    is a limit.

    Raises:
        ValueError: an unknown converter, an unknown key, or a bad limit or path (the key is named).
    """
    normalized = {}
    for name, spec in dict(_plain(sources) or {}).items():
        if name not in CONVERTERS:
            raise ValueError(f"data.sources.{name}: unknown converter; known: {', '.join(sorted(CONVERTERS))}")
        spec = {"limit": spec} if spec is None or isinstance(spec, int) else dict(spec)
        if unknown := sorted(set(spec) - {"limit", "path"}):
            raise ValueError(f"data.sources.{name}: unknown key(s) {unknown}; valid: limit, path")
        limit, path = spec.get("limit"), spec.get("path")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise ValueError(f"data.sources.{name}.limit={limit!r}: an integer >= 0, or null (all)")
        if path is not None and (not isinstance(path, str) or not path):
            raise ValueError(f"data.sources.{name}.path={path!r}: a file or glob, or null (the shared files)")
        normalized[name] = {"limit": limit, "path": path}
    return normalized


def source_files(name: str, path: str | None, shared_dir: Path) -> list[Path]:
    """The input files of converter ``name``: ``path`` (a file or glob, ``~`` expanded, relative to the current
    directory) when set, else the converter's default files under ``shared_dir``.

    Raises:
        FileNotFoundError: a default file is missing, or ``path`` matches no file.
    """
    if path is None:
        if not CONVERTERS[name].files:
            raise FileNotFoundError(
                f"data.sources.{name}.path: source {name!r} has no default files; give a file or glob"
            )
        paths = [shared_dir / f for f in CONVERTERS[name].files]
        if missing := [str(p) for p in paths if not p.exists()]:
            raise FileNotFoundError(f"source {name!r}: missing input file(s) {missing} (shared_dir={shared_dir})")
        return paths
    pattern = str(Path(path).expanduser().absolute())
    paths = sorted(Path(p) for p in glob.glob(pattern) if Path(p).is_file())
    if not paths:
        raise FileNotFoundError(f"data.sources.{name}.path={path!r}: no such file ({pattern})")
    return paths


def recorded_config(data_cfg: Mapping[str, Any], source: PrepareInput = PrepareInput()) -> dict[str, Any]:
    """The config that determines the prepared data's content, as written to ``report.json``. A source read
    from the user's ``path`` records each file's absolute path, size and mtime, so that editing it prepares again.

    Raises:
        ValueError: bad ``sources`` (see :func:`normalize_sources`) or ``filters``.
        FileNotFoundError: a source's ``path`` matches no file.
    """
    data_cfg = _plain(data_cfg)
    shared = data_cfg.get("shared_dir")
    shared_dir = Path(shared).expanduser() if shared else shared_data_dir()
    sources = {}
    if source.format == "converters":
        for name, spec in normalize_sources(data_cfg.get("sources")).items():
            files = None
            if spec["path"] is not None:
                files = [
                    {"path": str(p), "size": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns}
                    for p in source_files(name, spec["path"], shared_dir)
                ]
            sources[name] = {"limit": spec["limit"], "files": files}
    return {
        "format_version": FORMAT_VERSION,
        "input": asdict(source),
        "sources": sources,
        "shared_dir": str(shared_dir),
        "heldout_fraction": float(data_cfg.get("heldout_fraction", 0.05)),
        "split_seed": int(data_cfg.get("split_seed", 0)),
        "filters": asdict(DataFilters.from_config(data_cfg.get("filters"))),
    }


# --------------------------------------------------------------------------------------------------
# Prepare


def _convert(config: dict[str, Any], strict: bool) -> list[Conversion]:
    source = PrepareInput(**config["input"])
    if source.format == "llamafactory":
        return [alpaca_converter(source.task)([str(source.path)], strict=strict)]
    shared = Path(config["shared_dir"])
    conversions = []
    for name, spec in config["sources"].items():
        files = spec["files"]
        paths = [Path(f["path"]) for f in files] if files is not None else source_files(name, None, shared)
        conversions.append(CONVERTERS[name](paths, limit=spec["limit"], strict=strict))
    return conversions


def prepare(data_cfg: Mapping[str, Any], *, source: PrepareInput = PrepareInput(), strict: bool = False) -> Path:
    """Convert, filter, split and write the prepared data (see the module docstring); returns ``out_dir``.

    An existing ``out_dir`` is replaced atomically; on any error it is left as it was (or absent).

    Args:
        data_cfg: the ``data`` config group.
        source: where the trajectories come from (default: the converters named in ``data.sources``).
        strict: raise on the first trajectory that breaks the tag grammar instead of counting it.

    Raises:
        ValueError: bad config (unknown converter, filter key, fraction out of range).
        FileNotFoundError: a source file is missing (the shared file, or the user's ``path``).
        DataFormatError: a malformed source record (message names file, line and field).
        TagGrammarError: ``strict`` and a trajectory with broken tags.
    """
    config = recorded_config(data_cfg, source)
    out_dir = resolve_out_dir(data_cfg)
    filters = DataFilters(**config["filters"])
    conversions = _convert(config, strict)
    trajectories = [t for c in conversions for t in c.trajectories]
    filtered = run_filters(trajectories, filters)
    train, heldout = split_by_task(filtered.kept, config["heldout_fraction"], config["split_seed"])
    rows = {"train": upsampled_rows(train, filters), "heldout": upsampled_rows(heldout, 1)}
    report = {
        "format_version": FORMAT_VERSION,
        "config": config,
        "sources": {c.report.source: c.report.to_dict() for c in conversions},
        "filters": filters_report(filtered, len(trajectories), train, len(rows["train"]), filters),
        "split": {
            **{f"{split}_rows": len(rows[split]) for split in SPLITS},
            **{f"{split}_tasks": len({r["task_id"] for r in rows[split]}) for split in SPLITS},
            "by_task": {split: dict(sorted(Counter(r["task"] for r in rows[split]).items())) for split in SPLITS},
        },
        "schema": {f.name: str(f.type) for f in PREPARED_SCHEMA},
    }
    with atomic_dir(out_dir) as temp:
        for split in SPLITS:
            write_prepared(temp / f"{split}.parquet", rows[split])
        (temp / REPORT_FILE).write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return out_dir


def read_report(out_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The ``report.json`` of a prepared directory, or None when absent or unreadable."""
    try:
        return json.loads((Path(out_dir) / REPORT_FILE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def is_prepared(out_dir: Path, config: dict[str, Any]) -> bool:
    """Whether ``out_dir`` holds both splits and a report recording exactly ``config``."""
    report = read_report(out_dir)
    return (
        report is not None
        and report.get("config") == config
        and all((out_dir / f"{split}.parquet").is_file() for split in SPLITS)
    )


@contextlib.contextmanager
def dir_lock(out_dir: Path) -> Iterator[None]:
    """An exclusive lock (``flock``) on ``.<out_dir name>.lock`` next to ``out_dir``, so that concurrent
    callers (e.g. several ranks of one job) write ``out_dir`` once."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.parent / f".{out_dir.name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_prepared(
    data_cfg: Mapping[str, Any], *, source: PrepareInput = PrepareInput(), strict: bool = False, force: bool = False
) -> Path:
    """``out_dir`` of ``data_cfg``, prepared first when missing, when its ``report.json`` records
    another config, or when ``force``. Safe to call from several processes at once.

    Raises:
        as :func:`prepare`.
    """
    out_dir = resolve_out_dir(data_cfg)
    config = recorded_config(data_cfg, source)
    with dir_lock(out_dir):
        if force or not is_prepared(out_dir, config):
            prepare(data_cfg, source=source, strict=strict)
    return out_dir


# --------------------------------------------------------------------------------------------------
# Export


def read_prepared_trajectories(path: str | os.PathLike[str]) -> list[tuple[str, Trajectory]]:
    """``(row id, trajectory)`` for each row of a prepared parquet file.

    Raises:
        DataFormatError: wrong columns or a bad ``trajectory`` JSON (file and row named).
    """
    rows = read_prepared(path).select(["id", "trajectory"]).to_pylist()
    return [(row["id"], row_trajectory(row, path, i)) for i, row in enumerate(rows)]


def export_prepared(
    out_dir: str | os.PathLike[str], fmt: str, export_dir: str | os.PathLike[str] | None = None
) -> Path:
    """Export a prepared directory to a foreign format, atomically; returns the export directory.

    * ``llamafactory``: ``train.json`` and ``heldout.json`` (alpaca lists, every row including the
      upsampled copies) and a ``dataset_info.json`` registering them as ``afm_coa_train`` /
      ``afm_coa_heldout`` for LLaMA-Factory's ``dataset_dir``.
    * ``afm_rl``: ``train.parquet`` and ``heldout.parquet`` in the AFM/verl RL layout, one task per
      question (the first trajectory of each ``task_id``), ``extra_info.index`` = trajectory id.

    Args:
        export_dir: where to write; None: ``<out_dir>-<fmt>`` next to ``out_dir``.

    Raises:
        ValueError: unknown ``fmt``.
        FileNotFoundError / DataFormatError: ``out_dir`` is not a complete prepared directory.
    """
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"export format must be one of {EXPORT_FORMATS}, got {fmt!r}")
    out_dir = Path(out_dir)
    export_dir = Path(export_dir) if export_dir else out_dir.with_name(f"{out_dir.name}-{fmt}")
    splits = {split: read_prepared_trajectories(out_dir / f"{split}.parquet") for split in SPLITS}
    with atomic_dir(export_dir) as temp:
        for split, items in splits.items():
            if fmt == "llamafactory":
                records = [to_alpaca(trajectory) for _, trajectory in items]
                (temp / f"{split}.json").write_text(json.dumps(records, indent=1, ensure_ascii=False), encoding="utf-8")
            else:
                firsts: dict[str, Trajectory] = {}
                for row_id, trajectory in items:
                    if row_id == trajectory.id:  # not an upsampled copy
                        firsts.setdefault(task_id(trajectory.question), trajectory)
                tasks = [rl_task_from_trajectory(t, split) for t in firsts.values()]
                write_rl_tasks(temp / f"{split}.parquet", tasks)
        if fmt == "llamafactory":
            info = {f"afm_coa_{split}": {"file_name": f"{split}.json"} for split in SPLITS}
            (temp / "dataset_info.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return export_dir
