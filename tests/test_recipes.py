"""The paper recipes compose, carry the upstream hyper-parameters, fit the GPUs they name, and document the peak
memory that ``jobs.plan`` computes (so the numbers in the YAML comments cannot drift from the code)."""

import re

import pytest
from hydra import compose, initialize_config_dir

from afm_core.config import register_schemas
from afm_core.launch.plan import make_plan, plan_config
from afm_core.launch.plan_render import render
from afm_core.utils.paths import repo_root

RECIPES = {
    # recipe: (model, lr, global batch, seq_length, warmup_ratio, epochs)
    "afm_web_sft_32b": ("qwen2.5-32b-instruct", 1.4e-5, 128, 32768, 0.1, 4),
    "afm_code_sft_7b": ("qwen2.5-coder-7b-instruct", 3e-5, 32, 32768, 0.0, 2),
    "afm_code_sft_32b": ("qwen2.5-coder-32b-instruct", 1.4e-5, 64, 32768, 0.0, 2),
    "afm_mhqa_sft_3b": ("qwen2.5-3b-instruct", 1e-5, 128, 5120, 0.03, 4),
    "afm_web_sft_qwen3_32b": ("qwen3-32b", 1.4e-5, 128, 32768, 0.1, 4),
    "afm_mhqa_sft_llama3_8b": ("llama-3.1-8b-instruct", 1e-5, 128, 5120, 0.03, 4),
}


def _compose(overrides):
    register_schemas()
    with initialize_config_dir(config_dir=str(repo_root() / "conf"), version_base="1.3"):
        return compose(config_name="sft", overrides=overrides)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_hyperparameters_and_documented_memory_and_it_fits_its_gpus(recipe):
    model, lr, global_batch, seq_length, warmup, epochs = RECIPES[recipe]
    cfg = _compose([f"recipe={recipe}"])
    assert cfg.model.name == model
    assert (cfg.optim.lr, cfg.trainer.global_batch_size, cfg.trainer.seq_length) == (lr, global_batch, seq_length)
    assert (cfg.optim.warmup_ratio, cfg.trainer.epochs, cfg.trainer.max_steps) == (warmup, epochs, None)
    world = cfg.cluster.nodes * cfg.cluster.tasks_per_node
    assert world % (cfg.parallel.tp * cfg.parallel.pp) == 0
    text = (repo_root() / "conf" / "recipe" / f"{recipe}.yaml").read_text()
    documented = float(re.search(r"memory: ([\d.]+) GiB/GPU peak on 80 GB GPUs", text).group(1))
    plan = make_plan(plan_config("sft", [f"recipe={recipe}"]))  # checked as jobs.sft checks it
    assert plan["gpus"]["80"]["peak_gib"] == documented, render(plan)
    assert cfg.cluster.gpu_memory_gb == 80 and plan["fits"] is True, render(plan)


def test_command_line_overrides_win_over_recipe():
    cfg = _compose(["recipe=afm_web_sft_32b", "optim.lr=2e-5"])
    assert cfg.optim.lr == 2e-5


#: LoRA recipe: (app, its full-layout counterpart recipe or None)
LORA_RECIPES = {"afm_web_sft_32b_lora": ("sft", None), "afm_web_rl_32b_lora": ("rl", "afm_web_rl_32b")}


@pytest.mark.parametrize("recipe", sorted(LORA_RECIPES))
def test_lora_recipe_fits_and_documents_its_peak_beside_the_full_layouts(recipe):
    """32B LoRA SFT on one 8 x 80 GB node (the full layout of its settings does not fit), and 32B LoRA RL at the
    32k stage (prompt 2k + response 30k) beside afm_web_rl_32b's full layout, the weight sync's ratio stated."""
    app, full_recipe = LORA_RECIPES[recipe]
    text = (repo_root() / "conf" / "recipe" / f"{recipe}.yaml").read_text()
    documented = float(re.search(r"memory: ([\d.]+) GiB/GPU peak on 80 GB GPUs: fits", text).group(1))
    documented_full = float(re.search(r"the full layout of these settings: ([\d.]+) GiB/GPU", text).group(1))
    plan = make_plan(plan_config(app, [f"recipe={recipe}", "cluster.checkpoint_write_gb_s=1.0"]))
    lora = plan["lora"]["per_gpu"]["80"]
    assert plan["fits"] is True and plan["gpus"]["80"]["peak_gib"] == lora["lora_peak_gib"] == documented, render(plan)
    assert lora["full_peak_gib"] == documented_full, render(plan)
    if app == "sft":
        lay = plan["layout"]
        assert (lay["nodes"], lay["gpus_per_node"], lay["world_size"]) == (1, 8, 8) and not lora["full_fits"]
    else:
        assert plan["layout"]["seq_length"] == 32768
        ratio = float(re.search(r"the weight sync moves[\s#]+([\d.]+)% of the full sync's bytes", text).group(1))
        assert round(100 * plan["lora"]["weight_sync"]["ratio"], 2) == ratio, render(plan)
        # the full layout planned beside it is the full recipe's: the same groups but for the adapters and the lr
        full, lora_job = plan_config(app, [f"recipe={full_recipe}"]), plan_config(app, [f"recipe={recipe}"])
        for group in ("parallel", "cluster", "rollout", "engine", "data", "trainer", "algorithm", "colocation"):
            assert getattr(full, group) == getattr(lora_job, group), group
