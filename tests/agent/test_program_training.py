"""Training an agent program: the trainer plays it when the config names one
(env.name = "agent_program"), refuses what its episodes cannot do, and a smoke run of
configs/agent_program.py trains on its trajectories with the trainer's log-probs equal to the
sampler's."""

import os
import subprocess
import sys

import numpy as np
import openai
import pytest

from rl_tpu.agent import run_episodes
from rl_tpu.agent.program import play_programs, player_for
from rl_tpu.metrics import read_metrics
from rl_tpu.recipes.config import base_config, check, set_algo, set_env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))


def reply_length_agent(base_url: str, task: dict) -> float:
    """Two calls in one conversation, paid by the characters of the second reply (its
    tokens' texts differ in length): a reward a random tiny model's samples differ in, so
    every group has an advantage to train on."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": f"Say something about {task['a']}."}]
    first = client.chat.completions.create(model="m", messages=messages)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And more."}]
    second = client.chat.completions.create(model="m", messages=messages)
    return len(second.choices[0].message.content or "") / 40


def program_config():
    c = base_config("grpo")
    set_env(c, "agent_program", program="rl_tpu.envs.agent_programs:arithmetic_agent",
            tasks="rl_tpu.envs.agent_programs:arithmetic_tasks")
    return c


def test_the_trainer_plays_programs_only_for_the_agent_program_env():
    assert player_for(program_config(), run_episodes) is play_programs
    assert player_for(base_config("grpo"), run_episodes) is run_episodes


@pytest.mark.parametrize("key,value,match", [
    ("rollout.partial_token_budget", 16, "cannot be paused"),
    ("sft.steps", 5, "no teacher"),
    ("algo", "tl_grpo", "cannot be forked"),
    ("recipe", "selfplay", "its own game env"),
])
def test_what_a_program_cannot_do_is_refused(key, value, match):
    c = program_config()
    check(c)
    if key == "algo":
        set_algo(c, value)
    elif key == "recipe":
        c.recipe = value
    else:
        block, leaf = key.split(".")
        c[block][leaf] = value
    if key.startswith("rollout"):  # what partial rollouts need besides the budget
        c.rollout.max_staleness, c.rollout.deterministic = 1, False
    with pytest.raises(ValueError, match=match):
        check(c)


@pytest.mark.slow  # one launch.train run of 2 steps: ~60 s on 2 cores, mostly compiling
def test_a_program_trains_for_a_smoke_run_on_the_samplers_logprobs(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([REPO, HERE]))
    env.pop("XLA_FLAGS", None)
    out = subprocess.run(
        [sys.executable, "-m", "launch.train", "--config", "configs/agent_program.py:smoke",
         "--workdir", str(tmp_path),
         "--config.env.kwargs.program=test_program_training:reply_length_agent"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [r for r in read_metrics(str(tmp_path)) if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["rollout/turns"] == 2.0 and r["rollout/env_error_frac"] == 0.0
        assert r["train/skipped"] == 0 and np.isfinite(r["train/loss"])
        assert r["train/grad_norm"] > 0  # rewards differed within the groups: it trained
        # exp(trainer's log-prob - sampler's) on every sampled token: 1 within 1e-4
        assert abs(r["train/is_weight_mean"] - 1.0) < 1e-4
        assert r["train/is_truncated_frac"] == 0.0
    evals = [r for r in read_metrics(str(tmp_path)) if "eval/success" in r]
    assert [r["step"] for r in evals] == [0, 2] and all(r["eval/turns"] == 2.0 for r in evals)
