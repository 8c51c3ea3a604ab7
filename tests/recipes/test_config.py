"""The base config and `check`: env kwargs as typed keys, algo blocks that follow their name,
counts that make sense, every shipped config loads, and envs whose packages are missing."""

import glob
import importlib
import os
import subprocess
import sys

import pytest

from rl_tpu.core import env as envs
from rl_tpu.recipes import env_factory, placement
from rl_tpu.recipes.config import base_config, check, set_algo, set_env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# (config file, variant) of every shipped experiment; the smoke variants also build their env
VARIANTS = {"agentgym": ["babyai", "babyai,smoke", "textcraft,smoke", "sciworld,smoke",
                         "searchqa,smoke"],
            "bapo_offpolicy": ["", "smoke"], "quickstart": ["", "smoke", "sft_only"],
            "lora_largest": ["", "smoke", "full,lr3,seed1,smoke"],
            "real_gsm": ["", "smoke", "lora", "expert_iteration,smoke"]}


def load(name, variant):
    sys.path.insert(0, REPO)
    try:
        return importlib.import_module(f"configs.{name}").get_config(variant)
    finally:
        sys.path.remove(REPO)


def shipped():
    names = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(REPO, "configs/*.py")))
    return [(n, v) for n in names for v in VARIANTS.get(n, ["", "smoke"])]


@pytest.mark.parametrize("name,variant", shipped())
def test_every_config_loads_and_its_smoke_env_builds(name, variant):
    c = load(name, variant)
    if name == "math_sglang":  # its env needs a JSONL of problems, its engine servers
        c.rollout.urls = "http://127.0.0.1:1"
        if not variant:
            c.env.kwargs.path = "problems.jsonl"
    check(c)
    if "smoke" in variant:
        env_factory.make_env_factory(c)().close()


def test_real_gsm_trains_the_directory_get_model_writes():
    """configs/real_gsm.py names SmolLM2-135M-Instruct where `launch.get_model
    smollm2-135m-instruct` leaves it (the suite's real-model tests fetch it once a machine)."""
    from real_model import smollm2_dir
    assert load("real_gsm", "").model.path == smollm2_dir()
    assert load("real_gsm", "lora").model.lora.rank == 16


def test_env_kwargs_are_the_envs_own_with_their_types():
    c = base_config()
    assert c.env.kwargs.num_items == 5  # LargestEnv's default
    c.env.kwargs.num_items = 3
    with pytest.raises(TypeError):
        c.env.kwargs.num_items = "three"
    with pytest.raises(AttributeError, match="num_items"):
        c.env.kwargs.nm_items = 3
    set_env(c, "babyai", max_steps=10)
    assert c.env.kwargs.max_steps == 10 and isinstance(c.env.kwargs.levels, tuple)
    assert c.env.kwargs.is_locked


def test_a_kwarg_the_env_does_not_take_names_the_env_and_its_kwargs():
    with pytest.raises(ValueError, match=r"env 'largest' takes no keyword argument nm_items "
                                         r"\(its kwargs: .*num_items"):
        set_env(base_config(), "largest", nm_items=3)
    c = base_config()
    c.env.name = "countdown"  # without set_env: env.kwargs are still largest's
    with pytest.raises(ValueError, match="env.kwargs .*num_items.*set_env"):
        check(c)


def test_a_kwarg_the_env_needs_is_named():
    c = base_config()
    set_env(c, "math")
    with pytest.raises(ValueError, match="env 'math' needs the keyword argument path"):
        check(c)


def test_check_refuses_an_algo_block_left_from_another_algorithm():
    c = base_config("grpo")
    c.algo.name = "ppo"
    with pytest.raises(ValueError, match="algo.name='ppo' but the algo block holds 'grpo'.*"
                                         "algo.advantage='grpo'.*set_algo"):
        check(c)
    set_algo(c, "ppo", {"clip_high": 0.3})
    check(c)
    assert (c.algo.advantage, c.algo.clip_high, c.algo.lam) == ("gae", 0.3, 0.95)
    c.algo.advantage = "grpo"  # one key set on purpose: no longer grpo's whole block
    check(c)


@pytest.mark.parametrize("settings,message", [
    ({"ratio_against": "behaviour", "behaviour_is": "truncate"}, "would correct twice"),
    ({"dual_clip": 0.5}, "dual_clip=0.5 must be > 1"),
    ({"behaviour_is": "clip"}, "unknown behaviour_is 'clip'"),
    ({"behaviour_is_level": "row"}, "unknown behaviour_is_level 'row'"),
    ({"logprob_gap_threshold": 0.0}, "logprob_gap_threshold=0.0 must be > 0")])
def test_check_runs_the_policy_loss_checks_at_start_up(settings, message):
    c = base_config("grpo")
    for key, value in settings.items():
        c.algo[key] = value
    with pytest.raises(ValueError, match=f"^algo: .*{message}"):
        check(c)


@pytest.mark.parametrize("key,value", [
    ("train.steps", -5), ("train.tasks_per_step", 0), ("train.samples_per_task", 0),
    ("train.epochs", 0), ("train.minibatches", 0), ("train.micro_batches", 0),
    ("eval.num_tasks", 0), ("sft.steps", -1), ("checkpoint.keep", 0),
    ("rollout.sampler_tensor", -1), ("rollout.prefill_chunk", -2)])
def test_check_refuses_counts_that_make_no_sense(key, value):
    c = base_config()
    block, leaf = key.split(".")
    c[block][leaf] = value
    with pytest.raises(ValueError, match=f"{key}={value} must be >= "):
        check(c)


@pytest.mark.parametrize("key,value,message", [
    ("env.max_new_tokens", 0, "env.max_new_tokens=0 must be >= 1"),
    ("env.max_new_tokens", -3, "env.max_new_tokens=-3 must be >= 1"),
    ("env.max_turns", 0, "env.max_turns=0 must be >= 1"),
    ("eval.max_turns", -1, "eval.max_turns=-1 must be >= 0"),
    ("eval.pass_k", -2, "eval.pass_k=-2 must be >= 0"),
    ("seed", 2**64 + 1, r"seed=18446744073709551617 must be in \[0, 2\*\*31\)"),
    ("seed", 2**32, r"seed=4294967296 must be in \[0, 2\*\*31\)"),
    ("seed", -1, r"seed=-1 must be in \[0, 2\*\*31\)"),
    ("algo.kl_coef", -1.0, r"algo.kl_coef=-1.0 must be >= 0 \(0 = off\)"),
    ("algo.reward_kl_coef", -0.1, "algo.reward_kl_coef=-0.1 must be >= 0"),
    ("algo.value_clip", -0.2, "algo.value_clip=-0.2 must be >= 0"),
    ("algo.overlong_penalty", -1.0, "algo.overlong_penalty=-1.0 must be >= 0"),
    ("algo.overlong_buffer", -4, "algo.overlong_buffer=-4 must be >= 0"),
    ("algo.max_refill_rounds", -1, "algo.max_refill_rounds=-1 must be >= 0"),
    ("algo.gamma", 2.0, r"algo.gamma=2.0 must be in \[0, 1\]"),
    ("algo.lam", -1.0, r"algo.lam=-1.0 must be in \[0, 1\]"),
    ("algo.std_ddof", 2, "algo.std_ddof=2: choose 1"),
    ("env.step_timeout_s", 0.0, "env.step_timeout_s=0.0 must be > 0"),
    ("env.step_latency_s", -1.0,
     "env.step_timeout_s=60.0 must be > 0 and env.step_latency_s=-1.0 >= 0"),
    ("train.replay.max_staleness", 0, "train.replay.max_staleness=0 must be >= 1"),
    ("train.replay.capacity", -1, "train.replay.capacity=-1 must be >= 0")])
def test_check_refuses_numbers_out_of_their_range_at_start(key, value, message):
    """Each of these was accepted and then trained on nonsense or failed only after the run
    had compiled and written (env.max_new_tokens=0 with a traceback, a seed past 2**64 with an
    OverflowError)."""
    c = base_config()
    *blocks, leaf = key.split(".")
    node = c
    for block in blocks:
        node = node[block]
    node[leaf] = value
    with pytest.raises(ValueError, match=f"^{message}"):
        check(c)


@pytest.mark.parametrize("key,value,shown", [
    ("optim.lr", float("nan"), "optim.lr=nan"), ("algo.clip_high", float("inf"),
                                                "algo.clip_high=inf"),
    ("optim.grad_clip", float("-inf"), "optim.grad_clip=-inf")])
def test_check_refuses_a_number_that_is_not_finite_naming_the_key(key, value, shown):
    c = base_config()
    block, leaf = key.split(".")
    c[block][leaf] = value
    with pytest.raises(ValueError, match=f"^{shown}: config values must be finite numbers"):
        check(c)


def test_check_names_every_non_finite_number_even_nested_in_lists():
    c = base_config()
    c.optim.lr = float("nan")
    c.env.kwargs = {"weights": [1.0, float("inf")]}
    with pytest.raises(ValueError, match=r"^env.kwargs.weights\[1\]=inf, optim.lr=nan: .*give "
                                         "those keys a finite value"):
        check(c)


def test_a_nan_override_fails_the_launch_in_one_line_leaving_no_files(tmp_path):
    workdir = tmp_path / "run"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    result = subprocess.run(
        [sys.executable, "-m", "launch.train", "--config", "configs/quickstart.py:smoke",
         "--workdir", str(workdir), "--config.optim.lr=nan"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "optim.lr=nan" in lines[0], result.stderr[-2000:]
    assert not workdir.exists() or not os.listdir(workdir)


@pytest.mark.parametrize("text", ["256x512", "4x16x0", "4xfoo x16"])
def test_check_refuses_a_malformed_warmup_list_naming_the_part(text):
    c = base_config()
    c.rollout.warmup = f"8x16x16,{text}"
    with pytest.raises(ValueError, match=r"rollout.warmup=.*is not ROWSxPROMPTxNEW"):
        check(c)
    c.rollout.warmup = "8x16x16, 2x4096x512"
    check(c)


def test_zero_rl_steps_is_an_sft_only_run_and_nothing_at_all_is_refused():
    c = base_config()
    c.train.steps, c.sft.steps = 0, 10
    check(c)
    c.sft.steps = 0
    with pytest.raises(ValueError, match="nothing would be trained"):
        check(c)


def test_an_env_whose_package_is_missing_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "minigrid", None)  # what `import minigrid` sees uninstalled
    with pytest.raises(ModuleNotFoundError, match=r"'babyai' needs the Python package "
                                                  r"'minigrid'.*pip install 'rl_tpu\[envs\]'"):
        envs.make("babyai")


def test_a_router_url_needs_sglang_workers_and_a_url():
    c = base_config()
    c.rollout.router_url = "http://127.0.0.1:30000"
    with pytest.raises(ValueError, match="router_url needs rollout.engine='sglang'"):
        check(c)
    c.rollout.engine, c.rollout.urls = "sglang", "http://127.0.0.1:30001"
    check(c)
    c.rollout.router_url = "http://router"  # no port
    with pytest.raises(ValueError, match="rollout.router_url: .*http://host:port"):
        check(c)


def test_an_asynchronous_run_on_one_device_shares_it_between_sampler_and_learner():
    # a plain CPU (no XLA flags) has one device: bapo_offpolicy's smoke (max_staleness=2)
    import jax
    c = load("bapo_offpolicy", "smoke")
    assert c.rollout.max_staleness == 2 and c.rollout.engine == "jax"
    one = jax.devices()[:1]
    assert placement.split_devices(c, one, 0) == (one, one)
    c.rollout.sampler_devices = 1
    assert placement.split_devices(c, one, 0) == (one, one)
    c.rollout.sampler_devices = 2
    with pytest.raises(ValueError, match=r"rollout.sampler_devices=2, but this host has 1 "
                                         r"device\(s\).* Set rollout.sampler_devices to 0 "):
        placement.split_devices(c, one, 0)
    c.rollout.sampler_devices = 0  # two or more devices: each gets its own, as before
    learner, sampler = placement.split_devices(c, jax.devices()[:2], 0)
    assert [d.id for d in sampler] == [0] and [d.id for d in learner] == [1]
    c.rollout.sampler_devices = 2
    with pytest.raises(ValueError, match=r"Set rollout.sampler_devices to 0 \(half of them\) "
                                         r"or 1 <= rollout.sampler_devices < 2"):
        placement.split_devices(c, jax.devices()[:2], 0)


def test_presets_and_the_smoke_shrinker_by_hand():
    from rl_tpu.recipes.config import (largest_task, shrink_for_smoke, single_turn_reasoning,
                                       tiny_model_warm_start)
    # buckets up to the power of two holding the context: 1536 -> 2048, a quarter and a half
    c = single_turn_reasoning(base_config(), "largest", max_new_tokens=1024,
                              max_context_tokens=1536)
    assert c.train.length_buckets == (512, 1024, 2048) and c.model.remat == "dots"
    c = single_turn_reasoning(base_config(), "largest", max_new_tokens=8, max_context_tokens=4096)
    assert c.train.length_buckets == (1024, 2048, 4096)
    # a tiny model's rows: one bucket up to 128 tokens, else a half and the whole
    c = tiny_model_warm_start(base_config(), context_tokens=256, sft_steps=7, num_demos=9,
                              teacher_skill=0.5)
    assert c.train.length_buckets == (128, 256) and c.sft.max_length == 256
    assert (c.sft.steps, c.sft.num_demos, c.sft.teacher_skill) == (7, 9, 0.5)
    assert largest_task(base_config()).train.length_buckets == (64,)
    # smoke: new tokens and turns only ever shrink; a context gives two buckets and SFT's limit
    c = largest_task(base_config())
    c.env.max_turns, c.eval.max_turns, c.schedules.horizon_turns = 6, 5, (3, 6)
    shrink_for_smoke(c, warm_start_steps=4, context_tokens=512, eval_tasks=3)
    assert c.env.max_new_tokens == 4 and (c.env.max_turns, c.eval.max_turns) == (2, 2)
    assert c.schedules.horizon_turns == (2, 2)
    assert c.train.length_buckets == (256, 512) and c.sft.max_length == 512
    assert (c.sft.steps, c.sft.batch_size, c.eval.num_tasks) == (4, 16, 3)
    assert (c.train.steps, c.train.tasks_per_step, c.loop.rounds) == (2, 2, 2)
    check(c)
    c = shrink_for_smoke(base_config())
    assert c.sft.steps == 0 and c.env.max_new_tokens == 8 and c.eval.max_turns == 0


@pytest.mark.parametrize("overrides, message", [
    ({"reward_model.eval_fraction": 1.0}, r"reward_model.eval_fraction=1.0 must be in \[0, 1\)"),
    ({"reward_model.ssrm_threshold": 0.4}, r"ssrm_threshold=0.4 must be in \[0.5, 1\]"),
    ({"reward_model.batch_size": 0}, r"reward_model.batch_size=0 must be >= 1"),
    ({"reward_model.lr": 0.0}, r"lr=0.0 > 0"),
    ({"recipe": "reward_model", "loop.samples_per_task": 1}, r"loop.samples_per_task >= 2"),
    ({"reward.model_transform": "tanh"}, r"reward.model_transform='tanh'"),
    ({"reward.model_path": "/rm", "recipe": "sft"}, r"not by recipe='sft'"),
    ({"reward.model_path": "/rm", "recipe": "dpo", "dpo.data_path": "p.jsonl"},
     r"offline pairs \(dpo.data_path\)"),
])
def test_reward_blocks_refuse_what_cannot_run(overrides, message):
    c = base_config()
    for key, value in overrides.items():
        block, _, leaf = key.partition(".")
        if leaf:
            c[block][leaf] = value
        else:
            c[key] = value
    with pytest.raises(ValueError, match=message):
        check(c)
    ok = base_config()
    ok.reward.model_path, ok.recipe = "/rm", "dpo"  # online DPO ranks by the model
    check(ok)
