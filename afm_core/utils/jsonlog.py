"""Append-only JSON-lines logs (``metrics.jsonl``, ``events.jsonl``): one JSON object per line, flushed as written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_jsonl_log(path: str | Path) -> list[dict[str, Any]]:
    """All complete lines of an append-only JSONL log; [] when the file is absent.

    A torn last line (the writer died mid-write) is skipped; it is the only line that may be torn.

    Raises:
        ValueError: a line other than the last is not valid JSON (names the file and line number).
    """
    path = Path(path)
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number}: not a JSON object ({err.msg})") from None
    return records
