"""The one Megatron trainer core that SFT (:class:`afm_core.train.trainer.SFTTrainer`), the RL policy
(:mod:`afm_core.rl.policy_trainer`) and the PPO critic (:mod:`afm_core.rl.critic`) each hold: this rank's model
chunks wrapped as Megatron-LM wraps them, AdamW and its LR schedule, one optimizer step over micro batches with a
caller's loss, and checkpoints.

One optimizer step runs the caller's micro batches through ``get_forward_backward_func()`` (no pipelining for PP=1,
1F1B for PP>1, interleaved 1F1B with virtual stages); gradients accumulate in megatron DDP's fp32 buffers, are
reduced over DP, scaled by 1 / (the token count the loss reports) (``calculate_per_token_loss``, see
:mod:`afm_core.train.loss`), clipped, and applied by megatron's AdamW (:mod:`afm_core.engine.optim`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from megatron.core import parallel_state as ps
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_model_config

from afm_core.config.sft import OptimConfig
from afm_core.engine.checkpoint import Checkpointer, MegatronShards
from afm_core.engine.distributed import ParallelLayout
from afm_core.engine.optim import build_optimizer
from afm_core.models.attention import SDPAttention
from afm_core.models.gpt import build_gpt_model, mcore_config_from_hf
from afm_core.models.hf_weights import finish_param_gather
from afm_core.utils.host_memory import populate_for_write, zero_by_release


def ddp_config(*, distributed_optimizer: bool, on_gpu: bool, dp: int) -> DistributedDataParallelConfig:
    """Megatron DDP settings of the trainer (and of :mod:`afm_core.engine.memory`'s plan, which must size the same
    buffers): fp32 gradient buffers; on GPU with DP > 1 the gradient reduce overlapped with backward, and with the
    distributed optimizer the parameter all-gather with the next forward (Megatron-LM's ``--overlap-grad-reduce``
    / ``--overlap-param-gather``; overlapping also buckets the buffers, which changes their padding). CPU (gloo):
    synchronous, and no NaN scan of the grad buffer (the grad norm, computed for clipping anyway, is checked
    instead in ``train_step``)."""
    overlap = on_gpu and dp > 1
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap,
        overlap_param_gather=overlap and distributed_optimizer,
        use_distributed_optimizer=distributed_optimizer,
        check_for_nan_in_grad=on_gpu,
    )


class _DistributedDataParallel(DistributedDataParallel):
    """Megatron's DDP without the gradient collective when the data-parallel group has one rank, and with its
    grad buffers zeroed by page release on CPU.

    At DP = 1, ``finish_grad_sync`` would still scan the fp32 grad buffer for NaNs and all-reduce it over a
    one-rank group: passes over the whole buffer that change nothing. Gradient scaling by the token count
    (``finalize_model_grads``) and the embedding/layernorm syncs over PP/TP are unaffected.

    On CPU, :meth:`zero_grad_buffer` zeroes the fp32 grad buffers with
    :func:`~afm_core.utils.host_memory.zero_by_release` instead of a write pass, so the buffer (4 bytes/param)
    is not resident during the forward pass, when the activations peak (see :mod:`afm_core.utils.host_memory`).
    The backward hook that adds an autograd gradient into ``main_grad`` first maps that slice of the released
    buffer writable (:func:`~afm_core.utils.host_memory.populate_for_write`), so the add does not fault on every
    page twice.
    """

    def _make_backward_post_hook(self, param: torch.nn.Parameter):
        hook = super()._make_backward_post_hook(param)
        if torch.cuda.is_available():
            return hook

        def populate_then_hook(*args: Any) -> None:
            if param.grad is not None and getattr(param, "main_grad", None) is not None:
                populate_for_write(param.main_grad)
            hook(*args)

        return populate_then_hook

    def zero_grad_buffer(self) -> None:
        if torch.cuda.is_available() or getattr(self.config, "cuda_graph_impl", "none") == "transformer_engine":
            super().zero_grad_buffer()
            return
        # megatron-core 0.16.1 distributed_data_parallel.py zero_grad_buffer, with buffer.reset()'s
        # grad_data.zero_() done by page release
        for param in self.params_with_grad:
            param.grad_added_to_main_grad = False
        for buffer in self.buffers + self.expert_parallel_buffers:
            zero_by_release(buffer.grad_data)
        for bucket_group in self.bucket_groups + self.expert_parallel_bucket_groups:
            bucket_group.reset()

    def finish_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        if (
            self.ddp_config.use_distributed_optimizer
            or self.dp_cp_group.size() > 1
            or self.expert_parallel_bucket_groups
        ):
            super().finish_grad_sync(force_all_reduce=force_all_reduce)


def build_model_chunks(model_provider: Any, layout: ParallelLayout) -> list[torch.nn.Module]:
    """Build this rank's model chunk(s) (one per virtual pipeline stage) like Megatron-LM's ``get_model``.

    Args:
        model_provider: ``(pre_process, post_process, vp_stage) -> GPTModel``.
        layout: this rank's parallel layout (``vpp`` stages per rank, or None).
    """
    chunks = []
    for vp_stage in range(layout.vpp or 1):
        stage = vp_stage if layout.vpp else None
        chunks.append(
            model_provider(
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                vp_stage=stage,
            )
        )
    return chunks


def build_model(
    hf_config: Any, layout: ParallelLayout, *, params_dtype: torch.dtype, **config_overrides: Any
) -> list[torch.nn.Module]:
    """This rank's randomly initialised ``GPTModel`` chunks shaped like ``hf_config`` (a transformers Llama/Qwen2/Qwen3
    config), on ``layout.device``: :func:`afm_core.models.gpt.mcore_config_from_hf` with this rank's TP/PP/VPP
    and ``config_overrides`` (recompute, sequence parallel...), then :func:`build_model_chunks`. Every floating
    parameter is in ``params_dtype``: megatron's norms (the final layernorm among them) are built in fp32 whatever
    ``params_dtype`` says, and Megatron-LM's ``Float16Module`` casts them only in training
    (``megatron/core/transformer/module.py``), so an unwrapped bf16 model (the export, a reference policy) would
    otherwise carry one fp32 tensor. Megatron's parallel state must be initialised."""
    config = mcore_config_from_hf(
        hf_config,
        tp=layout.tp,
        pp=layout.pp,
        params_dtype=params_dtype,
        virtual_pipeline_model_parallel_size=layout.vpp,
        **config_overrides,
    )

    def provider(pre_process: bool, post_process: bool, vp_stage: int | None):
        return build_gpt_model(
            hf_config, config, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage
        ).to(device=layout.device, dtype=params_dtype)

    return build_model_chunks(provider, layout)


class MegatronTrainer:
    """The one Megatron trainer core that SFT (:class:`afm_core.train.trainer.SFTTrainer`), the RL policy
    (:mod:`afm_core.rl.policy_trainer`) and the PPO critic (:mod:`afm_core.rl.critic`) each hold: this rank's model
    chunks wrapped as Megatron-LM wraps them (Float16Module for bf16, DDP with fp32 grad buffers and per-token
    loss), AdamW and its LR schedule (:mod:`afm_core.engine.optim`), one optimizer step over micro batches with a
    caller's loss (:meth:`step`), and checkpoints (:meth:`save` / :meth:`load`, :mod:`afm_core.engine.checkpoint`).
    The requeue check is :meth:`afm_core.engine.preemption.Preemption.boundary_flags`, the loops'.

    Args:
        layout: this rank's parallel layout.
        model_chunks: unwrapped GPTModel chunk(s) of this rank (:func:`build_model_chunks`), on ``layout.device``,
            in their training dtype (bf16 or fp32).
        optim: the ``optim`` group (lr, schedule, weight decay, Adam betas/eps, warmup_ratio, min_lr), or its
            fields as a mapping (checked into an :class:`~afm_core.config.sft.OptimConfig`).
        max_steps: optimizer steps of the whole run (the LR schedule's length).
        grad_clip: global gradient-norm clip.
        distributed_optimizer: megatron's distributed optimizer (GPU only).
        checkpoint_dir: where ``step_N`` checkpoints go.
        keep_last: complete checkpoints kept.
    Raises:
        ValueError: a bad ``optim`` value (names the field).
    """

    optimizer: Any
    report_groups: list[Any]

    def __init__(
        self,
        layout: ParallelLayout,
        model_chunks: list[torch.nn.Module],
        *,
        optim: OptimConfig | Mapping[str, Any],
        max_steps: int,
        grad_clip: float,
        distributed_optimizer: bool,
        checkpoint_dir: str | Path,
        keep_last: int,
    ):
        self.layout = layout
        self.model = self._wrap(model_chunks, bool(distributed_optimizer))
        self.optimizer, self.scheduler = build_optimizer(
            self.model,
            optim if isinstance(optim, OptimConfig) else OptimConfig(**optim),
            max_steps=max_steps,
            grad_clip=grad_clip,
            params_dtype=get_model_config(self.model[0]).params_dtype,
            distributed_optimizer=bool(distributed_optimizer),
        )
        config = get_model_config(self.model[0])
        config.no_sync_func = [m.no_sync for m in self.model] if len(self.model) > 1 else self.model[0].no_sync
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = self.optimizer.scale_loss
        if self.ddp_config.overlap_grad_reduce:  # Megatron-LM's training.py: reduce each chunk as its grads are done
            syncs = [m.start_grad_sync for m in self.model]
            config.grad_sync_func = syncs if len(syncs) > 1 else syncs[0]
        if self.ddp_config.overlap_param_gather:  # ... and gather each chunk's updated weights before its forward
            syncs = [m.start_param_sync for m in self.model]
            config.param_sync_func = syncs if len(syncs) > 1 else syncs[0]
        self.forward_backward = get_forward_backward_func()
        self.checkpointer = Checkpointer(checkpoint_dir, keep_last, layout)
        self.shards = MegatronShards(self.model, self.optimizer)
        self.report_groups = [ps.get_data_parallel_group(), ps.get_pipeline_model_parallel_group()]

    # -- setup -----------------------------------------------------------------------------------------
    def _wrap(self, chunks: list[torch.nn.Module], distributed_optimizer: bool) -> list[torch.nn.Module]:
        """Megatron-LM's wrapping: Float16Module for bf16, then DDP with fp32 grad buffers."""
        config = get_model_config(chunks[0])
        config.calculate_per_token_loss = True  # read by DDP and the schedules: see afm_core.train.loss
        if config.pipeline_dtype is None:
            config.pipeline_dtype = config.params_dtype
        if not self.layout.on_gpu:
            # gloo pairs the batched isend/irecv of two ranks in posting order: with PP=2 and virtual stages the
            # activation and the gradient crossing between the same two ranks were swapped (wrong losses).
            # Megatron's unbatched p2p orders sends/receives by even/odd pipeline rank instead.
            config.batch_p2p_comm = False
        if config.bf16:
            chunks = [Float16Module(config, m) for m in chunks]
        self.ddp_config = ddp_config(
            distributed_optimizer=distributed_optimizer,
            on_gpu=self.layout.on_gpu,
            dp=self.layout.dp,
        )
        wrapped = [
            _DistributedDataParallel(config=config, ddp_config=self.ddp_config, module=m, disable_bucketing=i > 0)
            for i, m in enumerate(chunks)
        ]
        if not self.ddp_config.overlap_grad_reduce:  # grads reduced after backward: a loss may write main_grad
            for chunk in wrapped:
                for module in chunk.modules():
                    if hasattr(module, "grad_into_main_grad"):  # the fused loss and the local spec's linears
                        module.grad_into_main_grad = True
        return wrapped

    def sync_params(self) -> None:
        """Finish the pending parameter all-gather of the distributed optimizer (``overlap_param_gather``), so the
        weights are complete before an eval, a checkpoint or an export (Megatron-LM's ``force_param_sync``)."""
        finish_param_gather(self.model)

    def release_training_state(self) -> None:
        """Drop the optimizer state (AdamW moments) and the gradient buffers' contents when training is over (the
        last checkpoint holds them), so what follows (the HF export) has that memory: 12 bytes/param in fp32.
        The trainer cannot take another step afterwards."""
        for chained in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = getattr(chained, "optimizer", None)
            if inner is not None:
                inner.state.clear()
        self._release_grad_buffers()

    def _release_grad_buffers(self) -> None:
        """Zero the fp32 grad buffers by page release (:func:`~afm_core.utils.host_memory.zero_by_release`): at a
        step boundary their contents are spent (the next step zeroes them first), so on CPU their pages need not
        stay resident through an eval, a checkpoint write or an export."""
        for chunk in self.model:
            for buffer in chunk.buffers + chunk.expert_parallel_buffers:
                zero_by_release(buffer.grad_data)

    # -- one step --------------------------------------------------------------------------------------
    def run_schedule(
        self, micro_batches: Any, forward_step: Any, *, seq_length: int, micro_batch_size: int, forward_only: bool
    ) -> list[Any]:
        """megatron-core's forward(-backward) schedule over ``micro_batches`` (a sized iterable, read once per
        model chunk) with ``forward_step`` (megatron's ``forward_step_func``: ``(data_iterator, model) ->
        (output, loss_func)``); ``seq_length`` x ``micro_batch_size`` is the activation shape sent between
        pipeline stages. Returns the loss reports of the micro batches (last pipeline stage; others get none)."""
        iterators = [iter(micro_batches) for _ in self.model]
        return self.forward_backward(
            forward_step_func=forward_step,
            data_iterator=iterators if len(iterators) > 1 else iterators[0],
            model=self.model,
            num_microbatches=len(micro_batches),
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
        )

    def step(
        self, micro_batches: Any, forward_step: Any, *, seq_length: int, micro_batch_size: int, what: str
    ) -> tuple[list[Any], float, float]:
        """One optimizer step over ``micro_batches`` with ``forward_step``'s loss (see :meth:`run_schedule`):
        gradients zeroed, accumulated, reduced over DP, scaled by the reported token count (per-token loss),
        clipped, applied; the LR schedule advances.

        Returns:
            ``(loss reports of the micro batches, grad norm, lr used)``.
        Raises:
            FloatingPointError: non-finite gradients (``what`` names the update).
        """
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        lr = self.optimizer.param_groups[0]["lr"]
        reports = self.run_schedule(
            micro_batches, forward_step, seq_length=seq_length, micro_batch_size=micro_batch_size, forward_only=False
        )
        update_ok, grad_norm, _ = self.optimizer.step()
        if not update_ok or (grad_norm is not None and not math.isfinite(grad_norm)):
            raise FloatingPointError(f"{what}: non-finite gradients (grad norm {grad_norm})")
        self.scheduler.step(increment=1)
        return list(reports), float(grad_norm), float(lr)

    # -- checkpoints -----------------------------------------------------------------------------------
    def save(self, step: int, common: dict[str, Any], rank_state: dict[str, Any] | None = None) -> Path:
        """Write ``checkpoint_dir/step_N`` (every rank calls it): model, optimizer, the LR schedule and ``common``
        (rank 0's copy, identical on every rank as dist_checkpointing wants), and this rank's ``rank_state``.

        The spent gradients are released first: megatron's writer clones every tensor view it saves
        (``dist_checkpointing/strategies/filesystem_async.py`` ``prepare_write_data``), and the SwiGLU halves of
        ``linear_fc1``'s weight and of its AdamW moments are views (``transformer/mlp.py``
        ``apply_swiglu_sharded_factory``): 12 bytes per fc1 parameter, 0.6 GB at SmolLM2-135M, on top of
        everything else. With the 4 bytes/param of gradients still resident, the save, not training, set the
        SFT job's peak resident memory."""
        self.sync_params()
        self._release_grad_buffers()
        shared = [{**common, "scheduler": self.scheduler.state_dict()}]
        torch.distributed.broadcast_object_list(shared, src=0)  # dist_checkpointing wants identical commons
        return self.checkpointer.save(step, self.shards, shared[0], rank_state or {})

    def load(self, path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        """Load the checkpoint ``path`` into the model, optimizer and LR schedule (collective); returns its
        ``(common, this rank's state)``."""
        common, rank_state = self.checkpointer.load(path, self.shards)
        self.scheduler.load_state_dict(common["scheduler"])
        return common, rank_state


def reads_packed_seq_params(chunks: list[torch.nn.Module]) -> bool:
    """Whether every attention of the model chunks reads ``thd`` ``PackedSeqParams``: transformer-engine's
    ``TEDotProductAttention`` or :class:`~afm_core.models.attention.SDPAttention` (megatron's local
    ``DotProductAttention`` rejects them)."""
    kinds = [
        isinstance(m, SDPAttention) or type(m).__name__ == "TEDotProductAttention"
        for chunk in chunks
        for m in chunk.modules()
        if type(m).__name__.endswith("DotProductAttention") or isinstance(m, SDPAttention)
    ]
    return bool(kinds) and all(kinds)
