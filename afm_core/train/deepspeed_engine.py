"""The secondary SFT engine: DeepSpeed ZeRO-3 on the Hugging Face model (``trainer.engine=deepspeed``).

The upstream AFM recipe trains with LLaMA-Factory + DeepSpeed ZeRO-3 (``examples/deepspeed/ds_z3_config.json``:
stage 3, ``overlap_comm: false``, ``stage3_gather_16bit_weights_on_model_save: true``, ``"auto"`` batch sizes).
This engine runs that setup under the Megatron engine's contract, so a run differs only in who shards what:

- the same config keys (``trainer.*``, ``optim.*``), data stream, step loop, evals, ``metrics.jsonl`` records
  and run summary: :class:`DeepSpeedSFTTrainer` is an :class:`~afm_core.train.loop.SFTLoop` (the loop of
  the Megatron engine's :class:`~afm_core.train.trainer.SFTTrainer`) whose step, eval and checkpoint methods
  drive a ``deepspeed.DeepSpeedEngine`` instead of megatron modules;
- the same loss: the masked token mean over the global batch (:mod:`afm_core.train.loss`), made exact under
  DeepSpeed's gradient averaging by scaling each micro batch's loss sum by ``dp / N_global``;
- the same schedule: megatron's ``OptimizerParamScheduler`` (linear warmup, cosine to ``min_lr``) driving the
  param groups of torch AdamW inside the ZeRO-3 optimizer; DeepSpeed clips the global grad norm
  (``gradient_clipping``) at each accumulation boundary;
- the HF export to ``RUN_DIR/hf``: the ZeRO-3 partitions are gathered layer by layer into one 16-bit (or fp32)
  state dict on rank 0 (``stage3_gather_16bit_weights_on_model_save``), saved with ``save_pretrained``.

Parallelism is data parallel only (ZeRO shards parameters, gradients and optimizer state over the DP ranks):
``parallel.tp``, ``pp`` and ``cp`` must be 1, and ``dp = WORLD_SIZE``. Runs on GPU (NCCL) and, for tests, on CPU
(``DS_ACCELERATOR=cpu``, gloo; DeepSpeed JIT-builds its small shared-memory allreduce op on first use, about
70 s of CPU, cached under ``~/.cache/torch_extensions``: ``make setup`` builds it on CPU machines).

The DeepSpeed JSON is ``trainer.deepspeed_config`` when set (e.g. an upstream LLaMA-Factory file), else
``conf/deepspeed/ds_z3_config.json`` (:mod:`afm_core.train.deepspeed_config`). Checkpoints go through the one
protocol of :class:`afm_core.engine.checkpoint.Checkpointer`; this engine supplies only its ZeRO files
(:class:`DeepSpeedFiles`).

One module, one thing: the ZeRO-3 engine behind the SFT loop. Its parts (process group, HF model under ZeRO-3, the
loop's step / eval / checkpoint / export, the entry point) each exist for this engine only and share its
invariants (DP-only layout, the ``dp / N_global`` loss scale, ZeRO's partitioned parameters).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, set_seed

from afm_core.config.sft import LoopConfig, ParallelConfig
from afm_core.data.loader import SFTDataModule, full_micro_batches
from afm_core.engine.checkpoint import Checkpointer
from afm_core.engine.distributed import ParallelLayout, launcher_ranks, set_num_threads, training_dtype
from afm_core.engine.optim import build_lr_scheduler
from afm_core.train.deepspeed_config import DEFAULT_DEEPSPEED_CONFIG, deepspeed_config, zero_stage
from afm_core.train.loop import MicroBatchSource, Progress, SFTLoop, micro_batches_per_step
from afm_core.train.loss import masked_token_loss, reduce_reports
from afm_core.utils.atomic import atomic_dir

# -- process group -----------------------------------------------------------------------------------------


def init_deepspeed_distributed(
    parallel: ParallelConfig, *, num_threads: int | None = None, timeout_min: int = 30
) -> ParallelLayout:
    """Join the process group through DeepSpeed (NCCL on GPU, gloo on CPU): one data-parallel group.

    Reads the ``env://`` variables RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (LOCAL_WORLD_SIZE
    optional) as :func:`afm_core.engine.distributed.init_distributed` does
    (:func:`~afm_core.engine.distributed.launcher_ranks`). On a machine without CUDA it sets
    ``DS_ACCELERATOR=cpu`` before DeepSpeed is imported.

    Raises:
        ValueError: ``parallel.tp``, ``pp`` or ``cp`` is not 1 (ZeRO is data parallel only).
        RuntimeError: an env variable is missing or not an integer.
    """
    sizes = {f"parallel.{k}": getattr(parallel, k) for k in ("tp", "pp", "cp")}
    if any(v != 1 for v in sizes.values()):
        raise ValueError(
            f"trainer.engine=deepspeed shards over data-parallel ranks only (ZeRO-3); got {sizes}: "
            "set parallel.tp=1 parallel.pp=1 parallel.cp=1, or use trainer.engine=megatron"
        )
    rank, world_size, local_rank, local_world_size = ranks = launcher_ranks()

    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        device, backend = torch.device("cpu"), "gloo"
    import deepspeed  # here: DeepSpeed picks its accelerator at import, from DS_ACCELERATOR set just above

    set_num_threads(num_threads, local_world_size)
    deepspeed.init_distributed(
        dist_backend=backend,
        auto_mpi_discovery=False,
        init_method="env://",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(minutes=timeout_min),
    )
    return ParallelLayout(
        **ranks._asdict(),
        tp=1,
        pp=1,
        dp=world_size,
        vpp=None,
        tp_rank=0,
        pp_rank=0,
        dp_rank=rank,
        device=device,
    )


# -- model, optimizer, schedule ----------------------------------------------------------------------------


def per_token_cross_entropy(model: Any, batch: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """Next-token cross entropy of every position of a micro batch through an HF causal LM.

    Args:
        model: the HF model (or the DeepSpeed engine wrapping it), loaded with ``attn_implementation="sdpa"``.
        batch: the data loader's micro batch: ``tokens``, ``labels`` (already shifted: ``labels[:, t]`` is the
            target of the logits at ``t``; any value where ``loss_mask`` is 0), ``position_ids`` (``[b, s]``) and
            optionally ``attention_mask`` ``[b, 1, s, s]`` bool with True = masked out (block-causal for packed
            documents; absent or None: causal).
        device: where the model runs.
    Returns:
        ``[b, s]`` fp32 CE in nats (0 is not implied where ``loss_mask`` is 0: mask it).
    """
    tokens = batch["tokens"].to(device, non_blocking=True)
    labels = batch["labels"].to(device, non_blocking=True).clamp(min=0)
    position_ids = batch["position_ids"].to(device, non_blocking=True)
    attention_mask = batch.get("attention_mask")
    if attention_mask is not None:
        # HF passes a 4-D mask through as is; torch SDPA's boolean mask means True = attend.
        attention_mask = ~attention_mask.to(device, non_blocking=True)
    logits = model(input_ids=tokens, position_ids=position_ids, attention_mask=attention_mask, use_cache=False).logits
    # [b*s, vocab] rows, as HF's ForCausalLMLoss: CE over the transposed [b, vocab, s] view is ~7x slower on CPU.
    per_token = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
    return per_token.view_as(labels)


def adamw_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW param groups with megatron's weight-decay rule: no decay on biases and 1-D (norm) weights.

    Each group carries ``wd_mult`` (1.0 or 0.0), which megatron's ``OptimizerParamScheduler`` multiplies into
    ``weight_decay``. Shapes are read from ``ds_shape`` for ZeRO-3-partitioned parameters.
    """
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        shape = getattr(param, "ds_shape", param.shape)
        (no_decay if name.endswith(".bias") or len(shape) == 1 else decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay, "wd_mult": 1.0},
        {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0},
    ]


def load_zero_model(
    hf_dir: str | os.PathLike[str], ds_config: dict[str, Any], dtype: torch.dtype, recompute: str | None
) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_pretrained(hf_dir)`` with SDPA attention, partitioned while it loads.

    Under ZeRO-3, transformers builds the model inside ``deepspeed.zero.Init`` (it sees the live
    ``HfDeepSpeedConfig``), so no rank ever holds the whole model. ``recompute`` (``parallel.recompute``, any
    value but None) turns on HF gradient checkpointing (full recomputation per decoder layer).
    """
    # here: transformers' DeepSpeed integration imports accelerate's DeepSpeed utilities, for this build only
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    zero3 = HfDeepSpeedConfig(ds_config)  # noqa: F841 - must stay alive during from_pretrained
    try:
        model = AutoModelForCausalLM.from_pretrained(
            hf_dir, dtype=dtype, attn_implementation="sdpa", local_files_only=True
        )
    finally:
        unset_hf_deepspeed_config()
    if recompute:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model


# -- the trainer ---------------------------------------------------------------------------------------------


class DeepSpeedFiles:
    """DeepSpeed's part of a checkpoint (an :class:`~afm_core.engine.checkpoint.EngineState` of the one protocol,
    :class:`~afm_core.engine.checkpoint.Checkpointer`): the ZeRO shards of model and optimizer and ``common``
    (DeepSpeed's ``client_state``), written by ``engine.save_checkpoint`` into the staging dir as its ``tag``.
    ZeRO-3 shards are per rank: a checkpoint resumes on the same layout only (DeepSpeed's universal checkpoint
    conversion would be needed otherwise).
    """

    name: str = "deepspeed"
    same_layout_only: str | None = "ZeRO-3 checkpoints resume on the same number of data-parallel ranks"

    def __init__(self, engine: Any):
        self.engine = engine

    def save(self, staging: Path, common: dict[str, Any]) -> None:
        self.engine.save_checkpoint(str(staging.parent), tag=staging.name, client_state=common, save_latest=False)

    def check_saved(self, staging: Path) -> None:
        """Nothing to check: ``save_checkpoint`` raises when a write fails."""

    def load(self, path: Path) -> dict[str, Any]:
        _, client_state = self.engine.load_checkpoint(
            str(path.parent), tag=path.name, load_optimizer_states=True, load_lr_scheduler_states=False
        )
        return client_state


class DeepSpeedSFTTrainer(SFTLoop):
    """The Megatron engine's loop (:meth:`SFTLoop.fit`: evals, logging, checkpoint cadence, summary) over a
    DeepSpeed ZeRO engine wrapping an HF causal LM.

    Args:
        config: as for :class:`~afm_core.train.loop.SFTLoop` (``optim``: AdamW and its schedule).
        layout: from :func:`init_deepspeed_distributed` (dp = world size).
        model: the HF model from :func:`load_zero_model`.
        ds_config: from :func:`~afm_core.train.deepspeed_config.deepspeed_config`, with
            ``gradient_accumulation_steps`` equal to ``global_batch_size / (micro_batch_size * dp)``.
        train_data, eval_batches, run_dir, max_steps, resume_from: as for :class:`~afm_core.train.loop.SFTLoop`.
    Raises:
        ValueError: the batch sizes do not divide, or ``ds_config`` accumulates another number of micro batches.
    """

    def __init__(
        self,
        config: LoopConfig,
        layout: ParallelLayout,
        model: torch.nn.Module,
        ds_config: dict[str, Any],
        train_data: MicroBatchSource,
        eval_batches: list[dict[str, torch.Tensor]],
        run_dir: str | Path,
        max_steps: int,
        resume_from: str | Path | None = None,
    ):
        import deepspeed  # here: after init_deepspeed_distributed set DS_ACCELERATOR (off this module's other uses)

        super().__init__(config, layout, train_data, eval_batches, run_dir, max_steps, resume_from)
        if ds_config["gradient_accumulation_steps"] != self.num_microbatches:
            raise ValueError(
                f"DeepSpeed gradient_accumulation_steps={ds_config['gradient_accumulation_steps']}, "
                f"but the trainer runs {self.num_microbatches} micro batches per step"
            )
        self.ds_config = ds_config
        o = config.optim
        optimizer = torch.optim.AdamW(
            adamw_param_groups(model, o.weight_decay), lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps
        )
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        self.scheduler = build_lr_scheduler(self.optimizer, o, max_steps)
        self.report_groups = [torch.distributed.group.WORLD]
        self.checkpointer = Checkpointer(self.run_dir / "checkpoints", config.trainer.keep_last, layout)
        self.files = DeepSpeedFiles(self.engine)

    # -- one step --------------------------------------------------------------------------------------
    def _micro_batch_loss(self, batch: dict[str, torch.Tensor]):
        per_token = per_token_cross_entropy(self.engine, batch, self.layout.device)
        return masked_token_loss(batch["loss_mask"].to(per_token.device), per_token)

    def train_step(self) -> dict[str, float]:
        """One optimizer step over the next global batch; returns loss, tokens, lr and grad_norm.

        The gradient is that of ``sum(mask * CE) / N`` over the global batch (N: its unmasked tokens, all-reduced
        first): DeepSpeed averages gradients over the DP ranks, so each micro batch back-propagates
        ``loss_sum * dp / N`` (``scale_wrt_gas=False``: no extra division by the accumulation steps).

        Raises:
            FloatingPointError: the global gradient norm is not finite.
        """
        micro_batches = [next(self.train_data) for _ in range(self.num_microbatches)]
        for batch in micro_batches:
            self._check_batch(batch)
        local_tokens = sum(batch["loss_mask"].sum() for batch in micro_batches).to(torch.float64)
        global_tokens = local_tokens.to(self.layout.device)
        torch.distributed.all_reduce(global_tokens)
        scale = self.layout.dp / max(float(global_tokens), 1.0)
        lr = self.optimizer.param_groups[0]["lr"]
        reports = []
        for batch in micro_batches:
            loss_sum, _, report = self._micro_batch_loss(batch)
            self.engine.backward(loss_sum * scale, scale_wrt_gas=False)
            self.engine.step()  # applies the update at the accumulation boundary (the last micro batch)
            reports.append(report)
        grad_norm = float(self.engine.get_global_grad_norm())
        if not math.isfinite(grad_norm):
            raise FloatingPointError(f"optimizer step {self.progress.step + 1}: non-finite gradient norm {grad_norm}")
        self.scheduler.step(increment=1)
        loss, tokens = reduce_reports(reports, self.report_groups)
        return {"loss": loss, "tokens": tokens, "lr": lr, "grad_norm": grad_norm}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Masked token-mean ``loss`` and unmasked ``tokens`` over the held-out micro batches of all DP ranks."""
        self.engine.eval()
        reports = [self._micro_batch_loss(batch)[2] for batch in self.eval_batches]
        self.engine.train()
        loss, tokens = reduce_reports(reports, self.report_groups)
        return {"loss": loss, "tokens": tokens}

    # -- checkpoints -----------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/step_N`` (every rank calls it) through the one protocol
        (:meth:`~afm_core.engine.checkpoint.Checkpointer.save`): DeepSpeed's ZeRO shards (model and optimizer)
        with the step counters and LR scheduler as its ``client_state``, and ``rank_*.pt`` with this rank's RNG and
        data-loader state."""
        common = {"progress": asdict(self.progress), "scheduler": self.scheduler.state_dict()}
        return self.checkpointer.save(self.progress.step, self.files, common, {"data": self.train_data.state_dict()})

    def _resume(self) -> Path | None:
        """Load the latest complete checkpoint of ``run_dir`` (else of ``resume_from``), if any.

        Raises:
            ValueError: the checkpoint was written by the Megatron engine, or with another DP size (ZeRO-3
                shards are per rank; DeepSpeed's universal checkpoint conversion would be needed).
        """
        path = self._find_checkpoint()
        if path is None:
            return None
        common, rank_state = self.checkpointer.load(path, self.files)
        self.progress = Progress(**common["progress"])
        self.scheduler.load_state_dict(common["scheduler"])
        if "data" in rank_state:
            self.train_data.load_state_dict(rank_state["data"])
        if self.layout.is_rank0 and not path.is_relative_to(self.run_dir):
            self._seed_metrics_from(path.parent.parent / "metrics.jsonl")
        return path

    # -- export ----------------------------------------------------------------------------------------
    def export_hf(self, out_dir: str | Path, tokenizer: Any) -> Path:
        """Write the trained model as an HF checkpoint (safetensors, config, tokenizer) to ``out_dir``, atomically.

        Every rank must call it: under ZeRO-3 the partitions are gathered one layer at a time into a full
        state dict on rank 0 (DeepSpeed's ``_zero3_consolidated_16bit_state_dict``, the gather behind
        ``stage3_gather_16bit_weights_on_model_save`` / ``save_16bit_model``), in the training dtype.
        """
        if zero_stage(self.ds_config) == 3:
            state_dict = self.engine._zero3_consolidated_16bit_state_dict()
        else:
            state_dict = self.engine.module.state_dict()
        out_dir = Path(out_dir)
        if self.layout.is_rank0:
            with atomic_dir(out_dir) as temp:
                self.engine.module.save_pretrained(temp, state_dict=state_dict)
                tokenizer.save_pretrained(temp)
        torch.distributed.barrier()
        return out_dir


# -- entry point ---------------------------------------------------------------------------------------------


def train_deepspeed(
    config: LoopConfig,
    layout: ParallelLayout,
    data: SFTDataModule,
    hf_dir: str | os.PathLike[str],
    tokenizer: Any,
    run_dir: str | Path,
    max_steps: int,
    resume_from: str | Path | None = None,
) -> dict[str, Any]:
    """Train the HF model in ``hf_dir`` with ZeRO on this rank's share of ``data``; export it to ``RUN_DIR/hf``.

    Args:
        config: the loop's view of the run's config (``trainer``, with ``trainer.deepspeed_config``: a DeepSpeed
            JSON, null: ``conf/deepspeed/ds_z3_config.json``; ``optim``; ``parallel.recompute``).
        layout: from :func:`init_deepspeed_distributed`.
        data: the data module (train iterator and held-out batches per DP rank).
        hf_dir: the HF checkpoint to start from; tokenizer: its tokenizer (saved with the export).
        run_dir, max_steps, resume_from: as for :class:`~afm_core.train.loop.SFTLoop`.
    Returns:
        :meth:`SFTLoop.fit`'s summary, plus ``hf_dir`` (the export, or None when ``trainer.export_hf`` is
        false or the run stopped early) and ``engine: "deepspeed"``; identical on every rank.
    Raises:
        ValueError, DeepSpeedConfigError: bad batch sizes, precision or DeepSpeed JSON.
    """
    t = config.trainer
    set_seed(t.seed)  # python, numpy, torch (and CUDA): what megatron's init_distributed seeds
    grad_accum_steps = micro_batches_per_step(t, layout.dp)
    dtype = training_dtype(t.precision)
    hidden_size = AutoConfig.from_pretrained(hf_dir, local_files_only=True).hidden_size
    ds_config = deepspeed_config(
        t.deepspeed_config or DEFAULT_DEEPSPEED_CONFIG,
        micro_batch_size=t.micro_batch_size,
        grad_accum_steps=grad_accum_steps,
        dp=layout.dp,
        grad_clip=t.grad_clip,
        bf16=dtype == torch.bfloat16,
        hidden_size=hidden_size,
    )
    model = load_zero_model(hf_dir, ds_config, dtype, config.parallel.recompute)
    mbs = t.micro_batch_size
    train = data.train_iterator(seed=t.seed, micro_batch_size=mbs, dp_rank=layout.dp_rank, dp_size=layout.dp)
    eval_batches = full_micro_batches(  # the Megatron engine's held-out set, so both engines' eval losses compare
        data.heldout_batches(
            micro_batch_size=mbs, dp_rank=layout.dp_rank, dp_size=layout.dp, max_sequences=t.eval_sequences
        ),
        mbs,
    )
    trainer = DeepSpeedSFTTrainer(
        config, layout, model, ds_config, train, eval_batches, run_dir, max_steps, resume_from=resume_from
    )
    summary = trainer.fit()
    export = None
    if t.export_hf and not summary["stopped_early"]:
        export = str(trainer.export_hf(Path(run_dir) / "hf", tokenizer))
    return {**summary, "hf_dir": export, "engine": "deepspeed"}
