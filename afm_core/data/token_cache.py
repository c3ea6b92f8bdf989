"""Tokenized and packed SFT sequences cached next to the prepared parquet: built by one process, mapped by all.

``<prepared dir>/tokenized/<key>/`` holds :meth:`PackedSequences.save <afm_core.data.packing.PackedSequences.save>`
arrays and a ``meta.json`` recording what the key hashes: the parquet files (name, size, mtime), ``seq_length``,
packing, observation masking, the system prompt, a fingerprint of the tokenizer (its files, or its vocabulary,
merges, chat template and special tokens) and of the tokenization and packing code. A job that starts again
(requeue, resume) or another rank maps the arrays instead of tokenizing. The first process to take the
directory's ``flock`` builds and publishes the cache atomically; the others wait on the lock, then map it.
Re-preparing the data replaces the prepared directory and the caches inside it.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from afm_core.data import packing, tokenize
from afm_core.data.packing import PackedSequences
from afm_core.utils.atomic import atomic_dir

log = logging.getLogger(__name__)

CACHE_VERSION = 1
CACHE_DIR_NAME = "tokenized"
META_FILE = "meta.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of what decides token ids: for a checkpoint directory, its tokenizer files (``TOKENIZER_FILES``);
    for a loaded fast tokenizer, its serialized model (vocabulary, merges, normalizer, added tokens), chat
    template and special tokens.

    Raises:
        FileNotFoundError: a directory without any tokenizer file.
    """
    digest = hashlib.sha256()
    if isinstance(tokenizer, (str, Path)):
        files = [Path(tokenizer) / name for name in TOKENIZER_FILES if (Path(tokenizer) / name).is_file()]
        if not files:
            raise FileNotFoundError(f"{tokenizer}: no tokenizer file ({', '.join(TOKENIZER_FILES)})")
        for path in files:
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
        return digest.hexdigest()
    digest.update(type(tokenizer).__name__.encode())
    digest.update(tokenizer.backend_tokenizer.to_str().encode())
    digest.update(str(tokenizer.chat_template).encode())
    digest.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def code_fingerprint() -> str:
    """sha256 of the source of the tokenization and packing modules, so that a change to either rebuilds."""
    return hashlib.sha256("".join(inspect.getsource(m) for m in (tokenize, packing)).encode()).hexdigest()


def cache_inputs(paths: Sequence[str | Path], tokenizer: Any, **settings: Any) -> dict[str, Any]:
    """What a cache entry is keyed by (written to its ``meta.json``).

    Raises:
        FileNotFoundError: a parquet file is missing.
    """
    files = []
    for path in map(Path, paths):
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such parquet file")
        stat = path.stat()
        files.append({"name": path.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns})
    return {
        "version": CACHE_VERSION,
        "files": files,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "code": code_fingerprint(),
        **settings,
    }


def cached_packed(
    root: str | Path, inputs: dict[str, Any], build: Callable[[], PackedSequences]
) -> tuple[PackedSequences, bool]:
    """The packed sequences for ``inputs`` under ``root``, built with ``build()`` by the first caller only.

    Returns:
        ``(memory-mapped sequences, whether this call built them)``.
    """
    from afm_core.data.prepare import dir_lock  # prepare loads the converters and graders: a rank only reads data

    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:20]
    entry = Path(root) / key
    with dir_lock(entry):
        built = not (entry / META_FILE).is_file()
        if built:
            start = time.perf_counter()
            packed = build()
            with atomic_dir(entry) as temp:
                packed.save(temp)
                (temp / META_FILE).write_text(json.dumps(inputs, indent=1) + "\n", encoding="utf-8")
            log.info(
                "tokenized and packed %d sequences into %s in %.1f s", len(packed), entry, time.perf_counter() - start
            )
    return PackedSequences.load(entry), built
