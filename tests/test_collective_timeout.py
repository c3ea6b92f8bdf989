"""B5: the collective timeout outlasts the longest rollout a rank can wait for at a collective (it was a fixed
30 minutes against ``rollout.timeout_s`` = 3600 s in the 32B RL recipes)."""

from __future__ import annotations

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from afm_core.config import check_config, register_schemas
from afm_core.config.checks import ConfigError
from afm_core.config.rl import RLConfig
from afm_core.config.timeouts import collective_timeout_min, rollout_wait_s
from afm_core.utils.paths import repo_root
from afm_core.utils.ports import free_port
from tests.gloo_env import set_rank_env_for_test


def _rl(*overrides: str):
    register_schemas()
    with initialize_config_dir(config_dir=str(repo_root() / "conf"), version_base="1.3"):
        return compose(config_name="rl", overrides=["run_dir=/tmp/run", "data.files=[p.parquet]", *overrides])


def test_the_32b_rl_recipes_get_a_collective_timeout_longer_than_their_rollouts():
    for recipe in ("afm_code_rl_32b", "afm_web_rl_32b"):
        cfg = _rl(f"recipe={recipe}")
        wait = rollout_wait_s(cfg.rollout, cfg.algorithm.gen_batch_size)
        assert wait >= cfg.rollout.timeout_s == 3600
        assert collective_timeout_min(wait) * 60 > wait > 30 * 60


def test_an_explicit_collective_timeout_shorter_than_the_rollout_is_rejected_naming_both():
    try:
        check_config(_rl("recipe=afm_code_rl_32b", "parallel.collective_timeout_min=30"), RLConfig)
    except ConfigError as err:
        assert "parallel.collective_timeout_min=30" in str(err) and "rollout.timeout_s=3600" in str(err)
    else:
        raise AssertionError("a 30 min collective timeout passed against 3600 s rollouts")


def test_init_distributed_gives_every_process_group_the_configured_timeout(monkeypatch):
    from megatron.core import parallel_state as ps

    from afm_core.engine.distributed import destroy_distributed, init_distributed

    set_rank_env_for_test(monkeypatch, free_port())
    init_distributed(OmegaConf.create({"tp": 1, "pp": 1, "collective_timeout_min": 130}), seed=1, num_threads=1)
    try:
        cpu = torch.device("cpu")
        for group in (torch.distributed.distributed_c10d._get_default_group(), ps.get_data_parallel_group()):
            assert group._get_backend(cpu).options._timeout.total_seconds() == 130 * 60
    finally:
        destroy_distributed()
