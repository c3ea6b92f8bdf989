"""How much an RL run could learn from each benchmark under a model: the pass@k histogram of a ``jobs.filter_rl`` run
per benchmark, the problems with 0 < pass@k < 1 (the ones a GRPO/DAPO group gets a signal from), and how many
such problems its generated tokens buy.

    .venv/bin/python -m jobs.filter_rl "benchmarks=[gsm8k_test_2step,svamp_heldout,mawps_heldout]" \\
        model.hf_path=runs/rl-demo/1_warm/hf eval.limit=64 eval.k=8 eval.temperature=0.8 \\
        eval.max_response_tokens=512 eval.max_tool_calls=3 eval.max_turns=4 hydra.run.dir=runs/bench34/math
    .venv/bin/python -m benchmarks.rl_learnable runs/bench34/math [more run dirs] [--out table.json]

Reads each run dir's ``samples.jsonl`` (one line per sample: ``problem_id`` ``<benchmark>:<id>``, ``score``,
``generated_tokens``); a sample is correct at ``score >= 1`` (as ``jobs.filter_rl`` and eval's pass@k).
Per benchmark it prints: problems, samples per problem, the share of samples correct, the histogram of correct
samples per problem (0..k), the learnable problems (0 < correct < k) and their share, the mean generated tokens
per trajectory (model tokens only, observations excluded), and learnable problems per million generated tokens
(what sampling a prompt set costs per problem that carries a learning signal).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks.json_out import write_out


def learnable_table(run_dirs: list[Path]) -> dict[str, dict[str, Any]]:
    """Per benchmark, the figures the module docstring lists.

    A benchmark's ``k`` is the most samples any of its problems has; problems with fewer (a run still going or
    stopped) are left out and counted in ``incomplete``.

    Raises:
        FileNotFoundError: a run dir without ``samples.jsonl``.
    """
    correct: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    samples: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    tokens: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for run_dir in run_dirs:
        with (run_dir / "samples.jsonl").open(encoding="utf-8") as f:
            for line in f:
                record = json.loads(line)
                benchmark = record["problem_id"].split(":", 1)[0]
                samples[benchmark][record["problem_id"]] += 1
                correct[benchmark][record["problem_id"]] += int(float(record["score"]) >= 1.0)
                tokens[benchmark].append((record["problem_id"], int(record["generated_tokens"])))
    table = {}
    for benchmark, per_problem in sorted(samples.items()):
        k = max(per_problem.values())
        counts = [correct[benchmark][p] for p, n in per_problem.items() if n == k]
        done = {p for p, n in per_problem.items() if n == k}
        generated = [n for p, n in tokens[benchmark] if p in done]
        learnable = sum(0 < c < k for c in counts)
        table[benchmark] = {
            "problems": len(counts),
            "incomplete": len(per_problem) - len(counts),
            "k": k,
            "sample_accuracy": sum(counts) / (k * len(counts)),
            "histogram": [sum(c == i for c in counts) for i in range(k + 1)],
            "learnable": learnable,
            "learnable_share": learnable / len(counts),
            "mean_generated_tokens": sum(generated) / len(generated),
            "learnable_per_m_tokens": learnable / (sum(generated) / 1e6),
        }
    return table


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, help="jobs.filter_rl run dirs (their samples.jsonl)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table as JSON here")
    args = parser.parse_args(argv)
    table = learnable_table(args.run_dirs)
    print("| benchmark | problems x k | samples correct | correct per problem (0..k) | 0 < pass@k < 1 | "
          "generated tokens / trajectory | learnable per 1M tokens |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, row in table.items():
        print(
            f"| {name} | {row['problems']} x {row['k']} | {100 * row['sample_accuracy']:.1f}% | "
            f"{' '.join(map(str, row['histogram']))} | {row['learnable']} ({100 * row['learnable_share']:.0f}%) | "
            f"{row['mean_generated_tokens']:.0f} | {row['learnable_per_m_tokens']:.0f} |"
        )
    return write_out(args.out, table)


if __name__ == "__main__":
    main()
