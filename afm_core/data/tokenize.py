"""Tokenize one SFT example (prompt + CoA response) into input ids and observation-masked labels.

The response is tokenized segment by segment (model text; each observation block with its layout
newlines), exactly as a rollout builds its ids, so the loss mask is exact by construction and does not
depend on how the BPE would merge the characters around the ``<observation>`` tags. Upstream AFM (LLaMA-Factory-AFM ``IgnoreObsSupervisedDatasetProcessor.
_mask_search_result_tokens``) instead scans the token ids for marker token sequences; that scan
silently trains on observations whenever the BPE merges a tag with its neighbours (for example
``</web_search><observation>`` or `` <observation>``). :func:`upstream_marker_mask` replicates the
upstream scan, only so that tests and benchmarks can compare the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from afm_core.coa.render import observation_spans

if TYPE_CHECKING:  # transformers costs 1-2 s to import: a job's submitter prints its plan without it
    from transformers import PreTrainedTokenizerBase

IGNORE_INDEX = -100
"""Label of a token that is not trained (prompt, observation, padding): PyTorch's CE ``ignore_index``."""

_END_OF_TURN_PROBE = "\x00AFM-END-OF-TURN-PROBE\x00"

ENABLE_THINKING = True
"""The chat templates' ``enable_thinking`` (Qwen3): on, so CoA's ``<think>`` blocks are the model's thinking and no
empty think block is inserted before them (:func:`encode_prompt`)."""


@dataclass(frozen=True)
class TokenizedExample:
    """One tokenized SFT example.

    Attributes:
        input_ids: ``[n]`` token ids (python ints): the chat-template prompt, then the response, then
            the end-of-turn token.
        labels: ``[n]`` token ids aligned with ``input_ids`` (NOT shifted: ``labels[t]`` is the label
            of token ``t`` itself, the HF convention), ``IGNORE_INDEX`` (-100) where not trained.
        truncated: True when the example was cut to ``max_length`` tokens.
    """

    input_ids: list[int]
    labels: list[int]
    truncated: bool = False

    def __len__(self) -> int:
        return len(self.input_ids)


def end_of_turn_token(tokenizer: PreTrainedTokenizerBase) -> str:
    """The token that closes an assistant turn in ``tokenizer``'s chat template (ChatML: ``<|im_end|>``).

    Found by rendering a probe assistant message and taking the first special token after it; falls
    back to ``tokenizer.eos_token``.

    Raises:
        ValueError: the template closes the turn with no special token and the tokenizer has no EOS.
    """
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": _END_OF_TURN_PROBE}],
        tokenize=False,
    )
    after = rendered[rendered.index(_END_OF_TURN_PROBE) + len(_END_OF_TURN_PROBE) :]
    special_tokens = set(tokenizer.all_special_tokens)
    special_tokens.update(token.content for token in tokenizer.added_tokens_decoder.values() if token.special)
    special = sorted((after.find(token), token) for token in special_tokens if token and token in after)
    if special:
        return special[0][1]
    if tokenizer.eos_token:
        return tokenizer.eos_token
    raise ValueError(f"{type(tokenizer).__name__}: chat template closes no turn with a special token and no eos_token")


def end_of_turn_ids(tokenizer: PreTrainedTokenizerBase, generation_eos: int | list[int] | None = None) -> set[int]:
    """Every token id that ends a model turn: the chat template's end-of-turn token (:func:`end_of_turn_token`;
    Qwen ``<|im_end|>`` 151645, Llama 3 ``<|eot_id|>``), ``<|im_end|>`` where the vocabulary has it, the tokenizer's
    eos (Qwen ``<|endoftext|>`` 151643, Llama 3 base ``<|end_of_text|>``) and the ``eos_token_id`` of the
    model's ``generation_config.json`` (an int or, for Llama 3.x, a list: vLLM stops at each of them).

    Tokenizers without a pad token (Llama 3.x) need none of this: batches pad with id 0 under a zero loss mask
    (``data/loader.py``, ``rl/batch.py``).
    """
    ids: set[int] = set()
    if getattr(tokenizer, "chat_template", None):
        ids.add(tokenizer.convert_tokens_to_ids(end_of_turn_token(tokenizer)))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if im_end != getattr(tokenizer, "unk_token_id", None):
        ids.add(im_end)
    extra = [generation_eos] if isinstance(generation_eos, int) else list(generation_eos or [])
    ids.update([tokenizer.eos_token_id, *extra])
    return {i for i in ids if isinstance(i, int) and i >= 0}


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str, system: str | None = None) -> list[int]:
    """The ids of the chat-template prompt up to the assistant turn: what the model continues from.

    ``chat_template([system?, user: prompt], add_generation_prompt=True)`` rendered as text, then tokenized
    on its own with no added special tokens (the template writes them). ``system=None`` leaves the system
    turn to the template (SmolLM2 and Qwen2.5 insert a default one). Used by SFT and by every rollout, so
    the model meets the same prompt ids in both.

    Qwen3 (hybrid thinking, transformers ``models/qwen3``; its chat template reads ``enable_thinking``): the prompt
    is rendered with ``enable_thinking=True`` (:data:`ENABLE_THINKING`, also the template's default), so it ends
    at ``<|im_start|>assistant\n`` with no empty ``<think>\n\n</think>`` block; a CoA response's own
    ``<think>`` role blocks are then Qwen3's thinking, tokenized as its ``<think>`` / ``</think>`` tokens (151667 /
    151668: added tokens that are not "special", so :func:`encode_text` keeps them whole) and trained like any
    model text. Templates without the variable ignore it. Only the prompt goes through the template: Qwen3's
    (``tokenizer_config.json`` of Hugging Face ``Qwen/Qwen3-*``), given a whole CoA trajectory as one assistant
    message, keeps the first think block and the text after the last ``</think>`` and drops the tool calls,
    observations and think blocks between them, so responses are appended as written (:func:`tokenize_sft_example`).
    """
    messages = [{"role": "user", "content": prompt}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    prompt_text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, enable_thinking=ENABLE_THINKING
    )
    return tokenizer(prompt_text, add_special_tokens=False)["input_ids"]


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Ids of one segment of response text, tokenized on its own.

    Special-token text inside it (``<|im_end|>`` in a crawled page) is split like any other text
    (``split_special_tokens=True``), so only an appended end-of-turn token can end the turn.
    """
    if not text:
        return []
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def response_segments(response: str) -> list[tuple[str, bool]]:
    """Split a CoA response into ``[(text, is_environment)]`` segments, in order, that concatenate to it.

    An environment segment is one ``<observation>…</observation>`` block (both tags;
    :func:`afm_core.coa.render.observation_spans`, so an unclosed block runs to the end) together with the
    newlines the canonical layout puts around it: one ``"\\n"`` before and up to two after
    (:func:`afm_core.coa.render.render_observation`). Everything else is model text. This is how a rollout
    builds the text: the model's sampled segment ends at a tool's closing tag, and the environment appends
    ``render_observation(...)`` as one segment of its own.
    """
    segments: list[tuple[str, bool]] = []
    pos = 0
    for start, end in observation_spans(response):
        if start > pos and response[start - 1] == "\n":
            start -= 1
        start = max(start, pos)
        for _ in range(2):
            if end < len(response) and response[end] == "\n":
                end += 1
        if start > pos:
            segments.append((response[pos:start], False))
        segments.append((response[start:end], True))
        pos = end
    if pos < len(response):
        segments.append((response[pos:], False))
    return segments


def tokenize_sft_example(
    tokenizer: PreTrainedTokenizerBase,
    prompt: str,
    response: str,
    *,
    mask_observations: bool = True,
    max_length: int | None = None,
    system: str | None = None,
) -> TokenizedExample:
    """Tokenize ``prompt`` (user turn) and ``response`` (CoA text) into ids and observation-masked labels.

    Layout: :func:`encode_prompt`, then the response SEGMENT BY SEGMENT (:func:`response_segments`: model
    text, then each observation with its surrounding newlines on its own, each by :func:`encode_text`),
    then the end-of-turn token (:func:`end_of_turn_token`). This is exactly how an agent-loop rollout
    builds its ids (``afm_core.rollout.agent_loop``): sampled ids up to a tool's closing tag, then the
    observation tokenized alone. So no token straddles a model/environment boundary, the model meets the
    same ids in RL as in SFT, and the mask is exact by construction: no offset mapping, no marker scan.

    Labels: -100 for every prompt token; when ``mask_observations``, -100 also for every token of an
    environment segment. Every model-text token and the end-of-turn token are trained.

    Truncation: with ``max_length`` (tokens), only the first ``max_length`` tokens are kept (the prompt
    first, so a long prompt leaves no trained token and a long response loses its end-of-turn token);
    kept tokens keep their labels, also when the cut falls inside an observation (upstream drops such
    examples instead).

    Raises:
        ValueError: ``max_length`` < 1.
    """
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    prompt_ids = encode_prompt(tokenizer, prompt, system)
    response_ids: list[int] = []
    response_labels: list[int] = []
    for text, is_environment in response_segments(response):
        ids = encode_text(tokenizer, text)
        response_ids += ids
        response_labels += [IGNORE_INDEX] * len(ids) if is_environment and mask_observations else ids

    eot_id = tokenizer.convert_tokens_to_ids(end_of_turn_token(tokenizer))
    input_ids = prompt_ids + response_ids + [eot_id]
    labels = [IGNORE_INDEX] * len(prompt_ids) + response_labels + [eot_id]
    truncated = max_length is not None and len(input_ids) > max_length
    if truncated:
        input_ids, labels = input_ids[:max_length], labels[:max_length]
    return TokenizedExample(input_ids=input_ids, labels=labels, truncated=truncated)


def upstream_marker_mask(
    tokenizer: PreTrainedTokenizerBase, response_ids: list[int], tag: str = "observation"
) -> tuple[list[int], bool]:
    """UPSTREAM behaviour, for comparison only: LLaMA-Factory-AFM's ``_mask_search_result_tokens``.

    Replicates ``IgnoreObsSupervisedDatasetProcessor._mask_search_result_tokens`` (AFM commit 8f94516,
    ``LLaMA-Factory/src/llamafactory/data/processor/supervised.py``): start marker
    ``encode("<observation")``, end marker ``encode("observation>\\n\\n")``; a linear scan over
    ``response_ids`` masks from a start-marker match through the next end-marker match, both markers
    included. It fails silently when the BPE merges a tag with its neighbour (``><``, `` <``, ``>\\n``):
    the marker ids never match and the observation is trained.

    Args:
        response_ids: ``[n]`` token ids of the response alone.

    Returns:
        ``(labels, is_valid)``: ``labels`` is ``[n]``, ``response_ids`` with -100 where masked;
        ``is_valid`` is False when a start marker was never closed (upstream drops such examples).
    """
    start_marker = tokenizer.encode(f"<{tag}", add_special_tokens=False)
    end_marker = tokenizer.encode(f"{tag}>\n\n", add_special_tokens=False)
    labels = list(response_ids)
    inside = False
    i = 0
    while i < len(response_ids):
        if not inside and response_ids[i : i + len(start_marker)] == start_marker:
            labels[i : i + len(start_marker)] = [IGNORE_INDEX] * len(start_marker)
            inside = True
            i += len(start_marker)
        elif inside and response_ids[i : i + len(end_marker)] == end_marker:
            labels[i : i + len(end_marker)] = [IGNORE_INDEX] * len(end_marker)
            inside = False
            i += len(end_marker)
        else:
            if inside:
                labels[i] = IGNORE_INDEX
            i += 1
    return labels, not inside
