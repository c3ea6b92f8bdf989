"""Per-GPU memory estimate for Megatron-core SFT of a dense decoder (Llama / Qwen2 family).

Used to document the paper recipes (``conf/recipe/*.yaml``) and to sanity-check a parallel layout before
submitting it: ``python -m afm_core.train.memory recipe=afm_web_sft_32b``.

Model states (mixed precision with Megatron's DDP and distributed optimizer):
  * bf16 weights: 2 bytes/param, fp32 main-grad buffer: 4 bytes/param (Megatron accumulates grads in fp32);
  * fp32 master weights + Adam m and v: 12 bytes/param, sharded over data-parallel ranks by the distributed
    optimizer (ZeRO-1; Rajbhandari et al. 2020, "ZeRO", Sec. 5.1: 16 bytes/param with Adam).
Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Sec. 4):
  * one layer with tensor + sequence parallelism and flash attention keeps ``34 * s * b * h / t`` bytes
    (their Eq. 5 with the ``5as/h`` attention-score term removed, as flash attention does not store scores);
  * with full recomputation a layer keeps only its input, ``2 * s * b * h / t`` bytes (Sec. 4.1), and one
    layer's full activations are live during its recomputation;
  * the 1F1B pipeline schedule keeps ``pp`` micro batches in flight on the first stage (Sec. 4.2.3);
  * the output layer holds bf16 logits and fp32 cross-entropy workspace: ``6 * s * b * V / t`` bytes.
This is an estimate (no allocator fragmentation, CUDA context ~1 GiB, or communication buffers); budget
10-15% headroom on top.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

GIB = 1024**3


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU on the most loaded pipeline stage (the first one, or the last for the logits)."""

    params_per_gpu: int
    weights_and_grads: int
    optimizer: int
    activations: int
    logits: int

    @property
    def total(self) -> int:
        return self.weights_and_grads + self.optimizer + self.activations + self.logits

    def as_gib(self) -> dict[str, float]:
        fields = {
            "weights_and_grads": self.weights_and_grads,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "logits": self.logits,
            "total": self.total,
        }
        return {k: round(v / GIB, 1) for k, v in fields.items()}


def count_params(model: Mapping[str, Any]) -> dict[str, int]:
    """Parameter counts of a Llama/Qwen2 decoder from a ``conf/model`` preset.

    Returns ``{"per_layer", "embedding", "output", "total"}``; ``output`` is 0 with tied embeddings.
    """
    h, f, layers = model["hidden_size"], model["ffn_hidden_size"], model["num_layers"]
    heads, groups, vocab = model["num_attention_heads"], model["num_query_groups"], model["vocab_size"]
    head_dim = h // heads
    qkv_out = h + 2 * groups * head_dim
    per_layer = h * qkv_out + (qkv_out if model.get("qkv_bias") else 0)  # fused QKV (+ bias)
    per_layer += h * h  # attention output projection
    per_layer += 3 * h * f  # SwiGLU: gate, up, down
    per_layer += 2 * h  # two RMSNorms
    embedding = vocab * h
    output = 0 if model.get("tied_embeddings") else vocab * h
    total = layers * per_layer + embedding + output + h  # + final norm
    return {"per_layer": per_layer, "embedding": embedding, "output": output, "total": total}


def estimate_memory(
    model: Mapping[str, Any],
    *,
    tp: int,
    pp: int,
    dp: int,
    seq_length: int,
    micro_batch_size: int = 1,
    recompute: str | None = "full",
    distributed_optimizer: bool = True,
) -> MemoryEstimate:
    """Estimate bytes per GPU for bf16 SFT with the given parallel layout (see the module docstring).

    Args:
        model: a ``conf/model`` preset (architecture keys).
        tp, pp, dp: tensor, pipeline and data parallel sizes (context parallelism is not implemented).
        seq_length: tokens per sequence (the cutoff); micro_batch_size: sequences per micro batch.
        recompute: ``"full"`` (store layer inputs only) or ``None``/``"selective"`` (store all activations;
            selective recompute only drops the attention scores, which flash attention never stores).
        distributed_optimizer: shard the 12 bytes/param of optimizer state over ``dp``.
    Raises:
        ValueError: if the layers do not split evenly over ``pp`` or heads over ``tp``.
    """
    if model["num_layers"] % pp:
        raise ValueError(f"num_layers={model['num_layers']} is not divisible by pp={pp}")
    if model["num_attention_heads"] % tp or model["num_query_groups"] % tp:
        raise ValueError(f"attention heads/groups are not divisible by tp={tp}")
    counts = count_params(model)
    layers_per_stage = model["num_layers"] // pp
    first_stage = layers_per_stage * counts["per_layer"] + counts["embedding"]
    if pp == 1:
        first_stage += counts["output"]
    params = first_stage // tp
    weights_and_grads = 6 * params
    optimizer = 12 * params // (dp if distributed_optimizer else 1)

    s, b, h = seq_length, micro_batch_size, model["hidden_size"]
    full_layer = 34 * s * b * h // tp
    in_flight = pp  # 1F1B: the first stage holds pp micro batches
    if recompute == "full":
        activations = in_flight * layers_per_stage * (2 * s * b * h // tp) + full_layer
    else:
        activations = in_flight * layers_per_stage * full_layer
    logits = 6 * s * b * model["vocab_size"] // tp
    return MemoryEstimate(params, weights_and_grads, optimizer, activations, logits)


def estimate_from_config(cfg: Any) -> MemoryEstimate:
    """Estimate from a composed ``conf/sft.yaml`` (model, parallel, trainer and cluster groups)."""
    model_parallel = cfg.parallel.tp * cfg.parallel.pp
    if cfg.cluster.name == "slurm":
        dp = max(1, cfg.cluster.nodes * cfg.cluster.tasks_per_node // model_parallel)
    else:
        dp = cfg.cluster.dp
    return estimate_memory(
        cfg.model,
        tp=cfg.parallel.tp,
        pp=cfg.parallel.pp,
        dp=dp,
        seq_length=cfg.trainer.seq_length,
        micro_batch_size=cfg.trainer.micro_batch_size,
        recompute=cfg.parallel.recompute,
        distributed_optimizer=cfg.parallel.distributed_optimizer,
    )


def main(argv: list[str]) -> None:
    """Print the estimate for a config composed from ``conf/sft.yaml`` with Hydra overrides."""
    from hydra import compose, initialize_config_dir

    from afm_core.utils.paths import repo_root

    with initialize_config_dir(config_dir=str(repo_root() / "conf"), version_base="1.3"):
        cfg = compose(config_name="sft", overrides=argv)
    est = estimate_from_config(cfg)
    print(
        f"model={cfg.model.name} tp={cfg.parallel.tp} pp={cfg.parallel.pp} "
        f"seq_length={cfg.trainer.seq_length} params/GPU={est.params_per_gpu / 1e9:.2f}B"
    )
    for key, gib in est.as_gib().items():
        print(f"  {key:>18}: {gib:6.1f} GiB")


if __name__ == "__main__":
    main(sys.argv[1:])
