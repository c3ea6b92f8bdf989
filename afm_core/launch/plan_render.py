"""The plan as ``jobs.plan`` prints it (one table: per-rank memory, the engine, the verdict per GPU size, the
checkpoint, notes) and as ``plan.json``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from afm_core.launch.plan_estimates import GPU_OVERHEAD_BYTES, as_gib
from afm_core.utils.atomic import atomic_write_text


def render(plan: Mapping[str, Any]) -> str:
    """The plan as the table ``jobs.plan`` prints."""
    lay = plan["layout"]
    lines = [
        f"plan: {plan['app']} {plan['model']} ({plan['total_params'] / 1e9:.2f}B params), world {lay['world_size']} "
        f"= tp {lay['tp']} x pp {lay['pp']} x cp {lay['cp']} x dp {lay['dp']}, "
        f"{'bf16' if lay['bf16'] else 'fp32'} on {'GPU' if lay['on_gpu'] else 'CPU'}, seq {lay['seq_length']} x "
        f"micro batch {lay['micro_batch_size']}, {lay['num_microbatches']} micro batches/step, recompute "
        f"{lay['recompute']}, sequence parallel {lay['sequence_parallel']}, distributed optimizer "
        f"{lay['distributed_optimizer']}",
    ]
    lines += stage_lines(plan["stages"])
    if "vllm" in plan:
        v = plan["vllm"]
        lines.append(
            f"  vLLM: TP {v['tensor_parallel_size']}, weights {as_gib(v['weights_bytes'])} GiB/GPU, KV "
            f"{v['kv_bytes_per_token'] / 2**10:.0f} KiB/token, max_model_len {v['max_model_len']}, "
            f"gpu_memory_utilization {v['gpu_memory_utilization']}; sleep level {v['sleep_level']} frees "
            f"{v['sleep_frees']}"
        )
        for gb, e in v["per_gpu"].items():
            lines.append(
                f"    {gb} GB GPU: claims {as_gib(e['claimed_bytes'])} GiB, KV {as_gib(e['kv_cache_bytes'])} GiB = "
                f"{e['sequences_at_max_model_len']} sequences of max_model_len"
            )
        if "lora" not in plan:
            lines.append(f"  weight sync: {len(plan['weight_sync'])} HF tensors, each sent once (see plan.json)")
    for gb, verdict in plan["gpus"].items():
        phases = ", ".join(f"{k} {v}" for k, v in verdict["phases_gib"].items())
        state = "fits" if verdict["fits"] else "does not fit (" + "; ".join(verdict["why_not"]) + ")"
        lines.append(
            f"  {gb} GB GPU ({verdict['gpu_gib']} GiB): peak {verdict['peak_gib']} GiB ({phases}, + "
            f"{as_gib(GPU_OVERHEAD_BYTES)} overhead): {state}"
        )
    if plan.get("lora"):
        lines += lora_lines(plan)
    if plan.get("host"):
        h = plan["host"]
        lines.append(
            f"  host memory per node for colocation: {h['peak_gib']} GiB ("
            + ", ".join(f"{k} {as_gib(v)}" for k, v in h["per_node_bytes"].items())
            + ")"
        )
    c = plan["checkpoint"]
    write = f"~{c['write_s']:.0f} s at {c['write_gb_s_per_node']:.3g} GB/s per node, {c['write_speed_source']}"
    what = "the adapters with their optimizer state" if plan.get("lora") else "with optimizer state"
    lines.append(f"  checkpoint: {c['gb']} GB {what} ({write}); HF export {c['hf_export_gb']} GB")
    lines += [f"  note: {note}" for note in plan["notes"]]
    if plan["fits"] is not None:
        lines.append(f"verdict: {'fits' if plan['fits'] else 'does not fit'} on {plan['target_gpu_gb']:g} GB GPUs")
    if plan.get("suggestion"):
        lines.append("  would fit: " + " ".join(plan["suggestion"]))
    return "\n".join(lines)


def stage_lines(stages: list[Mapping[str, Any]]) -> list[str]:
    """The per-rank table of ``stages`` (GiB), with the KL reference's column when a row has one."""
    ref = any("reference" in row["gib"] for row in stages)
    lines = [
        f"  {'rank':>10} {'layers':>6} {'params':>9} {'grads':>9} {'optimizer':>9} "
        + (f"{'reference':>9} " if ref else "")
        + f"{'activ.':>9} {'logits':>9} {'train':>9}  GiB"
    ]
    for row in stages:
        g = row["gib"]
        lines.append(
            f"  {'pp' + str(row['pp_rank']) + ' tp*':>10} {row['layers']:>6} {g['params']:>9.2f} {g['grads']:>9.2f} "
            f"{g['optimizer']:>9.2f} "
            + (f"{g.get('reference', 0.0):>9.2f} " if ref else "")
            + f"{g['activations']:>9.2f} {g['logits']:>9.2f} {g['train']:>9.2f}"
        )
    return lines


def lora_lines(plan: Mapping[str, Any]) -> list[str]:
    """The LoRA section: what is trained, the full layout's table, both peaks per GPU size, the weight sync."""
    lo = plan["lora"]
    lines = [
        f"  LoRA: rank {lo['rank']}, alpha {lo['alpha']:g} on {', '.join(lo['target_modules'])}: "
        f"{lo['adapter_params'] / 1e6:.2f}M adapter params ({100 * lo['adapter_fraction']:.2f}% of the model; "
        f"{lo['rank_adapter_params'] / 1e6:.2f}M on the largest rank) with fp32 master weights, grads and Adam "
        f"moments; the base frozen in the params dtype (no grads, no optimizer state)"
        + ("; the KL reference is the base with the adapters disabled (no copy)" if lo["full_reference_gib"] else ""),
        "  the full layout of the same parallel settings (every parameter trained):",
        *stage_lines(lo["full_stages"]),
    ]
    for gb, row in lo["per_gpu"].items():
        full = "fits" if row["full_fits"] else "does not fit"
        lines.append(
            f"  {gb} GB GPU per-GPU peak: LoRA {row['lora_peak_gib']} GiB vs full {row['full_peak_gib']} GiB "
            f"({full}): {row['ratio']:.2f}x"
        )
    if plan["app"] == "rl":
        w = lo["weight_sync"]
        lines.append(
            f"  weight sync: the adapters only, {w['tensors']} tensors, {w['bytes'] / 1e6:.1f} MB vs "
            f"{w['full_tensors']} HF tensors, {w['full_bytes'] / 1e9:.2f} GB of full weights (bf16): "
            f"{100 * w['ratio']:.2f}% of the bytes"
        )
    lines.append(f"  adapter export (PEFT, bf16): {lo['adapter_export_mb']} MB")
    return lines


def write_plan(plan: Mapping[str, Any], path: str | Path) -> Path:
    """Write ``plan`` as indented JSON to ``path`` (atomic; parent folders made); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(plan, indent=1, default=str) + "\n")
    return path
