"""What each process imports: the job layer (``jobs.status``, ``jobs.plan``'s config path, the submitter) no
torch, Megatron, vLLM or wandb; a process that builds the model (a training rank, ``jobs.plan``'s model states)
megatron-core and mbridge's core without wandb, ``torch._inductor`` or mbridge's other families
(:mod:`afm_core.utils.import_hooks`). Each check runs in a fresh interpreter and reads its ``sys.modules``."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest
import torch

from afm_core.utils.import_hooks import deferred_compile
from afm_core.utils.paths import repo_root

#: Top-level packages the job layer never imports (aiohttp: the graders' and tools' HTTP client, imported by the
#: processes that grade or call tools; the data converters use the math grader only).
HEAVY = ("torch", "megatron", "mbridge", "vllm", "wandb", "transformers", "deepspeed", "aiohttp")


def loaded_after(code: str) -> list[str]:
    """``sorted(sys.modules)`` of a new interpreter (run from the repository root) after ``code``."""
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", script], cwd=repo_root(), capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def of_packages(modules: list[str], packages: tuple[str, ...]) -> list[str]:
    return [m for m in modules if m.split(".")[0] in packages]


@pytest.mark.parametrize("module", ["afm_core.rl.losses", "afm_core"])
def test_importing_the_loss_or_the_package_loads_no_launch_module_and_no_submitit(module):
    """The RL loss (a leaf of the trainer) imports without the job layer: no submitit, no afm_core.launch, and no
    Hydra, so no schema registration (``afm_core/__init__.py`` imports nothing; the loss reads its settings' one
    declaration, ``afm_core.config.policy_loss``, whose package registers schemas only when a job calls
    ``register_schemas``)."""
    loaded = loaded_after(f"import {module}")
    assert not [m for m in loaded if m == "submitit" or m.startswith(("submitit.", "afm_core.launch", "hydra"))]


def test_jobs_status_the_plans_config_path_and_the_submitters_modules_import_no_torch_megatron_vllm_or_wandb():
    code = """
import contextlib, io, runpy, sys
sys.argv = ["jobs.status", "--help"]
with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
    runpy.run_module("jobs.status", run_name="__main__")
from afm_core.launch.plan import infer_app, layout_of, plan_config
overrides = ["recipe=afm_web_sft_32b"]
app = infer_app(overrides)
layout_of(plan_config(app, overrides))
import jobs.sft, jobs.rl, jobs.eval, afm_core.launch.submit, afm_core.data.prepare
"""
    assert of_packages(loaded_after(code), HEAVY) == []


def test_jobs_export_refuses_an_incomplete_or_absent_step_before_importing_torch(tmp_path):
    """``python -m jobs.export`` finds the checkpoint (:func:`afm_core.engine.checkpoint_dirs.find_checkpoint`)
    before it imports the exporter: a step whose save did not finish, or that is not there, exits with status 2 and
    the message naming the complete steps, with no torch, Megatron or transformers loaded
    (tests/test_export.py runs the same refusals after a real SFT run)."""
    (tmp_path / "checkpoints" / "step_00000003").mkdir(parents=True)  # a save that died before its marker
    for step, message in ((3, "is incomplete (no COMPLETE marker"), (7, "step=7: no checkpoint of that step")):
        code = f"""
import contextlib, io, runpy, sys
sys.argv = ["jobs.export", "run_dir={tmp_path}", "step={step}"]
err = io.StringIO()
with contextlib.redirect_stderr(err):
    try:
        runpy.run_module("jobs.export", run_name="__main__")
    except SystemExit as exit:
        assert exit.code == 2, exit.code
assert {message!r} in err.getvalue() and "complete checkpoints in" in err.getvalue(), err.getvalue()
"""
        assert of_packages(loaded_after(code), HEAVY) == []


def test_building_the_model_imports_megatron_and_mbridge_core_only_and_autobridge_still_has_every_family():
    """``make_plan`` builds the model on the meta device as a training rank does (megatron-core, mbridge's core,
    our model and HF weight modules), and the rank's trainer modules are imported: no wandb or tensorboard (no
    tracker is configured), no ``torch._inductor`` (megatron's fusions are compiled at their first call), no
    mbridge family module and no transformers ``modeling_auto`` (a config's docstring is left as written)."""
    code = """
from afm_core.launch.plan import make_plan, plan_config
job = plan_config("sft", ["model=tiny-llama", "cluster=slurm", "cluster.checkpoint_write_gb_s=1"])  # CPU, no probe
assert make_plan(job)["total_params"] > 0
import afm_core.models.gpt, afm_core.models.hf_weights
import afm_core.train.trainer, afm_core.engine.core, afm_core.rl.policy_trainer
import megatron.core.jit, megatron.core.fusions.fused_bias_geglu
from afm_core.utils.import_hooks import deferred_compile
assert megatron.core.jit.jit_fuser is deferred_compile
"""
    loaded = loaded_after(code)
    assert {"megatron.core", "mbridge.core.llm_bridge", "afm_core.models.hf_weights"} <= set(loaded)
    assert of_packages(loaded, ("wandb", "tensorboard", "vllm")) == []
    # and no transformers model-class factory for the config's docstring (the plan reads a config, loads no model)
    hidden = (
        "torch._inductor.compile_fx",
        "torch.utils.tensorboard",
        "mbridge.models",
        "transformers.models.auto.modeling_auto",
    )
    assert [m for m in loaded if m.startswith(hidden)] == []

    code = "import afm_core.models.hf_weights, mbridge\nfrom mbridge import AutoBridge\nassert mbridge.__version__"
    code += "\nfrom mbridge.core.bridge import _MODEL_REGISTRY\nassert {'llama', 'qwen2', 'deepseek_v3'} <= set(_MODEL_REGISTRY)"
    assert "mbridge.models.deepseek_v3" in loaded_after(code)


def test_a_deferred_compile_compiles_at_the_first_call_and_is_traced_inline_inside_a_compiled_region(monkeypatch):
    calls = []
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append(fn) or compile_(fn, **kw))

    def gelu_gate(y: torch.Tensor) -> torch.Tensor:
        a, b = torch.chunk(y, 2, -1)
        return torch.nn.functional.gelu(a) * b

    fused = deferred_compile(gelu_gate, backend="eager")
    assert calls == [] and fused.__name__ == "gelu_gate"
    x = torch.randn(3, 8)
    assert torch.equal(fused(x), gelu_gate(x)) and calls == [gelu_gate]
    fused(x)
    assert calls == [gelu_gate]  # compiled once

    outer = compile_(lambda y: fused(y) + 1, backend="eager", fullgraph=True)  # a graph break would raise
    assert torch.equal(outer(x), gelu_gate(x) + 1) and calls == [gelu_gate]

    @deferred_compile(backend="eager")  # the decorator form with options, as torch.compile(backend=...)
    def double(y: torch.Tensor) -> torch.Tensor:
        return y * 2

    assert double(x).tolist() == (x * 2).tolist() and calls[-1].__name__ == "double"


ISA_CHECK = """
import json, sys
from afm_core.utils import import_hooks
import_hooks.install()
from torch._inductor import config, cpu_vec_isa
mode = sys.argv[1]
probe = cpu_vec_isa.VecISA._probe_load  # the dlopen in a child process, after the compile
if mode == "avx2_fails":  # this compiler's AVX2 build does not load (as an old compiler's AMX build would not)
    cpu_vec_isa.VecISA._probe_load = lambda isa, path: str(isa) != "avx2" and probe(isa, path)
if mode == "recorded":  # the record must answer: no dlopen process
    cpu_vec_isa.VecISA._probe_load = lambda isa, path: sys.exit("checked " + str(isa))
if mode == "user_says_no":
    config.cpp.vec_isa_ok = False
reported = cpu_vec_isa.x86_isa_checker()  # the ISAs the CPU reports, as valid_vec_isa_list reads them
candidates = [isa for isa in cpu_vec_isa.supported_vec_isa_list if set(str(isa).split()) <= set(reported)]
print(json.dumps({str(isa): bool(isa) for isa in candidates}))
"""


def test_inductors_cpu_isa_check_runs_once_per_machine_and_process_after_it_reuse_its_answers(tmp_path):
    """The ``torch._inductor.cpu_vec_isa`` hook (:mod:`afm_core.utils.import_hooks`): the first process checks each
    ISA the CPU reports (compile + ``dlopen`` in a child process) and records the answers, a failed check as
    failed; a later process answers as the first did without a ``dlopen`` process; ``config.cpp.vec_isa_ok`` set by
    a user still wins."""
    if platform.machine() != "x86_64":
        pytest.skip("inductor's ISA check probes x86 ISAs")

    def answers(mode: str) -> dict[str, bool]:
        env = {**os.environ, "AFM_CACHE": str(tmp_path / "cache"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ind")}
        env.pop("TORCHINDUCTOR_VEC_ISA_OK", None)
        done = subprocess.run([sys.executable, "-c", ISA_CHECK, mode], cwd=repo_root(), env=env, capture_output=True,
                              text=True, check=False)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.splitlines()[-1])

    checked = answers("avx2_fails")
    assert checked["avx2"] is False and len(checked) >= 1, checked
    ((key, recorded),) = json.loads((tmp_path / "cache" / "inductor" / "vec_isa_checks.json").read_text()).items()
    assert json.loads(key)[0] == torch.__version__ and len(recorded) >= len(checked)  # a check per flags and probe
    assert [passed for flags, passed in recorded.items() if flags.startswith("-mavx2 ")] == [False]
    assert answers("recorded") == checked  # every answer from the record, the failed one too
    assert answers("user_says_no") == dict.fromkeys(checked, False)
