"""Typed configs: ``python -m jobs.sft`` rejects a bad value before anything is built or submitted, naming the key
and the valid values; the schemas accept every shipped config (defaults, recipes, clusters)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from afm_core.config import ConfigError, check_config, register_schemas
from afm_core.config.data import PrepareDataConfig
from afm_core.config.sft import SFTConfig
from afm_core.utils.paths import repo_root

SFT_RECIPES = ["none", *sorted(p.stem for p in (repo_root() / "conf" / "recipe").glob("*_sft_*.yaml"))]


def _compose(*overrides: str, config: str = "sft"):
    register_schemas()
    with initialize_config_dir(config_dir=str(repo_root() / "conf"), version_base="1.3"):
        return compose(
            config_name=config, overrides=["run_dir=/tmp/run", *overrides] if config == "sft" else list(overrides)
        )


@pytest.mark.parametrize("recipe", SFT_RECIPES)
def test_every_shipped_recipe_passes_the_schema(recipe):
    checked = check_config(_compose(f"recipe={recipe}"), SFTConfig)
    assert checked.trainer.global_batch_size % (checked.trainer.micro_batch_size * checked.dp) == 0


def test_the_defaults_and_the_prepare_data_config_pass_the_schema():
    checked = check_config(_compose(), SFTConfig)
    assert checked.model.name == "smollm2-135m" and checked.parallel.cp == 1 and checked.dp == 1
    assert (
        check_config(
            _compose(
                "cluster=slurm",
                "cluster.nodes=2",
                "cluster.tasks_per_node=3",
                "parallel.tp=3",
                "trainer.global_batch_size=2",
            ),
            SFTConfig,
        ).dp
        == 2
    )
    prepared = check_config(_compose(config="prepare_data"), PrepareDataConfig)
    assert prepared.data.sources["gsm8k"] == {"limit": 600, "path": None}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.log_interval=0"], r"trainer.log_interval=0: must be >= 1"),
        (
            ["trainer.micro_batch_size=2", "trainer.global_batch_size=3"],
            r"trainer.global_batch_size=3: a multiple of trainer.micro_batch_size=2",
        ),
        (
            ["cluster.dp=2", "trainer.global_batch_size=3"],
            r"trainer.global_batch_size=3: must be a multiple of trainer.micro_batch_size \* dp = 1 \* 2 = 2",
        ),
        (["trainer.max_steps=null", "trainer.epochs=null"], r"trainer.max_steps=None: set trainer.max_steps or"),
        (["trainer.engine=jax"], r"trainer.engine='jax': one of megatron, deepspeed"),
        (["trainer.engine=deepspeed", "parallel.tp=3"], r"parallel.tp=3: trainer.engine=deepspeed is data parallel"),
        (["optim.min_lr=1.0"], r"optim.min_lr=1.0: in \[0, optim.lr=0.0002\]"),
        (["optim.lr_schedule=linear"], r"optim.lr_schedule='linear': one of cosine, constant"),
        (
            ["parallel.pp=2", "parallel.vpp=2"],
            (
                r"parallel.vpp=2: must divide the 15 layers per pipeline stage; "
                r"valid: \[1, 3, 5, 15\]"
            ),
        ),
        (["parallel.vpp=2"], r"parallel.vpp=2: virtual pipeline stages need parallel.pp > 1"),
        (["parallel.recompute=some"], r"parallel.recompute='some': null, selective or full"),
        (["parallel.cp=2"], r"parallel.cp=2: context parallelism is not implemented"),
        (["+parallel.ep=2"], r"parallel.ep: Key 'ep' not in 'ParallelConfig'; valid keys: tp, pp"),
        (["model.num_layers=0"], r"model.num_layers"),
        (["+data.sources.hotpot=3"], r"data.sources.hotpot: unknown converter; known: fireact, gsm8k"),
        (["data.sources.tora.path=/nowhere/*.jsonl"], r"data.sources.tora.path='/nowhere/\*.jsonl': no such file"),
        (["data.heldout_fraction=1.5"], r"data.heldout_fraction=1.5: in \[0, 1\]"),
        (["+data.filters.min_calls=1"], r"data.filters: unknown key\(s\) \['min_calls'\]"),
        (["cluster=slurm", "cluster.nodes=0"], r"cluster.nodes=0: an integer >= 1"),
        (
            ["cluster=slurm", "cluster.tasks_per_node=2", "parallel.tp=3"],
            (
                r"cluster.tasks_per_node=2: cluster.nodes \* cluster.tasks_per_node = 2 ranks must be a multiple of "
                r"parallel.tp \* parallel.pp = 3"
            ),
        ),
        (["+cluster.gres=gpu"], r"cluster.gres: Key 'gres' not in 'LocalClusterConfig'; valid keys: name, dp"),
        (["cluster.gpus_per_node=some"], r"cluster.gpus_per_node='some': auto or an integer >= 0"),
        (
            ["cluster=slurm", "trainer.compile_layers=true"],
            r"trainer.compile_layers=True: compiled layers run on CUDA only, and cluster.gpus_per_node=0 makes",
        ),
        (["cluster.gpus_per_node=0", "trainer.compile_layers=true"], r"trainer.compile_layers=True: compiled layers"),
    ],
)
def test_a_bad_value_is_rejected_naming_the_key_and_the_valid_values(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_config(_compose(*overrides), SFTConfig)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["export=sharegpt"], r"export='sharegpt': null or one of llamafactory, afm_rl"),
        (["input.format=llamafactory"], r"input.format=llamafactory needs input.path"),
        (["data.sources.tora.limit=-1"], r"data.sources.tora.limit=-1: an integer >= 0, or null"),
    ],
)
def test_prepare_data_rejects_a_bad_value_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_config(_compose(*overrides, config="prepare_data"), PrepareDataConfig)


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.eval_interval=0", "trainer.eval_interval=0: must be >= 1"),
        ("trainer.global_batch_size=0", "trainer.global_batch_size=0: must be >= 1"),
        (
            "trainer.seq_length=abc",
            ("Value 'abc' of type 'str' could not be converted to Integer\n    full_key: trainer.seq_length"),
        ),
        (
            "parallel.tp=2",
            (
                "parallel.tp=2: must divide model.num_attention_heads=9 and model.num_query_groups=3 "
                "(smollm2-135m); valid: [1, 3]"
            ),
        ),
        (
            "parallel.pp=7",
            ("parallel.pp=7: must divide model.num_layers=30 (smollm2-135m); valid: [1, 2, 3, 5, 6, 10, 15, 30]"),
        ),
        ("trainer.eval_every=5", "Key 'eval_every' not in 'TrainerConfig'\n    full_key: trainer.eval_every"),
        (
            "+trainer.eval_every=5",
            "trainer.eval_every: Key 'eval_every' not in 'TrainerConfig'; valid keys: seed, micro_batch_size",
        ),
    ],
)
def test_jobs_sft_rejects_a_bad_override_before_importing_torch_or_submitting(tmp_path, override, message):
    run_dir = tmp_path / "run"
    result, heavy = _run_importing(["jobs.sft", override, f"hydra.run.dir={run_dir}"])
    assert result.returncode != 0 and message in result.stderr, result.stderr
    assert not heavy, f"imported {heavy} before refusing"
    assert not (run_dir / "logs").exists(), "a job was submitted"


#: What a refusal must not wait for: each takes seconds to import (torch ~3 s, megatron.core ~5 s more on two cores).
HEAVY_MODULES = ("torch", "megatron.core", "vllm", "transformers", "deepspeed")


def _run_importing(module_and_args: list[str]) -> tuple[subprocess.CompletedProcess, list[str]]:
    """``python -X importtime -m <module_and_args>``: the result (import log stripped from stderr) and which of
    :data:`HEAVY_MODULES` it imported. Deterministic where a wall-clock bound is not (a loaded CI machine)."""
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", *module_and_args], cwd=repo_root(),
                            capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    lines = result.stderr.splitlines()
    imported = {line.rsplit("|", 1)[1].strip() for line in lines if line.startswith("import time:")}
    result.stderr = "\n".join(line for line in lines if not line.startswith("import time:"))
    return result, [m for m in HEAVY_MODULES if m in imported]


RL_RECIPES = [
    "none",
    "rl_smoke",
    "rl_demo",
    *sorted(p.stem for p in (repo_root() / "conf" / "recipe").glob("*_rl*.yaml")),
]


@pytest.mark.parametrize("recipe", RL_RECIPES)
def test_every_shipped_rl_recipe_passes_the_rl_schema(recipe):
    from afm_core.config.rl import RLConfig

    # AutoCoA's RL stages need >= 9,216 positions (prompt 1,024 + response 8,192): not the default SmolLM2's 8,192
    model = ["model=qwen2.5-7b-instruct"] if recipe.startswith("autocoa") else []
    cfg = _compose(f"recipe={recipe}", "run_dir=/tmp/run", "data.files=[prompts.parquet]", *model, config="rl")
    checked = check_config(cfg, RLConfig)
    assert checked.algorithm.filter_groups_metric == "acc"  # verl's filter_groups.metric default


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        (
            [{"until_step": 4}],
            "rollout.context_schedule[0].max_response_len: Structured config of type `ContextStage` has missing",
        ),
        ([{"max_response_len": 0}], "rollout.context_schedule[0].max_response_len=0: an integer >= 1"),
        ([{"max_response_len": 8}, {"max_response_len": 16}], "context_schedule[0].until_step=None: only the last"),
        ([{"until_step": 0, "max_response_len": 8}, {"max_response_len": 16}], "[0].until_step=0: an integer >= 1"),
        (
            [{"until_step": 4, "max_response_len": 8}, {"until_step": 4, "max_response_len": 16}],
            "rollout.context_schedule[1].until_step=4: increasing: above the previous stage's (4)",
        ),
        ([{"until": 4, "max_response_len": 8}], "Key 'until' not in 'ContextStage'"),
    ],
)
def test_a_bad_context_schedule_is_refused_at_submit_naming_the_stage_and_field(schedule, message):
    """The ``rollout`` group's schema is the one check of the staged context length (the ranks' stages are built
    from the checked group: afm_core.rl.schedule.build_stages)."""
    from afm_core.config.checks import instantiate
    from afm_core.config.rl import RolloutConfig

    with pytest.raises(ConfigError) as raised:
        instantiate(RolloutConfig, {"context_schedule": schedule}, "rollout.")
    assert message in str(raised.value)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("+rollout.nonsense_key=1", "rollout.nonsense_key: Key 'nonsense_key' not in 'RolloutConfig'; valid keys: n,"),
        ("algorithm.clip_ratio_high=-0.5", "algorithm.clip_ratio_high=-0.5: > 0"),
        ("algorithm.filter_groups_metric=reward", "algorithm.filter_groups_metric='reward': acc"),
        ("algorithm.adv_estimator=ppo", "algorithm.adv_estimator='ppo': one of grpo, drgrpo, gae"),
        ("algorithm.mini_batch_size=3", "algorithm.mini_batch_size=3: must divide algorithm.train_batch_size=2"),
        ("rollout.context_schedule=[{max_response_len:8},{max_response_len:9}]", "only the last stage has none"),
        ("engine.gpu_memory_utilization=1.5", "engine.gpu_memory_utilization=1.5: in (0, 1]"),
        ("+engine.nonsense_key=1", "engine.nonsense_key: Key 'nonsense_key' not in 'VLLMEngineConfig'; valid keys:"),
        ("tools.tools.code=3", "tools.tools.code=3: a mapping, or null (off)"),
        (
            "data.max_prompt_len=2040",  # B1: vLLM would refuse max_model_len 2088 > 2048 at start, after the queue
            "data.max_prompt_len + the largest stage's max_response_len = 2040 + 48 = 2088 tokens (vLLM "
            "max_model_len) > model.max_position_embeddings = 2048 of tiny-llama; lower",
        ),
        # checked after the schema, before the queue (afm_core.rl.driver.check_inputs): no engine starts
        (
            "+reward_fn._target_=/nonexistent/my_reward.py:score",
            "reward_fn._target_: no file /nonexistent/my_reward.py",
        ),
        (
            "trainer.val_before_train=true trainer.val_benchmarks=[gsm8k_tset]",
            "jobs.rl: trainer.val_benchmarks=['gsm8k_tset'] / val.benchmark_files=[]: unknown benchmark 'gsm8k_tset'",
        ),
    ],
)
def test_jobs_rl_rejects_a_bad_override_naming_the_key_before_importing_torch(tmp_path, override, message):
    run_dir = tmp_path / "run"
    result, heavy = _run_importing(["jobs.rl", "recipe=rl_smoke", *override.split(), f"hydra.run.dir={run_dir}"])
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not heavy, f"imported {heavy} before refusing"
    assert not (run_dir / "logs").exists(), "a job was submitted"


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        (
            ["tools.tools.code.server=null", "+tools.tools.code._target_=examples.plugins.my_plugins.Nope"],
            ValueError,
            "tools.code: Error locating target 'examples.plugins.my_plugins.Nope'",
        ),
        (
            ["trainer.test_freq=1", "val.benchmark_files=[/nonexistent/val.jsonl]"],
            FileNotFoundError,
            "trainer.val_benchmarks=[] / val.benchmark_files=['/nonexistent/val.jsonl']: benchmark file "
            "/nonexistent/val.jsonl not found",
        ),
        (
            ["data.presets=[]", "data.files=[/nonexistent/prompts.parquet]"],
            FileNotFoundError,
            "data.presets=[] / data.files=['/nonexistent/prompts.parquet']: benchmark file /nonexistent/prompts.parquet",
        ),
    ],
)
def test_the_rl_jobs_plug_ins_and_task_files_are_checked_before_the_queue_naming_the_key(overrides, error, message):
    from afm_core.config.rl import rl_config
    from afm_core.rl.driver import check_inputs

    config = rl_config(_compose("recipe=rl_smoke", "run_dir=/tmp/run", *overrides, config="rl"))
    with pytest.raises(error) as raised:
        check_inputs(config)
    assert message in str(raised.value)


@pytest.mark.parametrize(
    ("job", "override", "message"),
    [
        ("eval", "+eval.nonsense=1", "eval.nonsense: Key 'nonsense' not in 'SamplingConfig'; valid keys: k,"),
        ("eval", "eval.k=0", "eval.k=0: an integer >= 1"),
        ("filter_rl", "filter.max_pass_rate=2", "filter.max_pass_rate=2.0: in [0, 1], or null"),
        ("distill", "roles.planner.teacher=nope", "roles.planner.teacher='nope': one of the teachers: main"),
    ],
)
def test_eval_filter_rl_and_distill_reject_a_bad_override_before_submitting(tmp_path, job, override, message):
    run_dir = tmp_path / "run"
    extra = ["benchmarks=[gsm8k_test]"] if job == "filter_rl" else []
    result = subprocess.run(
        [sys.executable, "-m", f"jobs.{job}", *extra, override, f"hydra.run.dir={run_dir}"],
        cwd=repo_root(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not (run_dir / "logs").exists(), "a job was submitted"


@pytest.mark.parametrize("preset", ["none", "web", "code"])
def test_the_shipped_eval_distill_and_filter_rl_configs_pass_their_schemas(preset):
    from afm_core.config.eval import DistillConfig, EvalConfig, FilterRLConfig

    check_config(_compose("run_dir=/tmp/run", config="eval"), EvalConfig)
    check_config(_compose("run_dir=/tmp/run", config="distill"), DistillConfig)
    cfg = _compose("run_dir=/tmp/run", "benchmarks=[gsm8k_train]", f"filter_preset={preset}", config="filter_rl")
    assert check_config(cfg, FilterRLConfig).filter.max_pass_rate in (0.3, None)
