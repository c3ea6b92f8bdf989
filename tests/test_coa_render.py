"""Canonical rendering: exact layout, render -> parse round trips, observation spans."""

import pytest

from afm_core.coa.grammar import TagGrammarError
from afm_core.coa.parse import parse_steps
from afm_core.coa.render import observation_spans, render_observation, render_response
from afm_core.coa.trajectory import Step

STEPS = [
    Step("think", "I should search."),
    Step("web_search", "AFM Chain-of-Agents"),
    Step("observation", "Found 10 results: ..."),
    Step("think", "done"),
    Step("answer", "42"),
]


def test_layout_is_exact():
    assert render_response(STEPS) == (
        "<think>\nI should search.\n</think>\n"
        "<web_search>\nAFM Chain-of-Agents\n</web_search>"
        "\n<observation>\nFound 10 results: ...\n</observation>\n\n"
        "<think>\ndone\n</think>\n"
        "<answer>\n42\n</answer>"
    )


def test_observation_layout_is_exact():
    assert render_observation("  out\nput \n") == "\n<observation>\nout\nput\n</observation>\n\n"
    text = render_response([Step("code", "print(1)"), Step("observation", "1"), Step("answer", "1")])
    assert "</code>\n<observation>\n1\n</observation>\n\n<answer>" in text


def test_rollout_text_equals_rendering():
    # A rollout generates up to the closing tag (a stop string) and appends the rendered observation.
    generated = "<think>\nI should search.\n</think>\n<web_search>\nAFM Chain-of-Agents\n</web_search>"
    generated += render_observation("Found 10 results: ...")
    generated += "<think>\ndone\n</think>\n<answer>\n42\n</answer>"
    assert generated == render_response(STEPS)


def test_round_trip():
    assert parse_steps(render_response(STEPS)) == STEPS
    odd = [Step("code", "```py\nprint('<b>')\n```"), Step("observation", ""), Step("observation", "x"),
           Step("answer", "\\boxed{1}")]  # fmt: skip
    assert parse_steps(render_response(odd)) == odd


def test_parse_is_whitespace_insensitive():
    assert parse_steps("<think>I should search.</think><web_search> AFM Chain-of-Agents </web_search>"
                       "<observation>Found 10 results: ...</observation>  <think>done</think><answer>42</answer>") == STEPS  # fmt: skip


def test_parse_rejects_broken_text():
    with pytest.raises(TagGrammarError, match="nested_tag"):
        parse_steps("<think>a <code>x</code></think>")
    with pytest.raises(TagGrammarError, match="text_outside_tags"):
        parse_steps("hello <think>a</think>")
    with pytest.raises(TagGrammarError, match="unbalanced_tag"):
        parse_steps("<think>a")


def test_observation_spans_include_tags():
    text = render_response(STEPS)
    ((start, end),) = observation_spans(text)
    assert text[start:end] == "<observation>\nFound 10 results: ...\n</observation>"
    assert text[start - 1] == "\n" and text[end : end + 2] == "\n\n"


@pytest.mark.parametrize(
    "text",
    [
        "<web_search>q</web_search><observation>A</observation><think>t</think>",
        "<web_search>q</web_search> <observation>A</observation> <think>t</think>",
        "x<observation>A</observation><observation>B</observation>",
    ],
)
def test_observation_spans_do_not_depend_on_newlines(text):
    spans = observation_spans(text)
    assert spans and all(
        text[s:e].startswith("<observation>") and text[s:e].endswith("</observation>") for s, e in spans
    )
    assert "".join(text[s:e] for s, e in spans).count("<observation>") == len(spans)


def test_observation_spans_unclosed_runs_to_end():
    text = "<code>x</code>\n<observation>\npartial out"
    assert observation_spans(text) == [(15, len(text))]
    assert observation_spans("no observation") == []
