"""A compute roofline for decoding on this machine: the tokens/s a decoder-only model could generate if every
generated token cost only its matmul FLOPs at this machine's measured dense-matmul speed.

    .venv/bin/python -m benchmarks.roofline                         # SmolLM2-135M, 128 sequences, 2 threads
    .venv/bin/python -m benchmarks.roofline --batch 64 --context 400 --threads 1

Per generated token a decoder with ``L`` layers, hidden ``h``, ``n_q`` query and ``n_kv`` key/value heads of size
``d``, MLP width ``I`` (gated: three matrices) and vocabulary ``V`` spends (multiply-add = 2 FLOP; Kaplan et al.
2020, "Scaling Laws for Neural Language Models", Table 1, with GQA and a gated MLP):

- linear layers: ``2 L (h (n_q + 2 n_kv) d + n_q d h + 3 h I) + 2 h V`` (the LM head included);
- attention over a context of ``c`` tokens: ``4 L n_q d c`` (``q k^T`` and ``p v``).

The speed of each linear layer is measured with ``torch.nn.functional.linear`` on ``[batch, in]`` activations (the
decode step's shape: one new token per sequence in flight) in fp32 and bf16, with the engine's thread count; the bound
takes the faster dtype per shape, and the fastest measured rate for the attention FLOPs (an optimistic bound: decode
attention reads the KV cache and is memory-bound in practice). Memory traffic is not modelled, so the bound is an upper
limit, not a prediction.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class DecoderShape:
    """The sizes of a decoder-only transformer that set its FLOP per token (from an HF ``config.json``)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> DecoderShape:
        """From an HF Llama/Qwen2/Mistral-style ``config.json`` dict.

        Raises:
            KeyError: a size the FLOP count needs is missing (names it).
        """
        heads = config["num_attention_heads"]
        return cls(
            layers=config["num_hidden_layers"],
            hidden=config["hidden_size"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            intermediate=config["intermediate_size"],
            vocab=config["vocab_size"],
        )

    def linear_shapes(self) -> dict[str, tuple[int, int, int]]:
        """``{name: (in_features, out_features, count per token)}`` of every linear layer a token passes."""
        h, d = self.hidden, self.head_dim
        return {
            "qkv": (h, (self.heads + 2 * self.kv_heads) * d, self.layers),
            "o": (self.heads * d, h, self.layers),
            "gate_up": (h, 2 * self.intermediate, self.layers),
            "down": (self.intermediate, h, self.layers),
            "lm_head": (h, self.vocab, 1),
        }

    def linear_flop_per_token(self) -> float:
        return sum(2.0 * k * n * count for k, n, count in self.linear_shapes().values())

    def attention_flop_per_token(self, context: float) -> float:
        """FLOP of attention for one new token that attends to ``context`` tokens."""
        return 4.0 * self.layers * self.heads * self.head_dim * context


def measure_linear_gflops(
    in_features: int,
    out_features: int,
    batch: int,
    dtype: Any,
    threads: int,
    seconds: float = 0.3,
    device: str = "cpu",
) -> float:
    """Dense ``[batch, in] x [in, out]`` GFLOP/s of ``torch.nn.functional.linear`` (median of timed bursts).

    Runs in this process with ``torch.set_num_threads(threads)`` (restored after), on ``device`` (a CUDA device is
    synchronised around every burst).
    """
    import statistics

    import torch

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.randn(batch, in_features, device=device).to(dtype)
        w = torch.randn(out_features, in_features, device=device).to(dtype)
        for _ in range(3):
            torch.nn.functional.linear(x, w)
        rates = []
        for _ in range(5):
            sync()
            calls, start = 0, time.perf_counter()
            while calls < 2 or time.perf_counter() - start < seconds / 5:
                torch.nn.functional.linear(x, w)
                calls += 1
                if calls % 8 == 0:
                    sync()
            sync()
            rates.append(2.0 * batch * in_features * out_features * calls / (time.perf_counter() - start) / 1e9)
        return statistics.median(rates)
    finally:
        torch.set_num_threads(before)


def decode_roofline(shape: DecoderShape, *, batch: int, context: float, threads: int) -> dict[str, Any]:
    """The compute bound on decode tokens/s at ``batch`` sequences in flight and mean context ``context``.

    Returns:
        ``{"gflops": {shape: {"float32", "bfloat16"}}, "flop_per_token", "linear_flop_per_token",
        "attention_flop_per_token", "bound_tokens_per_s", "bound_dtype": {shape: dtype}, "threads", "batch",
        "context"}``; GFLOP/s are measured, FLOP counts are per generated token.
    """
    import torch

    gflops: dict[str, dict[str, float]] = {}
    seconds_per_token, best_dtype, best_rate = 0.0, {}, 0.0
    for name, (k, n, count) in shape.linear_shapes().items():
        rates = {
            str(dtype).removeprefix("torch."): measure_linear_gflops(k, n, batch, dtype, threads)
            for dtype in (torch.float32, torch.bfloat16)
        }
        gflops[name] = {key: round(value, 1) for key, value in rates.items()}
        dtype, rate = max(rates.items(), key=lambda item: item[1])
        best_dtype[name], best_rate = dtype, max(best_rate, rate)
        seconds_per_token += 2.0 * k * n * count / (rate * 1e9)
    attention = shape.attention_flop_per_token(context)
    seconds_per_token += attention / (best_rate * 1e9)
    linear = shape.linear_flop_per_token()
    return {
        "shape": asdict(shape),
        "threads": threads,
        "batch": batch,
        "context": round(context, 1),
        "gflops": gflops,
        "bound_dtype": best_dtype,
        "linear_flop_per_token": linear,
        "attention_flop_per_token": attention,
        "flop_per_token": linear + attention,
        "bound_tokens_per_s": round(1.0 / seconds_per_token, 1),
    }


def roofline_table(roof: dict[str, Any]) -> str:
    """The per-shape GFLOP/s and the bound as plain text lines."""
    lines = [f"roofline: {roof['batch']} sequences, context {roof['context']:.0f}, {roof['threads']} threads"]
    for name, rates in roof["gflops"].items():
        lines.append(f"  {name:8s} fp32 {rates['float32']:7.1f} GFLOP/s   bf16 {rates['bfloat16']:7.1f} GFLOP/s")
    lines.append(
        f"  FLOP/token {roof['flop_per_token'] / 1e9:.3f} G (linear {roof['linear_flop_per_token'] / 1e9:.3f}, "
        f"attention {roof['attention_flop_per_token'] / 1e9:.3f}) -> bound {roof['bound_tokens_per_s']:.0f} tok/s"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--context", type=float, default=400.0)
    parser.add_argument("--threads", type=int, default=None, help="default: the cores this process may use")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    import os

    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint

    config = json.loads((ensure_hf_checkpoint(args.model) / "config.json").read_text())
    threads = args.threads or len(os.sched_getaffinity(0))
    result = decode_roofline(
        DecoderShape.from_hf_config(config), batch=args.batch, context=args.context, threads=threads
    )
    print(roofline_table(result))
    if args.json:
        from afm_core.utils.atomic import atomic_write_json

        atomic_write_json(args.json, result)
