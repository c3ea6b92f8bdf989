"""The dry run of a job: per-rank GPU memory, fits or not, weight-sync plan, checkpoint cost (no GPU needed).

    python -m jobs.plan recipe=afm_web_sft_32b                         # SFT (conf/sft.yaml) overrides
    python -m jobs.plan recipe=afm_web_sft_32b parallel.tp=1 parallel.pp=1
    python -m jobs.plan recipe=afm_code_rl_32b                         # an RL recipe: conf/rl.yaml
    python -m jobs.plan rl model=qwen2.5-7b-instruct cluster=slurm ... # name the app when no recipe tells

Takes the same overrides as ``jobs.sft`` / ``jobs.rl`` (the app is the first argument ``sft`` / ``rl``, else the
recipe's kind), prints the table of :func:`afm_core.launch.plan_render.render` and writes ``plan.json`` (``plan.out=PATH``
elsewhere). The composed config is checked as ``jobs.sft`` / ``jobs.rl`` check it
(:func:`afm_core.launch.plan.plan_config`). Exit status 0 when it fits (or is a CPU job), 1 when it does not, 2 for
a bad config.
See :mod:`afm_core.launch.plan`.
"""

from __future__ import annotations

import sys

from afm_core.launch.plan import APPS, infer_app, make_plan, plan_config, suggest
from afm_core.launch.plan_render import render, write_plan


def main(argv: list[str]) -> int:
    app = argv[0] if argv and argv[0] in APPS else None
    overrides = argv[1:] if app else list(argv)
    out = "plan.json"
    for item in list(overrides):
        if item.startswith(("plan.out=", "+plan.out=")):
            out = item.split("=", 1)[1]
            overrides.remove(item)
    app = app or infer_app(overrides)
    try:
        job = plan_config(app, overrides)  # checked as jobs.sft / jobs.rl check it
        plan = make_plan(job)
    except ValueError as err:
        print(f"jobs.plan: bad config: {err}", file=sys.stderr)
        return 2
    if plan["fits"] is False:
        plan["suggestion"] = suggest(job)
    write_plan(plan, out)
    print(render(plan))
    print(f"wrote {out}")
    return 1 if plan["fits"] is False else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
