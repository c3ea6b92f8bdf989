"""A training checkpoint as an HF checkpoint (safetensors, config, tokenizer), as a Hydra app (conf/export.yaml).

    python -m jobs.export run_dir=runs/sft/X                     # the latest complete checkpoint -> X/hf_step_N
    python -m jobs.export run_dir=runs/rl/Y step=40 out=DIR       # any complete step of an SFT or RL run

A LoRA run's checkpoint (adapters only) is exported twice: merged into its base model's weights (``out``) and as
a PEFT adapter directory for that base (``adapter_out``, default ``<out>_adapter``: ``adapter_config.json`` +
``adapter_model.safetensors``, for ``peft.PeftModel.from_pretrained``); the summary names both.

TP/PP shards are merged, and the export's logits are checked against the Megatron model's before it is kept
(:mod:`afm_core.engine.export`). An incomplete or absent checkpoint exits with status 2 and a message naming
the complete steps there are. The export runs in this process (one rank), so run it where the model fits in
memory (``srun --mem=... python -m jobs.export ...`` on a cluster).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig


@hydra.main(config_path="../conf", config_name="export", version_base="1.3")
def main(cfg: DictConfig) -> dict[str, Any]:
    from afm_core.engine.checkpoint_dirs import ExportError, find_checkpoint

    try:
        path = find_checkpoint(cfg.run_dir, cfg.step)
        step = int(path.name.removeprefix("step_"))
        out = Path(cfg.out) if cfg.out else Path(cfg.run_dir) / f"hf_step_{step}"
        print(f"[export] {path} -> {out}", flush=True)
        # torch, megatron and transformers load here, for a checkpoint there is: not for --help, a bad override or
        # an incomplete or absent step (refused above in a fraction of a second)
        from afm_core.engine.export import export_checkpoint

        summary = export_checkpoint(cfg.run_dir, out, step, adapter_out=cfg.adapter_out)
    except ExportError as err:
        print(f"jobs.export: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
