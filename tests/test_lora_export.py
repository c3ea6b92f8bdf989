"""``python -m jobs.export`` of a LoRA SFT checkpoint: a TP=2 LoRA run of ``tiny-llama`` (gloo) through
``run_sft``, its adapters-only checkpoint exported as a merged HF checkpoint and as a PEFT adapter directory; both
give the adapted Megatron model's logits within 1e-4 (fp32), the adapter loaded by ``peft.PeftModel.from_pretrained``
onto the HF base; an export onto another base model is refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from afm_core.engine.export import PARITY_TOLERANCE
from tests.test_export import export, weights
from tests.test_sft_run import OVERRIDES, run_sft_spawned

pytestmark = pytest.mark.slow

#: lr 1e-2 from the first step (no warmup): B moves well away from zero in two steps, so the adapters change the
#: logits by far more than the tolerance (asserted below), and the checks are not vacuous.
LORA_RUN = ["parallel.tp=2", "trainer.precision=fp32", "trainer.max_steps=2", "trainer.save_interval=2",
            "trainer.eval_interval=100", "model.lora.rank=8", "model.lora.alpha=16", "optim.lr=1e-2",
            "optim.warmup_ratio=0"]  # fmt: skip


def test_a_lora_checkpoint_exports_merged_and_as_a_peft_adapter_with_matching_logits(tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint

    run_dir = tmp_path / "run"
    trained = run_sft_spawned([*OVERRIDES, f"run_dir={run_dir}", *LORA_RUN], tmp_path / "sft.json", world=2)
    assert trained["step"] == 2 and trained["hf_dir"] == str(run_dir / "hf")

    done = export(f"run_dir={run_dir}")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout[done.stdout.index("{") :])
    merged, adapter = run_dir / "hf_step_2", run_dir / "hf_step_2_adapter"
    assert summary["out"] == str(merged) and summary["adapter_out"] == str(adapter)
    assert summary["lora"]["rank"] == 8 and summary["lora"]["alpha"] == 16
    assert summary["max_logit_diff"] < 1e-4 and summary["max_logit_diff_adapter"] < 1e-4  # vs the Megatron model
    assert PARITY_TOLERANCE[torch.float32] > 1e-4
    assert {p.name for p in adapter.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    tensors = load_file(adapter / "adapter_model.safetensors")
    assert len(tensors) == 2 * 7 * 2  # layers x (q, k, v, o, gate, up, down) x (A, B)
    assert tensors["base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"].shape == (64, 8)  # 2 kv heads
    assert tensors["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"].shape == (8, 256)
    assert trained["adapter_dir"] == str(run_dir / "hf_adapter")  # the run's own adapter export is the same
    for name, tensor in load_file(run_dir / "hf_adapter" / "adapter_model.safetensors").items():
        torch.testing.assert_close(tensors[name], tensor, rtol=0, atol=0, msg=name)
    exported = weights(merged)  # the trainer's own export (merged at TP=2, per shard) is the same model
    assert exported.keys() == weights(run_dir / "hf").keys()
    for name, tensor in weights(run_dir / "hf").items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=1e-6, msg=name)

    base = ensure_hf_checkpoint("tiny-llama")
    ids = torch.tensor([[1, 17, 923, 5, 4000, 31, 2, 77, 13, 600, 9, 48000]])
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        base_logits = plain(ids).logits
        peft_logits = PeftModel.from_pretrained(plain, str(adapter)).eval()(ids).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()(ids).logits
    assert float((peft_logits - merged_logits).abs().max()) < 1e-4
    assert float((merged_logits - base_logits).abs().max()) > 0.1  # the adapters matter

    other = tmp_path / "other_base"  # the run's model now resolves to other weights of the same architecture
    shutil.copytree(base, other)
    save_file({k: v * 1.01 for k, v in load_file(other / "model.safetensors").items()}, other / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    tracking = json.loads((run_dir / "tracking.json").read_text())
    tracking["config"]["model"]["hf_path"] = str(other)
    (run_dir / "tracking.json").write_text(json.dumps(tracking))
    refused = export(f"run_dir={run_dir}", f"out={tmp_path / 'refused'}")
    assert refused.returncode == 2
    assert f"its adapters were trained on the base model {base} (weights_sha256" in refused.stderr, refused.stderr
    assert f"but the run's model resolves to {other}" in refused.stderr
    assert not (tmp_path / "refused").exists() and not (tmp_path / "refused_adapter").exists()
