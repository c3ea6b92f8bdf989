"""SFT on megatron-core: :class:`SFTTrainer`, the SFT loop (:class:`~afm_core.train.loop.SFTLoop`) over the one trainer
core (:class:`~afm_core.engine.core.MegatronTrainer`, which it holds as RL's policy does) with the SFT objective.

One optimizer step consumes ``global_batch_size`` packed sequences: ``num_microbatches = global_batch_size /
(micro_batch_size * dp)`` micro batches on each DP rank, run through ``get_forward_backward_func()`` (no
pipelining for PP=1, 1F1B for PP>1, interleaved 1F1B with virtual stages), gradients accumulated in megatron
DDP's fp32 buffers, reduced over DP, scaled by 1 / (unmasked tokens of the global batch) (see
:mod:`afm_core.train.loss`), clipped, and applied by megatron's AdamW (:mod:`afm_core.engine.optim`). The loss is
the ``trainer.objective``'s (:mod:`afm_core.train.objective`): observation-masked SFT by default, or AutoCoA's
contrastive pair loss (then scaled by 1 / pairs of the global batch).

A micro batch is a dict of CPU tensors (the data loader's contract):
    tokens [b, s] int64, labels [b, s] int64 (next-token targets; any value where loss_mask is 0),
    loss_mask [b, s] (1 = trained target token), position_ids [b, s] int64, and optionally
    attention_mask [b, 1, s, s] bool (True = masked out; block-causal for packed documents; absent: causal).
``b = trainer.micro_batch_size`` and ``s = trainer.seq_length`` are fixed (pipeline send/recv shapes).
When the model's attention reads ``PackedSeqParams`` (transformer-engine's on GPU, our
:class:`~afm_core.models.attention.SDPAttention` on the local spec) and the batch has ``cu_seqlens``
(``b`` int tensors ``[d_i + 1]`` of document offsets), the micro batch goes to the model in the ``thd`` format, as
Megatron-LM packs it: the ``b`` rows laid end to end as one ``[1, b * s]`` row, each document (and each row's
trailing padding) a sequence of its own with RoPE positions restarting at 0; no dense mask is needed or read.
Otherwise the ``attention_mask`` (built from ``cu_seqlens`` when absent) goes to the attention.

"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from afm_core.config.sft import LoopConfig
from afm_core.data.loader import StepMicroBatches
from afm_core.data.packing import block_causal_attention_mask, thd_offsets
from afm_core.engine.core import MegatronTrainer, reads_packed_seq_params
from afm_core.engine.distributed import ParallelLayout
from afm_core.engine.preemption import Preemption
from afm_core.models.attention import PackedDocuments
from afm_core.models.gpt import OutputRows
from afm_core.models.local_spec import compile_transformer_layers, set_compiled_elementwise
from afm_core.train.loop import MicroBatchSource, Progress, SFTLoop
from afm_core.train.objective import Objective, build_objective


def thd_packed_seq_params(cu_seqlens: list[torch.Tensor], seq_length: int, device: torch.device) -> PackedSeqParams:
    """``thd`` parameters for ``b`` packed sequences laid end to end as one row of ``b * seq_length`` tokens
    (:func:`~afm_core.data.packing.thd_offsets`), with the offsets on ``device`` and on the host
    (:class:`~afm_core.models.attention.PackedDocuments`): built once per micro batch, read by every layer.

    Args:
        cu_seqlens: ``b`` int tensors ``[d_i + 1]`` of document offsets in tokens (the loader's ``cu_seqlens``).
        seq_length: tokens in each packed sequence.
    Raises:
        ValueError: offsets that do not rise from 0 to at most ``seq_length``.
    """
    return PackedDocuments.from_offsets(thd_offsets(cu_seqlens, seq_length), device)


class SFTTrainer(SFTLoop):
    """Runs observation-masked SFT on prebuilt megatron model chunks: the :class:`SFTLoop` over a
    :class:`MegatronTrainer` it holds (``self.core``), as the RL policy (:class:`afm_core.rl.policy_trainer.PolicyTrainer`)
    holds its own. ``model``, ``optimizer`` and ``report_groups`` are the core's.

    Args:
        config, layout, train_data, eval_batches, run_dir, max_steps, resume_from, preemption: as for
            :class:`SFTLoop` (``config.optim``: AdamW and its schedule; ``config.parallel.distributed_optimizer``).
        model_chunks: unwrapped GPTModel chunk(s) of this rank, weights already loaded, on ``layout.device``,
            in their training dtype (bf16 or fp32).
        thd_packing: give batches with ``cu_seqlens`` to the model in the ``thd`` format (module docstring);
            None: whenever the model's attention reads ``PackedSeqParams`` (:func:`reads_packed_seq_params`).
        objective: what the loss is (:mod:`afm_core.train.objective`); None: ``config.trainer.objective`` with
            ``config.contrastive``.
    Raises:
        ValueError: the batch sizes do not divide (names the config fields), ``thd_packing=True`` on a model
            whose attention ignores ``PackedSeqParams``, or ``trainer.compile_layers`` with packed documents off
            CUDA.
    """

    def __init__(
        self,
        config: LoopConfig,
        layout: ParallelLayout,
        model_chunks: list[torch.nn.Module],
        train_data: MicroBatchSource,
        eval_batches: list[dict[str, torch.Tensor]],
        run_dir: str | Path,
        max_steps: int,
        resume_from: str | Path | None = None,
        thd_packing: bool | None = None,
        objective: Objective | None = None,
        preemption: Preemption | None = None,
    ):
        super().__init__(config, layout, train_data, eval_batches, run_dir, max_steps, resume_from, preemption)
        t = config.trainer
        self.objective = objective if objective is not None else build_objective(t, config.contrastive)
        reads_thd = reads_packed_seq_params(model_chunks)
        if thd_packing and not reads_thd:
            raise ValueError(
                "thd_packing=True, but the model's attention does not read PackedSeqParams (use "
                "afm_core.models.gpt.gpt_layer_spec)"
            )
        self.thd_packing = reads_thd if thd_packing is None else thd_packing
        set_compiled_elementwise(t.compile)  # process-wide, as megatron's own fusions are
        if t.compile_layers:
            if layout.device.type != "cuda" and self.thd_packing:
                raise ValueError(
                    "trainer.compile_layers=true needs CUDA with packed documents: the CPU attention's document "
                    "offsets are constants of the compiled graph (a recompilation for every micro batch)"
                )
            compile_transformer_layers(model_chunks)
        self.core = MegatronTrainer(
            layout,
            model_chunks,
            optim=config.optim,
            max_steps=max_steps,
            grad_clip=t.grad_clip,
            distributed_optimizer=config.parallel.distributed_optimizer,
            checkpoint_dir=self.run_dir / "checkpoints",
            keep_last=t.keep_last,
        )
        self.model, self.optimizer, self.report_groups = self.core.model, self.core.optimizer, self.core.report_groups
        # the model takes the labelled positions found on the host (gpt.OutputRows): no nonzero on the device
        self.output_rows = all("output_rows" in inspect.signature(chunk.forward).parameters for chunk in model_chunks)
        # the loss's gradient is 1 on every labelled position when the objective is a plain masked sum and the
        # optimizer scales no loss (bf16/fp32; read once here, a device sync)
        self.unit_row_grads = self.objective.unit_row_grads and float(self.optimizer.get_loss_scale()) == 1.0

    def model_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The ``GPTModel.forward`` arguments of a micro batch, on this rank's device (module docstring).

        Returns:
            ``input_ids``, ``position_ids``, ``labels`` (-100 wherever ``loss_mask`` is 0: no loss, and the fused
            output layer + loss of :class:`~afm_core.models.gpt._GPTModel` computes no gradient there),
            ``loss_mask`` (``[b, s]``, or ``[1, b * s]`` in the ``thd`` format), ``attention_mask`` and
            ``packed_seq_params`` (one of them None), and for our ``GPTModel`` ``output_rows`` (the labelled
            positions, :class:`~afm_core.models.gpt.OutputRows`, found on the host from the CPU batch).
        """
        device = self.layout.device
        names = {"input_ids": "tokens", "labels": "labels", "loss_mask": "loss_mask", "position_ids": "position_ids"}
        inputs = {key: batch[name].to(device, non_blocking=True) for key, name in names.items()}
        inputs["labels"] = inputs["labels"].masked_fill(inputs["loss_mask"] == 0, -100)
        inputs["attention_mask"] = inputs["packed_seq_params"] = None
        if self.output_rows:
            mask = batch["loss_mask"]
            labelled = (mask != 0) & (batch["labels"] >= 0)  # where the labels stay >= 0 above
            unit = self.unit_row_grads and bool(((mask == 1) | ~labelled).all())
            inputs["output_rows"] = OutputRows.of(labelled, device, unit_grads=unit)
        if self.thd_packing and batch.get("cu_seqlens") is not None:
            b, s = inputs["input_ids"].shape
            inputs.update(
                {key: inputs[key].reshape(1, b * s) for key in ("input_ids", "labels", "loss_mask", "position_ids")}
            )
            inputs["packed_seq_params"] = thd_packed_seq_params(batch["cu_seqlens"], s, device)
        elif batch.get("attention_mask") is not None:
            inputs["attention_mask"] = batch["attention_mask"].to(device, non_blocking=True)
        elif batch.get("cu_seqlens") is not None:
            inputs["attention_mask"] = torch.cat(
                [block_causal_attention_mask(c, self.seq_length) for c in batch["cu_seqlens"]]
            ).to(device)
        return inputs

    def _forward_step(self, data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module):
        batch = next(data_iterator)
        inputs = self.model_inputs(batch)
        loss_mask = inputs.pop("loss_mask")
        output = model(inputs.pop("input_ids"), inputs.pop("position_ids"), inputs.pop("attention_mask"), **inputs)
        return output, self.objective.loss_func(batch, loss_mask)

    def _run_schedule(self, micro_batches: Any, forward_only: bool):
        seq_length, micro_batch_size = self._shape()
        return self.core.run_schedule(
            micro_batches,
            self._forward_step,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
        )

    def _shape(self) -> tuple[int, int]:
        """The activation shape between pipeline stages: ``thd`` sends a micro batch's b rows as one row."""
        if self.thd_packing:
            return self.micro_batch_size * self.seq_length, 1
        return self.seq_length, self.micro_batch_size

    def train_step(self) -> dict[str, float]:
        """One optimizer step over the next global batch; returns loss, tokens, lr and grad_norm."""
        # Each micro batch is built when the schedule asks for it, not all of the step's up front.
        micro_batches = StepMicroBatches(self.train_data, self.num_microbatches, check=self._check_batch)
        seq_length, micro_batch_size = self._shape()
        reports, grad_norm, lr = self.core.step(
            micro_batches,
            self._forward_step,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            what=f"optimizer step {self.progress.step + 1}",
        )
        return {**self.objective.reduce(reports, self.report_groups), "lr": lr, "grad_norm": grad_norm}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The objective's held-out metrics (``loss``, ``tokens``, ...) over the micro batches of all DP ranks."""
        self.core.sync_params()
        for chunk in self.model:
            chunk.eval()
        reports = self._run_schedule(self.eval_batches, forward_only=True)
        for chunk in self.model:
            chunk.train()
        return self.objective.reduce(reports, self.report_groups)

    # -- checkpoints -----------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/step_N`` (every rank calls it; :meth:`MegatronTrainer.save`) with the step
        counters and this rank's data-loader position."""
        return self.core.save(
            self.progress.step, {"progress": asdict(self.progress)}, {"data": self.train_data.state_dict()}
        )

    def _resume(self) -> Path | None:
        path = self._find_checkpoint()
        if path is None:
            return None
        common, rank_state = self.core.load(path)
        self.progress = Progress(**common["progress"])
        if "data" in rank_state:
            self.train_data.load_state_dict(rank_state["data"])
        if self.layout.is_rank0 and not path.is_relative_to(self.run_dir):
            self._seed_metrics_from(path.parent.parent / "metrics.jsonl")
        return path
