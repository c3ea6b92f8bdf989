"""One request between the agent loop's engine interface and vLLM, for both wrappers (``AsyncLLM``:
:mod:`afm_core.rollout.vllm_engine`; ``LLMEngine`` in this process: :mod:`afm_core.rollout.vllm_inproc`): the
``SamplingParams`` of a :class:`~afm_core.rollout.engine.SamplingConfig`, the ``LoRARequest`` of the adapter the
engine serves (:class:`ServedAdapter`), and vLLM's ``RequestOutput`` as a
:class:`~afm_core.rollout.engine.Generation` (the final output, or the ``DELTA`` outputs joined)."""

from __future__ import annotations

from typing import Any

from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.sampling_params import RequestOutputKind

from afm_core.rollout.engine import EngineError, Generation, SamplingConfig
from afm_core.rollout.vllm_settings import VLLMConfig


def sampling_params(sampling: SamplingConfig, per_request_seeds: bool, delta: bool = False) -> Any:
    """vLLM ``SamplingParams`` of one sample: the stop string kept, sampled logprobs; the final output only, or
    with ``delta`` each step's new tokens (``RequestOutputKind.DELTA``: what an aborted request sampled is then
    known, :class:`~afm_core.rollout.vllm_inproc.InprocVLLMEngine`)."""
    return SamplingParams(
        n=1,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k if sampling.top_k > 0 else -1,
        max_tokens=sampling.max_tokens,
        stop=list(sampling.stop) or None,
        include_stop_str_in_output=True,
        seed=sampling.seed if per_request_seeds else None,
        logprobs=0 if sampling.logprobs else None,
        skip_special_tokens=False,
        ignore_eos=sampling.ignore_eos,
        output_kind=RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY,
    )


def to_generation(final: Any, sampling: SamplingConfig, request_id: str, paused: bool = False) -> Generation:
    """A finished vLLM ``RequestOutput`` (``FINAL_ONLY``: every token) as a
    :class:`~afm_core.rollout.engine.Generation`; ``paused``: an abort that
    :meth:`~afm_core.rollout.vllm_engine.VLLMEngine.pause` caused.

    Raises:
        EngineError: vLLM returned no output.
    """
    if final is None or not final.outputs:
        raise EngineError(f"vLLM returned no output for request {request_id}")
    out = final.outputs[0]
    logprobs = None
    if sampling.logprobs and out.logprobs is not None:
        logprobs = [float(step[token].logprob) for token, step in zip(out.token_ids, out.logprobs)]
    stop_reason = out.stop_reason if isinstance(out.stop_reason, str) else None
    finish_reason = out.finish_reason or "stop"
    return Generation(
        token_ids=list(out.token_ids),
        logprobs=logprobs,
        text=out.text,
        finish_reason=finish_reason,
        stop_reason=stop_reason,
        paused=paused and finish_reason == "abort",
    )


class DeltaOutputs:
    """One request's ``RequestOutputKind.DELTA`` outputs joined: the ids, logprobs and text so far, and at the end
    the :class:`~afm_core.rollout.engine.Generation` that :func:`to_generation` makes of the ``FINAL_ONLY`` output
    (the same ids, logprobs, text, finish and stop reasons: vLLM's delta texts are consecutive slices of the text
    its ``FINAL_ONLY`` output holds, ``vllm/v1/engine/detokenizer.py`` ``get_next_output_text``, with no
    hold-back as the stop string is kept)."""

    def __init__(self, sampling: SamplingConfig) -> None:
        self.sampling = sampling
        self.token_ids: list[int] = []
        self.logprobs: list[float] | None = [] if sampling.logprobs else None
        self.texts: list[str] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | None = None

    def add(self, output: Any) -> None:
        """Append one step's ``RequestOutput``."""
        out = output.outputs[0]
        self.token_ids += out.token_ids
        if self.logprobs is not None:
            if out.logprobs is None:
                self.logprobs = None
            else:
                self.logprobs += [float(step[token].logprob) for token, step in zip(out.token_ids, out.logprobs)]
        self.texts.append(out.text)
        if output.finished:
            self.finish_reason = out.finish_reason or "stop"
            self.stop_reason = out.stop_reason if isinstance(out.stop_reason, str) else None

    def generation(self, paused: bool = False) -> Generation:
        """The request's :class:`~afm_core.rollout.engine.Generation`; ``paused``: what it sampled before a pause
        aborted it (``finish_reason="abort"``)."""
        return Generation(
            token_ids=list(self.token_ids),
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            text="".join(self.texts),
            finish_reason="abort" if paused else self.finish_reason or "stop",
            stop_reason=None if paused else self.stop_reason,
            paused=paused,
        )


class ServedAdapter:
    """The one LoRA adapter an engine serves, the RL policy's (``enable_lora``, ``max_loras=1``): every request
    carries :attr:`request`, and each weight sync swaps in a new ``LoRARequest`` (:meth:`swap`) under the next
    int id and name: vLLM loads an adapter once per int id (``vllm/lora/worker_manager.py``,
    ``LRUCacheWorkerLoRAManager.add_adapter``) and keys the prefix cache's blocks by its name and path
    (``vllm/v1/core/kv_cache_utils.py``, ``_gen_lora_extra_hash_keys``), so a new id, name and directory per sync
    make it read the new weights and reuse no KV computed with the old ones. (verl removes and re-adds its
    adapter at every sync too, from tensors through a patched loader: ``verl/utils/vllm/utils.py``
    ``TensorLoRARequest``.) The ids count the same on every rank of a lockstep group (each rank swaps at the same
    syncs), so the group's schedulers see the same requests."""

    def __init__(self) -> None:
        self.request: LoRARequest | None = None
        self.next_id = 1  # vLLM's LoRA ids are positive

    def swap(self, path: str) -> tuple[LoRARequest, int | None]:
        """A new ``LoRARequest`` of the PEFT adapter directory ``path`` under :attr:`next_id`, made :attr:`request`,
        and the id of the one it replaces (None: the first) for the engine to drop (``remove_lora``)."""
        old = self.request.lora_int_id if self.request is not None else None
        self.request = LoRARequest(f"policy-{self.next_id}", self.next_id, str(path))
        self.next_id += 1
        return self.request, old


class ServesAdapter:
    """What a weight sync reads of an engine that may serve the policy's LoRA adapter (both vLLM engines: the
    ``AsyncLLM`` one and the in-process one); the class has ``cfg`` (its ``VLLMConfig``) and ``adapter`` (its
    :class:`ServedAdapter`)."""

    cfg: VLLMConfig
    adapter: ServedAdapter

    @property
    def serves_adapters(self) -> bool:
        """The engine was started with LoRA (``cfg.max_lora_rank`` > 0): a weight sync may send adapters only."""
        return self.cfg.max_lora_rank > 0

    @property
    def adapter_dir(self) -> str | None:
        """Where the trainer writes the adapters this engine loads (``cfg.lora_dir``)."""
        return self.cfg.lora_dir

    @property
    def model_dir(self) -> str:
        """The HF checkpoint directory the engine serves (``cfg.model``): a LoRA adapter's base."""
        return self.cfg.model

    @property
    def next_adapter_id(self) -> int:
        """The int id the next :meth:`load_adapter` gives its ``LoRARequest``."""
        return self.adapter.next_id
