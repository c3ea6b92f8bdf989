"""``python -m jobs.export``: a mid-run checkpoint of a TP=2 SFT run (tiny-llama, gloo) to HF safetensors, its
shards merged and its logits checked on load; the final step's export equals the trainer's own HF export;
incomplete and absent checkpoints are refused with a clear message."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from afm_core.engine.checkpoint_dirs import checkpoint_dir_name
from afm_core.utils.paths import repo_root
from tests.test_sft_run import OVERRIDES, run_sft_spawned

pytestmark = pytest.mark.slow


def export(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jobs.export", *args], cwd=repo_root(), capture_output=True,
                          text=True, timeout=600, env={**os.environ, **(env or {})})  # fmt: skip


def weights(hf_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(hf_dir.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize(("precision", "tp"), [("fp32", 2), ("bf16", 1)], ids=["fp32-tp2", "bf16-tp1"])
def test_a_mid_run_checkpoint_exports_to_hf_with_matching_logits_and_incomplete_ones_are_refused(
    precision, tp, tmp_path
):
    """In each precision: the export keeps the checkpoint's dtype, and its logits match the Megatron model's
    within that dtype's :data:`PARITY_TOLERANCE` (bf16: one rounding of logits of order 10). The TP=2 shards are
    merged by the fp32 run (the merge does not depend on the dtype; bf16 is emulated, slowly, on AVX2 CPUs)."""
    from afm_core.engine.export import PARITY_TOLERANCE

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    run_dir = tmp_path / "run"
    run_sft_spawned([*OVERRIDES, f"run_dir={run_dir}", f"parallel.tp={tp}", "trainer.max_steps=2", "trainer.save_interval=1",
                     "trainer.keep_last=2", "trainer.eval_interval=100", f"trainer.precision={precision}"],
                    tmp_path / "sft.json", world=tp)  # fmt: skip

    with socket.create_server(("127.0.0.1", 0)) as parents_store:  # a parent's rendezvous, still listening
        inherited = {"MASTER_PORT": str(parents_store.getsockname()[1]), "WORLD_SIZE": "1", "RANK": "0"}
        mid = export(f"run_dir={run_dir}", "step=1", f"out={tmp_path / 'step1'}", env=inherited)
    assert mid.returncode == 0, mid.stderr[-3000:]
    summary = json.loads(mid.stdout[mid.stdout.index("{") :])
    assert summary["step"] == 1 and summary["dtype"] == str(dtype).split(".")[-1]
    assert summary["max_logit_diff"] < PARITY_TOLERANCE[dtype]
    assert {t.dtype for t in weights(tmp_path / "step1").values()} == {dtype}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (tmp_path / "step1").iterdir()}

    last = export(f"run_dir={run_dir}")  # the latest complete checkpoint, into RUN_DIR/hf_step_2
    assert last.returncode == 0, last.stderr[-3000:]
    exported, trainer = weights(run_dir / "hf_step_2"), weights(run_dir / "hf")
    assert exported.keys() == trainer.keys() and all(torch.equal(exported[k], trainer[k]) for k in trainer), (
        f"the TP={tp} shards merged by the export differ from the trainer's own HF export"
    )
    assert any(not torch.equal(v, exported[k]) for k, v in weights(tmp_path / "step1").items()), "step 1 == step 2"
    if precision == "bf16":
        return  # refusing incomplete and absent checkpoints does not depend on the precision (two more processes)

    killed = run_dir / "checkpoints" / checkpoint_dir_name(3)
    shutil.copytree(run_dir / "checkpoints" / checkpoint_dir_name(2), killed)
    (killed / "COMPLETE").unlink()  # a save that died before its marker
    refused = export(f"run_dir={run_dir}", "step=3")
    assert refused.returncode == 2
    assert f"{killed} is incomplete (no COMPLETE marker: its save did not finish)" in refused.stderr
    assert "complete checkpoints in" in refused.stderr and ": 1, 2" in refused.stderr
    absent = export(f"run_dir={run_dir}", "step=7")
    assert absent.returncode == 2 and "step=7: no checkpoint of that step" in absent.stderr
