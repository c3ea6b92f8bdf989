"""Tokenization speed, packing efficiency and observation-mask correctness on the prepared CoA traces.

    .venv/bin/python -m benchmarks._packing_report [--seq-lengths 512 1024 2048]

Prepares ``conf/data/coa_traces.yaml`` when needed (cached under ``$AFM_CACHE``), tokenizes the train
split with the SmolLM2 tokenizer, and prints:

* tokenization time (examples / s);
* per sequence length: packed (first-fit-decreasing) vs unpacked sequences, efficiency (non-pad
  share) and target share (trained-token share);
* upstream marker-scan masking (LLaMA-Factory-AFM) vs ours, per example: dropped by upstream as
  invalid, or kept with observation tokens left trained.
"""

from __future__ import annotations

import argparse
import time

import pyarrow.parquet as pq
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from afm_core.coa.render import observation_spans
from afm_core.data.loader import read_sft_examples
from afm_core.data.packing import pack_examples, pad_examples
from afm_core.data.prepare import ensure_prepared
from afm_core.data.tokenize import IGNORE_INDEX, upstream_marker_mask
from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
from afm_core.utils.paths import repo_root


def _upstream_comparison(tokenizer, responses: list[str]) -> dict[str, int]:
    """Counts over responses with observations: upstream invalid (dropped), and kept but leaking."""
    counts = {"with_observations": 0, "upstream_dropped": 0, "upstream_kept_leaking": 0, "leaked_tokens": 0}
    for response in responses:
        spans = observation_spans(response)
        if not spans:
            continue
        counts["with_observations"] += 1
        encoded = tokenizer(response, add_special_tokens=False, return_offsets_mapping=True, split_special_tokens=True)
        labels, valid = upstream_marker_mask(tokenizer, encoded["input_ids"])
        if not valid:
            counts["upstream_dropped"] += 1
            continue
        leaked = sum(
            label != IGNORE_INDEX and any(s < end and start < e for s, e in spans)
            for (start, end), label in zip(encoded["offset_mapping"], labels)
        )
        counts["upstream_kept_leaking"] += leaked > 0
        counts["leaked_tokens"] += leaked
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lengths", type=int, nargs="+", default=[512, 1024, 2048])
    args = parser.parse_args()

    data_dir = ensure_prepared(OmegaConf.load(repo_root() / "conf" / "data" / "coa_traces.yaml"))
    tokenizer = AutoTokenizer.from_pretrained(ensure_hf_checkpoint("smollm2-135m"))
    train = data_dir / "train.parquet"

    start = time.perf_counter()
    examples = read_sft_examples([train], tokenizer)
    seconds = time.perf_counter() - start
    lengths = sorted(len(e) for e in examples)
    print(f"data: {train}")
    print(
        f"tokenized {len(examples)} examples in {seconds:.2f} s ({len(examples) / seconds:.0f} examples/s); "
        f"tokens per example: median {lengths[len(lengths) // 2]}, max {lengths[-1]}"
    )

    print("\n| seq_length | mode | sequences | truncated | dropped | efficiency | target share |")
    print("|---|---|---|---|---|---|---|")
    for seq_length in args.seq_lengths:
        for mode, build in (("packed", pack_examples), ("unpacked", pad_examples)):
            stats = build(examples, seq_length).stats
            print(
                f"| {seq_length} | {mode} | {stats.num_sequences} | {stats.num_truncated} | {stats.num_dropped} | "
                f"{stats.efficiency:.3f} | {stats.target_share:.3f} |"
            )

    responses = pq.read_table(train, columns=["response"]).column("response").to_pylist()
    print(f"\nupstream marker scan vs character spans: {_upstream_comparison(tokenizer, responses)}")


if __name__ == "__main__":
    main()
