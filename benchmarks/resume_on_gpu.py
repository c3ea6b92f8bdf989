"""Exact resume of our SFT trainer on one GPU: a run resumed from its step-``--save-at`` checkpoint in a new process
against the same run uninterrupted, bitwise.

    python -m benchmarks.resume_on_gpu --out runs/bench/resume_on_gpu.json      # one GPU: Qwen2.5-0.5B shape, bf16
    python -m benchmarks.resume_on_gpu --model tiny-llama --seq-length 128 --docs 2 --threads 1 --diagnose always
                                                                               # CPU: a dry run (fp32, gloo)
    python -m benchmarks.resume_on_gpu --diagnose deterministic --out runs/bench/resume_det.json  # deterministic only

At world size 1 (NCCL on GPU), a model preset's published shape with random weights (``conf/model``, nothing
downloaded) and synthetic packed sequences (:func:`benchmarks.plan_vs_gpu.synthetic_packed`, ``thd``), each phase
in a process of its own runs the SFT job's own loop, :meth:`SFTTrainer.fit
<afm_core.train.loop.SFTLoop.fit>` (``conf/sft.yaml`` with ``trainer.save_interval=--save-at``,
``keep_last=2``: checkpoints by :class:`~afm_core.engine.checkpoint.Checkpointer`, megatron ``dist_checkpointing``
plus the ``COMPLETE`` marker, and the resume path ``SFTTrainer._resume``):

1. **straight**: ``--steps`` steps from random weights, checkpoints at ``--save-at`` and at the end; its final
   state (model weights, the optimizer's fp32 main weights and AdamW moments, the LR schedule) is dumped;
2. **resumed**: the run dir as a requeued job finds it (the last checkpoint deleted, as if killed after
   ``--save-at``), a new process with a fresh model and optimizer: ``fit`` resumes and trains the remaining steps;
   its per-step loss / grad norm / lr and final state are compared with the straight run's, bitwise (``equal``)
   and as the largest absolute difference.

If they differ (or ``--diagnose always``) two more pairs say why: **repeat**, the straight run again in a new
process (differs too: the GPU kernels are not run-to-run deterministic, whatever resume does), and
**deterministic**, straight + resumed with ``torch.use_deterministic_algorithms(True, warn_only=True)`` and
``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (the ops torch warns about are recorded). Step seconds (device synchronised),
checkpoint seconds and bytes (and the marker's ``write_s``), resume seconds: from the straight and resumed phases,
each run alone on the device (repeat and deterministic straight run side by side).

``--diagnose deterministic`` runs the deterministic phases only: **straight-det** alone on the device, then
**resumed-det** (from its step-``--save-at`` checkpoint) and **repeat-det** (straight-det again from scratch) side
by side, both compared with straight-det: whether resume is exact under deterministic mode, and whether that mode
is run-to-run reproducible at all. Exit status 0 when both are bitwise equal.
Writes every figure as JSON to ``--out`` after each phase.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from afm_core.utils.atomic import atomic_write_json
from afm_core.utils.paths import repo_root

DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
STEP_KEYS = ("loss", "grad_norm", "lr", "tokens")
# The comparisons in result["deterministic"] that --diagnose deterministic requires to be bitwise equal.
DETERMINISTIC_PAIRS = ("resume_vs_straight", "repeat_vs_straight")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def final_state(trainer: Any) -> dict[str, torch.Tensor]:
    """Named tensors of a trainer's training state: ``model/<name>`` (what the model chunks hold, bf16 on GPU),
    ``optim/main/<name>`` (the optimizer's parameters: fp32 main weights under bf16) and ``optim/<key>/<name>``
    (their AdamW state: ``exp_avg``, ``exp_avg_sq``, ``step``), ``<name>`` the model parameter's (``<c.g.p>``,
    chained optimizer / group / index, where none is found)."""
    state = {
        f"model/{i}.{k}": v.detach()
        for i, chunk in enumerate(trainer.model)
        for k, v in chunk.module.state_dict().items()
        if isinstance(v, torch.Tensor)
    }
    names = {id(p): f"{i}.{n}" for i, chunk in enumerate(trainer.model) for n, p in chunk.module.named_parameters()}
    for c, chained in enumerate(getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])):
        # megatron's Float16OptimizerWithFloat16Params: fp32_from_float16_groups[g][i] is float16_groups[g][i]'s copy
        for model_group, main_group in zip(
            getattr(chained, "float16_groups", []), getattr(chained, "fp32_from_float16_groups", [])
        ):
            names.update({id(main): names[id(p)] for p, main in zip(model_group, main_group) if id(p) in names})
        inner = chained.optimizer
        for g, group in enumerate(inner.param_groups):
            for p, param in enumerate(group["params"]):
                name = names.get(id(param), f"{c}.{g}.{p}")
                state[f"optim/main/{name}"] = param.detach()
                for key, value in inner.state.get(param, {}).items():
                    tensor = value.detach() if isinstance(value, torch.Tensor) else torch.tensor(value)
                    state[f"optim/{key}/{name}"] = tensor
    return state


def compare_states(mine: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Per group of :func:`final_state` (``model``, ``optim/main``, ``optim/exp_avg``...): tensors, elements,
    tensors and elements that differ bitwise, the largest absolute difference, the first differing names."""
    groups: dict[str, dict[str, Any]] = {}
    for key in sorted(set(mine) | set(ref)):
        group = groups.setdefault(
            key.rsplit("/", 1)[0],
            {"tensors": 0, "elements": 0, "differing_tensors": 0, "differing_elements": 0, "max_abs_diff": 0.0,
             "first_differing": [], "missing": []},
        )  # fmt: skip
        if key not in mine or key not in ref:
            group["missing"].append(key)
            continue
        a = mine[key]
        b = ref[key].to(a.device)
        group["tensors"] += 1
        group["elements"] += a.numel()
        if a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b):
            continue
        group["differing_tensors"] += 1
        if len(group["first_differing"]) < 5:
            group["first_differing"].append(key)
        if a.shape == b.shape:
            group["differing_elements"] += int((a != b).sum())
            diff = float((a.double() - b.double()).abs().max())
            group["max_abs_diff"] = max(group["max_abs_diff"], diff)
    for group in groups.values():
        group["equal"] = not group["differing_tensors"] and not group["missing"]
    return {"equal": all(g["equal"] for g in groups.values()), "groups": groups}


# -- one phase, in a process of its own ---------------------------------------------------------------------
def child(args: argparse.Namespace) -> int:
    """Run ``fit`` in ``--run-dir`` (resuming whatever complete checkpoint is there), then dump and/or compare its
    final state; the records go to ``--records``."""
    from omegaconf import OmegaConf

    from afm_core.config.sft import sft_config
    from afm_core.data.loader import TrainIterator
    from afm_core.engine.checkpoint_dirs import read_marker
    from afm_core.engine.core import build_model
    from afm_core.engine.distributed import activation_memory_overrides, destroy_distributed, training_dtype
    from afm_core.launch.plan import hf_config_of
    from afm_core.models.arch import arch_from_hf_config
    from afm_core.train.trainer import SFTTrainer
    from benchmarks.plan_vs_gpu import compose_config, synthetic_packed
    from benchmarks.sft_throughput import join_single_process_group

    caught: list[str] = []
    if args.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        warnings.simplefilter("always")
        shown = warnings.showwarning

        def record(message: Any, *rest: Any, **kwargs: Any) -> None:
            if "determinis" in str(message) and str(message) not in caught:
                caught.append(str(message))
            shown(message, *rest, **kwargs)

        warnings.showwarning = record

    started = time.perf_counter()
    run_dir = Path(args.run_dir)
    cfg = compose_config(args.model, args.seq_length, args.recompute, args.micro_batch, args.global_batch,
                         args.steps, run_dir)  # fmt: skip
    for key, value in {"save_interval": args.save_at, "keep_last": args.keep_last, "eval_interval": 10**6}.items():
        OmegaConf.update(cfg, f"trainer.{key}", value)
    t = cfg.trainer
    layout = join_single_process_group(cfg, args.threads)
    rec: dict[str, Any] = {"phase": args.phase, "deterministic": args.deterministic, "device": str(layout.device),
                           "steps": [], "evals": [], "saves": []}  # fmt: skip
    try:
        hf_config = hf_config_of(OmegaConf.to_container(cfg, resolve=False)["model"])
        chunks = build_model(
            hf_config, layout, params_dtype=training_dtype(t.precision), **activation_memory_overrides(cfg.parallel)
        )
        vocab = arch_from_hf_config(hf_config).vocab_size
        train = TrainIterator(synthetic_packed(16, int(t.seq_length), args.docs, vocab), seed=int(t.seed),
                              micro_batch_size=int(t.micro_batch_size), dp_rank=0, dp_size=1, pack=True)  # fmt: skip
        heldout = TrainIterator(synthetic_packed(2, int(t.seq_length), args.docs, vocab, seed=1), seed=0,
                                micro_batch_size=int(t.micro_batch_size), dp_rank=0, dp_size=1, pack=True)  # fmt: skip
        eval_batches = [next(heldout) for _ in range(2 // int(t.micro_batch_size))]
        trainer = SFTTrainer(sft_config(cfg).loop, layout, chunks, train, eval_batches, run_dir, int(t.max_steps))
        rec["setup_s"] = time.perf_counter() - started
        train_step, evaluate, save, resume = (
            trainer.train_step,
            trainer.evaluate,
            trainer.save_checkpoint,
            trainer._resume,
        )

        def timed_train_step() -> dict[str, float]:
            sync()
            start = time.perf_counter()
            out = train_step()
            sync()
            rec["steps"].append({"step": trainer.progress.step + 1, **out, "seconds": time.perf_counter() - start})
            print(f"  [{args.phase}] step {trainer.progress.step + 1}: loss {out['loss']!r}", flush=True)
            return out

        def timed_evaluate() -> dict[str, float]:
            out = evaluate()
            rec["evals"].append({"step": trainer.progress.step, **out})
            return out

        def timed_save() -> Path:
            sync()
            start = time.perf_counter()
            path = save()
            sync()
            marker = read_marker(path)
            rec["saves"].append({"step": trainer.progress.step, "seconds": time.perf_counter() - start,
                                 "bytes": marker["bytes"], "marker_write_s": marker["write_s"]})  # fmt: skip
            return path

        def timed_resume() -> Path | None:
            start = time.perf_counter()
            path = resume()
            sync()
            if path is not None:
                rec["resume"] = {"checkpoint": path.name, "seconds": time.perf_counter() - start}
            return path

        trainer.train_step, trainer.evaluate = timed_train_step, timed_evaluate  # type: ignore[method-assign]
        trainer.save_checkpoint, trainer._resume = timed_save, timed_resume  # type: ignore[method-assign]
        rec["summary"] = trainer.fit()
        state = final_state(trainer)
        meta = {"scheduler": trainer.core.scheduler.state_dict(), "step": trainer.progress.step,
                "consumed_sequences": trainer.progress.consumed_sequences,
                "consumed_tokens": trainer.progress.consumed_tokens}  # fmt: skip
        rec["meta"] = meta
        if args.dump:
            start = time.perf_counter()
            torch.save({"tensors": {k: v.cpu() for k, v in state.items()}, "meta": meta}, args.dump)
            rec["dump_s"] = time.perf_counter() - start
        if args.compare_to:
            ref = torch.load(args.compare_to, mmap=True, weights_only=True)
            rec["final_state"] = compare_states(state, ref["tensors"])
            rec["final_state"]["meta_equal"] = json.dumps(meta, sort_keys=True) == json.dumps(
                ref["meta"], sort_keys=True
            )
        rec["deterministic_warnings"] = caught
        rec["wall_s"] = time.perf_counter() - started
    finally:
        destroy_distributed()
        atomic_write_json(Path(args.records), rec)
    return 0


# -- the driver -----------------------------------------------------------------------------------------------
def start_phase(args: argparse.Namespace, work: Path, phase: str, run_dir: Path, *, deterministic: bool = False,
                dump: Path | None = None, compare_to: Path | None = None, keep_last: int = 2) -> tuple[Any, Path, Path]:  # fmt: skip
    records, log = work / f"{phase}.json", work / f"{phase}.log"
    cmd = [sys.executable, "-m", "benchmarks.resume_on_gpu", "--phase", phase, "--run-dir", str(run_dir),
           "--records", str(records), "--model", args.model, "--seq-length", str(args.seq_length),
           "--micro-batch", str(args.micro_batch), "--global-batch", str(args.global_batch), "--steps", str(args.steps),
           "--save-at", str(args.save_at), "--docs", str(args.docs), "--recompute", args.recompute,
           "--keep-last", str(keep_last)]  # fmt: skip
    cmd += ["--threads", str(args.threads)] if args.threads else []
    cmd += ["--deterministic"] if deterministic else []
    cmd += ["--dump", str(dump)] if dump else []
    cmd += ["--compare-to", str(compare_to)] if compare_to else []
    env = {**os.environ, **(DETERMINISTIC_ENV if deterministic else {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo_root()), env.get("PYTHONPATH", "")) if p)
    print(f"phase {phase}: {'deterministic, ' if deterministic else ''}{run_dir}", flush=True)
    handle = log.open("w")
    proc = subprocess.Popen(cmd, cwd=repo_root(), env=env, stdout=handle, stderr=subprocess.STDOUT)
    return proc, records, log


def finish_phase(started: tuple[Any, Path, Path]) -> dict[str, Any]:
    proc, records, log = started
    rc = proc.wait()
    text = log.read_text(errors="replace")
    print("".join(f"    {line}\n" for line in text.splitlines() if line.startswith("  [")), end="", flush=True)
    rec = json.loads(records.read_text()) if records.is_file() else {}
    if rc:
        tail = "\n".join(text.splitlines()[-60:])
        print(f"phase failed (exit {rc}):\n{tail}", flush=True)
        rec.update(error=f"exit {rc}", log_tail=tail)
    return rec


def run_phase(args: argparse.Namespace, work: Path, phase: str, run_dir: Path, **kwargs: Any) -> dict[str, Any]:
    return finish_phase(start_phase(args, work, phase, run_dir, **kwargs))


def compare_runs(resumed: dict[str, Any], straight: dict[str, Any]) -> dict[str, Any]:
    """The resumed (or repeated) run's steps and evals against the straight run's same steps, and its final
    state comparison (made in its process)."""
    by_step = {s["step"]: s for s in straight.get("steps", [])}
    rows, first_diff, max_diff = [], None, 0.0
    for s in resumed.get("steps", []):
        ref = by_step.get(s["step"], {})
        diffs = {k: abs(s[k] - ref[k]) if k in ref else None for k in STEP_KEYS}
        equal = all(k in ref and s[k] == ref[k] for k in STEP_KEYS)
        if not equal and first_diff is None:
            first_diff = s["step"]
        max_diff = max(max_diff, diffs["loss"] or 0.0)
        rows.append({"step": s["step"], "loss": s["loss"], "straight_loss": ref.get("loss"), "equal": equal,
                     "abs_diff": diffs})  # fmt: skip
    evals = {e["step"]: e["loss"] for e in straight.get("evals", [])}
    eval_pairs = [(e["step"], e["loss"], evals.get(e["step"])) for e in resumed.get("evals", [])]
    state = resumed.get("final_state", {})
    steps_equal = bool(rows) and first_diff is None
    return {
        "equal": steps_equal
        and bool(state.get("equal"))
        and bool(state.get("meta_equal"))
        and all(a == b for _, a, b in eval_pairs),
        "steps_equal": steps_equal,
        "first_differing_step": first_diff,
        "max_abs_loss_diff": max_diff,
        "steps": rows,
        "evals": [{"step": s, "loss": a, "straight_loss": b, "equal": a == b} for s, a, b in eval_pairs],
        "final_state": state,
        "error": resumed.get("error") or straight.get("error"),
    }


def timings(rec: dict[str, Any]) -> dict[str, Any]:
    steps = [s["seconds"] for s in rec.get("steps", [])]
    return {
        "step_s": steps,
        "median_step_s": statistics.median(steps[1:] or steps) if steps else None,
        "saves": rec.get("saves", []),
        "resume": rec.get("resume"),
        "setup_s": rec.get("setup_s"),
        "wall_s": rec.get("wall_s"),
    }


def drop_last_checkpoint(run_dir: Path, step: int) -> None:
    """As if the job had been killed after its step-``--save-at`` checkpoint: the later ones gone."""
    from afm_core.engine.checkpoint_dirs import complete_checkpoints

    for done, path in complete_checkpoints(run_dir / "checkpoints"):
        if done > step:
            shutil.rmtree(path)


def render(name: str, pair: dict[str, Any]) -> str:
    groups = pair["final_state"].get("groups", {})
    parts = [
        f"{g}: equal" if v["equal"] else f"{g}: {v['differing_tensors']} tensors differ, max {v['max_abs_diff']:.3g}"
        for g, v in groups.items()
    ]
    return (
        f"{name}: {'BITWISE EQUAL' if pair['equal'] else 'DIFFERENT'}; steps equal {pair['steps_equal']} (first "
        f"differing step {pair['first_differing_step']}, max |loss diff| {pair['max_abs_loss_diff']:.3g}); "
        + "; ".join(parts)
    )


def deterministic_runs(args: argparse.Namespace, work: Path, result: dict[str, Any], straight_det: dict[str, Any],
                       *, repeat: bool = False) -> None:  # fmt: skip
    """After **straight-det** (in ``work/run-det``, final state in ``work/straight-det.pt``): **resumed-det** from
    its step-``--save-at`` checkpoint and, with ``repeat``, **repeat-det** (straight-det again from scratch) side by
    side with it, both compared with straight-det; into ``result["deterministic"]``, with the deterministic-mode
    warnings of every run and their timings."""
    run_d, dump_d = work / "run-det", work / "straight-det.pt"
    drop_last_checkpoint(run_d, args.save_at)
    resumed_proc = start_phase(args, work, "resumed-det", run_d, deterministic=True, compare_to=dump_d)
    repeat_dir, repeat_proc = work / "run-repeat-det", None
    if repeat:
        repeat_proc = start_phase(
            args, work, "repeat-det", repeat_dir, deterministic=True, compare_to=dump_d, keep_last=1
        )
    runs = {"straight-det": straight_det, "resumed-det": finish_phase(resumed_proc)}
    det = result["deterministic"] = {"straight": straight_det, "resumed": runs["resumed-det"],
                                     "resume_vs_straight": compare_runs(runs["resumed-det"], straight_det)}  # fmt: skip
    print(render("deterministic resumed vs straight", det["resume_vs_straight"]), flush=True)
    if repeat_proc is not None:
        runs["repeat-det"] = det["repeat"] = finish_phase(repeat_proc)
        shutil.rmtree(repeat_dir, ignore_errors=True)
        det["repeat_vs_straight"] = compare_runs(runs["repeat-det"], straight_det)
        print(render("deterministic repeat vs straight", det["repeat_vs_straight"]), flush=True)
    det["warnings"] = sorted({w for rec in runs.values() for w in rec.get("deterministic_warnings", [])})
    for message in det["warnings"]:
        print(f"  deterministic-mode warning: {message[:300]}", flush=True)
    result.setdefault("timings", {}).update({name: timings(rec) for name, rec in runs.items()})


def driver(args: argparse.Namespace) -> int:
    result: dict[str, Any] = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "config": {
            k: getattr(args, k)
            for k in ("model", "seq_length", "micro_batch", "global_batch", "steps", "save_at", "docs", "recompute")
        },
    }
    try:
        import megatron.core

        result["megatron_core"] = megatron.core.__version__
    except (ImportError, AttributeError):
        pass
    print(f"device: {result['device']}, torch {result['torch']}", flush=True)

    def write() -> None:
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(args.out, result)

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="afm-resume-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    run_d, dump_d = work / "run-det", work / "straight-det.pt"
    try:
        if args.diagnose == "deterministic":  # the deterministic phases only: straight-det alone, then the others
            straight_det = run_phase(args, work, "straight-det", run_d, deterministic=True, dump=dump_d)
            result["deterministic"] = {"straight": straight_det}
            write()
            deterministic_runs(args, work, result, straight_det, repeat=True)
            return 0 if all(result["deterministic"][k]["equal"] for k in DETERMINISTIC_PAIRS) else 1
        run_a, dump_a = work / "run", work / "straight.pt"
        straight = run_phase(args, work, "straight", run_a, dump=dump_a)
        result["straight"] = straight
        write()
        drop_last_checkpoint(run_a, args.save_at)
        resumed = run_phase(args, work, "resumed", run_a, compare_to=dump_a)
        result["resumed"] = resumed
        result["resume_vs_straight"] = compare_runs(resumed, straight)
        result["timings"] = {"straight": timings(straight), "resumed": timings(resumed)}
        print(render("resumed vs straight", result["resume_vs_straight"]), flush=True)
        write()
        if args.diagnose == "always" or (args.diagnose == "auto" and not result["resume_vs_straight"]["equal"]):
            shutil.rmtree(run_a, ignore_errors=True)
            repeat_proc = start_phase(args, work, "repeat", work / "run-repeat", compare_to=dump_a, keep_last=1)
            det_proc = start_phase(args, work, "straight-det", run_d, deterministic=True, dump=dump_d)
            repeat, straight_det = finish_phase(repeat_proc), finish_phase(det_proc)
            shutil.rmtree(work / "run-repeat", ignore_errors=True)
            result["repeat_vs_straight"] = compare_runs(repeat, straight)
            result["deterministic"] = {"straight": straight_det}
            print(render("repeat vs straight (default settings)", result["repeat_vs_straight"]), flush=True)
            write()
            deterministic_runs(args, work, result, straight_det)
            write()
    finally:
        write()
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
        print_timings(result)
    pair = result.get("resume_vs_straight")
    return 0 if pair and pair["equal"] else 1


def print_timings(result: dict[str, Any]) -> None:
    for name, rec in result.get("timings", {}).items():
        saves = ", ".join(f"step {s['step']}: {s['seconds']:.2f} s / {s['bytes'] / 1e9:.2f} GB" for s in rec["saves"])
        resume = rec["resume"]["seconds"] if rec.get("resume") else None
        print(f"{name}: median step {rec['median_step_s']}, saves [{saves}], resume {resume}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-0.5b-instruct")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--global-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-at", type=int, default=3, help="the step whose checkpoint the resumed run loads")
    parser.add_argument("--docs", type=int, default=4, help="documents per packed sequence")
    parser.add_argument("--recompute", default="full", choices=["none", "selective", "full"],
                        help="parallel.recompute (conf/sft.yaml's default: full)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads per process (CPU runs)")
    parser.add_argument("--diagnose", choices=["auto", "always", "never", "deterministic"], default="auto",
                        help="the repeat and deterministic pairs: auto = only when the resumed run differs; "
                        "deterministic = only the deterministic runs (straight, resumed, repeat from scratch)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="JSON of every figure, rewritten after each phase")
    parser.add_argument("--work-dir", type=Path, default=None, help="run dirs and dumps (default: a temp dir, removed)")
    # one phase (the driver starts these)
    parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--records", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--keep-last", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--deterministic", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dump", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--compare-to", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    return child(args) if args.phase else driver(args)


if __name__ == "__main__":
    raise SystemExit(main())
