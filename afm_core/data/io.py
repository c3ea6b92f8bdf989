"""Reading record files with errors that name the file, the line (or record) and the field."""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any


class DataFormatError(ValueError):
    """Bad input data. The message starts with ``<file>:<line>:`` (or ``<file>: record <i>:``)."""


class Where:
    """The location of one record, used to prefix error messages: ``file:line`` or ``file: record i``."""

    def __init__(self, path: str | os.PathLike[str], line: int | None = None, record: int | None = None) -> None:
        self.path = Path(path)
        self.line = line
        self.record = record

    def __str__(self) -> str:
        if self.line is not None:
            return f"{self.path}:{self.line}"
        if self.record is not None:
            return f"{self.path}: record {self.record}"
        return str(self.path)

    def error(self, message: str) -> DataFormatError:
        return DataFormatError(f"{self}: {message}")


def require(record: Mapping[str, Any], name: str, kind: type | tuple[type, ...], where: Where, owner: str = "") -> Any:
    """``record[name]``, checked to be of type ``kind``.

    Args:
        owner: path of ``record`` inside the top-level record, e.g. ``"messages[3]"``, for the message.

    Raises:
        DataFormatError: the field is missing (``missing field 'answer'``) or has another type.
    """
    prefix = f"{owner}: " if owner else ""
    if name not in record:
        raise where.error(f"{prefix}missing field {name!r}")
    value = record[name]
    if not isinstance(value, kind):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise where.error(f"{prefix}field {name!r} must be {names}, got {type(value).__name__}")
    return value


def read_jsonl(
    path: str | os.PathLike[str], skipped: list[str] | None = None
) -> Iterator[tuple[Where, dict[str, Any]]]:
    """Yield ``(where, record)`` for each non-blank line of a JSON-lines file (lines counted from 1; ``.gz`` read too).

    Args:
        skipped: when given, a malformed line is appended to it as ``"file:line: reason"`` and skipped instead
            of raising (evaluation skips and counts bad records; data preparation stops on them).

    Raises:
        DataFormatError: a line is not valid JSON or not a JSON object (``file.jsonl:17: invalid JSON ...``),
            unless ``skipped`` is given.
        FileNotFoundError: no such file.
    """
    path = Path(path)
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = Where(path, line=number)
            try:
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise where.error(f"expected a JSON object, got {type(record).__name__}")
            except json.JSONDecodeError as err:
                error = where.error(f"invalid JSON ({err.msg} at column {err.colno})")
                if skipped is None:
                    raise error from None
                skipped.append(str(error))
                continue
            except DataFormatError as error:
                if skipped is None:
                    raise
                skipped.append(str(error))
                continue
            yield where, record


def read_json_list(path: str | os.PathLike[str]) -> Iterator[tuple[Where, dict[str, Any]]]:
    """Yield ``(where, record)`` for each object of a file holding one JSON list (records counted from 0).

    Raises:
        DataFormatError: invalid JSON (with its line), not a list, or a non-object item.
        FileNotFoundError: no such file.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise Where(path, line=err.lineno).error(f"invalid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(data, list):
        raise Where(path).error(f"expected a JSON list of records, got {type(data).__name__}")
    for index, record in enumerate(data):
        where = Where(path, record=index)
        if not isinstance(record, dict):
            raise where.error(f"expected a JSON object, got {type(record).__name__}")
        yield where, record
