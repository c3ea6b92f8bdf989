"""DAPO dynamic sampling: drop prompt groups whose rewards are all equal, keep generating until the batch is full.

DAPO (arXiv 2503.14476, section 3.2, eq. 11: ``0 < |{o_i | is_equivalent(a, o_i)}| < G``): a group of
``rollout.n`` samples whose rewards are all equal has zero GRPO advantage for every sample and only dilutes the
gradient. The trainer over-samples: it generates batch after batch, keeps the groups with reward spread, and
stops once ``train_batch_size`` groups are kept; the surplus of the last batch is discarded; after
``max_num_gen_batches`` generation batches without a full batch it gives up (verl / AFM
``recipe/dapo/dapo_ray_trainer.py::fit``, ``algorithm.filter_groups``; a group of one sample is always kept,
as there).

The driver feeds every generation batch of one rollout step into a :class:`DynamicSampler` and takes the train
batch when it is full::

    sampler = dynamic_sampler(algorithm)  # the algorithm group: train_batch_size groups, filter_groups_metric=acc, ...
    while not sampler.ready:
        batch = generate(next(prompts))          # all n graded samples of each prompt
        sampler.add_samples(batch)               # by uid, on the metric; raises DynamicSamplingExhausted
    samples, stats = sampler.take()              # train_batch_size groups, in arrival order

A group is kept when its ``algorithm.filter_groups_metric`` varies (:func:`filter_values`): accuracy by default,
as DAPO's eq. 11 and verl's ``algorithm.filter_groups.metric=acc``, so that the overlong penalty's length
differences alone do not keep a group whose samples are all right or all wrong.

With data parallelism, feed the same (gathered) generation batches on every rank, so that all ranks keep the
same groups. :meth:`DynamicSampler.state_dict` holds everything (kept samples included, which must then be
picklable), so a checkpoint taken mid-step resumes the accumulation exactly.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from afm_core.config.rl import FILTER_METRICS, AlgorithmConfig

if TYPE_CHECKING:
    from afm_core.rl.grading import Sample


def filter_values(samples: Sequence[Sample], metric: str) -> list[float]:
    """The values a group must vary in to be kept (``algorithm.filter_groups_metric``): ``acc``, the task's
    correctness (each sample's ``score``; DAPO eq. 11, verl's ``algorithm.filter_groups.metric=acc``), or
    ``score``, the shaped reward (``reward``: with the overlong penalty on, a group whose samples are all right or
    all wrong would pass on length differences alone).

    Raises:
        ValueError: an unknown metric.
    """
    if metric not in FILTER_METRICS:
        raise ValueError(f"algorithm.filter_groups_metric={metric!r}: expected one of {', '.join(FILTER_METRICS)}")
    return [float(getattr(sample, FILTER_METRICS[metric])) for sample in samples]


class DynamicSamplingExhausted(RuntimeError):
    """``max_num_gen_batches`` generation batches did not yield ``train_batch_size`` groups with reward spread."""


@dataclass(frozen=True)
class DynamicSamplingStats:
    """One rollout step: generation batches used, groups/samples generated, groups kept (reward spread),
    groups trained on, kept groups discarded as surplus, groups of two or more samples whose scores were all equal
    (no GRPO signal; counted with or without filtering); ``kept_group_ratio`` = groups_kept / groups_generated,
    ``all_equal_group_ratio`` = groups_all_equal / groups_generated."""

    gen_batches: int
    groups_generated: int
    samples_generated: int
    groups_kept: int
    groups_trained: int
    groups_surplus: int
    groups_all_equal: int = 0

    @property
    def kept_group_ratio(self) -> float:
        return self.groups_kept / self.groups_generated if self.groups_generated else float("nan")

    @property
    def all_equal_group_ratio(self) -> float:
        return self.groups_all_equal / self.groups_generated if self.groups_generated else float("nan")

    def as_dict(self) -> dict[str, float]:
        return {
            **asdict(self),
            "kept_group_ratio": self.kept_group_ratio,
            "all_equal_group_ratio": self.all_equal_group_ratio,
        }


class DynamicSampler:
    """Accumulates generation batches into one train batch of ``train_batch_size`` prompt groups.

    Args:
        train_batch_size: prompt groups per train batch (``data.train_batch_size``; samples = groups x n).
        max_num_gen_batches: generation batches allowed per train batch; <= 0 means unlimited.
        filter_groups: drop groups whose scores are all equal (DAPO); False keeps every group (plain GRPO/PPO,
            where the first generation batch is the train batch).
        allow_partial: when ``max_num_gen_batches`` is reached, let :meth:`take` return the groups kept so far
            instead of raising :class:`DynamicSamplingExhausted`.
        metric: what :meth:`add_samples` filters on (``algorithm.filter_groups_metric``: :func:`filter_values`).
    Raises:
        ValueError: ``train_batch_size`` < 1 or an unknown ``metric``.
    """

    def __init__(
        self,
        train_batch_size: int,
        max_num_gen_batches: int = 10,
        *,
        filter_groups: bool = True,
        allow_partial: bool = False,
        metric: str = "acc",
    ):
        if train_batch_size < 1:
            raise ValueError(f"train_batch_size={train_batch_size}: must be >= 1")
        filter_values([], metric)  # an unknown metric fails here, not at the first generation batch
        self.metric = metric
        self.train_batch_size = int(train_batch_size)
        self.max_num_gen_batches = int(max_num_gen_batches)
        self.filter_groups = bool(filter_groups)
        self.allow_partial = bool(allow_partial)
        self._reset()

    def _reset(self) -> None:
        self.gen_batches = 0
        self.groups_generated = 0
        self.samples_generated = 0
        self.groups_all_equal = 0
        self.kept: list[tuple[Hashable, list[Sample]]] = []  # (group id, its samples), in arrival order
        self.seen: set[Hashable] = set()

    # -- feeding ---------------------------------------------------------------------------------------
    @property
    def is_full(self) -> bool:
        """Enough groups are kept for one train batch."""
        return len(self.kept) >= self.train_batch_size

    @property
    def exhausted(self) -> bool:
        """The generation budget of this step is used up (only reachable with ``allow_partial``)."""
        return 0 < self.max_num_gen_batches <= self.gen_batches and not self.is_full

    @property
    def ready(self) -> bool:
        """:meth:`take` may be called: full, or exhausted with ``allow_partial``."""
        return self.is_full or (self.allow_partial and self.exhausted)

    def keeps(self, group: Sequence[Sample]) -> bool:
        """Whether :meth:`add_samples` would keep this complete group of graded samples (its metric varies, or
        ``filter_groups`` is off, or it has one sample)."""
        if not self.filter_groups or len(group) < 2:
            return True
        values = filter_values(group, self.metric)
        return max(values) != min(values)

    def add(self, group_ids: Sequence[Hashable], scores: Sequence[float], samples: Sequence[Sample]) -> int:
        """Add one generation batch: ``group_ids[i]``, ``scores[i]`` (the filter metric, e.g. the final reward
        or accuracy) and ``samples[i]`` (any object: a trajectory) of each sample.

        A group must arrive whole in one batch; group ids must not repeat across the batches of one step.

        Returns:
            Groups kept from this batch.
        Raises:
            ValueError: lengths differ, the sampler is already full, or a group id was seen in an earlier batch.
            DynamicSamplingExhausted: this was batch ``max_num_gen_batches`` and the batch is still not full
                (unless ``allow_partial``).
        """
        if not len(group_ids) == len(scores) == len(samples):
            raise ValueError(
                f"one generation batch needs as many group ids ({len(group_ids)}), scores "
                f"({len(scores)}) and samples ({len(samples)})"
            )
        if self.ready:
            raise ValueError("the train batch is already complete: call take() before adding more")
        groups: dict[Hashable, list[int]] = {}
        for i, gid in enumerate(group_ids):
            groups.setdefault(gid, []).append(i)
        repeated = [gid for gid in groups if gid in self.seen]
        if repeated:
            raise ValueError(
                f"group id(s) {repeated[:5]} already came in an earlier generation batch of this step; "
                "group uids must be unique per prompt and generation batch"
            )
        kept = 0
        for gid, members in groups.items():
            self.seen.add(gid)
            values = [float(scores[i]) for i in members]
            all_equal = len(members) > 1 and max(values) == min(values)
            self.groups_all_equal += all_equal
            if not self.filter_groups or not all_equal:
                self.kept.append((gid, [samples[i] for i in members]))
                kept += 1
        self.gen_batches += 1
        self.groups_generated += len(groups)
        self.samples_generated += len(group_ids)
        if self.exhausted and not self.allow_partial:
            raise DynamicSamplingExhausted(
                f"{self.gen_batches} generation batches (max_num_gen_batches={self.max_num_gen_batches}) kept only "
                f"{len(self.kept)} of {self.train_batch_size} groups with unequal rewards "
                f"({self.groups_generated} generated): the data may be too hard or too easy for the policy; raise "
                "max_num_gen_batches (<= 0: unlimited) or filter the data (python -m jobs.filter_rl)"
            )
        return kept

    def add_samples(self, samples: Sequence[Sample]) -> int:
        """:meth:`add` for graded samples (:class:`~afm_core.rl.grading.Sample`: ``uid``, ``score``, ``reward``),
        grouped by ``uid`` and filtered on :attr:`metric`."""
        return self.add([s.uid for s in samples], filter_values(samples, self.metric), samples)

    def take(self) -> tuple[list[Sample], DynamicSamplingStats]:
        """The samples of the first ``train_batch_size`` kept groups (group after group, in arrival order) and
        this step's statistics; the sampler is then empty for the next step.

        Raises:
            RuntimeError: not :attr:`ready`.
        """
        if not self.ready:
            raise RuntimeError(f"take(): only {len(self.kept)} of {self.train_batch_size} groups kept so far")
        used = self.kept[: self.train_batch_size]
        stats = DynamicSamplingStats(
            gen_batches=self.gen_batches,
            groups_generated=self.groups_generated,
            samples_generated=self.samples_generated,
            groups_kept=len(self.kept),
            groups_trained=len(used),
            groups_surplus=len(self.kept) - len(used),
            groups_all_equal=self.groups_all_equal,
        )
        samples = [sample for _, members in used for sample in members]
        self._reset()
        return samples, stats

    # -- checkpointing ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, object]:
        """Everything needed to resume mid-step (the kept samples by reference: they must be picklable)."""
        return {
            "gen_batches": self.gen_batches,
            "groups_generated": self.groups_generated,
            "samples_generated": self.samples_generated,
            "groups_all_equal": self.groups_all_equal,
            "kept": [(g, list(m)) for g, m in self.kept],
            "seen": list(self.seen),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.gen_batches = int(state["gen_batches"])
        self.groups_generated = int(state["groups_generated"])
        self.samples_generated = int(state["samples_generated"])
        self.groups_all_equal = int(state.get("groups_all_equal", 0))  # absent in checkpoints before it existed
        self.kept = [(g, list(m)) for g, m in state["kept"]]
        self.seen = set(state["seen"])


def dynamic_sampler(algorithm: AlgorithmConfig) -> DynamicSampler:
    """The RL job's sampler from its ``algorithm`` group (:class:`~afm_core.config.rl.AlgorithmConfig`:
    ``train_batch_size``, ``max_num_gen_batches``, ``filter_groups``, ``filter_groups_metric``, ``allow_partial``).

    Raises:
        ValueError: an unknown ``filter_groups_metric`` (:func:`filter_values`).
    """
    return DynamicSampler(
        algorithm.train_batch_size,
        algorithm.max_num_gen_batches,
        filter_groups=algorithm.filter_groups,
        allow_partial=algorithm.allow_partial,
        metric=algorithm.filter_groups_metric,
    )
