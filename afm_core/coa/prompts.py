"""Task prompts: the instructions that teach a model the CoA tags, one per task family.

They follow the tag semantics of the upstream AFM prompts (afm-reference §2.1: the web prompt with
suggested_answer / double_check, ``MHQA_PROMPT`` with wiki_search, the math and code prompts with
``<code>```py …```</code>`` and a ``\\boxed{}`` answer), written anew for this project and matched to
its canonical layout (:mod:`afm_core.coa.render`). As upstream, the prompt is not a system message:
it is prepended to the user turn, ``prompt + "\\n\\nQuestion: " + question``.
"""

from __future__ import annotations

TASKS: tuple[str, ...] = ("math", "mhqa", "web", "code")
"""Task families: math (code tool), multi-hop QA (wiki_search), web (web_search, crawl_page), code."""

TASK_TOOLS: dict[str, tuple[str, ...]] = {
    "math": ("code",),
    "mhqa": ("wiki_search",),
    "web": ("web_search", "crawl_page"),
    "code": ("code",),
}
"""The tools each task family may call."""

_COMMON_RULES = """\
Rules:
- Write one block after another. Never put a tag inside another block and never write text outside blocks.
- Never write an <observation> block yourself: it is returned to you after each tool call.
- The <answer> block comes once, last."""

MHQA_PROMPT = (
    """\
Answer the question by reasoning step by step and searching a Wikipedia index. Build your answer from \
blocks, each written as <function>content</function> with one of these functions:

<think>your reasoning: what you know so far and what you still need</think>
<plan>the sub-questions to answer, in order (optional, as the first block)</plan>
<wiki_search>one short search query</wiki_search>
  Searches Wikipedia and stops. The retrieved passages come back as <observation>passages</observation>.
<reflection>whether the passages so far are relevant, consistent and sufficient, and what to change \
if they are not</reflection>
<answer>the final answer</answer>
  As short as possible: a name, a date, a number, yes or no. Several answers are separated by "|", \
for example <answer>answer1|answer2</answer>.

"""
    + _COMMON_RULES
)

WEB_PROMPT = (
    """\
Answer the question by reasoning step by step and using web tools. Build your answer from blocks, each \
written as <function>content</function> with one of these functions:

<think>your reasoning: what you know so far and what you still need</think>
<plan>the steps to find the answer; make a new plan whenever a double check fails</plan>
<web_search>one search query</web_search>
  Searches the web and stops. The results (titles, links, snippets) come back as \
<observation>results</observation>.
<crawl_page>url_1 | url_2</crawl_page>
  Reads the pages at one or more URLs separated by "|" and stops. Their content comes back as \
<observation>content</observation>.
<reflection>a review of the trajectory so far: conflicts between sources, tools that did not help, \
steps that went wrong, and what to do instead</reflection>
<suggested_answer>a candidate answer</suggested_answer>
<double_check>a score from 1 to 4 for the suggested answer and the reason for it</double_check>
  Always right after <suggested_answer>. With a score of 1 or 2, make a new <plan> and continue; with 3 \
or 4, give the final answer.
<answer>the final answer</answer>
  Only after a double check scored 3 or 4. As short as possible, for example <answer>Beijing</answer>.

"""
    + _COMMON_RULES
)

MATH_PROMPT = (
    """\
Solve the problem step by step. You may run Python code to compute or to check results. Build your \
solution from blocks, each written as <function>content</function> with one of these functions:

<plan>the mathematical approach, broken into steps (optional, as the first block)</plan>
<think>your step by step reasoning</think>
<code>
```py
a Python snippet that prints what you need with print()
```
</code>
  Runs the snippet and stops. Its printed output (stdout, then stderr) comes back as \
<observation>output</observation>.
<reflection>whether the output confirms your reasoning, and what to check or change next</reflection>
<answer>
\\boxed{the final answer}
</answer>

"""
    + _COMMON_RULES
)

CODE_PROMPT = (
    """\
Write a complete Python program that solves the programming task. You may run code to test ideas and \
edge cases before answering. Build your solution from blocks, each written as <function>content</function> \
with one of these functions:

<plan>the sub-problems and the algorithm for each (optional, as the first block)</plan>
<think>your step by step reasoning</think>
<code>
```py
a Python snippet that prints what you need with print()
```
```sh
optional standard input for the snippet
```
</code>
  Runs the snippet and stops. Its printed output (stdout, then stderr) comes back as \
<observation>output</observation>.
<reflection>whether the output is what you expected, and what to fix next</reflection>
<answer>
```py
the complete program, reading the input from stdin and writing the output to stdout
```
</answer>

"""
    + _COMMON_RULES
)

TASK_PROMPTS: dict[str, str] = {"math": MATH_PROMPT, "mhqa": MHQA_PROMPT, "web": WEB_PROMPT, "code": CODE_PROMPT}


def user_prompt(task: str, question: str) -> str:
    """The user-turn text for ``question``: the task prompt, a blank line, ``"Question: "`` and the question.

    Same construction as upstream ``AFM/data/prepare_data.py``: ``prompt.strip() + "\\n\\nQuestion: " +
    question.strip()``.

    Raises:
        ValueError: ``task`` is not one of :data:`TASKS`.
    """
    if task not in TASK_PROMPTS:
        raise ValueError(f"unknown task {task!r}; known tasks: {', '.join(TASKS)}")
    return TASK_PROMPTS[task].strip() + "\n\nQuestion: " + question.strip()


def split_user_prompt(prompt: str) -> tuple[str, str]:
    """Split a user-turn text built like :func:`user_prompt` into ``(task prompt, question)``.

    The split is at the LAST ``"\\n\\nQuestion: "``; a text without it is all question (empty prompt).
    """
    head, sep, question = prompt.rpartition("\n\nQuestion: ")
    if not sep:
        return "", prompt.strip()
    return head.strip(), question.strip()


def task_of_prompt(prompt: str) -> str | None:
    """The task whose prompt starts the user-turn text ``prompt``, or None for a foreign prompt."""
    head, _ = split_user_prompt(prompt)
    for task, text in TASK_PROMPTS.items():
        if head == text.strip():
            return task
    return None
