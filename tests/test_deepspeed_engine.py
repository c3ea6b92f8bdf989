"""The DeepSpeed ZeRO-3 SFT engine (afm_core.train.deepspeed_engine) on CPU: DeepSpeed's CPU accelerator over
gloo, the real tiny-llama HF checkpoint, and real GSM8K question/answer pairs through the real data module
(chat template, prompt masking, packing with block-causal attention).

A plain-torch loop (HF model, AdamW, the documented warmup/cosine formula, grad clipping, masked token mean over
the global batch) is the reference the ZeRO-3 losses and the exported weights must match.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from afm_core.utils.paths import repo_root, shared_data_dir
from afm_core.utils.ports import free_port

deepspeed = pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install -r requirements/base.txt)")

from afm_core.train.deepspeed_config import (  # noqa: E402
    DEFAULT_DEEPSPEED_CONFIG,
    DeepSpeedConfigError,
    deepspeed_config,
)
from tests.gloo_env import set_rank_env  # noqa: E402
from tests.ranks import start_ranks  # noqa: E402

SEQ, MICRO, GLOBAL, STEPS = 256, 1, 2, 4
GSM8K = shared_data_dir() / "math" / "gsm8k"


def make_cfg(**overrides) -> dict:
    """trainer/optim/parallel groups from the real conf/ files, sized down for tiny-llama."""
    conf = repo_root() / "conf"
    sft = OmegaConf.load(conf / "sft.yaml")
    cfg = OmegaConf.create(
        {"trainer": sft.trainer, "optim": sft.optim, "parallel": OmegaConf.load(conf / "parallel" / "default.yaml")}
    )
    cfg.trainer.update(
        engine="deepspeed",
        seq_length=SEQ,
        micro_batch_size=MICRO,
        global_batch_size=GLOBAL,
        max_steps=STEPS,
        eval_interval=2,
        eval_sequences=2,
        save_interval=2,
        keep_last=2,
        precision="fp32",
        progress=False,
        num_threads=1,
        export_hf=True,
    )
    cfg.optim.update(lr=3e-3, min_lr=3e-4, warmup_ratio=0.25, weight_decay=0.01)
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value)
    return OmegaConf.to_container(cfg)


def write_gsm8k_parquet(path: Path, split: str, count: int) -> Path:
    """The first ``count`` GSM8K records as the data module's prepared parquet (prompt, response)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in (GSM8K / f"{split}.jsonl").read_text().splitlines()[:count]]
    pq.write_table(pa.table({"prompt": [r["question"] for r in rows], "response": [r["answer"] for r in rows]}), path)
    return path


def data_module(data_dir: Path, hf_dir: Path):
    from transformers import AutoTokenizer

    from afm_core.data.loader import SFTDataModule

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    return SFTDataModule(
        [data_dir / "train.parquet"], tokenizer, SEQ, heldout_paths=[data_dir / "heldout.parquet"], pack=True
    ), tokenizer


def worker(rank: int, world: int, port: int, spec: dict) -> None:
    set_rank_env(rank, world, port)
    from transformers import set_seed

    from afm_core.config import check_config
    from afm_core.config.sft import LoopConfig
    from afm_core.engine.distributed import destroy_distributed
    from afm_core.train.deepspeed_engine import init_deepspeed_distributed, train_deepspeed

    loop = check_config(OmegaConf.create(spec["cfg"]), LoopConfig)
    layout = init_deepspeed_distributed(loop.parallel, num_threads=1)
    try:
        set_seed(loop.trainer.seed)
        data, tokenizer = data_module(Path(spec["data_dir"]), Path(spec["hf_dir"]))
        summary = train_deepspeed(
            loop, layout, data, spec["hf_dir"], tokenizer, spec["run_dir"], loop.trainer.max_steps
        )
        if rank == 0:
            Path(spec["run_dir"], "summary.json").write_text(json.dumps(summary))
    finally:
        destroy_distributed()


def run(run_dir: Path, setup: dict, world: int = 1, **overrides) -> dict:
    spec = {"cfg": make_cfg(**overrides), "run_dir": str(run_dir), **setup}
    start_ranks(worker, args=(world, free_port(), spec), nprocs=world)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"summary": json.loads((run_dir / "summary.json").read_text()), "records": records}


def losses(result: dict, split: str = "train") -> list[float]:
    return [r["loss"] for r in result["records"] if r["split"] == split]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    if not GSM8K.is_dir():
        pytest.skip(f"real data folder {GSM8K} is absent (set AFM_SHARED_DATA to the shared data folder)")
    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint

    data_dir = tmp_path_factory.mktemp("gsm8k")
    write_gsm8k_parquet(data_dir / "train.parquet", "train", 48)
    write_gsm8k_parquet(data_dir / "heldout.parquet", "test", 12)
    return {"hf_dir": str(ensure_hf_checkpoint("tiny-llama")), "data_dir": str(data_dir)}


@pytest.fixture(scope="module")
def single_rank(setup, tmp_path_factory) -> dict:
    """One ZeRO-3 rank, 4 steps of 2 packed sequences, checkpoints at steps 2 and 4, HF export."""
    return run(tmp_path_factory.mktemp("dp1") / "run", setup)


# -- the DeepSpeed JSON ------------------------------------------------------------------------------------


def test_shipped_config_is_upstream_zero3_with_auto_filled():
    config = deepspeed_config(
        DEFAULT_DEEPSPEED_CONFIG, micro_batch_size=2, grad_accum_steps=4, dp=2, grad_clip=1.0, bf16=True, hidden_size=64
    )
    assert config["train_batch_size"] == 16 and config["gradient_accumulation_steps"] == 4
    assert config["train_micro_batch_size_per_gpu"] == 2 and config["gradient_clipping"] == 1.0
    assert config["bf16"]["enabled"] is True and config["fp16"]["enabled"] is False
    zero = config["zero_optimization"]
    assert zero["stage"] == 3 and zero["overlap_comm"] is False and zero["stage3_gather_16bit_weights_on_model_save"]
    assert zero["reduce_bucket_size"] == 64 * 64 and zero["stage3_param_persistence_threshold"] == 640


def test_config_that_disagrees_with_trainer_names_file_line_and_field(tmp_path):
    text = DEFAULT_DEEPSPEED_CONFIG.read_text().replace(
        '"train_micro_batch_size_per_gpu": "auto"', '"train_micro_batch_size_per_gpu": 8'
    )
    path = tmp_path / "ds.json"
    path.write_text(text)
    line = next(i for i, s in enumerate(text.splitlines(), 1) if "train_micro_batch_size_per_gpu" in s)
    with pytest.raises(
        DeepSpeedConfigError,
        match=rf"ds.json:{line}: field 'train_micro_batch_size_per_gpu': 8 "
        r"disagrees with trainer.micro_batch_size = 1",
    ):
        deepspeed_config(path, micro_batch_size=1, grad_accum_steps=1, dp=1, grad_clip=1.0, bf16=False, hidden_size=8)
    path.write_text('{"optimizer": {"type": "AdamW"}}')
    with pytest.raises(DeepSpeedConfigError, match=r"ds.json:1: field 'optimizer': remove it"):
        deepspeed_config(path, micro_batch_size=1, grad_accum_steps=1, dp=1, grad_clip=1.0, bf16=False, hidden_size=8)


# -- training ------------------------------------------------------------------------------------------------


def reference_run(setup: dict, cfg: dict):
    """Plain torch: same model, same micro batches, AdamW with the documented schedule, clip, token mean."""
    from transformers import AutoModelForCausalLM

    t, o = cfg["trainer"], cfg["optim"]
    torch.manual_seed(t["seed"])
    data, _ = data_module(Path(setup["data_dir"]), Path(setup["hf_dir"]))
    model = AutoModelForCausalLM.from_pretrained(setup["hf_dir"], dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": o["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        betas=(o["adam_beta1"], o["adam_beta2"]),
        eps=o["adam_eps"],
    )
    warmup = math.ceil(o["warmup_ratio"] * STEPS)

    def lr_at(n: int) -> float:
        if n <= warmup:
            return o["lr"] * n / warmup
        return o["min_lr"] + (o["lr"] - o["min_lr"]) * (1 + math.cos(math.pi * (n - warmup) / (STEPS - warmup))) / 2

    def loss_sum(batch):
        logits = model(
            input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=~batch["attention_mask"]
        ).logits
        ce = F.cross_entropy(logits.float().transpose(1, 2), batch["labels"].clamp(min=0), reduction="none")
        return (ce * batch["loss_mask"]).sum()

    stream = data.train_iterator(seed=t["seed"], micro_batch_size=MICRO)
    train_losses = []
    for n in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(n)
        micro_batches = [next(stream) for _ in range(GLOBAL // MICRO)]
        tokens = sum(float(b["loss_mask"].sum()) for b in micro_batches)
        total = 0.0
        for batch in micro_batches:
            loss = loss_sum(batch)
            (loss / tokens).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t["grad_clip"])
        optimizer.step()
        optimizer.zero_grad()
        train_losses.append(total / tokens)
    return model, train_losses, data


@pytest.mark.slow
def test_zero3_matches_plain_torch_and_exports_hf(setup, single_rank):
    from transformers import AutoModelForCausalLM

    records, summary = single_rank["records"], single_rank["summary"]
    assert [(r["step"], r["split"]) for r in records] == [
        (0, "eval"),
        (1, "train"),
        (2, "train"),
        (2, "eval"),
        (3, "train"),
        (4, "train"),
        (4, "eval"),
    ]
    for record in records:
        assert {"step", "split", "loss", "lr", "tokens", "tokens_per_s"} <= record.keys()
    assert summary["engine"] == "deepspeed" and summary["step"] == STEPS
    assert summary["eval_loss_after"] < summary["eval_loss_before"] - 0.5

    reference, reference_losses, data = reference_run(setup, make_cfg())
    assert losses(single_rank) == pytest.approx(reference_losses, abs=2e-4)
    assert losses(single_rank)[-1] < losses(single_rank)[0]

    exported = AutoModelForCausalLM.from_pretrained(summary["hf_dir"], dtype=torch.float32, attn_implementation="sdpa")
    batch = next(iter(data.heldout_batches(micro_batch_size=2)))
    with torch.no_grad():
        args = dict(
            input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=~batch["attention_mask"]
        )
        torch.testing.assert_close(exported(**args).logits, reference(**args).logits, atol=2e-3, rtol=1e-3)
    assert (Path(summary["hf_dir"]) / "tokenizer.json").is_file()


@pytest.mark.slow
def test_two_zero3_ranks_match_one(setup, single_rank, tmp_path):
    two = run(tmp_path / "run", setup, world=2)
    assert losses(two) == pytest.approx(losses(single_rank), abs=1e-4)
    assert losses(two, "eval") == pytest.approx(losses(single_rank, "eval"), abs=1e-4)


@pytest.mark.slow
def test_resume_from_checkpoint_reproduces_the_run(setup, single_rank, tmp_path):
    run_dir = Path(single_rank["summary"]["checkpoint"]).parent.parent
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    shutil.rmtree(copy / "checkpoints" / "step_00000004")
    resumed = run(copy, setup)
    assert resumed["summary"]["resumed_from"].endswith("step_00000002")
    assert [(r["step"], r["split"]) for r in resumed["records"]] == [
        (r["step"], r["split"]) for r in single_rank["records"]
    ]
    assert losses(resumed) == pytest.approx(losses(single_rank), abs=1e-5)
    assert losses(resumed, "eval") == pytest.approx(losses(single_rank, "eval"), abs=1e-5)


def run_sft_worker(rank: int, world: int, port: int, cfg: dict) -> None:
    set_rank_env(rank, world, port)
    from afm_core.config.sft import sft_config
    from afm_core.train.sft import run_sft

    summary = run_sft(sft_config(cfg))
    if rank == 0:
        Path(cfg["run_dir"], "summary.json").write_text(json.dumps(summary))


@pytest.mark.slow
def test_run_sft_with_engine_deepspeed_trains_on_coa_traces(setup, tmp_path):
    """The job entry point with ``trainer.engine=deepspeed``: prepared CoA trajectories (observations masked),
    ZeRO-3 training, metrics and the HF export in the run dir."""
    from hydra import compose, initialize_config_dir

    from afm_core.config import register_schemas

    overrides = [
        "model=tiny-llama",
        "trainer.engine=deepspeed",
        f"run_dir={tmp_path / 'run'}",
        f"data.out_dir={tmp_path / 'coa'}",
        "data.sources={gsm8k: 12, fireact: 6, r1searcher: 6, tora: 0}",
        "data.heldout_fraction=0.2",
        "trainer.seq_length=512",
        "trainer.global_batch_size=2",
        "trainer.max_steps=3",
        "trainer.eval_interval=3",
        "trainer.eval_sequences=2",
        "trainer.save_interval=3",
        "trainer.progress=false",
        "trainer.num_threads=1",
        "optim.lr=3e-3",
        "optim.warmup_ratio=0.34",
    ]
    register_schemas()
    with initialize_config_dir(config_dir=str(repo_root() / "conf"), version_base="1.3"):
        cfg = OmegaConf.to_container(compose(config_name="sft", overrides=overrides), resolve=True)
    start_ranks(run_sft_worker, args=(1, free_port(), cfg), nprocs=1)

    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["engine"] == "deepspeed" and summary["step"] == 3 and not summary["stopped_early"]
    assert summary["eval_loss_after"] < summary["eval_loss_before"]
    assert summary["checkpoint"].endswith("step_00000003")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(summary["hf_dir"]))
    assert (tmp_path / "run" / "loss.png").is_file()
