"""The summary line a run prints once its model is loaded (rl_tpu/recipes/run_summary.py),
built from a real tiny model as the trainer loads it: every field a user checks a config by,
and LoRA said to be on or off in words (configs/lora_largest.py:smoke trains LoRA)."""

import jax
import pytest

from rl_tpu.models import lora
from rl_tpu.recipes import placement, policy_io, run_summary
from test_config import load


def _loaded(config, workdir):
    path = policy_io.model_path(config, str(workdir))
    model_cfg, _, params, _ = policy_io.load_policy(config, path, placement.make_mesh(config))
    return path, model_cfg, params


def test_lora_largest_smoke_trains_lora_and_its_summary_says_the_rank(tmp_path, capsys):
    config = load("lora_largest", "smoke")
    assert config.model.lora.rank == 8  # a bare smoke trains what the file is about
    assert load("lora_largest", "full,smoke").model.lora.rank == 0
    assert load("lora_largest", "r32,smoke").model.lora.rank == 32
    path, model_cfg, params = _loaded(config, tmp_path)
    line = run_summary.announce(config, path, model_cfg, params,
                                run_summary.warm_start_plan(config))
    assert capsys.readouterr().out == line + "\n"
    n, kind = len(jax.devices()), jax.devices()[0].device_kind
    base = model_cfg.replace(lora=None).num_params()
    assert line == (
        f"run: recipe rl, algorithm grpo, model {path} ({model_cfg.arch}, "
        f"{run_summary.short_count(base)} params), LoRA rank 8 "
        f"({run_summary.short_count(lora.adapter_count(params))} trainable), "
        f"engine jax sampler, env largest, devices {n} x {kind} on 1 host, "
        f"warm start 4 SFT steps on {config.sft.num_demos} teacher demos")


def test_a_full_fine_tune_says_lora_is_off_and_a_resume_skips_the_warm_start(tmp_path):
    config = load("quickstart", "smoke")
    config.rollout.engine, config.rollout.urls = "sglang", "http://a:1,http://b:2"
    path, model_cfg, params = _loaded(config, tmp_path)
    line = run_summary.describe(config, path, model_cfg, params, run_summary.warm_start_plan(
        config, done="none (resuming at step 3)"))
    assert f"({model_cfg.arch}, {run_summary.short_count(model_cfg.num_params())} params)" in line
    assert ", full fine-tuning (LoRA off: model.lora.rank=0), " in line
    assert ", engine sglang (2 servers), " in line
    assert line.endswith(", warm start none (resuming at step 3)")


@pytest.mark.parametrize("recipe,algorithm", [("sft", "sft"), ("dpo", "ipo"),
                                              ("expert_iteration", "filtered sft"),
                                              ("rloop", "grpo")])
def test_the_algorithm_is_the_recipes_own_where_it_has_no_rl_algorithm(recipe, algorithm):
    config = load("quickstart", "smoke")
    config.recipe, config.dpo.loss = recipe, "ipo"
    assert run_summary.algorithm(config) == algorithm


def test_the_warm_start_plan_names_its_steps_and_data_or_none():
    config = load("quickstart", "smoke")
    config.sft.steps = 0
    assert run_summary.warm_start_plan(config) == "none (sft.steps=0)"
    config.sft.steps, config.sft.data_path = 30, "/data/chats.jsonl"
    assert run_summary.warm_start_plan(config) == "30 SFT steps on /data/chats.jsonl"
