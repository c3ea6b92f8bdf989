"""The RL driver (afm_core.rl.driver): ``recipe=rl_smoke`` end to end on the real vLLM-CPU engine, the real
sandbox and the Megatron trainer; the staged context switching at its configured step, also across a resume;
a run stopped by SIGUSR2 while it generates (rollouts aborted in vLLM, the step restarted on resume, the trainer's
state offloaded around every generation round) logging every rollout step once and ending bit for bit where an
uninterrupted run does (weights, AdamW state, RNG); a sandbox killed mid-rollout turning into counted error
observations.

The job tests share one straight run and one stopped-and-resumed run per precision (module fixtures). The fp32
pair is also what a verl user expects around the RL loop: TensorBoard and MLflow tracking continued across the
resume, rollout dumps (``trainer.rollout_data_dir``), validation on a 2-problem benchmark with the live weights
(``trainer.val_before_train``, ``trainer.test_freq``), a plug-in reward and a plug-in ``<code>`` tool given by file
path, a profiled step, and its mid-run checkpoint exported to HF (``jobs.export``). The random tiny model calls no
tool, so the plug-in tool is also driven through the same rollout actor by a scripted policy."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from afm_core.config import register_schemas
from afm_core.config.rl import RewardConfig
from afm_core.config.rl import rl_config as as_rl_config
from afm_core.rl.metrics import rollout_metrics
from afm_core.rl.prompts import PromptStream
from afm_core.rl.reward_shaping import shaped_reward
from afm_core.rl.rollout_actor import RolloutActor, node_tool_urls
from afm_core.rl.rollout_buffer import Group
from afm_core.rl.schedule import Stage, build_stages
from afm_core.utils.paths import repo_root
from afm_core.utils.ports import free_port
from tests.gloo_env import set_rank_env
from tests.ranks import start_ranks
from tests.rl.helpers import needs_shared_data, paired_samples, rl_config, run_rl_ranks
from tests.test_tracking import mlflow_history, tensorboard_scalars

SCHEDULE = "[{until_step: 2, max_response_len: 32}, {max_response_len: 48}]"

PLUGINS = '''
from afm_core.tools.base import Tool


def tool_bonus(response, *, gold, question, meta, kind):
    """0.5 for every trajectory, 1.0 for one with a tool observation, whatever the built-in grader would say."""
    return 1.0 if "<observation>" in response else 0.5


def distinct_chars(response, *, gold, question, meta, kind):
    """The fraction of distinct characters: spread on a random model's text, and never the built-in grader's 0 or 1."""
    return len(set(response)) / max(1, len(response))


class DryRun(Tool):
    """<code> answered with no sandbox: the observation counts the program's lines, nothing runs."""

    name = "code"

    def parse(self, content):
        return content.strip()

    async def call(self, args, http, context):
        return f"dry run: {len(args.splitlines())} line(s), nothing executed"
'''


def plugin_overrides(root: Path, reward: str) -> list[str]:
    """``reward_fn`` (the function ``reward``) and ``tools.tools.code`` (in place of the sandbox's) from the file
    ``root/my_plugins.py``."""
    root.mkdir(parents=True, exist_ok=True)
    target = root / "my_plugins.py"
    target.write_text(PLUGINS)
    return [
        f"+reward_fn._target_={target}:{reward}",
        "~tools.tools.code",
        f"+tools.tools.code._target_={target}:DryRun",
    ]


def _config(run_dir: Path, *overrides: str) -> dict:
    return rl_config(run_dir, f"rollout.context_schedule={SCHEDULE}", *overrides)


def _user_overrides(run_dir: Path) -> list[str]:
    """What a verl user sets around the loop: TensorBoard and MLflow, rollout dumps, validation before training,
    every 2 steps and at the end, a profiled step, and the distinct-characters reward and a dry-run ``<code>`` tool
    as plug-ins given by file path."""
    return [
        "logger=[console,tensorboard,mlflow]",
        f"trainer.rollout_data_dir={run_dir / 'rollouts'}",
        "trainer.val_before_train=true",
        "trainer.test_freq=2",
        "trainer.val_benchmarks=[gsm8k_test]",
        "val.limit=2",
        "val.k=1",
        "val.max_response_tokens=16",
        "profile.enabled=true",
        "profile.steps=[3,3]",
        *plugin_overrides(run_dir, "distinct_chars"),
    ]


def _job_config(run_dir: Path, precision: str, *overrides: str) -> dict:
    """The smoke job in ``precision`` with a reward that varies on a random model's text (the fraction of distinct
    characters: non-zero advantages and gradients), keeping its checkpoints (the first attempt's stays readable
    and exportable). In fp32 also :func:`_user_overrides` (the reward as a file plug-in); in bf16 the reward by
    module path and the real sandbox."""
    if precision == "fp32":
        extra = _user_overrides(run_dir)
    else:
        extra = ["reward_fn={_target_: tests.rl.helpers.distinct_chars_reward}"]
    return _config(run_dir, f"trainer.precision={precision}", "reward.mode=score", "trainer.keep_last=3", *extra,
                   *overrides)  # fmt: skip


def _run(cfg: dict, stop_in_round: int | None = None) -> dict:
    """:func:`run_rl_ranks` as a Slurm job id's run (``tracking.json`` names it) with MLflow's default store."""
    with pytest.MonkeyPatch.context() as env:
        env.delenv("MLFLOW_TRACKING_URI", raising=False)
        env.setenv("SLURM_JOB_ID", "4242")
        return run_rl_ranks(cfg, stop_in_round=stop_in_round)


def _metrics(run_dir: Path, split: str = "train") -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["split"] == split]


def _checkpoint_common(path: str) -> dict:
    from megatron.core.dist_checkpointing import load_common_state_dict

    return load_common_state_dict(path)["afm"]


def _checkpoint_state(path: str, tmp_path: Path) -> tuple[dict, dict, dict]:
    """A one-rank checkpoint's ``(tensors, optimizer common state, rank 0's RNG)``: model weights and AdamW
    moments by name (``optimizer.state.exp_avg.<param>``), the optimizer's step counter and param groups."""
    from megatron.core.dist_checkpointing import load_common_state_dict
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = tmp_path / f"{Path(path).name}-{time.monotonic_ns()}.pt"
    dcp_to_torch_save(path, flat)
    tensors = {k: v for k, v in torch.load(flat, weights_only=False).items() if isinstance(v, torch.Tensor)}
    rank = torch.load(Path(path) / "rank_00000.pt", weights_only=False)
    return tensors, load_common_state_dict(path)["optimizer"], rank["rng"]


#: Mean |logprob| gap between the trainer and the engine it synced its weights into: in fp32 the two differ in
#: op order only; in bf16 each rounds activations and logits to 8-bit mantissas along its own kernels (0.00102
#: measured on tiny-llama). That the sync reaches the engine at all is tested in fp32 (tests/rl/test_weight_sync.py:
#: a stale engine > 1e-2, a synced one <= 1e-3).
LOGPROB_GAP = {"fp32": 1e-3, "bf16": 1e-2}


def adam_state(optimizer: dict) -> dict:
    """The AdamW part of a checkpoint's common optimizer state: the state itself in fp32; in bf16, megatron's
    ``Float16OptimizerWithFloat16Params`` nests it under ``optimizer`` beside its fp32 main weights
    (megatron/core/optimizer/optimizer.py, ``sharded_state_dict``)."""
    return optimizer.get("optimizer", optimizer)


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def uninterrupted(request, tmp_path_factory):
    """The smoke job run straight through, in each precision: fp32, and bf16 weights with fp32 main weights in
    megatron's mixed-precision optimizer (the layout of its state differs: tested both ways). ``(run_dir,
    summary, precision)``."""
    run_dir = tmp_path_factory.mktemp(f"rl-{request.param}") / "straight"
    return run_dir, _run(_job_config(run_dir, request.param)), request.param


@pytest.fixture(scope="module")
def interrupted(uninterrupted):
    """The same job stopped by SIGUSR2 while step 2's rollouts are in vLLM, then resumed to the end, with the
    bitwise restart of the stopped round (``rollout.partial.on_stop=restart``); it also offloads the trainer's state
    around every generation round (B4; forced on CPU). ``(run_dir, first attempt's summary, resumed attempt's
    summary)``."""
    run_dir = uninterrupted[0].with_name("interrupted")
    cfg = _job_config(run_dir, uninterrupted[2], "colocation.offload_trainer=true", "rollout.partial.on_stop=restart")
    first = _run(cfg, stop_in_round=2)
    return run_dir, first, _run(cfg)


#: The tests of the fp32 runs alone: what a verl user expects around the loop (:func:`_user_overrides`).
fp32_runs = pytest.mark.parametrize("uninterrupted", ["fp32"], indirect=True)


# -- fast units -------------------------------------------------------------------------------------------
def test_the_prompt_stream_resumes_at_its_saved_position_across_epochs():
    a = PromptStream(5, seed=3)
    a.take(7)
    b = PromptStream(5, seed=3)
    b.load_state_dict(a.state_dict())
    assert a.take(6) == b.take(6)
    uids = [uid for uid, _ in PromptStream(5, seed=3).take(12)]
    assert len(set(uids)) == 12, "uids stay unique when the data wraps"


def test_each_rank_uses_the_tool_servers_of_its_own_nodes_first_rank():
    gathered = [
        ("n1", 0, {"sandbox": "http://127.0.0.1:8001"}),
        ("n1", 1, {}),
        ("n2", 0, {"sandbox": "http://127.0.0.1:9002"}),
    ]
    assert node_tool_urls(gathered, "n1") == {"sandbox": "http://127.0.0.1:8001"}
    assert node_tool_urls(gathered, "n2") == {"sandbox": "http://127.0.0.1:9002"}
    with pytest.raises(RuntimeError, match="no rank with LOCAL_RANK=0 on node n3"):
        node_tool_urls(gathered, "n3")


def test_the_reward_is_score_times_format_with_the_overlong_penalty():
    cfg = RewardConfig(mode="score_x_format", overlong_buffer_len=4, overlong_penalty_factor=1.0)
    assert shaped_reward(1.0, 0.0, 10, cfg, 16) == 0.0
    assert shaped_reward(1.0, 1.0, 10, cfg, 16) == 1.0
    assert shaped_reward(1.0, 1.0, 14, cfg, 16) == pytest.approx(0.5)  # 2 tokens into the 4-token buffer
    assert shaped_reward(0.0, 1.0, 17, cfg, 16) == -1.0


@pytest.mark.parametrize("recipe", ["afm_code_rl_32b", "afm_web_rl_32b", "afm_mhqa_rl"])
def test_the_paper_rl_recipes_pass_the_submit_checks_and_start_an_engine_within_the_models_positions(recipe, tmp_path):
    """What jobs.rl runs before sbatch (the schema) and what run_rl runs before any model starts (the stage
    schedule, the engine's context, the batch split over the recipe's data-parallel ranks) accept the recipe."""
    from afm_core.config import check_config
    from afm_core.config.rl import RLConfig
    from afm_core.rl.policy_trainer import check_batch_split

    register_schemas()
    with initialize_config_dir(config_dir=str(repo_root() / "conf"), version_base="1.3"):
        cfg = compose(config_name="rl", overrides=[f"recipe={recipe}", f"run_dir={tmp_path}", "data.files=[p.parquet]"])
    checked = check_config(cfg, RLConfig)
    a, r = cfg.algorithm, cfg.rollout
    stages = build_stages(checked.rollout)
    max_model_len = cfg.data.max_prompt_len + max(s.max_response_len for s in stages)  # run_rl's engine context
    assert max_model_len <= cfg.model.max_position_embeddings  # vLLM refuses a longer one at start (B1)
    dp = checked.cluster.data_parallel(checked.parallel.model_parallel)
    check_batch_split(a.mini_batch_size * r.n, a.train_batch_size * r.n, dp, cfg.trainer.micro_batch_size,
                      cfg.trainer.max_tokens_per_micro_batch)  # fmt: skip


# -- the job --------------------------------------------------------------------------------------------
@needs_shared_data
@pytest.mark.slow
def test_rl_smoke_runs_every_step_with_the_time_split_and_the_stage_switch_at_its_step(uninterrupted):
    run_dir, summary, precision = uninterrupted
    assert summary["step"] == 3 and not summary["stopped_early"]
    records = _metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [(r["stage"], r["max_response_len"]) for r in records] == [(0, 32), (0, 32), (1, 48)]
    for r in records:
        assert r["response_len_max"] <= r["max_response_len"]
        assert r["optimizer_steps"] == 2  # train batch 2 groups / mini batch 1 group
        assert r["logprob_gap_vllm_trainer"] <= LOGPROB_GAP[precision], "weights in vLLM are the trainer's"
        for key in (
            "generate_s",
            "tools_s",
            "logprob_s",
            "train_s",
            "weight_sync_s",
            "reward_mean",
            "accuracy",
            "kept_group_ratio",
            "all_equal_group_ratio",
            "gen_batches",
            "actor/clip_frac",
            "entropy",
            "tool_calls",
            "tool_errors",
        ):
            assert key in r, key
    assert (run_dir / "rl.png").stat().st_size > 0
    hf = Path(summary["hf_dir"])  # the policy's HF export, which python -m jobs.eval model.hf_path=... reads
    assert hf == run_dir / "hf" and (hf / "config.json").is_file() and (hf / "tokenizer.json").is_file()
    assert list(hf.glob("*.safetensors"))


@needs_shared_data
@pytest.mark.slow
def test_a_run_stopped_while_generating_resumes_the_step_to_the_same_weights_optimizer_state_and_rng(
    uninterrupted, interrupted, tmp_path
):
    """SIGUSR2 while step 2's rollouts are in vLLM: the round is aborted (vLLM left with no request), the state
    from before it saved (step 2's prompts given back), and the resumed run logs every step once and ends with
    the uninterrupted run's weights, AdamW moments and step counter, and RNG states, bit for bit. This run also
    offloads the trainer's state around every generation round (B4; forced on CPU): it comes back exactly."""
    straight_dir, straight, precision = uninterrupted
    run_dir, first, second = interrupted
    assert first["stopped_early"] and first["step"] == 1 and first["hf_dir"] is None
    assert first["aborted_rounds_left_vllm_idle"] == [True]
    saved = _checkpoint_common(first["checkpoint"])
    assert saved["progress"]["stage"] == 0 and saved["progress"]["rollout_step"] == 1
    assert saved["prompts"]["offset"] == 2 and saved["progress"]["prompts_consumed"] == 2  # step 2's given back
    assert second["resumed_from"] == first["checkpoint"] and second["step"] == 3
    resumed, expected = _metrics(run_dir), _metrics(straight_dir)
    assert [r["step"] for r in resumed] == [1, 2, 3]
    keys = ("stage", "max_response_len", "data_epoch", "data_offset", "prompts_consumed", "reward_mean", "grad_norm")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in expected]
    assert all("reload_s" in r for r in resumed)  # the trainer's state came back for every step's training
    # and left for every step's generation; in the fp32 runs, which validate, it left before step 3 already, for
    # the validation after step 2 (the engine's turn too): step 3's record logs that offload
    assert [r.get("offload_gb", 0) > 0 for r in resumed] == [True, True, True]
    assert not any("offload_gb" in r for r in expected)  # CPU default: no offload
    assert second["data_state"] == straight["data_state"] and second["stage"] == straight["stage"] == 1
    final = _checkpoint_common(second["checkpoint"])
    assert final["prompts"] == _checkpoint_common(straight["checkpoint"])["prompts"]
    assert final["sampler"]["kept"] == [] and final["progress"]["rollout_step"] == 3

    tensors, optimizer, rng = _checkpoint_state(second["checkpoint"], tmp_path)
    want_tensors, want_optimizer, want_rng = _checkpoint_state(straight["checkpoint"], tmp_path)
    (embedding,) = [k for k in want_tensors if k.endswith("word_embeddings.weight") and not k.startswith("optimizer.")]
    assert want_tensors[embedding].dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    moments = [k for k in want_tensors if k.startswith("optimizer.state.exp_avg")]
    assert moments and any(want_tensors[k].abs().sum() > 0 for k in moments)  # gradients flowed
    assert tensors.keys() == want_tensors.keys()
    assert [k for k in want_tensors if not torch.equal(tensors[k], want_tensors[k])] == []
    assert optimizer == want_optimizer
    assert int(adam_state(optimizer)["state"]["common_step"]) == 6  # 3 rollout steps x 2
    assert rng["python"] == want_rng["python"] and torch.equal(rng["torch"], want_rng["torch"])
    assert all(np.array_equal(a, b) for a, b in zip(rng["numpy"], want_rng["numpy"]))
    assert rng["tracker"].keys() == want_rng["tracker"].keys()
    assert all(torch.equal(rng["tracker"][k], want_rng["tracker"][k]) for k in want_rng["tracker"])


@pytest.mark.slow
def test_the_final_rl_checkpoint_exports_to_hf_in_its_precision_with_the_megatron_models_logits(
    uninterrupted, tmp_path, monkeypatch
):
    """``jobs.export``'s body on the RL run's checkpoint: the export keeps the checkpoint's dtype and its logits
    match the Megatron model's within that dtype's tolerance (fp32 1e-3; bf16 one rounding of the logits)."""
    from afm_core.engine.export import PARITY_TOLERANCE, export_checkpoint
    from tests.test_export import weights

    run_dir, straight, precision = uninterrupted
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, os.environ.get(key, ""))  # the export's one-rank world sets them: undone after
    threads = torch.get_num_threads()
    summary = export_checkpoint(run_dir, tmp_path / "hf")
    torch.set_num_threads(threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    assert summary["checkpoint"] == straight["checkpoint"] and summary["dtype"] == str(dtype).split(".")[-1]
    assert summary["max_logit_diff"] < PARITY_TOLERANCE[dtype]
    assert {t.dtype for t in weights(tmp_path / "hf").values()} == {dtype}


# -- what a verl user expects around the loop (the fp32 runs) ---------------------------------------------------
def _run_ids(checkpoint: str) -> dict:
    return _checkpoint_common(checkpoint)["progress"]["run_ids"]


@needs_shared_data
@pytest.mark.slow
@fp32_runs
def test_a_resumed_rl_job_continues_its_tracking_runs_with_every_step_once(interrupted, monkeypatch):
    run_dir, first, second = interrupted
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the job's default store, RUN_DIR/mlruns
    ids = _run_ids(first["checkpoint"])
    assert set(ids) == {"mlflow"} and _run_ids(second["checkpoint"]) == ids  # the resumed job reopened that run
    assert [s for s, _ in mlflow_history(run_dir, ids["mlflow"], "train/reward_mean")] == [1, 2, 3]
    assert [s for s, _ in tensorboard_scalars(run_dir, "train/reward_mean")] == [1, 2, 3]
    tracking = json.loads((run_dir / "tracking.json").read_text())
    assert tracking["slurm_job_id"] == "4242" and tracking["git_commit"]
    assert tracking["config"]["trainer"]["test_freq"] == 2 and tracking["run_ids"] == ids


@needs_shared_data
@pytest.mark.slow
@fp32_runs
def test_every_rollout_step_is_dumped_as_one_jsonl_file_of_its_graded_trajectories(interrupted):
    files = sorted((interrupted[0] / "rollouts").iterdir())
    assert [f.name for f in files] == ["1.jsonl", "2.jsonl", "3.jsonl"]  # step 1 from the first attempt
    for step, path in enumerate(files, 1):
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        assert len(lines) == 4  # 2 prompts x rollout.n=2, all trained (filter_groups off)
        assert len({line["uid"] for line in lines}) == 2
        for line in lines:
            assert line["step"] == step and line["trained"] and line["prompt"] and line["response_tokens"] > 0
            assert 0 < line["score"] < 1 and line["tool_calls"] == []  # the plug-in reward; no tool called
            assert line["finish_reason"]


@needs_shared_data
@pytest.mark.slow
@fp32_runs
def test_validation_runs_before_training_every_test_freq_steps_and_at_the_end_with_the_plugged_in_reward(
    interrupted,
):
    run_dir = interrupted[0]
    val = _metrics(run_dir, "val")
    assert [r["step"] for r in val] == [0, 2, 3]  # val_before_train, test_freq=2, the last step; none repeated
    for r in val:
        assert r["gsm8k_test/n"] == 2 and r["gsm8k_test/k"] == 1
        # the plug-in reward grades validation too: on 2 problems the built-in grader's avg@1 is 0, 0.5 or 1
        assert r["gsm8k_test/avg@1"] not in (0.0, 0.5, 1.0)
    assert [s for s, _ in tensorboard_scalars(run_dir, "val/gsm8k_test/avg@1")] == [0, 2, 3]


@needs_shared_data
@pytest.mark.slow
@fp32_runs
def test_the_plugged_in_code_tool_replaces_the_sandbox_in_the_rl_jobs_tool_pool(interrupted):
    run_dir = interrupted[0]
    for r in _metrics(run_dir):  # the pool's metrics per tool: the plug-in alone answers <code>
        assert set(r["tool_metrics"]) == {"code"}
    assert not (run_dir / "logs" / "tool_servers").exists(), "a tool server started (the sandbox is not needed)"


@needs_shared_data
def test_a_policy_that_writes_code_gets_the_plugged_in_tools_observation_graded_by_the_plugged_in_reward(tmp_path):
    """The rl_smoke job's rollout side (RolloutActor: the one agent loop, the tool pool, the graders, the rollout
    dump) with the plug-in tool of the runs above, the policy's turns scripted (the random model never writes a
    tag)."""
    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
    from afm_core.rl.prompts import load_prompts
    from afm_core.rl.rollout_dump import dump_rollouts
    from afm_core.rollout.factory import load_tokenizer
    from tests.rollout.replay import ReplayEngine

    cfg = rl_config(tmp_path / "run", *plugin_overrides(tmp_path, "tool_bonus"))
    hf_dir = ensure_hf_checkpoint(cfg["model"])
    tokenizer = load_tokenizer(hf_dir)
    config = as_rl_config(cfg)
    task = load_prompts(config.data, config.data_dir, tokenizer)[0]
    policy = ReplayEngine(tokenizer, ["<think>Compute it.</think>\n<code>\nx = 6 * 7\nprint(x)\n</code>",
                                      "<think>Done.</think>\n<answer>\\boxed{42}</answer>"], 2048)  # fmt: skip
    actor = RolloutActor(config.actor, hf_dir, tokenizer, {}, 2048, engine=policy)
    try:
        round_ = actor.generate([Group("0:0", 0)], [task], 1, Stage(0, 256, None), seed=0)
        (sample,) = round_.groups[0].samples()
        assert actor.tool_metrics()["code"]["calls"] == 1
    finally:
        actor.close()
    (line,) = [json.loads(x) for x in dump_rollouts(tmp_path / "rollouts", 1, [sample], [sample], tokenizer).open()]
    assert line["tool_calls"] == [{"name": "code", "error": None}] and line["finish_reason"] == "answer"
    observation = "<observation>\ndry run: 2 line(s), nothing executed\n</observation>"
    assert observation in line["response"]
    masked = [t for t, m in zip(sample.response_ids, sample.response_mask, strict=True) if m == 0]
    assert observation in tokenizer.decode(masked)  # the observation's tokens are kept out of the loss
    assert line["score"] == 1.0 and line["format"] == 1.0 and line["reward"] == 1.0  # built-in math grader: 0


@needs_shared_data
@pytest.mark.slow
@fp32_runs
def test_the_mid_run_rl_checkpoint_exports_to_hf_with_the_megatron_models_logits(interrupted, tmp_path, monkeypatch):
    """``jobs.export``'s body (:func:`export_checkpoint`) run here: a process of its own would spend ~12 s
    importing Megatron and transformers again; the CLI around it is tested in tests/test_export.py."""
    from afm_core.engine.export import export_checkpoint
    from tests.test_export import weights

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, os.environ.get(key, ""))  # the export's one-rank world sets them: undone after
    run_dir, first, _ = interrupted
    threads = torch.get_num_threads()
    mid_dir = tmp_path / "hf_step_1"
    summary = export_checkpoint(run_dir, mid_dir, step=1)
    torch.set_num_threads(threads)  # and the torch threads
    assert not torch.distributed.is_initialized()
    assert summary["checkpoint"] == first["checkpoint"] and summary["max_logit_diff"] < 1e-3
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in mid_dir.iterdir()}
    mid, last = weights(mid_dir), weights(run_dir / "hf")  # run_dir/hf: the trainer's, after step 3
    assert mid.keys() == last.keys() and any(not torch.equal(mid[k], last[k]) for k in last), "step 1 == step 3"


@needs_shared_data
@pytest.mark.slow
@fp32_runs
def test_the_profiled_rollout_step_leaves_a_torch_profiler_trace(interrupted):
    traces = list((interrupted[0] / "profile").glob("*.pt.trace.json"))
    assert len(traces) == 1
    events = json.loads(traces[0].read_text())["traceEvents"]
    assert any(e.get("name") == "step 3" for e in events)


# -- the policy update ------------------------------------------------------------------------------------
def _update_rank(rank: int, world: int, port: int, cfg: dict, out: str) -> None:
    set_rank_env(rank, world, port)
    from afm_core.engine.distributed import destroy_distributed, init_distributed
    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
    from afm_core.rl.batch import response_values, sample_micro_batches
    from afm_core.rl.logprobs import compute_logprobs
    from afm_core.rl.policy_model import build_policy_model
    from afm_core.rl.policy_trainer import build_policy_trainer, policy_update

    layout = init_distributed(OmegaConf.create(cfg["parallel"]), seed=1, num_threads=1)
    try:
        chunks, _ = build_policy_model(ensure_hf_checkpoint(cfg["model"]), layout)
        policy = as_rl_config({k: v for k, v in cfg.items() if k != "_samples"}).policy
        trainer = build_policy_trainer(policy, layout, chunks, Path(cfg["run_dir"]), 10)
        samples = paired_samples(cfg.get("_samples", 4))  # observation tokens (mask 0) mid-response
        advantages = torch.tensor([1.0, -1.0] * (len(samples) // 2))

        def mean_logprobs() -> list[float]:
            (batch,) = sample_micro_batches(samples, len(samples), 16, 0)
            (res,) = compute_logprobs(trainer.model, [batch], temperature=1.0)
            masks = response_values(batch["response_mask"], batch)
            return [float(v[m.bool()].mean()) for v, m in zip(response_values(res["logprobs"], batch), masks)]

        before = mean_logprobs()
        stats = policy_update(trainer, samples, advantages, policy, 16, 0)
        after = mean_logprobs()
        Path(out).write_text(json.dumps({"before": before, "after": after, "stats": stats}))
    finally:
        destroy_distributed()


@pytest.mark.slow
def test_a_policy_update_raises_the_logprobs_of_positive_advantage_samples_and_lowers_the_others(tmp_path):
    cfg = _config(
        tmp_path / "run",
        "rollout.n=2",
        "algorithm.mini_batch_size=2",
        "algorithm.train_batch_size=2",
        "trainer.micro_batch_size=2",
        "optim.lr=1e-3",
        "optim.min_lr=1e-3",
        "optim.weight_decay=0.0",
    )
    out = tmp_path / "update.json"
    start_ranks(_update_rank, args=(1, free_port(), cfg, str(out)), nprocs=1)
    result = json.loads(out.read_text())
    deltas = [a - b for a, b in zip(result["after"], result["before"])]
    assert deltas[0] > 0 and deltas[2] > 0 and deltas[1] < 0 and deltas[3] < 0, deltas
    assert result["stats"]["optimizer_steps"] == 1 and result["stats"]["actor/tokens"] == 4 * 7


@pytest.mark.slow
def test_a_partial_train_batch_trains_its_last_mini_batch_on_the_remaining_groups(tmp_path):
    """Dynamic sampling with ``allow_partial`` can hand over a number of groups that the mini-batch does not
    divide (rl_demo: 5 groups of 8 for mini-batches of 4 groups): the last mini-batch takes the rest."""
    cfg = _config(
        tmp_path / "run",
        "rollout.n=2",
        "algorithm.mini_batch_size=2",
        "algorithm.train_batch_size=4",
        "algorithm.allow_partial=true",
        "trainer.micro_batch_size=2",
    )
    cfg["_samples"] = 6  # 3 groups: mini-batches of 4 and 2 samples
    out = tmp_path / "update.json"
    start_ranks(_update_rank, args=(1, free_port(), cfg, str(out)), nprocs=1)
    stats = json.loads(out.read_text())["stats"]
    assert stats["optimizer_steps"] == 2 and stats["actor/tokens"] == 6 * 7


# -- tools failing mid-rollout ----------------------------------------------------------------------------
class ScriptedPolicy:
    """A stand-in policy that always writes one slow ``<code>`` call, then answers (no checkpoint here calls tools
    reliably). Everything after it is real: agent loop, tool pool, sandbox server, grader."""

    max_model_len = 4096

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.started = threading.Event()

    async def generate(self, prompt_ids, sampling, request_id):
        from afm_core.rollout.engine import Generation

        if "<observation>" not in self.tokenizer.decode(prompt_ids):
            text, stop = "<code>\nimport time\ntime.sleep(4)\nprint(42)\n</code>", "</code>"
            self.started.set()
        else:
            text, stop = "<answer>42</answer>", "</answer>"
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return Generation(ids, [-0.5] * len(ids), text, "stop", stop)

    async def close(self):
        pass


@pytest.mark.slow
def test_a_sandbox_killed_mid_rollout_gives_counted_error_observations_not_a_crash(tmp_path):
    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
    from afm_core.rollout import AgentTask
    from afm_core.rollout.factory import load_tokenizer
    from afm_core.tools.launcher import ServerGroup
    from tests.tools.conftest import jail_unavailable

    if jail_unavailable():
        pytest.skip(jail_unavailable())
    cfg = _config(tmp_path / "run", "tools.tools.code.limits.retries=1", "tools.tools.code.limits.timeout_s=20")
    hf_dir = ensure_hf_checkpoint(cfg["model"])
    tokenizer = load_tokenizer(hf_dir)
    policy = ScriptedPolicy(tokenizer)
    tasks = [
        (
            f"0:{i}",
            AgentTask(
                id=f"t{i}",
                task="math",
                prompt=f"What is 6 x 7? ({i})",
                question="6 x 7",
                answer="42",
                meta={"grader": "math"},
            ),
        )
        for i in range(2)
    ]
    with ServerGroup(log_dir=tmp_path / "servers") as group:
        group.launch("sandbox", ["--max-concurrency", "4"])
        urls = group.wait()
        actor = RolloutActor(as_rl_config(cfg).actor, hf_dir, tokenizer, urls, 4096, engine=policy)
        (sandbox,) = group.processes()

        def kill_when_calls_run():
            policy.started.wait(60)
            time.sleep(1.0)  # the calls are inside the sandbox now
            os.kill(sandbox.pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_when_calls_run)
        killer.start()
        try:
            groups = [Group(uid, i) for i, (uid, _) in enumerate(tasks)]
            round_ = actor.generate(groups, [task for _, task in tasks], n=2, stage=Stage(0, 1024, None), seed=0)
            samples = [s for g in round_.groups for s in g.samples()]
        finally:
            killer.join()
            actor.close()
    assert len(samples) == 4
    for s in samples:
        assert [name for name, _ in s.tool_calls] == ["code"] and s.tool_calls[0][1] is not None
        assert s.finish_reason == "answer" and s.score == 1.0  # the trajectory went on after the error
    metrics = rollout_metrics(samples, samples)
    assert metrics["tool_calls"] == {"code": 4} and metrics["tool_errors"] == {"code": 4}


# -- preemption during generation ----------------------------------------------------------------------------
class StuckPolicy:
    """A stand-in policy whose requests never finish by themselves (a 32B rollout of 30k tokens, in miniature):
    only an abort ends the round."""

    max_model_len = 4096

    def __init__(self):
        self.started = threading.Event()
        self.cancelled = 0
        self.settled = False

    async def generate(self, prompt_ids, sampling, request_id):
        import asyncio

        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def idle(self):  # InprocVLLMEngine: the aborts applied in vLLM
        self.settled = self.cancelled == 4

    async def close(self):
        pass


def test_sigusr2_while_a_round_generates_or_validates_aborts_every_request_of_the_round_at_once(tmp_path):
    from afm_core.engine.preemption import Preemption
    from afm_core.eval.benchmarks import Benchmark
    from afm_core.models.hf_checkpoint import ensure_hf_checkpoint
    from afm_core.rl.rounds import RolloutAborted
    from afm_core.rollout import AgentTask
    from afm_core.rollout.factory import load_tokenizer

    preemption = Preemption()  # the actor's own: nothing process-wide is set, nothing to reset
    relay = signal.signal(signal.SIGUSR2, lambda signum, frame: preemption.request())  # as jobs.rl's relay
    cfg = _config(tmp_path / "run")
    hf_dir = ensure_hf_checkpoint(cfg["model"])
    policy = StuckPolicy()
    actor = RolloutActor(
        as_rl_config(cfg).actor, hf_dir, load_tokenizer(hf_dir), {}, 4096, engine=policy, preemption=preemption
    )
    task = AgentTask(
        id="t", task="math", prompt="What is 6 x 7?", question="6 x 7", answer="42", meta={"grader": "math"}
    )
    sender = threading.Thread(target=lambda: policy.started.wait(60) and os.kill(os.getpid(), signal.SIGUSR2))
    sender.start()
    start = time.perf_counter()
    try:
        with pytest.raises(RolloutAborted):
            actor.generate([Group("0:0", 0), Group("0:1", 0)], [task], n=2, stage=Stage(0, 64, None), seed=0)
        sender.join()
        assert policy.cancelled == 4 and policy.settled and time.perf_counter() - start < 10
        assert preemption.stop_requested()  # still set: the driver clears it when it saves (boundary_flags)

        # validation during RL (2 problems x k=2, the eval job's loop) is aborted the same way
        preemption = Preemption()  # the next round's: a fresh object, not a reset flag
        actor.preemption = preemption
        policy.started.clear()
        policy.cancelled, policy.settled = 0, False
        sender = threading.Thread(target=lambda: policy.started.wait(60) and os.kill(os.getpid(), signal.SIGUSR2))
        sender.start()
        start = time.perf_counter()
        val_task = AgentTask(id="v", task="math", prompt="What is 6 x 7?", question="6 x 7", answer="42",
                             meta={"grader": "math", "benchmark": "val"})  # fmt: skip
        val = Benchmark("val", [val_task, val_task], {"k": 2})
        with pytest.raises(RolloutAborted, match="during validation"):
            actor.validate([val], replace(as_rl_config(cfg).val, k=2, max_response_tokens=64))
        assert policy.cancelled == 4 and policy.settled and time.perf_counter() - start < 10
    finally:
        sender.join()
        actor.close()
        signal.signal(signal.SIGUSR2, relay)


def test_a_step_whose_training_and_checkpoint_outlast_the_signal_lead_is_warned_about_once_per_new_worst(capsys):
    from afm_core.rl.checkpoint import StopLead

    lead = StopLead(120, enabled=True)
    lead.observe(1, trainer_s=50.0, checkpoint_s=30.0)  # 80 s: a stop in training is saved in time
    lead.observe(2, trainer_s=100.0, checkpoint_s=57.0)  # 157 s > 120: warned, with a lead that covers it
    lead.observe(3, trainer_s=90.0, checkpoint_s=57.0)  # shorter than step 2: not again
    out = capsys.readouterr().out
    assert out.count("warning") == 1 and "step 2" in out and "cluster.signal_delay_s=120" in out
    assert "set it to at least 295" in out  # 157 x 1.5 + 60


@needs_shared_data
@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-llama3"])
def test_one_rl_step_on_another_family_with_the_engine_serving_the_trainers_weights(tmp_path, model):
    """``recipe=rl_smoke`` for one rollout step on the tiny random Qwen3 (QK-norm, head_dim 32 at hidden 96) and
    Llama 3.x (llama3 RoPE scaling), fp32: generation in vLLM, a DAPO update of the Megatron model, the weight sync
    back into vLLM."""
    run_dir = tmp_path / "run"
    cfg = rl_config(
        run_dir,
        f"model={model}",
        "trainer.max_steps=1",
        "trainer.precision=fp32",
        "reward.mode=score",
        *plugin_overrides(run_dir, "distinct_chars"),
    )
    summary = run_rl_ranks(cfg)
    assert summary["step"] == 1 and not summary["stopped_early"]
    (record,) = _metrics(run_dir)
    assert record["optimizer_steps"] == 2 and record["logprob_gap_vllm_trainer"] <= LOGPROB_GAP["fp32"]
