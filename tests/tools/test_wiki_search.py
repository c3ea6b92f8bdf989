"""wiki_search end to end: the real retrieval server over HotpotQA-500 and the real client (acceptance d)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from afm_core.tools import ToolLimits, ToolPool, WikiSearchTool
from afm_core.tools.http import ToolHttp
from afm_core.tools.launcher import ServerGroup
from afm_core.tools.metrics import ToolMetrics
from afm_core.tools.retrieval import load_corpus


@pytest.fixture(scope="module")
def hotpot(data_dir):
    folder = data_dir / "mhqa" / "hotpotqa500"
    questions = [json.loads(line) for line in (folder / "questions.jsonl").open()]
    return folder / "corpus.jsonl", questions


@pytest.fixture(scope="module")
def wiki_url(hotpot, tmp_path_factory):
    corpus, _ = hotpot
    with ServerGroup(log_dir=tmp_path_factory.mktemp("wiki")) as group:
        group.launch("wiki", ["--corpus", str(corpus), "--topk", "3"])
        yield group.wait()["wiki"]


def test_gold_paragraph_in_top5_for_90_percent(hotpot, wiki_url):
    _, questions = hotpot
    tool = WikiSearchTool(wiki_url, topk=5)

    async def main():
        async with aiohttp.ClientSession() as session:
            http = ToolHttp(session, ToolLimits(), ToolMetrics())
            return await asyncio.gather(*(tool.retrieve(q["question"], http) for q in questions))

    all_hits = asyncio.run(main())
    found = sum(any(hit["document"]["id"] in q["gold_doc_ids"] for hit in hits) for q, hits in zip(questions, all_hits))
    assert len(questions) == 500 and all(len(h) == 5 for h in all_hits)
    recall = found / len(questions)
    print(f"wiki_search BM25 recall@5 (any gold paragraph): {recall:.3f}")
    assert recall >= 0.90


def test_observation_format_and_batch_api(wiki_url):
    async def main():
        async with ToolPool([WikiSearchTool(wiki_url)]) as pool:
            observation = await pool.call("wiki_search", "Shirley Temple Chief of Protocol")
        async with aiohttp.ClientSession() as session:
            async with session.post(
                wiki_url + "/retrieve", json={"queries": ["Shirley Temple", "Kiss and Tell"], "topk": 2}
            ) as r:
                batch = await r.json()
            async with session.post(wiki_url + "/retrieve", json={"queries": "not a list"}) as r:
                bad = (r.status, await r.json())
        return observation, batch, bad

    observation, batch, bad = asyncio.run(main())
    blocks = observation.split("\n---\n")
    assert len(blocks) == 3 and blocks[0].startswith('Doc 1 (Title: "Shirley Temple")\nShirley Temple Black')
    assert [len(row) for row in batch["result"]] == [2, 2] and set(batch["result"][0][0]) == {"id", "title", "contents"}
    assert bad[0] == 400 and "'queries'" in bad[1]["error"]


def test_corpus_errors_name_file_line_and_field(tmp_path):
    bad = tmp_path / "corpus.jsonl"
    bad.write_text('{"id": "1", "contents": "a"}\n{"id": "2"}\n')
    with pytest.raises(ValueError, match=r"corpus.jsonl:2: field 'contents'"):
        load_corpus(bad)
    bad.write_text('{"id": "1", "contents": "a"}\nnot json\n')
    with pytest.raises(ValueError, match=r"corpus.jsonl:2: invalid JSON"):
        load_corpus(bad)
    bad.write_text('{"id": "1", "contents": "a"}\n{"id": "1", "contents": "b"}\n')
    with pytest.raises(ValueError, match=r"corpus.jsonl:2: field 'id' repeats"):
        load_corpus(bad)


def test_dense_retriever_on_a_tiny_encoder(tmp_path):
    """The optional dense path end to end with a tiny random BERT (the plumbing, not retrieval quality)."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    from afm_core.tools.retrieval import DenseRetriever, Document
    from afm_core.tools.servers.wiki import build_app
    from tests.tools.conftest import serve_app

    docs = [
        Document("a", "Alpha", "Alpha\nthe alpha river runs north"),
        Document("b", "Beta", "Beta\nbeta mountains are tall and cold"),
        Document("c", "Gamma", "Gamma\ngamma rays come from space"),
    ]
    words = sorted({w for d in docs for w in d.contents.lower().split()})
    vocab = {token: i for i, token in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words])}
    BertTokenizerFast(vocab=vocab).save_pretrained(tmp_path)
    config = BertConfig(
        vocab_size=len(words) + 5, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    BertModel(config).save_pretrained(tmp_path)

    retriever = DenseRetriever(docs, tmp_path, query_prefix="", passage_prefix="")
    [[(top, score), *rest]] = retriever.search([docs[1].contents], 3)
    assert top.id == "b" and score == pytest.approx(1.0, abs=1e-5) and len(rest) == 2
    assert all(score >= s for _, s in rest)

    async def main():
        async with serve_app(build_app(retriever)) as url:
            async with aiohttp.ClientSession() as session:
                async with session.get(url + "/health") as r:
                    health = await r.json()
                async with session.post(
                    url + "/retrieve", json={"queries": [docs[2].contents], "topk": 1, "return_scores": True}
                ) as r:
                    answer = await r.json()
        return health, answer

    health, answer = asyncio.run(main())
    assert health["retriever"] == "dense" and answer["result"][0][0]["document"]["id"] == "c"
