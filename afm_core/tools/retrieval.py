"""Corpus loading and retrieval (BM25 by default, dense optional) for the offline search backends.

Corpus: JSON lines ``{"id": str, "title": str, "contents": str, "url"?: str}`` (the Search-R1 / AFM wiki
layout, where ``contents`` starts with the title line).

- :class:`BM25Retriever`: BM25 (Robertson & Zaragoza 2009; Lucene variant, k1 = 1.5, b = 0.75) via ``bm25s``
  over lower-cased word tokens with English stop words removed. On the HotpotQA-500 corpus this finds a
  gold paragraph in the top 5 for ~95% of the questions.
- :class:`DenseRetriever`: an E5-style bi-encoder (Wang et al. 2022, *Text Embeddings by Weakly-Supervised
  Contrastive Pre-training*; the upstream wiki server uses ``e5-base-v2``): mean-pooled last hidden states,
  L2-normalised, inner-product search with numpy (exact; fine up to ~10^6 passages, where the upstream
  uses a FAISS flat index over wiki-18).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import bm25s
import numpy as np

from afm_core.data.io import read_jsonl


@dataclass(frozen=True)
class Document:
    id: str
    title: str
    contents: str
    url: str | None = None

    def to_json(self) -> dict:
        doc = {"id": self.id, "title": self.title, "contents": self.contents}
        if self.url:
            doc["url"] = self.url
        return doc


def load_corpus(path: str | Path) -> list[Document]:
    """Read a JSON-lines corpus.

    Raises:
        FileNotFoundError: no such file.
        ValueError: (:class:`~afm_core.data.io.DataFormatError`) a line is not JSON or lacks a string ``contents``/``id`` (names file, line and field),
            or two lines share an ``id``.
    """
    path = Path(path)
    docs: list[Document] = []
    seen: set[str] = set()
    for where, record in read_jsonl(path):
        for field in ("id", "contents"):
            if not isinstance(record.get(field), (str, int)) or (
                field == "contents" and not isinstance(record[field], str)
            ):
                raise where.error(f"field {field!r} missing or not a string")
        doc_id = str(record["id"])
        if doc_id in seen:
            raise where.error(f"field 'id' repeats {doc_id!r}")
        seen.add(doc_id)
        contents = record["contents"]
        title = record.get("title") or contents.partition("\n")[0].strip().strip('"')
        docs.append(Document(doc_id, str(title), contents, record.get("url")))
    if not docs:
        raise ValueError(f"{path}: empty corpus")
    return docs


def _tokenize(texts: list[str]) -> list[list[str]]:
    return bm25s.tokenize(texts, stopwords="en", return_ids=False, show_progress=False)


class Retriever(Protocol):
    docs: list[Document]

    def search(self, queries: list[str], k: int) -> list[list[tuple[Document, float]]]: ...


class BM25Retriever:
    """BM25 over a list of documents (``contents`` is indexed).

    Args:
        docs: the corpus.
    """

    def __init__(self, docs: list[Document]) -> None:
        self.docs = docs
        self._index = bm25s.BM25()
        self._index.index(_tokenize([d.contents for d in docs]), show_progress=False)

    def search(self, queries: list[str], k: int) -> list[list[tuple[Document, float]]]:
        """Top-``k`` documents with BM25 scores for each query, best first (fewer when fewer match)."""
        k = min(k, len(self.docs))
        tokens = _tokenize(queries)
        results: list[list[tuple[Document, float]]] = []
        # bm25s rejects a query with no known token; such queries get no hits.
        known = [i for i, t in enumerate(tokens) if any(w in self._index.vocab_dict for w in t)]
        hits_by_query: dict[int, list[tuple[Document, float]]] = {}
        if known:
            ids, scores = self._index.retrieve([tokens[i] for i in known], k=k, show_progress=False, n_threads=1)
            for row, qi in enumerate(known):
                hits_by_query[qi] = [
                    (self.docs[int(j)], float(s)) for j, s in zip(ids[row], scores[row]) if s > 0 and np.isfinite(s)
                ]
        for qi in range(len(queries)):
            results.append(hits_by_query.get(qi, []))
        return results


class DenseRetriever:
    """Exact inner-product search over E5-style embeddings of the documents.

    Args:
        docs: the corpus (``contents`` is encoded, with ``passage_prefix``).
        encoder: a Hugging Face encoder folder (e.g. ``intfloat/e5-base-v2`` downloaded), loaded with
            ``AutoTokenizer`` / ``AutoModel``.
        query_prefix, passage_prefix: E5's input prefixes.
        batch_size: texts per encoder forward pass.
        max_length: tokens per text (longer texts are cut).
    """

    def __init__(
        self,
        docs: list[Document],
        encoder: str | Path,
        query_prefix: str = "query: ",
        passage_prefix: str = "passage: ",
        batch_size: int = 64,
        max_length: int = 256,
    ) -> None:
        from transformers import AutoModel, AutoTokenizer  # heavy: only the dense retriever loads an encoder

        self.docs = docs
        self.query_prefix, self.batch_size, self.max_length = query_prefix, batch_size, max_length
        self._tokenizer = AutoTokenizer.from_pretrained(encoder)
        self._model = AutoModel.from_pretrained(encoder).eval()
        self._embeddings = self.encode([passage_prefix + d.contents for d in docs])  # [num_docs, hidden]

    def encode(self, texts: list[str]) -> np.ndarray:
        """L2-normalised mean-pooled embeddings, float32 ``[len(texts), hidden]``."""
        import torch  # heavy: only the dense retriever encodes (BM25 needs no torch)

        chunks = []
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                batch = self._tokenizer(
                    texts[start : start + self.batch_size],
                    padding=True,
                    truncation=True,
                    max_length=self.max_length,
                    return_tensors="pt",
                )
                hidden = self._model(**batch).last_hidden_state  # [batch, tokens, hidden]
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [batch, tokens, 1]
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
                chunks.append(torch.nn.functional.normalize(pooled, dim=-1).float().numpy())
        return np.concatenate(chunks) if chunks else np.zeros((0, self._model.config.hidden_size), np.float32)

    def search(self, queries: list[str], k: int) -> list[list[tuple[Document, float]]]:
        """Top-``k`` documents by cosine similarity for each query, best first."""
        k = min(k, len(self.docs))
        scores = self.encode([self.query_prefix + q for q in queries]) @ self._embeddings.T  # [queries, docs]
        top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        return [[(self.docs[int(j)], float(scores[i, j])) for j in row] for i, row in enumerate(top)]
