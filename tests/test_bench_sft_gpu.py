"""benchmarks.sft_gpu: its packed steps drawn from the committed CoA length histogram, and its CPU dry run (our
engine with the compiled elementwise kernels CUDA runs, and HF's, on tiny-llama, each in a process of its own,
from the same initial weights; the JSON report)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest


def test_packed_steps_draw_new_documents_every_step_from_the_histogram():
    from benchmarks.sft_gpu import LENGTHS_PATH, packed_steps

    histogram = json.loads(LENGTHS_PATH.read_text())
    assert histogram["documents"] > 1000 and 0 < histogram["target_share"] < 1
    data = packed_steps(histogram, steps=3, global_batch=2, seq_length=4096, vocab_size=1000)
    assert len(data) == 6 and data.stats.efficiency > 0.9  # first-fit-decreasing fills the sequences
    lengths = [np.diff(offsets).tolist() for offsets in data.cu_seqlens]
    steps = [sorted(lengths[2 * i] + lengths[2 * i + 1]) for i in range(3)]
    assert all(a != b for a, b in itertools.combinations(steps, 2))  # new document lengths every step
    assert max(max(row) for row in lengths) < len(histogram["counts"]) * histogram["bin_tokens"]
    share = data.stats.num_target_tokens / data.stats.num_tokens
    assert abs(share - histogram["target_share"]) < 0.02


@pytest.mark.slow  # the compiled engine has inductor compile its layers on the CPU: ~40 s on two AVX2 cores
def test_sft_gpu_dry_run_reports_both_engines_from_the_same_weights(tmp_path):
    from benchmarks import sft_gpu

    out = tmp_path / "sft_gpu.json"
    argv = [
        "--dry-run",
        "--engines",
        "ours-compiled",
        "hf",
        "--profile",
        "--trace-dir",
        str(tmp_path),
        "--out",
        str(out),
    ]
    assert sft_gpu.main(argv) == 0  # 1: an engine failed, or the first-step losses differ beyond the fp32 bound
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["versions"]["torch"] and report["matmul_peak_tflops"] > 0
    ours, hf = report["engines"]["ours-compiled"], report["engines"]["hf"]
    assert ours["attention"] == "cpu" and ours["compiled_elementwise"]  # the thd kernel, torch.compile'd norms
    assert {row["name"] for row in ours["memory_vs_plan"]} >= {"train peak", "device peak"}
    for engine in (ours, hf):
        assert engine["input_tokens_per_s"] > 0 and engine["tflops"] > 0 and engine["mfu_datasheet"] is None
        assert np.isfinite(engine["losses"]).all()
        assert engine["profile"]["cpu_s"] > 0 and "aten::mm" in engine["profile"]["by_cpu_time"]
        assert (tmp_path / f"sft_gpu_trace_{engine['engine']}.json.gz").stat().st_size > 0
    # the bound of the precision that ran (auto: fp32 here, bf16 on a CPU with native bf16)
    precision = "bf16" if ours["precision"] == "bfloat16" else "fp32"
    assert (
        report["first_step_loss_gap"]["ours-compiled"] <= sft_gpu.LOSS_TOLERANCE[precision] == report["loss_tolerance"]
    )
    assert report["ratio_over_hf"]["ours-compiled"] > 0 and not report["failed"]
