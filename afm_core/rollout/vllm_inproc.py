"""vLLM's engine core in THIS process (:class:`InprocVLLMEngine`), and :class:`Lockstep`, which keeps the engines
of one vLLM tensor-parallel group in step.

vLLM's ``LLMEngine`` with its ``InprocClient`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) is stepped from the event
loop, so that a weight update hands tensors to the worker by reference. With
``distributed_executor_backend="external_launcher"`` the worker joins the caller's ``torch.distributed`` world
(vLLM ``examples/offline_inference/torchrun_example.py``,
``vllm/v1/executor/uniproc_executor.py::ExecutorWithExternalLauncher``): vLLM's TP groups are consecutive ranks of
that world, and every rank of a group must feed its engine the same requests in the same order (:class:`Lockstep`).
On GPU this is RL colocation: with ``enable_sleep_mode`` :meth:`InprocVLLMEngine.sleep` frees the weights and the
KV cache while the trainer runs (vLLM docs, "Sleep Mode": CUDA only). :meth:`VLLMEngine.start
<afm_core.rollout.vllm_engine.VLLMEngine.start>` gives this engine for ``VLLMConfig.in_process``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from vllm import LLM
from vllm.inputs import TokensPrompt

from afm_core.rollout.engine import EngineDead, EngineError, Generation, SamplingConfig
from afm_core.rollout.vllm_platform import engine_args, modules_hidden_from_vllms_kernel_scan, unlink_cpu_shm_files
from afm_core.rollout.vllm_requests import DeltaOutputs, ServedAdapter, ServesAdapter, sampling_params
from afm_core.rollout.vllm_settings import VLLMConfig
from afm_core.utils.hardware import cuda_available
from afm_core.utils.process_exit import freeze_heap

Command = tuple[Any, ...]  # ("add", request_id, prompt ids, SamplingParams) | ("abort", request_id)


class Lockstep:
    """Keeps the engines of one vLLM tensor-parallel group in step (``external_launcher``, TP > 1).

    vLLM's external launcher runs one engine per rank, and the ranks of a TP group exchange activations inside
    every forward: their schedulers must see the same requests in the same order between the same ``step()``
    calls, or the batches differ and the collectives hang (vLLM ``ExecutorWithExternalLauncher``: "all the
    engines ... process the same prompts"). Agent loops submit requests at times set by tool latencies, so
    only the group's leader (its first rank) runs them; before each step it broadcasts the requests added and
    aborted since the last one, and the followers (:meth:`InprocVLLMEngine.follow`) apply them and step too.

    Args:
        group: a ``torch.distributed`` process group of the TP group's ranks with a CPU (gloo) backend.
        leader: the global rank of the group's first rank.
    """

    def __init__(self, group: Any, leader: int):
        self.group, self.leader = group, leader

    def exchange(self, message: Any = None) -> Any:
        """The leader's ``message`` on every rank of the group (collective)."""
        box = [message]
        dist.broadcast_object_list(box, src=self.leader, group=self.group)
        return box[0]


@contextlib.contextmanager
def _one_collection_after() -> Iterator[None]:
    """The block's ``gc.collect()`` calls skipped, and one full collection (and, on a GPU, ``empty_cache``) run after
    it: vLLM's shutdown collects three times over the whole heap (``_cleanup_profiling_kv_cache``, then
    ``cleanup_dist_env_and_memory`` after ``gc.unfreeze()``: vllm/v1/worker/gpu_model_runner.py,
    vllm/distributed/parallel_state.py; ~0.3 s each on 2 CPU cores), before the engine itself is unreferenced, so
    none of them frees the engine's cycles that the collection after does. For this thread's block only: the
    process's other threads do not call ``gc.collect``."""
    collect = gc.collect
    gc.collect = lambda generation=2: 0  # type: ignore[assignment]
    try:
        yield
    finally:
        gc.collect = collect
        collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class InprocVLLMEngine(ServesAdapter):
    """vLLM's ``LLMEngine`` in this process behind :class:`~afm_core.rollout.engine.GenerationEngine`.

    Requests from concurrent coroutines are queued; one stepping task (on the caller's event loop) adds them to
    the engine and calls ``LLMEngine.step()`` until none is left, resolving each request when it finishes. Each
    request streams ``RequestOutputKind.DELTA`` outputs, joined as they come (:class:`DeltaOutputs`), so that
    :meth:`pause` can hand back what an aborted request sampled (vLLM's ``LLMEngine`` returns no output for an
    aborted request).
    A step blocks the loop for one forward pass; between steps the loop runs whatever became ready (tool
    replies, graders), so batching stays continuous. ``collective_rpc`` hands arguments to the worker by
    reference (weight sync without copies), and must not run while requests are in flight.

    With a :class:`Lockstep` (``lockstep`` attribute; set on every rank of a TP group > 1) the leader runs the
    agent loop and each of its steps is mirrored by the followers, which call :meth:`follow` instead of
    generating; :meth:`end_round` releases them.
    """

    in_process = True  # tensors reach the worker by reference

    def __init__(self, cfg: VLLMConfig, llm: Any) -> None:
        self.cfg, self.llm = cfg, llm
        self.max_model_len = cfg.max_model_len
        self.per_request_seeds = cuda_available()  # vLLM-CPU: the engine's generator (vllm_platform)
        self._ids = itertools.count()
        self._paused = False
        self.lockstep: Lockstep | None = None
        self._futures: dict[str, asyncio.Future] = {}
        self._outputs: dict[str, DeltaOutputs] = {}  # the outputs of the requests in _futures so far
        self.sampled_tokens = 0  # tokens the engine's steps returned, live (a round's token budget reads it)
        self._commands: list[Command] = []
        self._stepper: asyncio.Task | None = None
        self.adapter = ServedAdapter()  # the LoRA adapter every request carries (cfg.max_lora_rank > 0)

    @classmethod
    def create(cls, cfg: VLLMConfig) -> InprocVLLMEngine:
        """Build the in-process engine (blocking; ~3 s on CPU for SmolLM2-135M).

        vLLM reads ``VLLM_ENABLE_V1_MULTIPROCESSING`` when the engine is created; it is set to 0 for this
        process (vLLM sets it too for ``external_launcher``).
        """
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        freeze_heap()  # vLLM's five whole-heap collections at start then see the engine's objects only
        with modules_hidden_from_vllms_kernel_scan():
            llm = LLM(**engine_args(cfg))
        unlink_cpu_shm_files()
        return cls(cfg, llm)

    # -- generation ------------------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig, request_id: str) -> Generation:
        """One sample from ``prompt_ids`` (see :class:`~afm_core.rollout.engine.GenerationEngine`).

        Raises:
            EngineError: vLLM rejected the request or the engine failed.
            RuntimeError: called on a follower rank of a lockstep group.
        """
        if self.lockstep is not None and not self._is_leader():
            raise RuntimeError("InprocVLLMEngine.generate on a follower rank: call follow() there")
        if self._paused:
            return Generation.refused_while_paused()
        rid = f"{request_id}#{next(self._ids)}"
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._futures[rid] = future
        self._outputs[rid] = DeltaOutputs(sampling)
        self._commands.append(("add", rid, list(prompt_ids), sampling_params(sampling, self.per_request_seeds, True)))
        self._ensure_stepper()
        try:
            return await future
        except asyncio.CancelledError:  # the agent loop gave up on the trajectory (timeout)
            self._outputs.pop(rid, None)
            if self._futures.pop(rid, None) is not None:
                self._commands.append(("abort", rid))
            raise

    def _ensure_stepper(self) -> None:
        if self._stepper is None or self._stepper.done():
            self._stepper = asyncio.ensure_future(self._step_until_idle())

    def _resolve(self, rid: str, paused: bool = False) -> None:
        """Hand a request's Generation to its caller (finished, or aborted by :meth:`pause`)."""
        future, outputs = self._futures.pop(rid, None), self._outputs.pop(rid, None)
        if future is not None and outputs is not None and not future.done():
            future.set_result(outputs.generation(paused=paused))

    async def pause(self) -> None:
        """Pause generation (see :meth:`~afm_core.rollout.engine.GenerationEngine.pause`): every request in
        flight is aborted through the command path (a lockstep group's followers abort it too, before the same
        step) and returns the tokens, logprobs and text its ``DELTA`` outputs brought so far; a request not yet
        added to vLLM returns empty. Returns once the stepping task has applied the aborts and stopped."""
        self._paused = True
        queued = {command[1] for command in self._commands if command[0] == "add"}
        self._commands = [command for command in self._commands if command[1] not in queued]
        for rid in list(self._futures):
            if rid in queued:
                self._resolve(rid, paused=True)
            else:
                self._commands.append(("abort", rid))
        if self._commands:
            self._ensure_stepper()
        await self.idle()

    async def resume(self) -> None:
        """Undo :meth:`pause`."""
        self._paused = False

    def _is_leader(self) -> bool:
        return self.lockstep is None or dist.get_rank() == self.lockstep.leader

    def _apply(self, commands: list[Command]) -> list[tuple[str, Exception]]:
        """Add / abort requests on this rank's engine; the requests vLLM rejected, with the error."""
        engine, rejected = self.llm.llm_engine, []
        for command in commands:
            if command[0] == "add":
                _, rid, prompt_ids, params = command
                try:
                    engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt_ids), params,
                                       lora_request=self.adapter.request)  # fmt: skip
                except Exception as e:  # vLLM's input validation: same outcome on every rank of a group
                    rejected.append((rid, e))
            else:
                engine.abort_request([command[1]])
        return rejected

    async def _step_until_idle(self) -> None:
        engine = self.llm.llm_engine
        try:
            while self._commands or engine.has_unfinished_requests():
                commands, self._commands = self._commands, []
                if self.lockstep is not None:
                    self.lockstep.exchange(("step", commands))
                for rid, error in self._apply(commands):
                    future = self._futures.pop(rid, None)
                    self._outputs.pop(rid, None)
                    if future is not None and not future.done():
                        future.set_exception(EngineError(f"vLLM rejected request {rid}: {error}"))
                for command in commands:  # a cancelled caller's request is gone from _futures: only pause's remain
                    if command[0] == "abort" and command[1] in self._futures:
                        self._resolve(command[1], paused=True)
                if engine.has_unfinished_requests():
                    for output in engine.step():
                        outputs = self._outputs.get(output.request_id)
                        if outputs is not None:
                            outputs.add(output)
                            self.sampled_tokens += len(output.outputs[0].token_ids)
                            if output.finished:
                                self._resolve(output.request_id)
                await asyncio.sleep(0)  # let the coroutines whose requests finished submit their next ones
        except Exception as e:  # the engine itself failed: every waiting request fails with it
            for future in self._futures.values():
                if not future.done():
                    future.set_exception(EngineDead(f"vLLM engine step failed: {e.__class__.__name__}: {e}"))
            self._futures.clear()
            self._outputs.clear()
            raise

    async def idle(self) -> None:
        """Return once the requests of cancelled callers are aborted in vLLM and none is in flight (the stepping
        task applies the aborts and stops; on a lockstep leader the followers apply them too)."""
        while self._stepper is not None and not self._stepper.done():
            await asyncio.wait({self._stepper})

    def end_round(self) -> None:
        """Leader of a lockstep group: release the followers from :meth:`follow` (after a generation round)."""
        if self.lockstep is not None:
            self.lockstep.exchange(("end", []))

    def follow(self) -> int:
        """Follower of a lockstep group: mirror the leader's adds, aborts and steps until it ends the round.

        Returns:
            Steps taken.
        """
        if self.lockstep is None:
            return 0
        engine, steps = self.llm.llm_engine, 0
        while True:
            kind, commands = self.lockstep.exchange()
            if kind == "end":
                return steps
            self._apply(commands)
            if engine.has_unfinished_requests():
                engine.step()
                steps += 1

    # -- weights and memory ----------------------------------------------------------------------------
    def _check_idle(self, what: str) -> None:
        if self._futures or self._commands:
            raise RuntimeError(f"{what} while {len(self._futures)} requests are in flight")

    async def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        """Call ``method`` on this process's vLLM worker with ``args`` by reference (no serialisation).

        Raises:
            RuntimeError: requests are in flight.
        """
        self._check_idle(f"collective_rpc({method!r})")
        return self.llm.collective_rpc(method, args=args, kwargs=kwargs)

    async def reset_prefix_cache(self) -> None:
        """Drop cached KV (after a weight update it was computed with the old weights)."""
        self.llm.reset_prefix_cache()

    async def load_adapter(self, path: str) -> int:
        """Serve the PEFT adapter directory ``path`` (``adapter_config.json`` + ``adapter_model.safetensors``) from
        now on: the previous adapter is removed and this one loaded at once (vLLM ``LLMEngine.remove_lora`` /
        ``add_lora``, read from disk by the worker's LoRA manager), and every later request carries it
        (:class:`~afm_core.rollout.vllm_requests.ServedAdapter`). Returns its int id.

        Raises:
            RuntimeError: requests are in flight, or the engine was started without LoRA.
        """
        self._check_idle("load_adapter")
        if not self.serves_adapters:
            raise RuntimeError("load_adapter: the engine was started without LoRA (VLLMConfig.max_lora_rank=0)")
        request, old = self.adapter.swap(path)
        engine = self.llm.llm_engine
        if old is not None:
            engine.remove_lora(old)
        engine.add_lora(request)
        return request.lora_int_id

    async def sleep(self, level: int = 1) -> None:
        """Free GPU memory while the trainer runs (vLLM ``LLM.sleep``): level 1 offloads the weights to CPU
        memory and drops the KV cache, level 2 drops both. A no-op without ``enable_sleep_mode``.

        Raises:
            RuntimeError: requests are in flight.
        """
        self._check_idle("sleep")
        if self.cfg.enable_sleep_mode:
            self.llm.sleep(level=level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-allocate what :meth:`sleep` freed: ``["weights"]`` before a weight sync, ``["kv_cache"]`` before
        generating (vLLM ``LLM.wake_up``); None: both. A no-op without ``enable_sleep_mode``."""
        if self.cfg.enable_sleep_mode:
            self.llm.wake_up(tags=tags)

    async def close(self) -> None:
        """Shut the in-process engine core down (vLLM's cleanup also destroys torch.distributed's default
        group: close the engine after the trainer's last collective)."""
        if self.llm is not None:
            llm, self.llm = self.llm, None
            with _one_collection_after():
                llm.llm_engine.engine_core.shutdown()
                del llm
