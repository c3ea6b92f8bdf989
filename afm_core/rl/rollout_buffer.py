"""The rollout buffer: prompt groups whose ``rollout.n`` trajectories are not all finished, carried from one
generation round to the next (partial rollouts, ``rollout.partial.enable``) and across a stop (a checkpoint holds
it: ``rollout.partial.on_stop=keep``).

A group is the unit GRPO needs whole: its finished trajectories wait here, graded, beside its paused ones
(:class:`~afm_core.rollout.types.PausedTrajectory`: token ids, loss mask, rollout logprobs and the policy version
of every token so far, the unfinished turn, the tool calls), and only a complete group reaches DAPO's dynamic
sampler. The next round continues the buffer's groups first, oldest first (the length bias of partial rollouts:
the long trajectories are the ones that wait).

Staleness. Every sampled token carries the policy version it was sampled under (the rollout step whose weights the
engine held: :attr:`afm_core.rl.checkpoint.RLProgress.rollout_step`); its lag when trained is the trainer's
version minus its own. ``rollout.partial.max_staleness`` bounds the lag, as AReaL's ``max_head_offpolicyness``
and ``max_token_version_gap`` (areal-project/AReaL ``areal/infra/staleness_manager.py``,
docs/en/algorithms/partial_rollout.md) and NeMo-RL's ``max_trajectory_age_steps`` do; past it, ``stale=mask``
takes the token out of the loss (:func:`mask_stale_tokens`, slime's ``--mask-offpolicy-in-partial-rollout`` for a
whole prefix) and ``stale=drop`` regenerates the trajectory from its prompt (:meth:`RolloutBuffer.take`). The
buffer itself is not versioned: each token is.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from afm_core.rollout.types import PausedTrajectory, ToolCallRecord

if TYPE_CHECKING:
    from afm_core.rl.grading import Sample


@dataclass
class Group:
    """One prompt's ``n`` trajectories in the making.

    Attributes:
        uid: the group id (the prompt stream's ``"{epoch}:{offset}"``).
        index: the task's index in the run's prompts.
        finished: sample index -> its graded :class:`~afm_core.rl.grading.Sample`.
        paused: sample index -> its :class:`~afm_core.rollout.types.PausedTrajectory`.
        born: the policy version when the group's first trajectory started.
        rolled_back: sample index -> the tokens its pauses rolled back that are counted as sampled again already
            (``PausedTrajectory.rolled_back_tokens`` is over all its pauses).
    Sample indices in neither dict are not started (or were dropped as stale: started again from the prompt).
    """

    uid: str
    index: int
    finished: dict[int, Sample] = field(default_factory=dict)
    paused: dict[int, PausedTrajectory] = field(default_factory=dict)
    born: int = 0
    rolled_back: dict[int, int] = field(default_factory=dict)

    def complete(self, n: int) -> bool:
        """All ``n`` trajectories are finished and graded."""
        return len(self.finished) == n

    def samples(self) -> list[Sample]:
        """The finished samples in sample order."""
        return [self.finished[i] for i in sorted(self.finished)]


@dataclass
class BufferStats:
    """What the buffer did in one rollout step (added up over its rounds): trajectories ``paused`` at a round's
    end, ``resumed`` from a pause, ``dropped`` as stale (``stale=drop``; their ``dropped_tokens`` sampled tokens
    are regenerated), tokens ``masked_stale`` at training (``stale=mask``)."""

    paused: int = 0
    resumed: int = 0
    dropped: int = 0
    dropped_tokens: int = 0
    masked_stale: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f"partial/{k}": v for k, v in self.__dict__.items()}


def sampled_versions(item: Sample | PausedTrajectory) -> list[int]:
    """The policy versions of the tokens the model sampled in ``item`` (a graded Sample: ``versions`` and
    ``response_mask`` over its response; a PausedTrajectory: those and its unfinished turn's ``turn_versions``),
    observation tokens left out."""
    return [v for v, m in zip(item.versions, item.response_mask) if m] + list(getattr(item, "turn_versions", []))


def oldest_version(item: Sample | PausedTrajectory, default: int) -> int:
    """The smallest version of ``item``'s sampled tokens (``default`` when it sampled none yet)."""
    return min(sampled_versions(item), default=default)


class RolloutBuffer:
    """The groups carried between rounds, oldest first (see the module docstring); a checkpoint holds
    :meth:`state_dict` (the groups, their graded samples and paused trajectories: picklable dataclasses)."""

    def __init__(self) -> None:
        self.groups: list[Group] = []

    def __len__(self) -> int:
        return len(self.groups)

    def put(self, groups: list[Group]) -> None:
        """Add ``groups`` after those already here (they keep their order)."""
        self.groups += groups

    def take(self, version: int, max_staleness: int, stale: str, stats: BufferStats) -> list[Group]:
        """Every group, oldest first, emptying the buffer, for a round under policy ``version``. With
        ``stale="drop"`` a trajectory (finished or paused) whose oldest token would be trained with a lag above
        ``max_staleness`` is dropped and starts again from its prompt (counted in ``stats``)."""
        groups, self.groups = self.groups, []
        if stale != "drop":
            return groups
        for group in groups:
            for where in (group.finished, group.paused):
                for i in [i for i, item in where.items() if version - oldest_version(item, version) > max_staleness]:
                    stats.dropped += 1
                    stats.dropped_tokens += len(sampled_versions(where.pop(i)))
        return groups

    def state_dict(self) -> dict[str, list[dict[str, object]]]:
        """The groups as plain containers (dicts, lists, numbers, strings: what ``torch.load(weights_only=True)``
        reads back, as megatron's ``load_common_state_dict`` does)."""
        return {"groups": [_plain(g) for g in self.groups]}

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        """Restore :meth:`state_dict` (None: a checkpoint from before the buffer existed, an empty buffer)."""
        self.groups = [_group(g) for g in (state or {}).get("groups", [])]


def _plain(group: Group) -> dict[str, object]:
    return {
        "uid": group.uid,
        "index": group.index,
        "born": group.born,
        "rolled_back": dict(group.rolled_back),
        "finished": {i: asdict(s) for i, s in group.finished.items()},
        "paused": {i: asdict(p) for i, p in group.paused.items()},
    }


def _group(plain: Mapping[str, Any]) -> Group:
    from afm_core.rl.grading import Sample  # imports torch: not where jobs.rl submits

    def paused(fields: Mapping[str, Any]) -> PausedTrajectory:
        return PausedTrajectory(**{**fields, "tool_calls": [ToolCallRecord(**c) for c in fields["tool_calls"]]})

    return Group(plain["uid"], plain["index"], {int(i): Sample.from_dict(s) for i, s in plain["finished"].items()},
                 {int(i): paused(p) for i, p in plain["paused"].items()}, plain["born"],
                 {int(i): n for i, n in plain["rolled_back"].items()})  # fmt: skip


def mask_stale_tokens(samples: list[Sample], version: int, max_staleness: int) -> list[Sample]:
    """``samples`` with every sampled token whose lag (``version`` minus its own) exceeds ``max_staleness`` taken
    out of the loss (its ``response_mask`` 0, as an observation token's); returns new Samples, the inputs are left
    as they are. Count the masked tokens with :func:`lag_histogram` before and after."""
    out = []
    for s in samples:
        if len(s.versions) != len(s.response_mask):  # no versions recorded (a stand-in sample): all current
            out.append(s)
            continue
        mask = [0 if m and version - v > max_staleness else m for v, m in zip(s.versions, s.response_mask)]
        out.append(s if mask == list(s.response_mask) else replace(s, response_mask=mask))
    return out


def lag_histogram(samples: list[Sample], version: int) -> dict[str, int]:
    """Trained tokens by lag: ``{"0": tokens sampled under ``version``, "1": one version older, ...}``."""
    counts = Counter(version - v for s in samples for v in sampled_versions(s))
    return {str(lag): counts[lag] for lag in sorted(counts)}
