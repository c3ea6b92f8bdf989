"""Schema of the prepared CoA data (``train.parquet`` / ``heldout.parquet`` written by ``jobs.prepare_data``).

One row per trajectory:

==================  =======  =====================================================================
column              type     meaning
==================  =======  =====================================================================
``id``              string   unique trajectory id, ``<source>:<id in source>`` (``#up<k>`` suffix on
                             the extra copies made by error-correction upsampling)
``task_id``         string   16 hex digits of SHA-1 of the normalized question: rows sharing it are
                             the same question, and the train/held-out split never separates them
``source``          string   converter / dataset name (``gsm8k``, ``fireact``, ``r1searcher``...)
``task``            string   task family: ``math`` | ``mhqa`` | ``web`` | ``code``
``question``        string   the question alone
``answer``          string   reference answer (gold when the source has one), plain text
``prompt``          string   the user-turn text: task prompt + ``"\\n\\nQuestion: "`` + question
``response``        string   the assistant turn: the trajectory rendered in the canonical CoA layout
                             (:func:`afm_core.coa.render.render_response`), observations inline
``num_tool_calls``  int32    tool calls in the response
``trajectory``      string   JSON of :meth:`afm_core.coa.trajectory.Trajectory.to_dict`
==================  =======  =====================================================================
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from afm_core.coa.render import render_response
from afm_core.coa.trajectory import Trajectory
from afm_core.data.io import DataFormatError

_DESCRIPTIONS = {
    "id": "unique trajectory id <source>:<id in source>",
    "task_id": "sha1 of the normalized question (16 hex); the split never separates equal task_ids",
    "source": "converter or dataset name",
    "task": "math | mhqa | web | code",
    "question": "the question alone",
    "answer": "reference answer, plain text",
    "prompt": "user-turn text: task prompt + '\\n\\nQuestion: ' + question",
    "response": "assistant turn: the CoA trajectory in the canonical layout, observations inline",
    "num_tool_calls": "tool calls in the response",
    "trajectory": "JSON of Trajectory.to_dict()",
}

PREPARED_SCHEMA = pa.schema(
    [
        pa.field(name, pa.int32() if name == "num_tool_calls" else pa.string(), nullable=False,
                 metadata={"description": text})
        for name, text in _DESCRIPTIONS.items()
    ]
)  # fmt: skip
"""Arrow schema of the prepared parquet files (columns in this order)."""


def task_id(question: str) -> str:
    """Id of a question: SHA-1 (16 hex digits) of it lower-cased, whitespace-collapsed, without a
    trailing ``?`` / ``.``. Equal questions from different sources get the same id."""
    normalized = " ".join(question.lower().split()).rstrip("?. ")
    return hashlib.sha1(normalized.encode("utf-8")).hexdigest()[:16]


def trajectory_row(trajectory: Trajectory, row_id: str | None = None) -> dict[str, Any]:
    """One row of :data:`PREPARED_SCHEMA` for ``trajectory`` (``row_id`` overrides its ``id``)."""
    return {
        "id": row_id or trajectory.id,
        "task_id": task_id(trajectory.question),
        "source": trajectory.source,
        "task": trajectory.task,
        "question": trajectory.question,
        "answer": trajectory.answer,
        "prompt": trajectory.prompt,
        "response": render_response(trajectory.steps),
        "num_tool_calls": trajectory.num_tool_calls,
        "trajectory": json.dumps(trajectory.to_dict(), ensure_ascii=False),
    }


def write_prepared(path: str | os.PathLike[str], rows: list[dict[str, Any]]) -> None:
    """Write rows of :data:`PREPARED_SCHEMA` to a parquet file (not atomic by itself: write into a
    directory made with :func:`afm_core.utils.atomic.atomic_dir`, or use ``atomic_path``)."""
    pq.write_table(pa.Table.from_pylist(rows, schema=PREPARED_SCHEMA), path)


def read_prepared(path: str | os.PathLike[str]) -> pa.Table:
    """Read a prepared parquet file, checking its columns and types against :data:`PREPARED_SCHEMA`.

    Raises:
        DataFormatError: a column is missing or has another type (named in the message).
        FileNotFoundError: no such file.
    """
    path = Path(path)
    table = pq.read_table(path)
    for field in PREPARED_SCHEMA:
        if field.name not in table.column_names:
            raise DataFormatError(f"{path}: missing column {field.name!r}")
        actual = table.schema.field(field.name).type
        if actual != field.type:
            raise DataFormatError(f"{path}: column {field.name!r} must be {field.type}, got {actual}")
    return table.select(PREPARED_SCHEMA.names)


def row_trajectory(row: dict[str, Any], path: str | os.PathLike[str] = "", index: int | None = None) -> Trajectory:
    """The :class:`Trajectory` stored in a row's ``trajectory`` column.

    Raises:
        DataFormatError: the JSON is invalid or misses a field (message names the file and row).
    """
    where = f"{path}: row {index}" if index is not None else str(path or "row")
    try:
        return Trajectory.from_dict(json.loads(row["trajectory"]))
    except (ValueError, KeyError, TypeError) as err:
        raise DataFormatError(f"{where}: column 'trajectory': {err}") from None
