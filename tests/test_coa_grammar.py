"""The CoA tag grammar: valid and invalid texts and step sequences, with their stable issue codes."""

import pytest

from afm_core.coa.grammar import TagGrammarError, scan_text, validate_steps, validate_text
from afm_core.coa.trajectory import Step

VALID = (
    "<think>\nI should search.\n</think>\n<web_search>\nAFM\n</web_search>\n<observation>\nFound it.\n</observation>\n\n"
    "<suggested_answer>\n42\n</suggested_answer>\n<double_check>\n4: the page says 42\n</double_check>\n<answer>\n42\n</answer>"
)


def codes(text_or_steps, **kwargs):
    if isinstance(text_or_steps, str):
        return [issue.code for issue in validate_text(text_or_steps, **kwargs)]
    return [issue.code for issue in validate_steps(text_or_steps, **kwargs)]


def test_valid_texts():
    assert codes(VALID) == []
    assert codes("<think>x</think><answer>y</answer>") == []  # whitespace between blocks is optional
    assert (
        codes(
            "<plan>p</plan> <code>print(1)</code>\n<observation></observation><reflection>ok</reflection><answer>1</answer>"
        )
        == []
    )


def test_observation_content_is_opaque():
    # A crawled page may contain CoA-looking tags; only observation tags themselves are forbidden inside.
    text = "<crawl_page>http://x</crawl_page><observation><code>a</code> </think></observation><answer>a</answer>"
    assert codes(text) == []
    text = "<crawl_page>http://x</crawl_page><observation>a <observation> b</observation><answer>a</answer>"
    assert codes(text) == ["nested_tag"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<think>a</think>stray<answer>b</answer>", ["text_outside_tags"]),
        ("<think>a<answer>b</answer>", ["unbalanced_tag", "missing_answer"]),
        ("<think>a</think></plan><answer>b</answer>", ["unbalanced_tag"]),
        ("<think>a <plan>b</plan></think><answer>c</answer>", ["nested_tag"]),
        ("<think>a <web_search>q</web_search> b</think><answer>c</answer>", ["nested_tag"]),
        ("<think>a</think><observation>o</observation><answer>b</answer>", ["observation_without_tool_call"]),
        ("<wiki_search>q</wiki_search><think>a</think><answer>b</answer>", ["missing_observation"]),
        ("<think>a</think><double_check>3</double_check><answer>b</answer>", ["double_check_without_suggested_answer"]),
        ("<answer>a</answer><think>b</think>", ["answer_not_last", "missing_answer"]),
        ("<answer>a</answer><answer>b</answer>", ["answer_not_last"]),
        ("<think>a</think>", ["missing_answer"]),
        ("<think>  </think><answer>b</answer>", ["empty_step"]),
        ("<code></code><observation>o</observation><answer>b</answer>", ["empty_step"]),
        ("", ["missing_answer"]),
    ],
)
def test_invalid_texts(text, expected):
    assert codes(text) == expected


def test_unknown_tags_are_text():
    assert codes("<tool_call>x</tool_call><answer>a</answer>") == ["text_outside_tags"]
    assert codes("<think>see <b>bold</b> and a < b</think><answer>a</answer>") == []


def test_in_progress_rollout():
    steps = [Step("think", "t"), Step("wiki_search", "q")]
    assert codes(steps, require_answer=False) == []
    assert codes(steps) == ["missing_observation", "missing_answer"]


def test_strict_raises_with_reasons():
    with pytest.raises(TagGrammarError) as info:
        validate_text("<think>a</think>", strict=True)
    assert isinstance(info.value, ValueError)
    assert [i.code for i in info.value.issues] == ["missing_answer"]
    assert "missing_answer" in str(info.value)
    with pytest.raises(TagGrammarError, match="observation_without_tool_call"):
        validate_steps([Step("observation", "o"), Step("answer", "a")], strict=True)


def test_scan_text_returns_blocks():
    steps, issues = scan_text(VALID)
    assert issues == []
    assert [s.tag for s in steps] == [
        "think",
        "web_search",
        "observation",
        "suggested_answer",
        "double_check",
        "answer",
    ]
    assert steps[2].content == "Found it."
