"""Contrastive "when to act" pairs for AutoCoA SFT stage 1, tokenized and packed pair by pair.

AutoCoA (Zhang et al., "Agent models: Internalizing Chain-of-Action Generation into Reasoning models",
arXiv 2503.06580, §3.2.1 "CoT+A data" and §3.2.2) trains the decision to act with pairs that share a prefix
and diverge at one step: one branch triggers an action, the other keeps reasoning and answers. The paper builds
them from CoT and CoA runs of the same question where one of the two was wrong; our converted real traces are all
correct (``data.filters.require_correct``), so the trajectory's own choice at a decision point is the chosen branch
and the rejected branch is the other choice, written from the trajectory itself:

* ``act`` (at every tool call that opens an action, i.e. not directly after another call): context = prompt +
  the response before the call; chosen = the call (``<wiki_search>…</wiki_search>``); rejected = answering now,
  without the evidence (``<answer>`` with the trajectory's final answer);
* ``answer`` (at the final ``<answer>``): context = prompt + the response before it; chosen = the answer;
  rejected = one more action: the trajectory's last call repeated (a redundant call, the kind the SFT quality
  filter drops), or for a trajectory without calls a search for the question itself (the paper's "CoT correct,
  CoA indiscriminate" case; only for task families that search, ``mhqa`` and ``web``).

Each branch ends at its closing tag, where a rollout stops (:func:`afm_core.coa.stop_strings`). The context is
tokenized as SFT and rollouts tokenize it (prompt by :func:`~afm_core.data.tokenize.encode_prompt`, then the
response segment by segment, each observation on its own), the branch on its own after it. A pair becomes two
documents, ``context + chosen`` then ``context + rejected``, labels only on the branch tokens; a packed sequence
holds whole pairs, so documents ``2j`` and ``2j + 1`` of a row are always pair ``j``'s chosen and rejected
(:func:`afm_core.train.contrastive.pair_index` reads the pairing back from ``cu_seqlens``).
"""

from __future__ import annotations

import hashlib
import inspect
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from afm_core.coa.prompts import TASK_TOOLS
from afm_core.coa.render import render_block, render_response
from afm_core.coa.trajectory import Trajectory
from afm_core.data.loader import SFTDataModule
from afm_core.data.packing import PackedSequences, PackingStats, fill_sequences, first_fit_decreasing
from afm_core.data.tokenize import IGNORE_INDEX, encode_prompt, encode_text, response_segments

PAIR_KINDS = ("act", "answer")
SEARCH_FAMILIES = ("mhqa", "web")


@dataclass(frozen=True)
class ActionPair:
    """One decision point of a trajectory, with both branches.

    Attributes:
        id: ``"<trajectory id>@<step index>"`` (the step the branches replace).
        task_id: the question's id (:func:`afm_core.data.schema.task_id`): no question is in both splits.
        kind: ``act`` (chosen: the call; rejected: answering now) or ``answer`` (chosen: the answer;
            rejected: one more call).
        prompt: the user-turn text.
        context: the response before the decision, canonical layout, observations inline (may be empty).
        chosen: the branch to make more likely, one block (``<tag>\\n…\\n</tag>``).
        rejected: the branch to make less likely, one block.
    """

    id: str
    task_id: str
    kind: str
    prompt: str
    context: str
    chosen: str
    rejected: str


def _prefix(trajectory: Trajectory, k: int) -> str:
    """The response text before step ``k``, with the separator the canonical layout puts before a block."""
    steps = trajectory.steps[:k]
    text = render_response(steps)
    return text + "\n" if steps and steps[-1].kind != "observation" else text


def trajectory_pairs(trajectory: Trajectory, question_id: str) -> tuple[list[ActionPair], Counter[str]]:
    """Every decision-point pair of one trajectory (module docstring) and the count of points skipped, by reason.

    Reasons: ``no_answer`` (the trajectory has no ``<answer>``), ``no_action_to_reject`` (an answer pair without
    a call in the trajectory, in a family that does not search).
    """
    skipped: Counter[str] = Counter()
    steps = trajectory.steps
    answer_at = [i for i, step in enumerate(steps) if step.tag == "answer"]
    if not answer_at:
        skipped["no_answer"] += 1
        return [], skipped
    final = answer_at[-1]
    answer_block = render_block("answer", steps[final].content)
    pairs: list[ActionPair] = []
    last_call: str | None = None
    for k, step in enumerate(steps[:final]):
        if step.kind != "tool":
            continue
        call = render_block(step.tag, step.content)
        last_call = call
        if k > 0 and steps[k - 1].kind == "tool":  # a second call of the same action: no decision here
            continue
        pairs.append(
            ActionPair(
                f"{trajectory.id}@{k}",
                question_id,
                "act",
                trajectory.prompt,
                _prefix(trajectory, k),
                call,
                answer_block,
            )
        )
    if last_call is None and trajectory.task in SEARCH_FAMILIES:
        last_call = render_block(TASK_TOOLS[trajectory.task][0], trajectory.question)
    if last_call is None:
        skipped["no_action_to_reject"] += 1
    else:
        pairs.append(
            ActionPair(
                f"{trajectory.id}@{final}",
                question_id,
                "answer",
                trajectory.prompt,
                _prefix(trajectory, final),
                answer_block,
                last_call,
            )
        )
    return pairs, skipped


def build_pairs(trajectories: Sequence[tuple[str, Trajectory]]) -> tuple[list[ActionPair], dict[str, Any]]:
    """Every pair of the ``(row id, trajectory)`` items, in order; upsampled copies (row id != trajectory id,
    ``#up<k>``) give no extra pairs.

    Returns:
        ``(pairs, report)``: report = ``{"trajectories", "pairs_found", "skipped"}`` (skipped decision points by
        reason, see :func:`trajectory_pairs`).
    """
    from afm_core.data.schema import task_id

    found: list[ActionPair] = []
    skipped: Counter[str] = Counter()
    used = 0
    for row_id, trajectory in trajectories:
        if row_id != trajectory.id:
            continue
        used += 1
        pairs, why = trajectory_pairs(trajectory, task_id(trajectory.question))
        found += pairs
        skipped += why
    return found, {"trajectories": used, "pairs_found": len(found), "skipped": dict(skipped)}


def select_pairs(
    lengths: Sequence[int], kinds: Sequence[str], seq_length: int, max_pairs: int | None, seed: int
) -> list[int]:
    """Indices of the pairs to use, in a seeded random order: those whose two documents fit in ``seq_length``
    tokens, at most ``max_pairs`` of them, sampled per kind in the proportions of all the pairs found (the length
    limit alone would favour the short ``act`` pairs: answer pairs carry the whole trajectory as context); a kind
    short of its quota leaves the rest to the others."""
    rng = random.Random(seed)
    fits = [i for i, length in enumerate(lengths) if length <= seq_length]
    rng.shuffle(fits)
    if max_pairs is None or len(fits) <= max_pairs:
        return fits
    found = Counter(kinds)
    by_kind = {kind: [i for i in fits if kinds[i] == kind] for kind in found}
    picked = [i for kind, items in by_kind.items() for i in items[: round(max_pairs * found[kind] / len(kinds))]]
    chosen = set(picked)
    picked += [i for i in fits if i not in chosen][: max(0, max_pairs - len(picked))]
    picked = picked[:max_pairs]
    rng.shuffle(picked)
    return picked


@dataclass(frozen=True)
class TokenizedPair:
    """A pair as token ids: the shared context and the two branches (each alone, no end-of-turn token)."""

    context_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]

    def __len__(self) -> int:
        """Tokens of both documents: ``2 * context + chosen + rejected``."""
        return 2 * len(self.context_ids) + len(self.chosen_ids) + len(self.rejected_ids)


def tokenize_pair(tokenizer: Any, pair: ActionPair, system: str | None = None) -> TokenizedPair:
    """Token ids of a pair, as SFT and rollouts tokenize (module docstring)."""
    context = encode_prompt(tokenizer, pair.prompt, system)
    for text, _ in response_segments(pair.context):
        context += encode_text(tokenizer, text)
    return TokenizedPair(context, encode_text(tokenizer, pair.chosen), encode_text(tokenizer, pair.rejected))


def pack_pairs(
    pairs: Sequence[TokenizedPair], seq_length: int, *, pad_id: int = 0, keep_order: bool = False
) -> tuple[PackedSequences, int]:
    """Pack whole pairs into ``seq_length``-token sequences, first-fit-decreasing on pair lengths, or with
    ``keep_order`` in the given order (next fit: a new sequence when a pair does not fit the current one), so that
    the first sequences hold the first pairs (a held-out eval reads the first ``trainer.eval_sequences``).

    In each row, pair ``j`` is documents ``2j`` (context + chosen) and ``2j + 1`` (context + rejected); labels are
    the branch tokens, -100 on the context and padding. A pair longer than ``seq_length`` is dropped (truncating
    would cut a branch or the context the branches depend on).

    Returns:
        ``(sequences, dropped)``: the packed sequences (``stats.num_examples`` counts pairs) and the number of
        pairs dropped as too long.
    Raises:
        ValueError: ``seq_length`` < 2, or a pair with an empty branch.
    """
    if seq_length < 2:
        raise ValueError(f"seq_length must be >= 2, got {seq_length}")
    for i, pair in enumerate(pairs):
        if not pair.chosen_ids or not pair.rejected_ids:
            raise ValueError(f"pair {i}: empty chosen or rejected branch")
    fits = [i for i, pair in enumerate(pairs) if len(pair) <= seq_length]
    lengths = np.array([len(pairs[i]) for i in fits], dtype=np.int64)
    docs = []  # pair j's chosen and rejected documents are docs 2j and 2j + 1
    for i in fits:
        pair, masked = pairs[i], [IGNORE_INDEX] * len(pairs[i].context_ids)
        docs += [(pair.context_ids + branch, masked + branch) for branch in (pair.chosen_ids, pair.rejected_ids)]
    if keep_order:
        rows: list[list[int]] = []
        room = 0
        for j, length in enumerate(lengths.tolist()):
            if not rows or length > room:
                rows.append([])
                room = seq_length
            rows[-1].append(j)
            room -= length
    else:
        rows = [sorted(members) for members in first_fit_decreasing(lengths, seq_length)]
    bins = [[d for j in members for d in (2 * j, 2 * j + 1)] for members in rows]
    input_ids, labels, position_ids, cu_seqlens = fill_sequences(docs, bins, seq_length, pad_id)
    n = len(bins)
    stats = PackingStats(
        num_examples=len(pairs),
        num_sequences=n,
        num_truncated=0,
        num_dropped=len(pairs) - len(fits),
        num_tokens=int(lengths.sum()),
        num_target_tokens=int((labels != IGNORE_INDEX).sum()),
        capacity=n * seq_length,
    )
    return PackedSequences(input_ids, labels, position_ids, cu_seqlens, stats), len(pairs) - len(fits)


def _code_fingerprint() -> str:
    return hashlib.sha256(inspect.getsource(inspect.getmodule(pack_pairs)).encode()).hexdigest()  # type: ignore[arg-type]


class PairDataModule(SFTDataModule):
    """:class:`~afm_core.data.loader.SFTDataModule` over contrastive pairs built from prepared trajectories.

    Same interface, micro batches and token cache as the SFT data (the packed pairs are cached next to the
    parquet, keyed also by the pair settings and this module's code); the train split keeps at most
    ``max_pairs`` pairs, the held-out split at most ``max_heldout_pairs`` (:func:`select_pairs`: seeded, in the
    kinds' proportions); held-out pairs are packed in their random order, so the held-out eval's first
    ``trainer.eval_sequences`` sequences are a random sample.

    Args:
        train_paths, tokenizer, seq_length, heldout_paths, system, dense_mask, cache: as for SFTDataModule
            (packing is always on: a pair's two documents share a sequence; ``mask_observations`` does not apply:
            a pair's labels are on its branch tokens only).
        max_pairs: train pairs kept (the upstream write-up used about 1,500); None: all.
        max_heldout_pairs: held-out pairs kept; None: all.
        seed: the sample's seed.
    """

    def __init__(
        self,
        train_paths: Sequence[str | Path],
        tokenizer: Any,
        seq_length: int,
        *,
        heldout_paths: Sequence[str | Path] = (),
        max_pairs: int | None = 1500,
        max_heldout_pairs: int | None = None,
        seed: int = 0,
        system: str | None = None,
        dense_mask: bool | None = None,
        cache: bool = True,
    ):
        super().__init__(
            train_paths,
            tokenizer,
            seq_length,
            heldout_paths=heldout_paths,
            pack=True,
            system=system,
            dense_mask=dense_mask,
            cache=cache,
        )
        self.max_pairs, self.max_heldout_pairs, self.seed = max_pairs, max_heldout_pairs, seed
        self.reports: dict[str, dict[str, Any]] = {}  # split -> pair report (when this process built it)

    def _split(self, name: str, paths: list[str | Path]) -> PackedSequences:
        from afm_core.data.token_cache import CACHE_DIR_NAME, cache_inputs, cached_packed

        limit = self.max_pairs if name == "train" else self.max_heldout_pairs
        if not (self.cache and paths):
            self.built[name] = True
            return self._build_pairs(name, paths, limit)
        inputs = cache_inputs(
            paths,
            self._tokenizer,
            kind="contrastive_pairs",
            seq_length=self.seq_length,
            system=self.system,
            max_pairs=limit,
            seed=self.seed,
            pairs_code=_code_fingerprint(),
        )
        packed, self.built[name] = cached_packed(
            Path(paths[0]).parent / CACHE_DIR_NAME, inputs, lambda: self._build_pairs(name, paths, limit)
        )
        return packed

    def _build_pairs(self, name: str, paths: list[str | Path], limit: int | None) -> PackedSequences:
        from afm_core.data.prepare import read_prepared_trajectories

        items = [item for path in paths for item in read_prepared_trajectories(path)]
        pairs, report = build_pairs(items)
        tokenizer = self.tokenizer
        tokenized = [tokenize_pair(tokenizer, pair, self.system) for pair in pairs]
        kinds = [pair.kind for pair in pairs]
        kept = select_pairs([len(t) for t in tokenized], kinds, self.seq_length, limit, self.seed)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        packed, _ = pack_pairs(
            [tokenized[i] for i in kept], self.seq_length, pad_id=pad_id, keep_order=name == "heldout"
        )
        too_long = sum(len(t) > self.seq_length for t in tokenized)
        by_kind = Counter(pairs[i].kind for i in kept)
        self.reports[name] = {**report, "too_long": too_long, "pairs": len(kept), "by_kind": dict(by_kind)}
        return packed
