"""A judge's verdict as a reward: the judge's prompt, a reply without a verdict kept out of the
loss (never a silent 0), and, end to end, a frozen judge fine-tuned to approve paying every
rollout of an RL run."""

import json
import math
import os
import string
import subprocess
import sys

import numpy as np
import pytest

from rl_tpu.core.trajectory import Trajectory
from rl_tpu.metrics import read_metrics
from rl_tpu.models import tiny
from rl_tpu.models.tokenizer import load_tokenizer
from rl_tpu.rewards.judge import pairwise_messages, pointwise_messages
from rl_tpu.rewards.judge_reward import JudgeReward, question_and_reply, ring_pairs, win_rates
from rl_tpu.rewards.mix import RewardMix, source_metrics
from rl_tpu.rollout.sampler import JaxSampler
from rl_tpu.train.rollout_batch import NO_LOSS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REPLY_CHARS = string.ascii_letters + string.digits + " .,:;?!'-()[]"
MESSAGES = [{"role": "system", "content": "Reply with the largest number."},
            {"role": "user", "content": "Which number is largest? 3 7 2"},
            {"role": "assistant", "content": "3"},
            {"role": "user", "content": "No: 7 was."},
            {"role": "assistant", "content": "7"}]


def test_the_judge_sees_the_task_and_the_final_reply():
    assert question_and_reply(MESSAGES) == ("Which number is largest? 3 7 2", "7")
    with pytest.raises(ValueError, match="no assistant reply"):
        question_and_reply(MESSAGES[:2])


def trajectory(messages, reward, group=0):
    return Trajectory(tokens=np.asarray([5, 6, 7], np.int32), loss_mask=np.ones(3, bool),
                      behaviour_logprobs=np.zeros(3, np.float32), turn_ids=np.zeros(3, np.int32),
                      rewards=[reward], reward=reward, success=reward > 0, num_turns=1,
                      weight_versions=[0], task_id="t", group_id=group, finish="stop",
                      messages=messages, info={})


def cpu_env():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    env.pop("XLA_FLAGS", None)
    return env


@pytest.fixture(scope="module")
def random_judge(tmp_path_factory):
    """A tiny random model as the judge: what it says is no verdict."""
    path = str(tmp_path_factory.mktemp("judge"))
    cfg = tiny.write_tiny_model(path, hidden_size=32, intermediate_size=64, num_layers=1,
                                head_dim=8, init_scale=0.2)
    tokenizer = load_tokenizer(path)
    sampler = JaxSampler(cfg, tiny.random_params(cfg, seed=0, scale=0.2), tokenizer=tokenizer,
                         max_batch=8)
    return JudgeReward(sampler, tokenizer, max_new_tokens=8), tokenizer


def test_no_verdict_keeps_the_row_out_of_the_loss_and_is_counted(random_judge):
    judge, tokenizer = random_judge
    traj = trajectory(MESSAGES, 1.0)
    assert judge.prompt_ids(traj) == tokenizer.apply_chat_template(
        pointwise_messages("Which number is largest? 3 7 2", "7"), add_generation_prompt=True)
    trajs = [trajectory(MESSAGES, 1.0), trajectory(MESSAGES[:3], 0.0)]
    verdicts = judge.judge(trajs)
    assert [v.value for v in verdicts] == [None, None], [v.raw for v in verdicts]
    RewardMix(None, rule_weight=0.5, model_weight=0.0, judge=judge, judge_weight=2.0).apply(trajs)
    for traj, rule in zip(trajs, (1.0, 0.0)):
        assert traj.info[NO_LOSS] and traj.info["judge_error"].startswith("no verdict")
        assert math.isnan(traj.info["reward_sources"]["judge"])
        assert traj.reward == 0.5 * rule  # the rule's part only: the judge paid nothing
    metrics = source_metrics(trajs, ("rule", "judge"))
    assert metrics == {"rollout/reward_rule": 0.5, "rollout/reward_judge": 0.0,
                       "rollout/judge_unparsed": 1.0}
    with pytest.raises(ValueError, match="a reward model or a judge"):
        RewardMix(None, 1.0, 1.0)


def test_pairwise_compares_each_group_around_a_ring_and_pays_win_rates():
    groups = [0, 0, 0, 7, 7, 9]  # a group of three, of two, of one
    trajs = [trajectory(MESSAGES, 0.0, g) for g in groups]
    pairs = ring_pairs(trajs)
    assert pairs == [(0, 1), (1, 2), (2, 0), (3, 4)]
    # 0 beats 1, 1 vs 2 has no verdict, 0 beats 2; 4 beats 3
    rates = win_rates(6, pairs, [0, None, 0, 4])
    assert rates == [1.0, 0.0, 0.0, 0.0, 1.0, None]  # 5 was compared with no one


def test_pairwise_prompt_and_no_verdicts(random_judge):
    judge, tokenizer = random_judge
    pairwise = JudgeReward(judge.engine, tokenizer, max_new_tokens=8, mode="pairwise")
    a, b = trajectory(MESSAGES, 1.0), trajectory(MESSAGES[:3], 0.0)
    assert pairwise.prompt_ids(a, b) == tokenizer.apply_chat_template(
        pairwise_messages("Which number is largest? 3 7 2", "7", "3"),
        add_generation_prompt=True)
    rewards, errors = pairwise.rewards([a, b])
    assert rewards == [None, None] and all(e.startswith("no verdict") for e in errors)


def test_an_episode_without_a_reply_is_never_put_to_the_judge(random_judge):
    judge, tokenizer = random_judge
    pairwise = JudgeReward(judge.engine, tokenizer, max_new_tokens=8, mode="pairwise")
    for mode in (judge, pairwise):
        failed = trajectory(MESSAGES[:2], 0.0)  # reset gave the task, no reply came
        failed.tokens, failed.loss_mask = np.asarray([5], np.int32), np.zeros(1, bool)
        no_transcript = trajectory([], 0.0)  # the env failed at reset: nothing at all
        no_transcript.tokens, no_transcript.loss_mask = (np.zeros(0, np.int32),
                                                         np.zeros(0, bool))
        trajs = [trajectory(MESSAGES, 1.0), failed, no_transcript, trajectory(MESSAGES, 0.0)]
        RewardMix(None, rule_weight=1.0, model_weight=0.0, judge=mode).apply(trajs)
        for traj in (failed, no_transcript):
            assert traj.info[NO_LOSS] and "before the policy replied" in traj.info["reward_error"]
            assert "judge" not in traj.info["reward_sources"]  # not counted as unparsed
        assert all(math.isnan(t.info["reward_sources"]["judge"]) for t in (trajs[0], trajs[3]))
        assert source_metrics(trajs, ("rule", "judge"))["rollout/judge_unparsed"] == 0.5
    # the judge alone, handed a transcript with no reply: no verdict, no exception
    [verdict] = judge.judge([trajectory(MESSAGES[:2], 0.0)])
    assert verdict.value is None and "no assistant reply" in verdict.error
    rewards, errors = pairwise.rewards([trajectory(MESSAGES[:2], 0.0),
                                        trajectory(MESSAGES, 1.0)])
    assert rewards == [None, None] and "no task or no reply" in errors[0]


@pytest.mark.slow
def test_a_frozen_judge_that_approves_pays_every_rollout(tmp_path):
    """A tiny model fine-tuned (from its random start) to answer every judgement [[YES]]
    judges an RL run's rollouts: each is paid judge_weight, none is unparsed."""
    chats = tmp_path / "approve.jsonl"
    with open(chats, "w") as f:
        rng = np.random.RandomState(0)
        for i in range(128):  # replies of every kind a barely trained policy gives
            numbers = rng.randint(0, 10, 5)
            question = "Which number is largest? " + " ".join(map(str, numbers))
            # a policy's reply is any few tokens, decoded: text of any letters and marks
            reply = ("".join(rng.choice(list(REPLY_CHARS), rng.randint(0, 20)))
                     if i % 2 else str(numbers[i % 5]))
            messages = pointwise_messages(question, reply)
            f.write(json.dumps({"messages": messages + [
                {"role": "assistant", "content": "[[YES]]"}]}) + "\n")
    judge_dir = tmp_path / "judge"
    run = subprocess.run([sys.executable, "-m", "launch.sft", "--config",
                          "configs/quickstart.py:smoke", "--workdir", str(judge_dir),
                          # these chats are 159-181 tokens: 256 pads them to one short
                          # bucket (1024 made every step four times the work)
                          f"--config.sft.data_path={chats}", "--config.sft.steps=150",
                          "--config.sft.max_length=256", "--config.sft.lr=3e-3"],
                         cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    rl_dir = tmp_path / "rl"
    run = subprocess.run([sys.executable, "-m", "launch.train", "--config",
                          "configs/quickstart.py:smoke", "--workdir", str(rl_dir),
                          "--config.log.plot=False", "--config.reward.judge=pointwise",
                          f"--config.reward.judge_model_path={judge_dir / 'final_hf'}",
                          "--config.reward.judge_weight=2.0", "--config.reward.rule_weight=0"],
                         cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    steps = [r for r in read_metrics(str(rl_dir)) if "rollout/reward_judge" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["rollout/judge_unparsed"] == 0.0 and r["rollout/reward_judge"] == 1.0
        assert r["rollout/reward"] == pytest.approx(2.0)
