"""The SFT data path at long sequence lengths: memory per rank for one step, and what the token cache saves.

    python -m benchmarks.data_path                              # seq 32768, a step of 16 micro batches, 2 ranks
    python -m benchmarks.data_path --seq-length 8192 --ranks 4 --out runs/bench/data_path.json
    python -m benchmarks.data_path --dense-mask                 # with the [b, 1, s, s] mask (HF / DeepSpeed engine)

Prepares the real CoA traces (``conf/data/coa_traces.yaml``) into ``--data-dir`` (default: a fresh temporary
folder, so the shared cache is not touched) and uses the SmolLM2 tokenizer. No model is built. Every figure is
measured in fresh processes, one per rank, all started together like the ranks of one job:

- cold: ``--ranks`` processes open the train and held-out splits of an empty token cache
  (:class:`~afm_core.data.loader.SFTDataModule`): one tokenizes and packs, the others wait on its lock and then
  memory-map the arrays; each reports whether it built the cache, the seconds to open the data, and its RSS;
- each rank then draws one optimizer step of ``--micro-batches`` micro batches of ``--micro-batch-size``
  sequences (``trainer.seq_length=--seq-length``) through :class:`~afm_core.data.loader.StepMicroBatches`, the
  way the pipeline schedule asks for them (built one at a time, dropped after its forward and backward), without
  the dense mask (attention reads ``cu_seqlens``) unless ``--dense-mask``, and reports its peak RSS
  (``ru_maxrss``, the whole process: interpreter, torch, numpy, the mapped pages it touched);
- warm: one more process opens the same data again, as a requeued or resumed job does: it maps the cache.

"requeue saving" is cold open (the builder's) minus warm open: the re-tokenization a restart no longer pays. The
dense ``[b, 1, s, s]`` mask the old path built for every micro batch of a step is given as arithmetic
(``micro batches * b * s * s`` bytes), not run.
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.json_out import write_out

GIB = 1024**3


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _rank(args: dict[str, Any], barrier: Any, results: Any) -> None:
    """One rank: open the data (cold or warm cache), then draw one step of micro batches."""
    import numpy as np

    from afm_core.data.loader import SFTDataModule, StepMicroBatches

    barrier.wait()
    start = time.perf_counter()
    data_dir = Path(args["data_dir"])
    module = SFTDataModule(
        [data_dir / "train.parquet"],
        args["tokenizer_dir"],
        args["seq_length"],
        heldout_paths=[data_dir / "heldout.parquet"],
        dense_mask=args["dense_mask"],
    )
    train, heldout = module.train, module.heldout
    open_s = time.perf_counter() - start
    rss_open = _rss_bytes()
    out = {
        "built": module.built["train"],
        "open_s": open_s,
        "rss_open_gib": rss_open / GIB,
        "train_sequences": len(train),
        "heldout_sequences": len(heldout),
        "mapped": isinstance(train.input_ids, np.memmap),
    }
    if args["micro_batches"]:
        stream = module.train_iterator(seed=0, micro_batch_size=args["micro_batch_size"], dp_rank=0, dp_size=1)
        start = time.perf_counter()
        tokens = 0
        for batch in StepMicroBatches(stream, args["micro_batches"]):
            assert (batch["attention_mask"] is not None) == args["dense_mask"]
            tokens += int(batch["num_target_tokens"])
            del batch  # as after the micro batch's backward
        out.update(step_s=time.perf_counter() - start, step_target_tokens=tokens, rss_after_step_gib=_rss_bytes() / GIB)
    out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB
    results.put(out)


def _run_ranks(count: int, args: dict[str, Any]) -> list[dict[str, Any]]:
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(count), context.Queue()
    ranks = [context.Process(target=_rank, args=(args, barrier, results)) for _ in range(count)]
    for rank in ranks:
        rank.start()
    outcomes = [results.get(timeout=1800) for _ in ranks]
    for rank in ranks:
        rank.join(timeout=60)
    return sorted(outcomes, key=lambda o: not o["built"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-length", type=int, default=32768)
    parser.add_argument("--micro-batches", type=int, default=16, help="micro batches of one step per rank")
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--ranks", type=int, default=2, help="processes opening the data at once")
    parser.add_argument("--dense-mask", action="store_true", help="micro batches carry the dense mask")
    parser.add_argument("--data-dir", type=Path, default=None, help="prepared data (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=None, help="also write the figures as JSON")
    opts = parser.parse_args(argv)

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from afm_core.config import register_schemas
    from afm_core.data.prepare import ensure_prepared
    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
    from afm_core.utils.paths import repo_root

    register_schemas()
    with initialize_config_dir(config_dir=str(repo_root() / "conf"), version_base="1.3"):
        cfg = compose(config_name="sft", overrides=["run_dir=unused"])
    with tempfile.TemporaryDirectory(prefix="afm-data-path-") as temp:
        data_dir = opts.data_dir or Path(temp) / "coa_traces"
        data_cfg = {**OmegaConf.to_container(cfg.data), "out_dir": str(data_dir)}
        ensure_prepared(data_cfg)
        args = {
            "data_dir": str(data_dir),
            "tokenizer_dir": str(ensure_hf_checkpoint(cfg.model)),
            "seq_length": opts.seq_length,
            "micro_batches": opts.micro_batches,
            "micro_batch_size": opts.micro_batch_size,
            "dense_mask": opts.dense_mask,
        }
        cold = _run_ranks(opts.ranks, args)
        (warm,) = _run_ranks(1, {**args, "micro_batches": 0})

    dense_mask_gib = opts.micro_batches * opts.micro_batch_size * opts.seq_length**2 / GIB
    result = {
        "seq_length": opts.seq_length,
        "micro_batches": opts.micro_batches,
        "dense_mask": opts.dense_mask,
        "micro_batch_size": opts.micro_batch_size,
        "ranks": cold,
        "warm": warm,
        "ranks_that_tokenized": sum(o["built"] for o in cold),
        "requeue_saving_s": cold[0]["open_s"] - warm["open_s"],
        "max_peak_rss_gib": max(o["peak_rss_gib"] for o in cold),
        "old_path_dense_masks_per_step_gib": dense_mask_gib,
    }
    print(
        f"data path at seq_length={opts.seq_length}{' with dense masks' if opts.dense_mask else ''}: "
        f"{cold[0]['train_sequences']} train + {cold[0]['heldout_sequences']} held-out packed sequences"
    )
    for i, o in enumerate(cold):
        print(
            f"  rank {i}: {'tokenized+packed' if o['built'] else 'mapped the cache'} in {o['open_s']:.2f} s; "
            f"step of {opts.micro_batches} micro batches in {o['step_s']:.2f} s; RSS after open "
            f"{o['rss_open_gib']:.2f} GiB, after the step {o['rss_after_step_gib']:.2f} GiB, peak "
            f"{o['peak_rss_gib']:.2f} GiB"
        )
    print(f"  ranks that tokenized: {result['ranks_that_tokenized']} of {opts.ranks}")
    print(
        f"  warm open (requeue/resume): {warm['open_s']:.2f} s, mapped={warm['mapped']}; saving vs cold "
        f"{result['requeue_saving_s']:.2f} s"
    )
    print(
        f"  old path: dense masks alone for one step = {opts.micro_batches} x {opts.micro_batch_size} x "
        f"{opts.seq_length}^2 B = {dense_mask_gib:.1f} GiB per rank (all micro batches built at once)"
    )
    return write_out(opts.out, result)


if __name__ == "__main__":
    main(sys.argv[1:])
