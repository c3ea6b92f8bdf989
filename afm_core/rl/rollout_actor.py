"""The rollout side of one rank: its vLLM engine, tool pool and graders on one long-lived event loop
(:class:`RolloutActor`), started beside this node's tool servers by :func:`start_rollout_actor`.

Colocation (:mod:`afm_core.rl.colocation`): every rank holds its Megatron model chunk and its part of a vLLM
engine running in the same process (vLLM's ``external_launcher`` executor; ``engine.tensor_parallel_size``
consecutive ranks share one engine, whose first rank runs the agent loops while the others follow it step by
step), so a weight sync hands tensors to the worker by reference; on GPU the engine sleeps while the trainer
runs. ``colocation.mode=async`` instead gives every rank an ``AsyncLLM`` at vLLM TP=1 whose engine core runs in a
child process (weights travel as safetensors bytes). The prompts of a generation batch are split over the
engines (each prompt's ``n`` samples on one engine) and the trajectories gathered
(:meth:`RolloutActor.generate` with ``gather``), so every rank feeds the same groups to the dynamic sampler.

One thing over 400 lines: the actor is the one owner of the event loop that its engine, tool pool and graders
share, and each method is a call the driver's parts make on it (a round, a validation, a weight sync, the
engine's sleep and wake-up); what a round is and how a stop ends it are :mod:`afm_core.rl.rounds`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, cast

import torch

from afm_core.config.rl import ActorConfig, ValConfig
from afm_core.engine.distributed import ParallelLayout, gather_objects, training_dtype
from afm_core.engine.preemption import JOB_PREEMPTION, Preemption
from afm_core.eval.runner import validate
from afm_core.rewards.code import SandboxClient
from afm_core.rewards.grader import Graders, custom_reward
from afm_core.rewards.judge import LLMJudge
from afm_core.rl.colocation import Colocation, lockstep_group, select_colocation
from afm_core.rl.grading import grade_rollout
from afm_core.rl.parts import ColocatedEngine, ToolBackend
from afm_core.rl.rollout_buffer import Group
from afm_core.rl.rounds import RolloutAborted, Round, RoundTarget, Stopped, unless_stopped
from afm_core.rl.schedule import Stage
from afm_core.rl.weight_sync import EXTENSION, WeightSyncStats, sync_weights_async
from afm_core.rollout.agent_loop import AgentConfig, AgentLoop, sample_seed
from afm_core.rollout.engine import GenerationEngine, SamplingConfig
from afm_core.rollout.factory import build_engine, load_tokenizer
from afm_core.rollout.simulated_tools import build_tool_runner
from afm_core.rollout.types import AgentTask, FinishReason, PausedTrajectory
from afm_core.tools.job_servers import needed_servers, reachable_tools_cfg, tool_servers
from afm_core.tools.pool import ToolPool
from afm_core.tools.registry import build_tool_pool
from afm_core.utils.hardware import this_node
from afm_core.utils.rng import python_random_kept

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from afm_core.eval.benchmarks import Benchmark
    from afm_core.rollout.vllm_inproc import Lockstep

T = TypeVar("T")


class RolloutActor:
    """This rank's vLLM engine, tool pool and graders on one long-lived event loop.

    Args:
        config: the rollout side's settings (``rollout``, ``reward``, ``judge``, ``engine``, ``tools``, ...).
        hf_dir: the policy's HF checkpoint (the engine's initial weights; the trainer syncs its own after).
        tokenizer: the policy's tokenizer.
        urls: ``{server: url}`` of the tool servers.
        max_model_len: the engine's context (prompt + the largest stage's response budget).
        engine: an already started :class:`~afm_core.rollout.engine.GenerationEngine` to use instead of vLLM.
        colocation: this rank's engine layout (:mod:`afm_core.rl.colocation`); None: a vLLM ``AsyncLLM`` of its
            own (``colocation.mode=async``).
        lockstep: the :class:`~afm_core.rollout.vllm_inproc.Lockstep` of this rank's vLLM TP group (TP > 1).
        preemption: where a stop is asked for (:class:`~afm_core.engine.preemption.Preemption`), polled while a
            round generates; None: the job's (:data:`~afm_core.engine.preemption.JOB_PREEMPTION`).
    """

    def __init__(
        self,
        config: ActorConfig,
        hf_dir: Path,
        tokenizer: PreTrainedTokenizerBase,
        urls: Mapping[str, str],
        max_model_len: int,
        engine: GenerationEngine | None = None,
        colocation: Colocation | None = None,
        lockstep: Lockstep | None = None,
        preemption: Preemption | None = None,
    ):
        self.config, self.hf_dir, self.tokenizer = config, hf_dir, tokenizer
        self.colocation, self.lockstep = colocation, lockstep
        self.preemption = JOB_PREEMPTION if preemption is None else preemption
        self.asleep = False
        self.runner = asyncio.Runner()
        reachable = reachable_tools_cfg(asdict(config.tools), urls)
        self.pool: ToolPool | None = build_tool_pool(reachable, addresses=dict(urls)) if reachable["tools"] else None
        judge = config.judge
        self.graders = Graders(
            custom=custom_reward(config.reward_fn),  # a plug-in reward (docs/plugins.md) grades every task
            sandbox=SandboxClient(urls["sandbox"], timeout_s=config.reward.test_timeout_s)
            if "sandbox" in urls
            else None,
            judge=LLMJudge(judge.url, judge.model, judge.api_key_env) if judge.url and judge.model else None,
        )
        # the layout calls ColocatedEngine's methods only where it has them (sleep mode, lockstep); set below when None
        self.engine = cast("ColocatedEngine", engine)
        self.simulator_engine: GenerationEngine | None = None  # rollout.simulator.model: writes the observations
        self._tool_runner: ToolBackend | None = None
        if self.pool is not None:
            self.run(self.pool.start())
        if engine is None:
            self.start_engine(max_model_len)

    def run(self, coro: Coroutine[object, object, T]) -> T:
        """Run ``coro`` on this actor's event loop; python's ``random`` comes back as it was
        (:func:`afm_core.utils.rng.python_random_kept`: the aiohttp connections of tool calls draw from it as
        timing has it, and the loop runs only here). Nothing run here needs a draw from it (vLLM samples with
        torch's generator; the prompt stream has its own)."""
        with python_random_kept():
            return self.runner.run(coro)

    def start_engine(self, max_model_len: int) -> None:
        """Start vLLM with context ``max_model_len`` (prompt + the largest stage's response budget: an engine
        argument fixed at construction; each stage then caps every request at its own ``max_response_len``)."""
        engine_args: dict[str, object] = {
            **asdict(self.config.engine),
            **(self.colocation.engine_overrides() if self.colocation is not None else {}),
            "max_model_len": int(max_model_len),
            "worker_extension_cls": EXTENSION,
        }
        if self.config.engine.dtype == "auto":  # the colocation's overrides leave the dtype
            # the engine computes in the trainer's dtype on every machine (the policy warns about an emulated bf16):
            # in fp32 their logprobs agree to ~1e-5 (TIS, tests); in bf16 each rounds its own way (~1e-3)
            trainer_dtype = training_dtype(self.config.precision, warn=False)
            engine_args["dtype"] = str(trainer_dtype).removeprefix("torch.")
        if self.config.lora.enabled:  # the engine serves the synced adapters on its base (afm_core.rl.lora_sync)
            engine_args.update(max_lora_rank=self.config.lora.rank,
                               lora_dir=str(Path(self.config.run_dir) / "weight_sync" / "lora"))  # fmt: skip
        set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
        self.engine = cast("ColocatedEngine", self.run(build_engine(engine_args, self.hf_dir, self.tokenizer)))
        set_num_threads(threads)  # vLLM may patch torch's thread setter; the trainer keeps its threads
        if self.lockstep is not None:
            self.engine.lockstep = self.lockstep

    @property
    def follower(self) -> bool:
        """This rank mirrors its vLLM TP group's leader instead of running agent loops."""
        return self.lockstep is not None and self.colocation is not None and not self.colocation.is_leader

    def generate(
        self,
        groups: Sequence[Group],
        tasks: Sequence[AgentTask],
        n: int,
        stage: Stage,
        seed: int,
        *,
        version: int = 0,
        target: RoundTarget | None = None,
        keep_on_stop: bool = False,
        gather: bool = False,
    ) -> Round:
        """Run every unfinished trajectory of ``groups`` (``n`` per group; a paused one continues where it
        stopped, token-in) concurrently on this rank's engine, with policy ``version``'s weights, and grade each
        one that finishes; the groups are filled in place and returned in a :class:`Round`.

        With ``gather`` (collective) ``groups`` are a round the same on every rank, run over the job's engines
        (:attr:`engines`): each engine runs every ``engines``-th group (with ``target``'s group count and token
        budget split among them, rounded up), and the groups of all ranks are gathered, so every rank returns the
        same :class:`Round`.

        Without ``target`` the round ends when every trajectory has (a synchronous round). With one (partial
        rollouts) the engine is paused once ``target.groups`` complete groups that ``target.keeps`` accepts are
        graded, or ``target.tokens`` tokens were sampled: the trajectories in flight come back paused
        (:class:`~afm_core.rollout.types.PausedTrajectory`) and stay in their groups.

        On a follower rank of a vLLM TP group (:attr:`follower`) this mirrors the leader's engine steps and
        returns no group (the leader's carry the group's).

        Raises:
            RolloutAborted: a stop was requested before the round ended (looked for every :data:`STOP_POLL_S`
                seconds, between engine steps) and not ``keep_on_stop``: every trajectory of the round is
                cancelled, its request aborted in vLLM (:meth:`~afm_core.rollout.vllm_inproc.InprocVLLMEngine.idle`
                waits for that), its tool calls and grading too. With ``keep_on_stop`` the engine is paused
                instead and the round returns with ``stopped`` set. With ``gather``: on every rank, when any
                rank's round was aborted.
        """
        here = functools.partial(self._generate_here, tasks=tasks, n=n, stage=stage, seed=seed, version=version,
                                 keep_on_stop=keep_on_stop)  # fmt: skip
        if not gather:
            return here(groups, target)
        # gathered: what differs per engine is its share of the groups and of the target
        engines, engine = self.engines
        if target is not None:
            target = RoundTarget(-(-target.groups // engines), target.keeps,
                                 None if target.tokens is None else -(-target.tokens // engines))  # fmt: skip
        try:
            part: Round | None = here(groups[engine::engines], target)
        except RolloutAborted:
            part = None
        parts = gather_objects(part)
        if any(p is None for p in parts):
            raise RolloutAborted(f"a stop was requested during generation (aborted on ranks "
                                 f"{[r for r, p in enumerate(parts) if p is None]})")  # fmt: skip
        return Round.merge([p for p in parts if p is not None])

    def _generate_here(
        self,
        groups: Sequence[Group],
        target: RoundTarget | None,
        *,
        tasks: Sequence[AgentTask],
        n: int,
        stage: Stage,
        seed: int,
        version: int,
        keep_on_stop: bool,
    ) -> Round:
        """:meth:`generate` on this rank's engine alone, for ``groups`` up to ``target`` (the ``gather=False`` case,
        and each engine's share with ``gather``): a round is one call of :meth:`generate`, whichever way it runs."""
        if self.follower:
            self.engine.follow()
            return Round([], stopped=False)
        r = self.config.rollout
        agent = AgentConfig(
            max_turns=r.max_turns,
            max_tool_calls=r.max_tool_calls,
            max_response_tokens=stage.max_response_len,
            timeout_s=r.timeout_s,
        )
        sampling = SamplingConfig(
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_tokens=stage.max_response_len,
        )
        loop = AgentLoop(self.engine, self.tokenizer, self.tool_runner(), agent, sampling)
        reward_cfg = self.config.reward
        result = Round(list(groups), stopped=False)
        kept = [0]

        async def one(group: Group, sample: int) -> None:
            paused = group.paused.pop(sample, None)
            before, rolled = (paused.num_generated_tokens, paused.rolled_back_tokens) if paused else (0, 0)
            if paused is not None:  # the tokens its last pause rolled back are sampled again now
                result.resumed += 1
                result.regenerated_tokens += rolled - group.rolled_back.get(sample, 0)
                group.rolled_back[sample] = rolled
            rollout = await loop.run(tasks[group.index], sample, seed=sample_seed(group.uid, sample, seed),
                                     version=version, resume=paused)  # fmt: skip
            now = rollout.paused.num_generated_tokens if rollout.paused else rollout.num_generated_tokens
            result.sampled_tokens += now - before + rollout.rolled_back_tokens - rolled  # rolled back: sampled too
            if rollout.finish_reason is FinishReason.PAUSED:
                group.paused[sample] = cast("PausedTrajectory", rollout.paused)  # set when paused
                result.paused += 1
                return
            group.finished[sample] = await grade_rollout(self.graders, rollout, group.uid, reward_cfg,
                                                         stage.max_response_len)  # fmt: skip
            if target is not None and group.complete(n) and target.keeps(group.samples()):
                kept[0] += 1
                if kept[0] >= target.groups:
                    result.target_reached = True

        async def all_() -> Round:
            slots = asyncio.Semaphore(r.concurrency)

            async def bounded(group: Group, sample: int) -> None:
                async with slots:
                    if reached() or (keep_on_stop and self.preemption.stop_requested()):
                        return  # the round is pausing: not started, it starts in a later round
                    await one(group, sample)

            work = [(g, i) for g in result.groups for i in range(n) if i not in g.finished]
            await asyncio.gather(*(bounded(g, i) for g, i in work))
            return result

        counted = getattr(self.engine, "sampled_tokens", None)  # the in-process engine counts its steps' tokens

        def reached() -> bool:
            if target is None:
                return False
            if target.tokens is not None:  # live where the engine counts, else as trajectories end
                now = getattr(self.engine, "sampled_tokens", None)
                sampled = result.sampled_tokens if now is None or counted is None else now - counted
                if sampled >= target.tokens:
                    return True
            return result.target_reached

        out = self._round(all_(), "the generation round: its trajectories were aborted",
                          keep_on_stop=keep_on_stop, pause_when=reached if target is not None else None)  # fmt: skip
        if out is not result:  # stopped with keep_on_stop: the engine paused the round
            result.stopped = True
        return result

    @property
    def engines(self) -> tuple[int, int]:
        """``(engines in the job, this rank's engine index)``: one engine per vLLM TP group of ranks."""
        if self.colocation is not None:
            return self.colocation.groups, self.colocation.group
        return torch.distributed.get_world_size(), torch.distributed.get_rank()

    def validate(self, benchmarks: Sequence[Benchmark], settings: ValConfig) -> dict[str, dict[str, object]]:
        """``benchmarks`` x ``k`` on this rank's engine with the weights it holds now (the trainer's, after a
        sync; nothing reloaded) through :func:`afm_core.eval.runner.validate`: the eval job's agent loop, tools
        and graders; returns ``{benchmark: metrics}`` (``avg@k``, ``pass@k``, ... as in ``metrics.json``). Not
        collective: the driver calls it on engine 0's ranks (a follower rank mirrors its leader, returns {}).

        Raises:
            RolloutAborted: a stop was requested before the validation ended (as in :meth:`generate`: its
                requests are aborted in vLLM, the checkpoint need not wait for it).
        """
        if self.follower:
            self.engine.follow()
            return {}
        work = validate(self.engine, self.tokenizer, self.tool_runner(), self.graders, list(benchmarks),
                        settings)  # fmt: skip
        return dict(cast("dict[str, dict[str, object]]", self._round(work, "validation: its requests were aborted")))

    def _round(
        self,
        work: Coroutine[object, object, T],
        during: str,
        *,
        keep_on_stop: bool = False,
        pause_when: Callable[[], bool] | None = None,
    ) -> T | Stopped:
        """Run ``work`` (a coroutine on this rank's engine) to its end, then release the followers of a vLLM TP
        group. A stop that comes first raises RolloutAborted ("a stop was requested during {during}"), or with
        ``keep_on_stop`` pauses the engine and returns :data:`~afm_core.rl.rounds.STOPPED` once ``work`` has
        returned what it holds; ``pause_when()`` true pauses the engine too (``work``'s result is returned). The
        engine is resumed after.
        """
        try:
            result = self.run(unless_stopped(work, self.engine, self.preemption.stop_requested,
                                              keep_on_stop=keep_on_stop, pause_when=pause_when))  # fmt: skip
        finally:
            if self.lockstep is not None:
                self.engine.end_round()  # release the followers
        if result is None:
            raise RolloutAborted(f"a stop was requested during {during}")
        return result

    def sleep(self) -> None:
        """Free the engine's memory for the training phase (GPU sleep mode; a no-op elsewhere). The next
        :meth:`sync_weights` wakes it."""
        if self.colocation is not None and self.colocation.sleeps and not self.asleep:
            self.run(self.engine.sleep(self.colocation.sleep_level))
            self.asleep = True

    def sync_weights(
        self,
        model_chunks: Sequence[torch.nn.Module],
        bucket_bytes: int,
        before_kv_cache: Callable[[], None] | None = None,
    ) -> WeightSyncStats:
        """Load the trainer's weights into this rank's engine (:func:`afm_core.rl.weight_sync.sync_weights_async`:
        HF-named buckets through the worker extension, by reference to an in-process engine, as safetensors
        bytes to an ``AsyncLLM``; prefix cache reset); returns its stats. A sleeping engine wakes its weights
        before and its KV cache after; ``before_kv_cache`` runs between the sync and the KV cache's wake-up (the
        trainer's state leaves the GPU there: :class:`afm_core.rl.colocation.Handover`)."""
        return self._wake_around(
            lambda: self.run(sync_weights_async(self.engine, model_chunks, bucket_bytes=bucket_bytes)),
            before_kv_cache,
        )

    def wake(self, before_kv_cache: Callable[[], None] | None = None) -> None:
        """Wake a sleeping engine with the weights it had (sleep level 1 kept them in host memory): weights, then
        ``before_kv_cache``, then the KV cache. Level 2 dropped them: sync instead (:meth:`sync_weights`).

        Raises:
            RuntimeError: the engine slept at level 2.
        """
        if self.asleep and self.colocation is not None and self.colocation.sleep_level >= 2:
            raise RuntimeError("the engine slept at level 2 (weights dropped): wake it with sync_weights")
        self._wake_around(lambda: None, before_kv_cache)

    def _wake_around(self, work: Callable[[], T], before_kv_cache: Callable[[], None] | None) -> T:
        """A sleeping engine's weights woken, ``work()``, ``before_kv_cache()``, then its KV cache woken; returns
        what ``work`` returned."""
        asleep, self.asleep = self.asleep, False
        if asleep:
            self.run(self.engine.wake_up(["weights"]))
        result = work()
        if before_kv_cache is not None:
            before_kv_cache()
        if asleep:
            self.run(self.engine.wake_up(["kv_cache"]))
        return result

    @property
    def keeps_weights_asleep(self) -> bool:
        """Whether the engine wakes with its own weights (awake, or asleep at level 1)."""
        return not self.asleep or self.colocation is None or self.colocation.sleep_level < 2

    def tool_runner(self) -> ToolBackend | None:
        """What answers the calls: the real tool pool, or with ``rollout.environment: simulated`` a model (the
        policy's own engine, or ``rollout.simulator.model``) writing each observation
        (:mod:`afm_core.rollout.simulated_tools`, AutoCoA RL stage 1)."""
        if self._tool_runner is None:
            r = self.config.rollout
            engine: GenerationEngine = self.engine
            tokenizer, policy_tokenizer = self.tokenizer, None
            if r.environment == "simulated" and r.simulator.model:
                engine_args = {**asdict(self.config.engine), "max_model_len": self.engine.max_model_len}
                self.simulator_engine = self.run(build_engine(engine_args, r.simulator.model))
                engine, tokenizer = self.simulator_engine, load_tokenizer(r.simulator.model)
                policy_tokenizer = self.tokenizer
            self._tool_runner = build_tool_runner(
                r.environment,
                pool=self.pool,
                engine=engine,
                tokenizer=tokenizer,
                simulator=asdict(r.simulator),  # the rollout layer's mapping
                policy_tokenizer=policy_tokenizer,
                temperature=r.temperature,
            )
        return self._tool_runner

    def tool_metrics(self) -> dict[str, dict]:
        metrics = self.pool.metrics_snapshot() if self.pool is not None else {}
        if self._tool_runner is not None and self._tool_runner is not self.pool:
            metrics.update(self._tool_runner.metrics_snapshot())
        return metrics

    def close(self) -> None:
        try:
            if self.engine is not None:
                self.run(self.engine.close())
            if self.simulator_engine is not None:
                self.run(self.simulator_engine.close())
            if self.pool is not None:
                self.run(self.pool.close())
            self.run(self.graders.close())
        finally:
            self.runner.close()


def node_tool_urls(gathered: Sequence[tuple[str, int, dict[str, str]]], node: str) -> dict[str, str]:
    """The tool server URLs that the first rank (local rank 0) of ``node`` started or read, from every rank's
    ``(node, local_rank, urls)``.

    Raises:
        RuntimeError: no rank of ``node`` has local rank 0 (a launcher that does not set ``LOCAL_RANK`` per node).
    """
    for where, local_rank, urls in gathered:
        if where == node and local_rank == 0:
            return urls
    raise RuntimeError(f"no rank with LOCAL_RANK=0 on node {node}: nobody started its tool servers")


@contextlib.contextmanager
def start_rollout_actor(
    config: ActorConfig,
    layout: ParallelLayout,
    hf_dir: Path,
    tokenizer: PreTrainedTokenizerBase,
    tasks: Sequence[AgentTask],
    max_model_len: int,
    preemption: Preemption | None = None,
) -> Iterator[RolloutActor]:
    """This rank's :class:`RolloutActor` beside its node's tool servers (collective); closed, and the servers
    stopped, on exit. ``preemption``: as for :class:`RolloutActor`.

    The first rank of each node starts the servers the tasks need on its loopback (or reads the addresses file)
    and tells its node's other ranks where they are: no sandbox is exposed to the network, no tool call leaves
    its node. With ``rollout.environment: simulated`` no tool server starts (a model answers the calls).
    """
    simulated, tools = config.rollout.environment == "simulated", asdict(config.tools)  # the tool layer's mapping
    graders = {g for task in tasks if (g := task.meta.get("grader")) is not None}
    names = needed_servers(() if simulated else {task.task for task in tasks}, graders, tools)
    node, log_dir = this_node(), Path(config.run_dir) / "logs" / "tool_servers"
    if len(set(gather_objects(node))) > 1:  # a job across nodes: one log folder per node
        log_dir /= node
    with tool_servers(names if layout.local_rank == 0 else [], log_dir, addresses_file=config.tools.addresses_file,
                      **asdict(config.tool_servers), data_dir=config.data_dir) as local_urls:  # fmt: skip
        urls = node_tool_urls(gather_objects((node, layout.local_rank, local_urls())), node)
        colocation = select_colocation(
            config.colocation,
            config.engine.tensor_parallel_size,
            on_gpu=layout.on_gpu,
            rank=layout.rank,
            world_size=layout.world_size,
        )
        actor = RolloutActor(config, hf_dir, tokenizer, urls, max_model_len, colocation=colocation,
                             lockstep=lockstep_group(colocation), preemption=preemption)  # fmt: skip
        try:
            yield actor
        finally:
            actor.close()
