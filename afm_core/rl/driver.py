"""``run_rl(cfg)``: one colocated DAPO job with tool rollouts, the entry point every rank of ``jobs.rl`` runs.

Reads like slime's ``train.py`` (THUDM/slime) and verl's DAPO ``fit`` (``recipe/dapo/dapo_ray_trainer.py``)::

    resume (model, optimizer, rollout step, stage, prompt-loader and dynamic-sampler state, RNG)
    sync the trainer's weights into this rank's vLLM engine
    for each rollout step:
        stage = schedule(step)                        # staged context: response budget, trainer seq length
        while the train batch is not full:            # DAPO dynamic sampling, <= max_num_gen_batches
            prompts = next gen batch; this rank runs its share, rollout.n samples each, through the agent loop
            rewards = grader score x format (+ overlong shaping); trajectories gathered from every rank
            sampler.add(groups)                       # groups whose rewards are all equal are dropped
        the engine sleeps (GPU: its memory goes to the trainer)
        advantages = GRPO over each prompt's group       (or, PPO: critic values -> GAE; critic updates)
        old logprobs recomputed by the trainer (and the vLLM-vs-trainer gap measured; reference logprobs for KL)
        mini-batch policy updates (token-mean over the global mini-batch, observation tokens masked)
        weight sync Megatron -> vLLM                     (the engine wakes: weights, sync, KV cache)
        metrics.jsonl line, rl.png; checkpoint at the interval or when asked (USR2 / preemption)

Colocation (:mod:`afm_core.rl.colocation`): every rank holds its Megatron model chunk and its part of a vLLM
engine running in the same process (vLLM's ``external_launcher`` executor; ``engine.tensor_parallel_size``
consecutive ranks share one engine, whose first rank runs the agent loops while the others follow it step by
step), so a weight sync hands tensors to the worker by reference; on GPU the engine sleeps while the trainer
runs. ``colocation.mode=async`` instead gives every rank an ``AsyncLLM`` at vLLM TP=1 whose engine core runs in a
child process (weights travel as safetensors bytes). The prompts of a generation batch are split over the
engines (each prompt's ``n`` samples on one engine) and the trajectories gathered, so every rank feeds the same
groups to the dynamic sampler and builds the same train batch; each data-parallel rank then trains on its
share.

Resume: checkpoints are taken at rollout-step boundaries (``checkpoints/step_N``, N = rollout steps done) with
the prompt loader's position (not step x batch: dynamic sampling consumes a variable number of prompts), the
sampler's state and the stage; ``metrics.jsonl`` is cut back to the checkpoint's step, so every rollout step
appears once.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

REWARD_MODES = ("score_x_format", "score", "score_minus_format_penalty")
ADVANTAGE_ESTIMATORS = ("grpo", "drgrpo", "gae")


# ----------------------------------------------------------------------------------------------------------
# Staged context length
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stage:
    """One stage of the context schedule: ``max_response_len`` tokens per trajectory (model + observation
    tokens) until rollout step ``until_step`` (exclusive; None: to the end)."""

    index: int
    max_response_len: int
    until_step: int | None


def parse_schedule(schedule: Sequence[Mapping[str, Any]] | None, default_len: int) -> list[Stage]:
    """``[{until_step: 40, max_response_len: 16384}, {max_response_len: 32768}]`` -> stages.

    Raises:
        ValueError: a stage without ``max_response_len``, ``until_step`` not increasing, or a stage other than
            the last without ``until_step`` (names the stage: ``rollout.context_schedule[i]``).
    """
    if not schedule:
        return [Stage(0, int(default_len), None)]
    stages, last = [], 0
    for i, entry in enumerate(schedule):
        where = f"rollout.context_schedule[{i}]"
        unknown = set(entry) - {"until_step", "max_response_len"}
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; expected until_step, max_response_len")
        if entry.get("max_response_len") is None or int(entry["max_response_len"]) < 1:
            raise ValueError(f"{where}.max_response_len: a positive token count is required")
        until = entry.get("until_step")
        if until is None and i != len(schedule) - 1:
            raise ValueError(f"{where}.until_step: only the last stage may omit it")
        if until is not None and int(until) <= last:
            raise ValueError(f"{where}.until_step={until}: must be above the previous stage's ({last})")
        last = int(until) if until is not None else last
        stages.append(Stage(i, int(entry["max_response_len"]), None if until is None else int(until)))
    return stages


def stage_at(stages: Sequence[Stage], step: int) -> Stage:
    """The stage of rollout step ``step`` (0-based: the step being generated)."""
    for stage in stages:
        if stage.until_step is None or step < stage.until_step:
            return stage
    return stages[-1]


# ----------------------------------------------------------------------------------------------------------
# Prompts: a resumable, epoch-shuffled stream
# ----------------------------------------------------------------------------------------------------------
class PromptStream:
    """The RL prompts in a fresh seeded permutation per epoch; its state is ``(epoch, offset)``.

    Every rank holds the same stream and draws the same generation batches. A group uid is
    ``"{epoch}:{offset}"`` of the prompt, unique even when a small dataset wraps within one rollout step.
    """

    def __init__(self, num_prompts: int, seed: int):
        if num_prompts < 1:
            raise ValueError("the RL data holds no prompt")
        self.num_prompts, self.seed = num_prompts, seed
        self.epoch = self.offset = 0
        self._order: list[int] | None = None

    def _permutation(self) -> list[int]:
        if self._order is None:
            self._order = list(range(self.num_prompts))
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(self._order)
        return self._order

    def take(self, count: int) -> list[tuple[str, int]]:
        """The next ``count`` prompts as ``(uid, prompt index)``."""
        out = []
        for _ in range(count):
            if self.offset >= self.num_prompts:
                self.epoch, self.offset, self._order = self.epoch + 1, 0, None
            out.append((f"{self.epoch}:{self.offset}", self._permutation()[self.offset]))
            self.offset += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset, "num_prompts": self.num_prompts, "seed": self.seed}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        if int(state["num_prompts"]) != self.num_prompts:
            log.warning(
                "the RL data changed since the checkpoint (%s -> %s prompts): the position is kept",
                state["num_prompts"],
                self.num_prompts,
            )
        self.epoch, self.offset, self._order = int(state["epoch"]), int(state["offset"]), None


def load_prompts(data_cfg: Mapping[str, Any], tokenizer: Any) -> list[Any]:
    """The RL tasks: eval presets (``data.presets``) and AFM/verl RL files (``data.files``), each cut to
    ``data.limit``, kept to GSM8K references with at most ``data.max_calculator_steps`` calculator annotations
    (when set) and stripped of prompts longer than ``data.max_prompt_len`` tokens.

    Raises:
        ValueError: no data configured, or nothing left after the length filter.
    """
    from afm_core.data.tokenize import encode_prompt
    from afm_core.eval.benchmarks import load_file, load_preset

    data_dir = Path(data_cfg["data_dir"]) if data_cfg.get("data_dir") else None
    benches = [load_preset(name, data_dir) for name in data_cfg.get("presets") or []]
    benches += [load_file(path) for path in data_cfg.get("files") or []]
    if not benches:
        raise ValueError("data.presets / data.files: name at least one source of RL prompts")
    skip = int(data_cfg.get("skip") or 0)
    limit = data_cfg.get("limit")
    tasks = [t for b in benches for t in b.tasks][skip:]
    steps = data_cfg.get("max_calculator_steps")
    if steps is not None:  # GSM8K: references with at most this many calculator annotations
        tasks = [t for t in tasks if t.meta.get("calculator_steps", 0) <= int(steps)]
    if limit is not None:
        tasks = tasks[: int(limit)]
    max_len = int(data_cfg["max_prompt_len"])
    kept = [t for t in tasks if len(encode_prompt(tokenizer, t.prompt, t.system)) <= max_len]
    if len(kept) < len(tasks):
        log.warning(
            "RL data: %d of %d prompts are longer than data.max_prompt_len=%d tokens and were dropped",
            len(tasks) - len(kept),
            len(tasks),
            max_len,
        )
    if not kept:
        raise ValueError(f"no RL prompt fits data.max_prompt_len={max_len}")
    return kept


# ----------------------------------------------------------------------------------------------------------
# Trajectories and rewards
# ----------------------------------------------------------------------------------------------------------
@dataclass
class Sample:
    """One graded trajectory as the trainer needs it (picklable, no text): token ids, mask, vLLM logprobs,
    reward parts and what the metrics count."""

    uid: str
    task_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    logprobs: list[float]
    score: float
    format: float
    reward: float
    finish_reason: str
    tool_calls: list[tuple[str, str | None]] = field(default_factory=list)
    seconds: float = 0.0
    tool_seconds: float = 0.0


def shaped_reward(score: float, fmt: float, length: int, reward_cfg: Mapping[str, Any], max_len: int) -> float:
    """The trajectory reward: ``score x format`` (``reward.mode: score_x_format``, the default), ``score``, or
    ``score - reward.format_penalty`` when the format is invalid (``score_minus_format_penalty``: AutoCoA's exact
    match plus a format penalty, arXiv 2503.06580 §3.3.1), plus DAPO's overlong penalty over the stage's
    ``max_len`` when ``reward.overlong_buffer_len`` > 0."""
    from afm_core.rl.reward_shaping import overlong_penalty

    mode = reward_cfg.get("mode", "score_x_format")
    if mode not in REWARD_MODES:
        raise ValueError(f"reward.mode={mode!r}: expected one of {', '.join(REWARD_MODES)}")
    reward = score * fmt if mode == "score_x_format" else score
    if mode == "score_minus_format_penalty":
        reward -= float(reward_cfg.get("format_penalty", 1.0)) * (1.0 - fmt)
    buffer = int(reward_cfg.get("overlong_buffer_len") or 0)
    if buffer > 0:
        buffer = min(buffer, max_len)
        penalty = overlong_penalty(
            torch.tensor([length]), max_len, buffer, factor=float(reward_cfg.get("overlong_penalty_factor", 1.0))
        )
        reward += float(penalty[0])
    return reward


async def grade_rollout(graders: Any, rollout: Any, uid: str, reward_cfg: Mapping[str, Any], max_len: int) -> Sample:
    """Grade one :class:`~afm_core.rollout.Rollout` (score from its task's grader, format from the CoA validator)."""
    from afm_core.rewards import grade_format

    task = rollout.task
    grade = await graders.grade(
        task.meta["grader"], rollout.response_text, gold=task.answer, question=task.question, meta=task.meta
    )
    fmt = grade_format(rollout.response_text).score
    reward = shaped_reward(grade.score, fmt, len(rollout.response_ids), reward_cfg, max_len)
    return Sample(
        uid=uid,
        task_id=task.id,
        prompt_ids=list(rollout.prompt_ids),
        response_ids=list(rollout.response_ids),
        response_mask=list(rollout.response_mask),
        logprobs=list(rollout.logprobs),
        score=float(grade.score),
        format=float(fmt),
        reward=reward,
        finish_reason=rollout.finish_reason.value,
        tool_calls=[(c.name, c.error) for c in rollout.tool_calls],
        seconds=rollout.seconds,
        tool_seconds=sum(c.seconds for c in rollout.tool_calls),
    )


# ----------------------------------------------------------------------------------------------------------
# The rollout side of one rank: engine, tools, agent loop (async, driven from the synchronous trainer loop)
# ----------------------------------------------------------------------------------------------------------
class RolloutActor:
    """This rank's vLLM engine, tool pool and graders on one long-lived event loop.

    Args:
        cfg: the RL config (``engine``, ``tools``, ``rollout``, ``judge``).
        hf_dir: the policy's HF checkpoint (the engine's initial weights; the trainer syncs its own after).
        tokenizer: the policy's tokenizer.
        urls: ``{server: url}`` of the tool servers.
        max_model_len: the engine's context (prompt + the largest stage's response budget).
        engine: an already started :class:`~afm_core.rollout.engine.GenerationEngine` to use instead of vLLM.
        colocation: this rank's engine layout (:mod:`afm_core.rl.colocation`); None: a vLLM ``AsyncLLM`` of its
            own (``colocation.mode=async``).
        lockstep: the :class:`~afm_core.rollout.vllm_engine.Lockstep` of this rank's vLLM TP group (TP > 1).
    """

    def __init__(
        self,
        cfg: Mapping[str, Any],
        hf_dir: Path,
        tokenizer: Any,
        urls: Mapping[str, str],
        max_model_len: int,
        engine: Any = None,
        colocation: Any = None,
        lockstep: Any = None,
    ):
        from afm_core.rewards import Graders, LLMJudge, SandboxClient
        from afm_core.tools.job_servers import reachable_tools_cfg
        from afm_core.tools.registry import build_tool_pool

        self.cfg, self.hf_dir, self.tokenizer = cfg, hf_dir, tokenizer
        self.colocation, self.lockstep = colocation, lockstep
        self.asleep = False
        self.runner = asyncio.Runner()
        tools_cfg = reachable_tools_cfg(cfg["tools"], urls)
        self.pool = build_tool_pool(tools_cfg, addresses=dict(urls)) if tools_cfg["tools"] else None
        judge = cfg.get("judge") or {}
        self.graders = Graders(
            sandbox=SandboxClient(urls["sandbox"], timeout_s=float(cfg["reward"]["test_timeout_s"]))
            if "sandbox" in urls
            else None,
            judge=LLMJudge(judge["url"], judge["model"], judge.get("api_key_env")) if judge.get("url") else None,
        )
        self.engine = engine
        self.simulator_engine: Any = None  # rollout.simulator.model: a second engine that writes the observations
        self._tool_runner: Any = None
        if self.pool is not None:
            self.run(self.pool.start())
        if engine is None:
            self.start_engine(max_model_len)

    def run(self, coro: Any) -> Any:
        return self.runner.run(coro)

    def start_engine(self, max_model_len: int) -> None:
        """Start vLLM with context ``max_model_len`` (prompt + the largest stage's response budget: an engine
        argument fixed at construction; each stage then caps every request at its own ``max_response_len``)."""
        from afm_core.rl.weight_sync import EXTENSION
        from afm_core.rollout.factory import build_engine

        engine_cfg = {
            **self.cfg["engine"],
            **(self.colocation.engine_overrides() if self.colocation is not None else {}),
            "max_model_len": int(max_model_len),
            "worker_extension_cls": EXTENSION,
        }
        from afm_core.train.distributed import training_dtype

        if (
            engine_cfg.get("dtype", "auto") == "auto"
            and training_dtype(self.cfg["trainer"]["precision"]) == torch.float32
        ):
            engine_cfg["dtype"] = "float32"  # an fp32 trainer gets fp32 rollouts: logprobs agree to ~1e-5 (TIS, tests)
        set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
        self.engine = self.run(build_engine(engine_cfg, self.hf_dir, self.tokenizer))
        set_num_threads(threads)  # vLLM may patch torch's thread setter; the trainer keeps its threads
        if self.lockstep is not None:
            self.engine.lockstep = self.lockstep

    @property
    def follower(self) -> bool:
        """This rank mirrors its vLLM TP group's leader instead of running agent loops."""
        return self.lockstep is not None and self.colocation is not None and not self.colocation.is_leader

    def generate(self, items: Sequence[tuple[str, Any]], n: int, stage: Stage, seed: int) -> list[Sample]:
        """``n`` graded trajectories for each ``(uid, task)`` in ``items`` (all concurrently), in item order.

        On a follower rank of a vLLM TP group (:attr:`follower`) this mirrors the leader's engine steps and
        returns no trajectory (the leader's carry the group's)."""
        from afm_core.rollout import AgentConfig, AgentLoop, SamplingConfig

        if self.follower:
            self.engine.follow()
            return []
        from afm_core.rollout.agent_loop import sample_seed

        r = self.cfg["rollout"]
        agent = AgentConfig(
            max_turns=int(r["max_turns"]),
            max_tool_calls=int(r["max_tool_calls"]),
            max_response_tokens=stage.max_response_len,
            timeout_s=r.get("timeout_s"),
        )
        sampling = SamplingConfig(
            temperature=float(r["temperature"]),
            top_p=float(r["top_p"]),
            top_k=int(r.get("top_k", -1)),
            max_tokens=stage.max_response_len,
        )
        loop = AgentLoop(self.engine, self.tokenizer, self.tool_runner(), agent, sampling)
        reward_cfg = self.cfg["reward"]

        async def one(uid: str, task: Any, sample: int) -> Sample:
            rollout = await loop.run(task, sample, seed=sample_seed(uid, sample, seed))
            return await grade_rollout(self.graders, rollout, uid, reward_cfg, stage.max_response_len)

        async def all_() -> list[Sample]:
            slots = asyncio.Semaphore(int(r.get("concurrency", 64)))

            async def bounded(uid: str, task: Any, sample: int) -> Sample:
                async with slots:
                    return await one(uid, task, sample)

            return list(await asyncio.gather(*(bounded(uid, task, s) for uid, task in items for s in range(n))))

        try:
            return self.run(all_())
        finally:
            if self.lockstep is not None:
                self.engine.end_round()  # release the followers

    def sleep(self) -> None:
        """Free the engine's memory for the training phase (GPU sleep mode; a no-op elsewhere). The next
        :meth:`sync_weights` wakes it."""
        if self.colocation is not None and self.colocation.sleeps and not self.asleep:
            self.run(self.engine.sleep(self.colocation.sleep_level))
            self.asleep = True

    def sync_weights(self, model_chunks: Sequence[torch.nn.Module], bucket_bytes: int) -> Any:
        """Load the trainer's weights into this rank's engine (:func:`afm_core.rl.weight_sync.sync_weights_async`:
        HF-named buckets through the worker extension, by reference to an in-process engine, as safetensors
        bytes to an ``AsyncLLM``; prefix cache reset); returns its stats. A sleeping engine wakes its weights
        before and its KV cache after."""
        from afm_core.rl.weight_sync import sync_weights_async

        asleep, self.asleep = self.asleep, False
        if asleep:
            self.run(self.engine.wake_up(["weights"]))
        stats = self.run(sync_weights_async(self.engine, model_chunks, bucket_bytes=bucket_bytes))
        if asleep:
            self.run(self.engine.wake_up(["kv_cache"]))
        return stats

    def tool_runner(self) -> Any:
        """What answers the calls: the real tool pool, or with ``rollout.environment: simulated`` a model (the
        policy's own engine, or ``rollout.simulator.model``) writing each observation
        (:mod:`afm_core.rollout.simulated_tools`, AutoCoA RL stage 1)."""
        from afm_core.rollout.factory import build_engine, load_tokenizer
        from afm_core.rollout.simulated_tools import build_tool_runner

        if self._tool_runner is None:
            r = self.cfg["rollout"]
            simulator = dict(r.get("simulator") or {})
            engine, tokenizer, policy_tokenizer = self.engine, self.tokenizer, None
            if r.get("environment", "real") == "simulated" and simulator.get("model"):
                engine_cfg = {**self.cfg["engine"], "max_model_len": self.engine.max_model_len}
                self.simulator_engine = self.run(build_engine(engine_cfg, simulator["model"]))
                engine, tokenizer = self.simulator_engine, load_tokenizer(simulator["model"])
                policy_tokenizer = self.tokenizer
            self._tool_runner = build_tool_runner(
                r.get("environment", "real"),
                pool=self.pool,
                engine=engine,
                tokenizer=tokenizer,
                simulator=simulator,
                policy_tokenizer=policy_tokenizer,
                temperature=float(r["temperature"]),
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


# ----------------------------------------------------------------------------------------------------------
# The trainer side: SFT's Megatron engine (DDP wrap, optimizer, scheduler, checkpointer) with a policy step
# ----------------------------------------------------------------------------------------------------------
@dataclass
class RLProgress:
    """Counters saved in every checkpoint (identical on all ranks)."""

    rollout_step: int = 0  # rollout steps done
    optimizer_steps: int = 0
    stage: int = 0
    prompts_consumed: int = 0
    samples_trained: int = 0
    train_time_s: float = 0.0


def _trainer_cfg(cfg: Mapping[str, Any], dp: int) -> DictConfig:
    """The ``trainer`` / ``optim`` / ``parallel`` view the SFT trainer's constructor reads."""
    t = cfg["trainer"]
    return OmegaConf.create(
        {
            "trainer": {
                "seq_length": 1,
                "micro_batch_size": int(t["micro_batch_size"]),
                "global_batch_size": int(t["micro_batch_size"]) * dp,
                "keep_last": int(t["keep_last"]),
                "grad_clip": float(t["grad_clip"]),
            },
            "optim": dict(cfg["optim"]),
            "parallel": dict(cfg["parallel"]),
        }
    )


def build_policy_trainer(
    cfg: Mapping[str, Any], layout: Any, chunks: list[torch.nn.Module], run_dir: Path, max_optimizer_steps: int
) -> Any:
    """:class:`afm_core.train.trainer.SFTTrainer` on the policy chunks (the one trainer core: Megatron DDP with
    per-token loss, AdamW + schedule, checkpointer, the USR2 flags); the RL loop drives it step by step."""
    from afm_core.train.trainer import SFTTrainer

    return SFTTrainer(
        _trainer_cfg(cfg, layout.dp),
        layout,
        chunks,
        train_data=None,  # type: ignore[arg-type]  # train_step gets its batches from the driver
        eval_batches=[],
        run_dir=run_dir,
        max_steps=max_optimizer_steps,
    )


def check_batch_split(mini_batch: int, train_batch: int, dp: int, micro_batch_size: int) -> None:
    """Every mini-batch and the train batch (in samples) must split evenly over the data-parallel ranks' micro
    batches.

    Raises:
        ValueError: naming ``algorithm.mini_batch_size``, ``rollout.n`` and ``trainer.micro_batch_size``.
    """
    if mini_batch % (dp * micro_batch_size) or train_batch % (dp * micro_batch_size):
        raise ValueError(
            f"algorithm.mini_batch_size x rollout.n = {mini_batch} samples and the train batch ({train_batch}) must "
            f"be multiples of dp x trainer.micro_batch_size = {dp * micro_batch_size}"
        )


def policy_update(
    trainer: Any,
    samples: Sequence[Sample],
    advantages: torch.Tensor | Sequence[Sequence[float]],
    cfg: Mapping[str, Any],
    seq_length: int,
    pad_id: int,
    reference: Sequence[torch.nn.Module] | None = None,
) -> dict[str, float]:
    """Old-logprob recompute, then ``ppo_epochs`` x (train batch / mini batch) optimizer steps on this DP rank's
    share of each mini-batch. Every rank gets the same ``samples`` (the gathered train batch, grouped by prompt).

    Args:
        advantages: ``[N]`` one per sample (GRPO: broadcast over its response tokens), or per-token lists as
            long as each response (GAE).
        reference: the frozen reference policy's chunks when ``algorithm.kl_coef`` > 0 (the low-var KL loss,
            verl ``use_kl_loss`` with ``kl_loss_type=low_var_kl``).
    Returns:
        Reduced loss statistics (clip fraction, entropy, KL, vLLM-vs-trainer logprob gap...), ``logprob_s``,
        ``train_s``, ``optimizer_steps``, ``grad_norm`` (last), ``lr``.
    Raises:
        ValueError: the mini-batch or the train batch does not split over DP ranks and micro batches, or
            ``kl_coef`` > 0 without ``reference``.
    """
    from megatron.core import parallel_state as ps

    from afm_core.rl.actor import STATS_KEY, megatron_update_step, policy_forward_step
    from afm_core.rl.batch import minibatch_shares, response_values, sample_micro_batches
    from afm_core.rl.logprobs import compute_logprobs
    from afm_core.rl.losses import PolicyLossConfig, logprob_gap_stats, reduce_stats

    a, t = cfg["algorithm"], cfg["trainer"]
    layout = trainer.layout
    dp, dp_rank, mbs = layout.dp, layout.dp_rank, int(t["micro_batch_size"])
    mini = int(a["mini_batch_size"]) * int(cfg["rollout"]["n"])
    check_batch_split(mini, len(samples), dp, mbs)
    kl_coef = float(a.get("kl_coef") or 0.0)
    if kl_coef > 0 and reference is None:
        raise ValueError("algorithm.kl_coef > 0 needs the reference policy's chunks")
    temperature = float(cfg["rollout"]["temperature"])
    if isinstance(advantages, torch.Tensor):
        token_adv = [[float(a_)] * len(s.response_ids) for s, a_ in zip(samples, advantages.tolist())]
    else:
        token_adv = [list(map(float, values)) for values in advantages]
    # each micro batch holds samples of similar length and, without pipeline stages (whose p2p shapes are
    # fixed), is padded to its own longest: fewer padded positions through the transformer
    pad_to = seq_length if layout.pp > 1 else None

    def by_length(indices: Sequence[int]) -> list[int]:
        return sorted(indices, key=lambda i: len(samples[i].prompt_ids) + len(samples[i].response_ids))

    shares = [by_length(share) for share in minibatch_shares(len(samples), mini, dp, dp_rank)]
    mine = by_length([i for share in shares for i in share])

    # old logprobs (the trainer's, before this step's updates) and the gap to vLLM's; reference logprobs
    start = time.perf_counter()
    for chunk in trainer.model:
        chunk.eval()
    batches = sample_micro_batches([samples[i] for i in mine], mbs, pad_to, pad_id)
    outs = compute_logprobs(trainer.model, batches, temperature=temperature, with_entropy=True)
    refs = compute_logprobs(reference, batches, temperature=temperature) if kl_coef > 0 and reference else []
    for chunk in trainer.model:
        chunk.train()
    old: dict[int, list[float]] = {}
    ref: dict[int, list[float]] = {}
    recompute = []
    for b, (batch, out) in enumerate(zip(batches, outs)):
        mask = batch["response_mask"]
        recompute.append(
            {
                **logprob_gap_stats(out["logprobs"], batch["rollout_log_prob"], mask),
                "entropy_sum": torch.where(mask.bool(), out["entropy"], 0.0).sum(),
            }
        )
        for j, values in enumerate(response_values(out["logprobs"], batch)):
            old[mine[b * mbs + j]] = values.tolist()
        if refs:
            for j, values in enumerate(response_values(refs[b]["logprobs"], batch)):
                ref[mine[b * mbs + j]] = values.tolist()
    recomputed = reduce_stats(recompute, ps.get_data_parallel_group())
    logprob_s = time.perf_counter() - start

    # mini-batch updates
    start = time.perf_counter()
    loss_cfg = PolicyLossConfig(
        clip_ratio_low=float(a["clip_ratio_low"]),
        clip_ratio_high=float(a["clip_ratio_high"]),
        clip_ratio_c=a.get("clip_ratio_c"),
        kl_coef=kl_coef,
        tis_cap=a.get("tis_cap"),
        entropy_coeff=float(a.get("entropy_coeff", 0.0)),
    )
    forward_step = policy_forward_step(loss_cfg, temperature=temperature)
    stats, grad_norm, lr, steps = [], float("nan"), float("nan"), 0
    for _ in range(int(a["ppo_epochs"])):
        for share in shares:
            extra = {"old_log_prob": [old[i] for i in share], "advantages": [token_adv[i] for i in share]}
            if ref:
                extra["ref_log_prob"] = [ref[i] for i in share]
            micro = sample_micro_batches([samples[i] for i in share], mbs, pad_to, pad_id, extra=extra)
            reports, grad_norm, lr = megatron_update_step(
                trainer, forward_step, micro, seq_length, mbs, what=f"policy update {steps + 1} of this rollout step"
            )
            steps += 1
            stats += [r[STATS_KEY] for r in reports]
    reduced = reduce_stats(stats, ps.get_data_parallel_group()) if stats else {}
    return {
        **{f"actor/{k}": v for k, v in reduced.items()},
        "logprob_gap_vllm_trainer": recomputed["logprob_gap"],
        "logprob_gap_vllm_trainer_max": recomputed["logprob_gap_max"],
        "prob_ratio_error": recomputed["prob_ratio_error"],
        "entropy": recomputed["entropy"],
        "grad_norm": grad_norm,
        "lr": lr,
        "optimizer_steps": steps,
        "logprob_s": logprob_s,
        "train_s": time.perf_counter() - start,
    }


# ----------------------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------------------
def rollout_metrics(samples: Sequence[Sample], all_generated: Sequence[Sample]) -> dict[str, Any]:
    """Reward, accuracy, lengths, finish reasons and tool calls/errors per tool of one rollout step.

    ``samples`` are the trained ones; accuracy and tool counts are over everything generated in the step."""
    lengths = [len(s.response_ids) for s in samples] or [0]
    calls: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    for s in all_generated:
        for name, error in s.tool_calls:
            calls[name] += 1
            errors[name] += error is not None
    finish = Counter(s.finish_reason for s in all_generated)
    gen = len(all_generated) or 1
    return {
        "reward_mean": sum(s.reward for s in samples) / max(len(samples), 1),
        "reward_mean_generated": sum(s.reward for s in all_generated) / gen,
        "accuracy": sum(s.score > 0 for s in all_generated) / gen,
        "format_ok": sum(s.format > 0 for s in all_generated) / gen,
        "response_len_mean": sum(lengths) / len(lengths),
        "response_len_max": max(lengths),
        "generated_tokens_mean": sum(sum(s.response_mask) for s in samples) / max(len(samples), 1),
        "truncated_frac": finish.get("length", 0) / gen,
        "finish_reasons": dict(finish),
        "tool_calls": dict(calls),
        "tool_errors": dict(errors),
        "tool_calls_per_traj": sum(calls.values()) / gen,
    }


def plot_rl(metrics_path: Path, png_path: Path) -> None:
    """Reward, accuracy and mean response length against the rollout step (``rl.png``)."""
    from afm_core.train.metrics import plot_panels

    plot_panels(
        metrics_path,
        png_path,
        [("reward_mean", "reward (trained)"), ("accuracy", "accuracy"), ("response_len_mean", "response tokens")],
        xlabel="rollout step",
    )


# ----------------------------------------------------------------------------------------------------------
# The job
# ----------------------------------------------------------------------------------------------------------
def _gather(obj: Any) -> list[Any]:
    parts: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, obj)
    return parts


def _broadcast(obj: Any) -> Any:
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


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


def run_rl(cfg: DictConfig | Mapping[str, Any], after_step: Callable[[int], None] | None = None) -> dict[str, Any]:
    """DAPO with tool rollouts on this rank (see the module docstring); every rank of the job calls it.

    Args:
        cfg: the composed ``conf/rl.yaml``.
        after_step: called with the rollout step number after each step's metrics are written (before the
            checkpoint decision), e.g. to :func:`afm_core.train.trainer.request_checkpoint`.
    Returns:
        ``{"step", "max_steps", "stopped_early", "resumed_from", "checkpoint", "hf_dir", "stage", "data_state",
        "run_dir", ...}`` (identical on every rank); ``hf_dir`` is the policy's HF export ``RUN_DIR/hf``
        (safetensors + config + tokenizer, written when the run completes and ``trainer.export_hf``), else None.
    Raises:
        ValueError: a bad config value (names the field).
        afm_core.rl.dynamic_sampling.DynamicSamplingExhausted: ``max_num_gen_batches`` batches did not fill a
            train batch.
    """
    from afm_core.launch.placement import this_node
    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
    from afm_core.rl.colocation import lockstep_group, select_colocation
    from afm_core.rl.critic import Critic
    from afm_core.rl.dynamic_sampling import DynamicSampler
    from afm_core.rl.policy_model import build_policy_model, build_reference_model
    from afm_core.rollout.factory import load_tokenizer
    from afm_core.tools.job_servers import needed_servers, tool_servers
    from afm_core.train.distributed import (
        destroy_distributed,
        init_distributed,
        training_dtype,
    )
    from afm_core.train.metrics import MetricsLog
    from afm_core.train.trainer import find_resume_checkpoint

    cfg = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    t, a, r = cfg["trainer"], cfg["algorithm"], cfg["rollout"]
    if a["adv_estimator"] not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"algorithm.adv_estimator={a['adv_estimator']!r}: expected one of {', '.join(ADVANTAGE_ESTIMATORS)}"
        )
    run_dir = Path(cfg["run_dir"])
    stages = parse_schedule(r.get("context_schedule"), int(r["max_response_len"]))
    max_steps = int(t["max_steps"])
    n, train_bs = int(r["n"]), int(a["train_batch_size"])
    updates_per_step = int(a["ppo_epochs"]) * (train_bs // int(a["mini_batch_size"]))
    max_prompt_len = int(cfg["data"]["max_prompt_len"])

    hf_dir = ensure_hf_checkpoint(cfg["model"])
    tokenizer = load_tokenizer(hf_dir)
    tasks = load_prompts({**cfg["data"], "data_dir": cfg.get("data_dir")}, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    layout = init_distributed(OmegaConf.create(cfg["parallel"]), seed=int(t["seed"]), num_threads=t.get("num_threads"))
    actor = None
    try:
        # before any model or engine starts, not after the first rollout step's generation
        check_batch_split(int(a["mini_batch_size"]) * n, train_bs * n, layout.dp, int(t["micro_batch_size"]))
        resume_path = find_resume_checkpoint(run_dir, cfg.get("resume"))
        dtype = training_dtype(t["precision"])
        chunks, hf_config = build_policy_model(hf_dir, layout, params_dtype=dtype, load_weights=resume_path is None)
        trainer = build_policy_trainer(cfg, layout, chunks, run_dir, max(1, max_steps * updates_per_step))
        critic = reference = None
        if a["adv_estimator"] == "gae":  # PPO: a value model with its own optimizer
            critic = Critic(
                cfg, layout, hf_dir, run_dir, max_steps * updates_per_step, params_dtype=dtype,
                load_weights=resume_path is None,
            )  # fmt: skip
        if float(a.get("kl_coef") or 0.0) > 0:  # the low-var KL loss needs the frozen initial policy
            reference = build_reference_model(hf_dir, layout, params_dtype=dtype)
        stream = PromptStream(len(tasks), int(t["seed"]))
        sampler = DynamicSampler(
            train_bs,
            int(a["max_num_gen_batches"]),
            filter_groups=bool(a["filter_groups"]),
            allow_partial=bool(a.get("allow_partial", False)),
        )
        progress = RLProgress()
        if resume_path is not None:
            common, _ = trainer.checkpointer.load(resume_path, trainer.model, trainer.optimizer)
            progress = RLProgress(**common["progress"])
            trainer.scheduler.load_state_dict(common["scheduler"])
            stream.load_state_dict(common["prompts"])
            sampler.load_state_dict(common["sampler"])
            if critic is not None:
                critic.load(resume_path)
            if layout.is_rank0:
                print(
                    f"[rl] resumed from {resume_path} at rollout step {progress.rollout_step}, stage "
                    f"{progress.stage}, prompts {common['prompts']}",
                    flush=True,
                )
        metrics = MetricsLog(run_dir / "metrics.jsonl", progress.rollout_step) if layout.is_rank0 else None

        family = {task.task for task in tasks}
        graders = {task.meta.get("grader") for task in tasks}
        simulated = cfg["rollout"].get("environment", "real") == "simulated"  # no tool servers: a model answers
        names = needed_servers(() if simulated else family, graders, cfg["tools"])
        # the first rank of each node starts the servers on its loopback (or reads the addresses file) and tells
        # its node's other ranks where they are: no sandbox is exposed to the network, no tool call leaves its node
        node, log_dir = this_node(), run_dir / "logs" / "tool_servers"
        if len(set(_gather(node))) > 1:  # a job across nodes: one log folder per node
            log_dir /= node
        with tool_servers(cfg, names if layout.local_rank == 0 else [], log_dir) as local_urls:
            urls = node_tool_urls(_gather((node, layout.local_rank, dict(local_urls))), node)
            colocation = select_colocation(
                cfg.get("colocation"), cfg["engine"], on_gpu=layout.on_gpu, rank=layout.rank,
                world_size=layout.world_size,
            )  # fmt: skip
            actor = RolloutActor(
                cfg, hf_dir, tokenizer, urls, max_prompt_len + max(s.max_response_len for s in stages),
                colocation=colocation, lockstep=lockstep_group(colocation),
            )  # fmt: skip
            sync0 = actor.sync_weights(trainer.model, int(cfg["weight_sync"]["bucket_mb"]) * 2**20)
            if layout.is_rank0:
                print(
                    f"[rl] {cfg['model']['name']}: world {layout.world_size} (tp={layout.tp} pp={layout.pp} "
                    f"dp={layout.dp}), {len(tasks)} prompts, {max_steps} rollout steps x {train_bs} prompts x "
                    f"n={n}; stages {[asdict(s) for s in stages]}; first sync {sync0.seconds:.2f} s; run dir "
                    f"{run_dir}",
                    flush=True,
                )
            summary = _loop(
                cfg, layout, trainer, actor, tasks, stream, sampler, progress, stages, metrics, pad_id, after_step,
                critic, reference,
            )  # fmt: skip
        summary["resumed_from"] = str(resume_path) if resume_path else None
        summary["hf_dir"] = None
        if t.get("export_hf", True) and not summary["stopped_early"]:  # the policy, for python -m jobs.eval
            from afm_core.models.bridge import save_hf_checkpoint

            trainer.sync_params()
            summary["hf_dir"] = str(save_hf_checkpoint(trainer.model, hf_config, hf_dir, run_dir / "hf"))
        return summary
    finally:
        if actor is not None:
            actor.close()
        destroy_distributed()


def _loop(
    cfg, layout, trainer, actor, tasks, stream, sampler, progress, stages, metrics, pad_id, after_step,
    critic=None, reference=None,
) -> dict[str, Any]:  # fmt: skip
    from afm_core.rl.advantages import grpo_advantages
    from afm_core.rl.critic import gae_per_sample

    t, a, r = cfg["trainer"], cfg["algorithm"], cfg["rollout"]
    run_dir = Path(cfg["run_dir"])
    max_steps, n, gen_bs = int(t["max_steps"]), int(r["n"]), int(a["gen_batch_size"])
    max_prompt_len = int(cfg["data"]["max_prompt_len"])
    bucket_bytes = int(cfg["weight_sync"]["bucket_mb"]) * 2**20
    # the prompts are split over the engines (colocation: one per vLLM TP group of ranks)
    engines, engine = (
        (actor.colocation.groups, actor.colocation.group) if actor.colocation else (layout.world_size, layout.rank)
    )
    last_checkpoint, stopped_early = None, False
    while progress.rollout_step < max_steps:
        step_start = time.perf_counter()
        stage = stage_at(stages, progress.rollout_step)
        times = {"generate_s": 0.0, "tools_s": 0.0, "weight_sync_s": 0.0}
        if stage.index != progress.stage:
            if layout.is_rank0:
                print(
                    f"[rl] rollout step {progress.rollout_step + 1}: stage {stage.index}, max_response_len "
                    f"{stage.max_response_len}",
                    flush=True,
                )
            progress.stage = stage.index
        generated: list[Sample] = []
        while not sampler.ready:
            items = stream.take(gen_bs)
            progress.prompts_consumed += len(items)
            start = time.perf_counter()
            mine = [(uid, tasks[index]) for uid, index in items[engine::engines]]
            local = actor.generate(mine, n, stage, seed=int(t["seed"]))
            batch = [s for part in _gather(local) for s in part]
            times["generate_s"] += time.perf_counter() - start
            times["tools_s"] += sum(s.tool_seconds for s in batch)  # summed over calls (they overlap)
            generated += batch
            sampler.add([s.uid for s in batch], [s.reward for s in batch], batch)
        samples, ds_stats = sampler.take()
        stage_seq_length = max_prompt_len + stage.max_response_len
        seq_length, out = 0, {}
        if samples:  # empty only with allow_partial when no group had reward spread: nothing to learn from
            actor.sleep()  # GPU: the engine's memory goes to the trainer until the weight sync
            # the trainer's sequence length follows the stage: the stage's cap with pipeline stages (fixed p2p
            # shapes), else the longest trajectory of the batch (never above the cap)
            longest = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
            seq_length = stage_seq_length if layout.pp > 1 else longest
            critic_out: dict[str, Any] = {}
            advantages: Any
            if critic is not None:  # PPO: GAE over the critic's values, then the critic's updates
                start = time.perf_counter()
                old_values = critic.values(samples, seq_length, pad_id)
                advantages, returns = gae_per_sample(
                    samples, old_values, gamma=float(a.get("gamma", 1.0)), lam=float(a.get("lam", 1.0))
                )
                times["values_s"] = time.perf_counter() - start
                critic_out = critic.update(samples, old_values, returns, seq_length, pad_id)
            else:
                rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
                advantages = grpo_advantages(
                    rewards, [s.uid for s in samples], norm_by_std=a["adv_estimator"] == "grpo"
                )
            out = {**policy_update(trainer, samples, advantages, cfg, seq_length, pad_id, reference), **critic_out}
            start = time.perf_counter()
            sync = actor.sync_weights(trainer.model, bucket_bytes)
            times["weight_sync_s"] = time.perf_counter() - start
            times["weight_sync_gb_per_s"] = sync.gb_per_s
        progress.rollout_step += 1
        progress.optimizer_steps += int(out.get("optimizer_steps", 0))
        progress.samples_trained += len(samples)
        step_s = time.perf_counter() - step_start
        progress.train_time_s += step_s
        record = {
            "step": progress.rollout_step,
            "split": "train",
            "stage": stage.index,
            "max_response_len": stage.max_response_len,
            "seq_length": seq_length,
            "stage_seq_length": stage_seq_length,
            **rollout_metrics(samples, generated),
            **ds_stats.as_dict(),
            **out,
            **times,
            "step_s": step_s,
            "elapsed_s": progress.train_time_s,
            "prompts_consumed": progress.prompts_consumed,
            "data_epoch": stream.epoch,
            "data_offset": stream.offset,
            "tool_metrics": actor.tool_metrics() if layout.is_rank0 else None,
            "environment": r.get("environment", "real"),
        }
        if metrics is not None:
            metrics.write(record)
            plot_rl(run_dir / "metrics.jsonl", run_dir / "rl.png")
            print(
                f"[rl] step {progress.rollout_step}/{max_steps}: reward {record['reward_mean']:.3f} acc "
                f"{record['accuracy']:.3f} len {record['response_len_mean']:.0f} kept "
                f"{record['kept_group_ratio']:.2f} gen {record['generate_s']:.1f}s train "
                f"{out.get('train_s', 0):.1f}s sync {times['weight_sync_s']:.2f}s",
                flush=True,
            )
        if after_step is not None:
            after_step(progress.rollout_step)
        want, stop = trainer._boundary_flags()  # USR2 / preemption, OR-ed over ranks
        step = progress.rollout_step
        if want or step % int(t["save_interval"]) == 0 or step == max_steps:
            last_checkpoint = save_rl_checkpoint(trainer, progress, stream, sampler, critic)
        if stop and step < max_steps:
            stopped_early = True
            break
    if metrics is not None:
        metrics.close()
    return {
        "step": progress.rollout_step,
        "max_steps": max_steps,
        "stopped_early": stopped_early,
        "checkpoint": str(last_checkpoint) if last_checkpoint else None,
        "stage": progress.stage,
        "optimizer_steps": progress.optimizer_steps,
        "data_state": stream.state_dict(),
        "train_time_s": progress.train_time_s,
        "run_dir": str(run_dir),
    }


def save_rl_checkpoint(
    trainer: Any, progress: RLProgress, stream: PromptStream, sampler: Any, critic: Any = None
) -> Path:
    """``checkpoints/step_N`` (N = rollout steps done): model, optimizer, scheduler, progress (stage), the
    prompt stream's position and the dynamic sampler's state (common to all ranks), RNG per rank. A critic is
    saved first (``checkpoints/critic/step_N``), so a complete ``step_N`` always has its critic."""
    if critic is not None:
        critic.save(progress.rollout_step)
    common = _broadcast(
        {
            "progress": asdict(progress),
            "scheduler": trainer.scheduler.state_dict(),
            "prompts": stream.state_dict(),
            "sampler": sampler.state_dict(),
        }
    )
    return trainer.checkpointer.save(progress.rollout_step, trainer.model, trainer.optimizer, common, {})
