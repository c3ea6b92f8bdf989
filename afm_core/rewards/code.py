"""Code answers graded by running tests in the sandbox (``sandbox.server``'s ``POST /run``).

Two kinds of tests cover the benchmarks:

- ``stdio``: the program reads stdin and its stdout must equal the expected output (LiveCodeBench
  AtCoder problems, AFM/verl code parquet ``{"stdin": [...], "expected_output": [...]}`` or
  ``{"inputs": [...], "outputs": [...]}``); outputs compare line by line with trailing whitespace
  ignored, as LiveCodeBench's ``testing_util.py`` does;
- ``assert``: test code appended to the program must exit 0 (HumanEval ``check(entry_point)``, MBPP
  ``test_list``, LiveCodeBench LeetCode ``functional`` asserts).

The score is binary: 1.0 only if every test passes (upstream ``is_binary_reward=True``). Unlike upstream
(which scores a missing test file as a silent 0.0), missing or unparsable tests raise
:class:`BadTestsError` at load time or grade as ``bad_tests`` with ``error=True``, so they are counted.
The program is the last fenced Python block of the answer (or the bare answer).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from afm_core.rewards.base import Grade, extract_answer

_FENCE_RE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)(?:```|$)", re.DOTALL)

#: Imports prepended to LeetCode-style functional tests (starter code uses ``List``, ``Optional``...),
#: as LiveCodeBench's harness does.
FUNCTIONAL_PREFIX = (
    "from typing import *\nfrom collections import *\nfrom functools import *\nfrom itertools import *\n"
    "import math, heapq, bisect, string, re, sys\n"
)


class BadTestsError(ValueError):
    """A task's tests are missing or cannot be parsed (the message names the field)."""


@dataclass(frozen=True)
class CodeTests:
    """The tests of one code task.

    Attributes:
        kind: ``stdio`` or ``assert``.
        inputs: stdio: one stdin text per test.
        outputs: stdio: the expected stdout per test.
        test_code: assert: code appended after the program (must exit 0).
        prefix: code prepended before the program (imports).
    """

    kind: str
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    test_code: str = ""
    prefix: str = ""

    def __post_init__(self) -> None:
        if self.kind == "stdio":
            if not self.inputs or len(self.inputs) != len(self.outputs):
                raise BadTestsError(
                    f"stdio tests need as many inputs as outputs, got {len(self.inputs)} and {len(self.outputs)}"
                )
        elif self.kind == "assert":
            if not self.test_code.strip():
                raise BadTestsError("assert tests need non-empty test code")
        else:
            raise BadTestsError(f"unknown test kind {self.kind!r} (stdio or assert)")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "inputs": list(self.inputs), "outputs": list(self.outputs),
                "test_code": self.test_code, "prefix": self.prefix}  # fmt: skip

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CodeTests:
        return cls(kind=data["kind"], inputs=tuple(data.get("inputs", ())), outputs=tuple(data.get("outputs", ())),
                   test_code=data.get("test_code", ""), prefix=data.get("prefix", ""))  # fmt: skip


def code_tests_from_ground_truth(ground_truth: Any) -> CodeTests:
    """Tests from an AFM/verl code ``reward_model.ground_truth`` (a JSON string or its decoded object).

    Accepted: ``{"stdin": [...], "expected_output": [...]}``, ``{"inputs": [...], "outputs": [...]}`` and
    ``{"functional": "<assert code>"}``.

    Raises:
        BadTestsError: none of these forms, or not JSON.
    """
    if isinstance(ground_truth, str):
        try:
            ground_truth = json.loads(ground_truth)
        except json.JSONDecodeError as e:
            raise BadTestsError(f"ground_truth is not JSON ({e.msg} at char {e.pos})") from None
    if not isinstance(ground_truth, Mapping):
        raise BadTestsError(f"ground_truth must be a JSON object, got {type(ground_truth).__name__}")
    if "functional" in ground_truth:
        return CodeTests("assert", test_code=str(ground_truth["functional"]), prefix=FUNCTIONAL_PREFIX)
    for ins, outs in (("stdin", "expected_output"), ("inputs", "outputs")):
        if ins in ground_truth:
            inputs, outputs = ground_truth[ins], ground_truth.get(outs)
            if not isinstance(inputs, list) or not isinstance(outputs, list):
                raise BadTestsError(f"ground_truth fields {ins!r} and {outs!r} must both be lists")
            return CodeTests("stdio", tuple(map(str, inputs)), tuple(map(str, outputs)))
    raise BadTestsError(
        f"ground_truth has no tests (keys: {sorted(ground_truth)}; expected stdin/expected_output, "
        "inputs/outputs or functional)"
    )


def humaneval_tests(record: Mapping[str, Any]) -> CodeTests:
    """HumanEval: the record's ``test`` (defines ``check``) then ``check(entry_point)``."""
    return CodeTests("assert", test_code=f"{record['test']}\n\ncheck({record['entry_point']})\n")


def mbpp_tests(record: Mapping[str, Any]) -> CodeTests:
    """MBPP (sanitized): ``test_imports`` before the program, the ``test_list`` asserts after it."""
    return CodeTests("assert", test_code="\n".join(record["test_list"]) + "\n",
                     prefix="\n".join(record.get("test_imports") or []) + "\n")  # fmt: skip


def extract_program(answer: str) -> str:
    """The last fenced Python block of ``answer`` (```` ```py ````, ```` ```python ```` or untagged), else the text."""
    blocks = [body for lang, body in _FENCE_RE.findall(answer) if lang.lower() in ("", "py", "python", "python3")]
    return blocks[-1].strip("\n") if blocks else answer.strip()


def _same_output(actual: str, expected: str) -> bool:
    a = [line.rstrip() for line in actual.strip().splitlines()]
    b = [line.rstrip() for line in expected.strip().splitlines()]
    return a == b


@dataclass
class SandboxClient:
    """A minimal client of the sandbox's ``POST /run`` for graders (retries a full queue, HTTP 503).

    Args:
        url: the sandbox server's base URL.
        timeout_s: per-test wall-clock limit inside the jail.
        memory_mb: per-test memory limit.
    """

    url: str
    timeout_s: float = 10.0
    memory_mb: int = 1024
    retries: int = 5
    _session: aiohttp.ClientSession | None = field(default=None, repr=False)

    async def run(self, code: str, stdin: str | None = None) -> dict[str, Any]:
        """The sandbox's result JSON (``status``, ``stdout``, ``stderr``, ``exit_code``...).

        Raises:
            aiohttp.ClientError, asyncio.TimeoutError: the sandbox could not be reached.
        """
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        body = {"code": code, "stdin": stdin, "timeout_s": self.timeout_s, "memory_mb": self.memory_mb}
        client_timeout = aiohttp.ClientTimeout(total=self.timeout_s * 4 + 30)
        for attempt in range(self.retries + 1):
            async with self._session.post(f"{self.url}/run", json=body, timeout=client_timeout) as resp:
                if resp.status == 503 and attempt < self.retries:
                    await asyncio.sleep(0.5 * 2**attempt)
                    continue
                resp.raise_for_status()
                return await resp.json()
        raise aiohttp.ClientError("sandbox queue stayed full")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


async def run_tests(client: SandboxClient, program: str, tests: CodeTests) -> Grade:
    """Run ``program`` against ``tests`` in the sandbox; 1.0 only if all pass.

    Reasons: ``correct``, ``wrong`` (output differs / an assert failed), ``runtime_error``, ``timeout``,
    ``memory_limit``, ``grader_error`` (sandbox unreachable or its jail failed; ``error=True``).
    """
    try:
        if tests.kind == "assert":
            result = await client.run(f"{tests.prefix}\n{program}\n\n{tests.test_code}")
            return _grade_result(result, expected=None, total=1)
        passed = 0
        for stdin, expected in zip(tests.inputs, tests.outputs):
            result = await client.run(f"{tests.prefix}\n{program}" if tests.prefix else program, stdin)
            grade = _grade_result(result, expected, total=len(tests.inputs))
            if not grade.correct:
                return Grade(0.0, grade.reason, grade.error, {**(grade.extra or {}), "passed": passed,
                                                              "total": len(tests.inputs)})  # fmt: skip
            passed += 1
        return Grade(1.0, "correct", extra={"passed": passed, "total": passed})
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        return Grade(0.0, "grader_error", error=True, extra={"message": f"{e.__class__.__name__}: {e}"[:300]})


def _grade_result(result: Mapping[str, Any], expected: str | None, total: int) -> Grade:
    status = result.get("status")
    if status == "sandbox_error":
        return Grade(0.0, "grader_error", error=True, extra={"message": str(result.get("stderr", ""))[-300:]})
    if status in ("timeout", "memory_limit", "output_limit"):
        return Grade(0.0, status)
    if result.get("exit_code") != 0:
        stderr = str(result.get("stderr", ""))
        reason = "wrong" if "AssertionError" in stderr else "runtime_error"
        return Grade(0.0, reason, extra={"stderr": stderr[-300:]})
    if expected is not None and not _same_output(str(result.get("stdout", "")), expected):
        return Grade(0.0, "wrong", extra={"stdout": str(result.get("stdout", ""))[:200]})
    return Grade(1.0, "correct")


async def grade_code(client: SandboxClient, response: str, tests: CodeTests | None) -> Grade:
    """Grade a CoA response: the program of its last ``<answer>`` against ``tests``.

    ``tests=None`` (a task whose tests could not be loaded) grades ``bad_tests`` with ``error=True``.
    """
    if tests is None:
        return Grade(0.0, "bad_tests", error=True)
    answer = extract_answer(response)
    if answer is None or not answer.strip():
        return Grade(0.0, "no_answer")
    return await run_tests(client, extract_program(answer), tests)


def task_tests(meta: Mapping[str, Any]) -> CodeTests | None:
    """The :class:`CodeTests` stored in a task's ``meta["tests"]`` (see :meth:`CodeTests.to_dict`), or None."""
    data = meta.get("tests")
    return CodeTests.from_dict(data) if isinstance(data, Mapping) else None


__all__ = [
    "BadTestsError",
    "CodeTests",
    "SandboxClient",
    "code_tests_from_ground_truth",
    "extract_program",
    "grade_code",
    "humaneval_tests",
    "mbpp_tests",
    "run_tests",
    "task_tests",
]  # fmt: skip
