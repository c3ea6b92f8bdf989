"""GSM8K solutions -> CoA trajectories with real code-tool calls (task ``math``).

Source: openai/grade-school-math ``train.jsonl``: ``{question, answer}``; the answer is prose with
calculator annotations ``<<48/2=24>>`` and ends with ``#### 72``.

Mapping: each annotation ``<<expr=result>>`` becomes a ``<code>`` call whose snippet is
``print(expr)``, and its ``<observation>`` is the REAL output of executing that snippet (see
:func:`run_print`), written as the live code tool writes it (:mod:`afm_core.coa.observations`); the prose between annotations becomes ``<think>`` blocks; the final answer after
``####`` becomes ``<answer>\\boxed{...}``. A trajectory is kept only if every printed result equals
the annotated result numerically (so ``print(48/2)`` -> ``24.0`` matches ``24``).

Rejection reasons: ``no_answer`` (no ``####``), ``bad_annotation`` (no single ``=``),
``unsafe_expression`` (not plain arithmetic), ``execution_error``, ``calculation_mismatch``.
"""

from __future__ import annotations

import ast
import contextlib
import io
import re
from typing import Any

from afm_core.coa.trajectory import Step, Trajectory
from afm_core.data.converters.answer_check import numbers_equal, parse_number
from afm_core.data.converters.base import Converter, Rejected, kept_trajectory
from afm_core.data.converters.math_tools import code_call, steps_around_calls
from afm_core.data.io import Where, require

_ANNOTATION_RE = re.compile(r"<<(.*?)>>", re.DOTALL)
_ARITHMETIC_NODES = (
    ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant,
    ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.USub, ast.UAdd,
)  # fmt: skip
_MAX_EXPONENT = 64
_MAX_POWER_BASE = 10**6


class UnsafeExpression(ValueError):
    """The expression is not plain arithmetic on number literals (or has a huge power)."""


def _constant(node: ast.AST) -> float | None:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _constant(node.operand)
        return None if value is None else (-value if isinstance(node.op, ast.USub) else value)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    return None


def _check_arithmetic(expression: str) -> None:
    if "\n" in expression or "#" in expression:
        raise UnsafeExpression(f"{expression!r}: one line without comments expected")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise UnsafeExpression(f"{expression!r}: {err.msg}") from None
    for node in ast.walk(tree):
        if not isinstance(node, _ARITHMETIC_NODES):
            raise UnsafeExpression(f"{expression!r}: {type(node).__name__} is not arithmetic")
        if isinstance(node, ast.Constant) and (
            isinstance(node.value, bool) or not isinstance(node.value, (int, float))
        ):
            raise UnsafeExpression(f"{expression!r}: {node.value!r} is not a number")
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            base, exponent = _constant(node.left), _constant(node.right)
            if base is None or exponent is None or abs(exponent) > _MAX_EXPONENT or abs(base) > _MAX_POWER_BASE:
                raise UnsafeExpression(f"{expression!r}: power must be literal**literal with a small exponent")


def run_print(expression: str) -> str:
    """Execute the Python snippet ``print(<expression>)`` and return what it printed, without the final newline.

    This is a real execution by CPython, in process: the expression is first checked to be plain
    arithmetic on int/float literals (``+ - * / // % **``, powers limited to ``|exponent| <= 64``), so
    it cannot touch anything or run long; the snippet then runs with no builtins but ``print`` and its
    stdout is captured. The output is byte-identical to ``python -c "print(<expression>)"``.

    Raises:
        UnsafeExpression: the expression is not plain arithmetic.
        ArithmeticError: the execution raised (``ZeroDivisionError``, ``OverflowError``).
    """
    _check_arithmetic(expression)
    snippet = compile(f"print({expression.strip()})", "<gsm8k>", "exec")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        exec(snippet, {"__builtins__": {"print": print}})
    return stdout.getvalue().removesuffix("\n")


def _code_call(expression: str, annotated: str) -> list[Step]:
    try:
        printed = run_print(expression)
    except UnsafeExpression as err:
        raise Rejected("unsafe_expression", str(err)) from None
    except ArithmeticError as err:
        raise Rejected("execution_error", f"{expression!r}: {type(err).__name__}: {err}") from None
    value, expected = parse_number(printed), parse_number(annotated)
    if value is None or expected is None or not numbers_equal(value, expected):
        raise Rejected("calculation_mismatch", f"print({expression}) printed {printed!r}, annotated {annotated!r}")
    return code_call(f"print({expression.strip()})", printed)


def convert_record(where: Where, record: dict[str, Any]) -> Trajectory:
    """One GSM8K record -> one trajectory.

    Raises:
        Rejected: see the module docstring for the reasons.
        DataFormatError: a missing or mistyped ``question``/``answer`` field.
    """
    question = require(record, "question", str, where).strip()
    solution, sep, final = require(record, "answer", str, where).rpartition("####")
    final = final.strip()
    if not sep or not final:
        raise Rejected("no_answer", "no '#### <answer>' line")

    def annotation_steps(annotation: re.Match[str]) -> list[Step]:
        expression, eq, annotated = annotation.group(1).partition("=")
        if not eq or "=" in annotated:
            raise Rejected("bad_annotation", f"<<{annotation.group(1)}>> is not <<expression=result>>")
        return _code_call(expression, annotated)

    steps, tail = steps_around_calls(solution, _ANNOTATION_RE, annotation_steps)
    if tail.strip():
        steps.append(Step("think", tail.strip()))
    gold = final.replace(",", "")
    steps.append(Step("answer", f"\\boxed{{{gold}}}"))
    source_id = f"{where.path.stem}:{where.line}"
    return kept_trajectory("gsm8k", "math", source_id, question, steps, gold, {"file": where.path.name})


GSM8K = Converter(name="gsm8k", files=("math/gsm8k/train.jsonl",), convert_record=convert_record)
