"""The whole RL loop learns: the real job path (``run_rl``: the vLLM-CPU engine, the agent loop, a reward through
the ``reward_fn`` plug-in, DAPO dynamic sampling and the clip-higher update on the Megatron trainer, the weight sync
into the engine) moves SmolLM2-135M toward a reward it can earn in a few rollout steps, and does not when the sign
of the advantages is flipped.

What it proves: rollouts, reward, advantages, masks, the update and the weight sync *together* raise the reward,
which the unit tests of each piece cannot show. The model is the embedded SmolLM2-135M-Instruct, asked to "Name a
color." and 15 prompts like it (an empty system turn keeps them at 18 tokens); the rule reward is 1 when the
response's first word is "The", which the model writes in ~40% of its samples at temperature 1. Each
rollout step generates 4 prompts x 8 samples of 4 tokens and trains on the groups with reward spread (at most 2:
DAPO's dynamic sampling, one generation batch a step); 8 steps at a constant learning rate of 1e-5; fixed seeds.

How: the mean reward of every sample generated in the last 2 rollout steps against the first 2 (64 samples each,
read from the rollout dumps), with the standard error of the difference of the two means
(``sqrt(var_first / n_first + var_last / n_last)``, samples counted as independent). Every learning run of the table
:data:`CASES` (plain DAPO; partial rollouts with every other group paused across a weight update; LoRA at rank 16 with
its adapters synced alone) must gain more than
3 standard errors. One negative control serves the whole table: the partial-rollout run with the GRPO advantages
negated by a monkeypatch in its rank (this module's :func:`flip_advantage_sign`, not a production switch) must not
gain more than 1. It is the run whose sampling and measuring contain every case's: its groups are drawn, rewarded
and dumped through the same agent loop, reward plug-in, dynamic sampling and rollout dumps as the plain case's, with
the rollout buffer's pause and resume on top; so a reward that rose by an artefact of how samples are drawn,
rewarded or read back, not by the update's sign, would rise there too. Every run samples with the same per-sample seeds (the
first rollout step of each is the same prompts). ``slow``: a run is the engine's and the trainer's start, 8 rollout
steps and a final checkpoint (~100 s on one AVX512-BF16 EPYC core, fp32). Modelled on verl's end-to-end
reward-threshold tests (a run that must reach a reward), with a statistical bound and a control instead of a fixed
threshold. A case is one row of :data:`CASES`: its overrides, the setup its ranks run, and what else its run shows.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.rl.helpers import rl_config, run_rl_ranks
from tests.rl.test_lora_rl import LORA_LEARNS, adapters_synced_every_step

THINGS = ["a color", "an animal", "a fruit", "a country", "a city", "a sport", "a planet", "a flower", "a tree",
          "a bird", "a metal", "a drink", "a tool", "a river", "a fish", "a game"]  # fmt: skip
STEPS = 8
WINDOW = 2  # rollout steps compared at each end


def first_word_is_the(response: str, **_: object) -> float:
    """The plug-in reward (``reward_fn``): 1.0 when the response starts with the word "The", else 0.0."""
    return 1.0 if re.match(r"\s*The\b", response) else 0.0


def flip_advantage_sign() -> None:
    """In a rank of the negative control, before the job starts: every GRPO advantage negated where
    :meth:`~afm_core.rl.policy_trainer.PolicyTrainer.advantages` looks the estimator up. The process ends with the
    run, so the patch is never undone."""
    import afm_core.rl.advantages as advantages

    grpo = advantages.grpo_advantages
    pytest.MonkeyPatch().setattr(advantages, "grpo_advantages", lambda *args, **kwargs: -grpo(*args, **kwargs))


def _prompts(path: Path) -> Path:
    """The RL prompts as an AFM/verl RL file: an empty system turn (SmolLM2's template would insert a 16-token
    default), one short request each."""
    rows = [
        {
            "data_source": "first_word",
            "ability": "math",  # the math family: the sandbox's <code> tool in the pool, as the RL demo has
            "prompt": [{"role": "system", "content": ""}, {"role": "user", "content": f"Name {thing}."}],
            "reward_model": {"ground_truth": "The"},
            "extra_info": {"index": i},
        }
        for i, thing in enumerate(THINGS)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _config(root: Path, *extra: str) -> dict:
    root.mkdir(parents=True)
    return rl_config(
        root / "run",
        "model=smollm2-135m",
        "data.presets=[]",
        f"data.files=[{_prompts(root / 'prompts.jsonl')}]",
        f"reward_fn={{_target_: {__name__}.first_word_is_the}}",
        "reward.mode=score",
        "rollout.n=8",
        "rollout.max_response_len=4",
        "rollout.context_schedule=[]",
        "rollout.concurrency=32",
        "algorithm.gen_batch_size=4",
        "algorithm.train_batch_size=2",
        "algorithm.mini_batch_size=2",
        "algorithm.filter_groups=true",
        "algorithm.max_num_gen_batches=1",
        "algorithm.allow_partial=true",
        f"trainer.max_steps={STEPS}",
        "trainer.micro_batch_size=8",
        "trainer.precision=fp32",
        "trainer.export_hf=false",
        f"trainer.rollout_data_dir={root / 'rollouts'}",
        "optim.lr=1.0e-5",
        "optim.min_lr=1.0e-5",
        "optim.weight_decay=0.0",
        "engine.max_num_seqs=32",
        *extra,
    )


@dataclass
class Gain:
    """The mean reward of the first and the last :data:`WINDOW` rollout steps, and the standard error of their
    difference."""

    first: float
    last: float
    se: float
    optimizer_steps: int

    @property
    def delta(self) -> float:
        return self.last - self.first

    def __str__(self) -> str:
        z = self.delta / self.se if self.se else math.copysign(math.inf, self.delta)
        return (f"first {self.first:.3f}, last {self.last:.3f}, delta {self.delta:+.3f}, SE {self.se:.3f} "
                f"({z:+.1f} SE), {self.optimizer_steps} optimizer steps")  # fmt: skip


def _mean_and_sq_se(values: list[float]) -> tuple[float, float]:
    """The mean of ``values`` and its squared standard error (sample variance / count)."""
    mean = sum(values) / len(values)
    return mean, sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values)


def _run(root: Path, setup=None, extra: tuple[str, ...] = ()) -> Gain:
    summary = run_rl_ranks(_config(root, *extra), setup=setup)
    assert summary["step"] == STEPS and not summary["stopped_early"]

    def rewards(steps: range) -> list[float]:
        lines = [line for s in steps for line in (root / "rollouts" / f"{s}.jsonl").read_text().splitlines()]
        return [json.loads(line)["reward"] for line in lines]

    (first, sq_se_first), (last, sq_se_last) = (
        _mean_and_sq_se(rewards(steps)) for steps in (range(1, WINDOW + 1), range(STEPS - WINDOW + 1, STEPS + 1))
    )
    return Gain(first, last, math.sqrt(sq_se_first + sq_se_last), summary["optimizer_steps"])


#: Partial rollouts with an off-policy correction (token TIS, cap 2), every trajectory paused after its first 2
#: tokens (:func:`tests.rl.helpers.pause_first_turns`): it waits in the rollout buffer and finishes in a later round,
#: from the second rollout step on under newer weights than its first tokens'.
PARTIAL = ("rollout.partial.enable=true", "algorithm.tis_cap=2.0")


def _paused_trajectories(flip: bool = False) -> None:
    """The ranks' setup of the partial-rollout runs: every trajectory paused once; the control's sign flip."""
    from tests.rl.helpers import pause_first_turns

    pause_first_turns(2)
    if flip:
        flip_advantage_sign()


def _trained_tokens_sampled_a_step_back(run: Path) -> None:
    """From step 2 on, every step that trained (dynamic sampling may keep no group) trained tokens sampled under
    the previous weights (``partial/lag_tokens`` has lag-1 tokens)."""
    lags = [json.loads(line)["partial/lag_tokens"] for line in (run / "metrics.jsonl").open()
            if json.loads(line)["split"] == "train"]  # fmt: skip
    assert all(lag.get("1", 0) > 0 for lag in lags[1:] if lag), lags


@dataclass(frozen=True)
class Case:
    """One learning run: its overrides, the setup its ranks run before the job (a module-level function, pickled to
    them), and what else its run directory must show."""

    id: str
    overrides: tuple[str, ...] = ()
    setup: Callable[[], None] | None = None
    check: Callable[[Path], None] | None = None


CASES = [
    Case("dapo"),
    Case("partial_rollouts_paused_across_a_weight_update", PARTIAL, _paused_trajectories,
         _trained_tokens_sampled_a_step_back),
    # LoRA at rank 16 (base frozen, adapters alone synced into vLLM as a LoRARequest each step)
    Case("lora_rank16_adapter_sync", LORA_LEARNS, check=adapters_synced_every_step),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_dapo_raises_a_learnable_reward_by_over_3_se(case: Case, tmp_path):
    learned = _run(tmp_path / "learned", setup=case.setup, extra=case.overrides)
    print(f"\n{case.id}, learned: {learned}")
    assert learned.delta > 3 * learned.se, f"the policy did not learn the reward ({case.id}): {learned}"
    if case.check is not None:
        case.check(tmp_path / "learned" / "run")


@pytest.mark.slow
def test_with_the_advantage_sign_flipped_the_reward_does_not_rise(tmp_path):
    control = _run(tmp_path / "control", setup=functools.partial(_paused_trajectories, flip=True), extra=PARTIAL)
    print(f"\ncontrol (partial rollouts, advantages negated): {control}")
    assert control.optimizer_steps > 0, "the control trained"
    assert control.delta <= control.se, f"the flipped-sign control gained reward: {control}"
