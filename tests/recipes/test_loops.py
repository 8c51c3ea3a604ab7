"""The loops around the update: expert iteration, RLoop, DPO; the experience they keep, SFT's
checkpointable batches, and exact resume of an SFT run and an RLoop run after kill -9."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from test_rl import REPO, _cpu_env, _finite, config, kill_mid_run

from rl_tpu.metrics import read_metrics
from rl_tpu.recipes import dpo, sft
from rl_tpu.recipes.experience import ExpertSet
from rl_tpu.core.trajectory import Trajectory


def _traj(task, tokens, reward, success=None, finish="stop"):
    n = len(tokens)
    mask = np.array([False] + [True] * (n - 1))
    return Trajectory(tokens=np.array(tokens, np.int32), loss_mask=mask,
                      behaviour_logprobs=np.zeros(n, np.float32),
                      turn_ids=np.array([-1] + [0] * (n - 1), np.int32), rewards=[reward],
                      reward=reward, success=reward >= 1 if success is None else success,
                      num_turns=1, weight_versions=[0], task_id=task, group_id=0,
                      finish=finish, messages=[], info={})


# ----------------------------------------------------------------------------- experience


def _expert_set():
    expert = ExpertSet(reward_threshold=1.0)
    kept = expert.add([
        _traj("easy", [1, 2], 1.0), _traj("easy", [1, 3], 1.0), _traj("easy", [1, 2], 1.0),
        _traj("hard", [4, 5], 1.0), _traj("hard", [4, 6], 0.0), _traj("hard", [4, 7], 0.0),
        _traj("hard", [4, 8], 0.5), _traj("never", [9, 9], 0.0),
        _traj("broken", [7, 7], 1.0, finish="env_error")])
    return expert, kept


def test_expert_set_keeps_distinct_passing_samples_and_counts_every_try():
    expert, kept = _expert_set()
    # easy: [1,2] and [1,3] (the second [1,2] is a duplicate); hard: [4,5]; the env error's
    # reward counts as a pass but its sample is not kept
    assert kept == 3
    assert expert.tried == {"easy": 3, "hard": 4, "never": 1, "broken": 1}
    assert expert.solved == {"easy": 3, "hard": 1, "broken": 1}
    assert expert.success_rate("hard") == 0.25 and expert.success_rate("never") == 0.0
    m = expert.metrics()
    assert m["loop/sampled"] == 9 and m["loop/kept"] == 3 and m["loop/tasks_solved"] == 2
    assert m["loop/pass_rate"] == 5 / 9  # rewards >= 1: 3 easy, 1 hard, 1 broken
    assert m["loop/sampled_tokens"] == 9  # one generated token each


def test_expert_set_gives_the_hardest_tasks_first_under_the_caps():
    expert, _ = _expert_set()
    # hard (1/4 solved) before easy (3/3)
    assert [ids for ids, _ in expert.examples()] == [[4, 5], [1, 2], [1, 3]]
    assert [ids for ids, _ in expert.examples(max_per_task=1)] == [[4, 5], [1, 2]]
    assert [ids for ids, _ in expert.examples(max_examples=2)] == [[4, 5], [1, 2]]
    assert expert.examples()[0][1] == [False, True]  # the loss mask of the policy's ids


def test_expert_set_state_round_trips_and_merges_without_duplicates():
    expert, _ = _expert_set()
    back = ExpertSet.from_state(json.loads(json.dumps(expert.state())))
    assert back.examples() == expert.examples() and back.metrics() == expert.metrics()
    more = ExpertSet(1.0)
    more.add([_traj("hard", [4, 5], 1.0), _traj("hard", [4, 6], 1.0)])
    back.merge(more)
    assert back.tried["hard"] == 6 and back.solved["hard"] == 3
    assert [ids for ids, _ in back.examples()] == [[4, 5], [4, 6], [1, 2], [1, 3]]


# ----------------------------------------------------------------------------- batches


def _examples(lengths):
    return [([7] * n, [True] * n) for n in lengths]


def test_example_batches_resume_from_their_state_exactly():
    examples = _examples([5, 2, 8, 1, 7, 3, 6, 4, 2, 3])
    straight = sft.ExampleBatches(examples, 4, (4, 8), seed=1, group_by_length=2)
    for _ in range(3):  # into the second pool of two batches, the third epoch's permutation
        next(straight)
    state = json.loads(json.dumps(straight.get_state()))
    expected = [next(straight) for _ in range(5)]
    resumed = sft.ExampleBatches(examples, 4, (4, 8), seed=1, group_by_length=2)
    resumed.set_state(state)
    for want, got in zip(expected, [next(resumed) for _ in range(5)]):
        assert want.keys() == got.keys()
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])
    with pytest.raises(ValueError, match="same data"):
        sft.ExampleBatches(examples[:9], 4, (4, 8), seed=1).set_state(state)


def test_bucket_lengths_cover_the_longest_example():
    c = config("quickstart")
    c.train.length_buckets = (16, 64, 128)
    assert sft.bucket_lengths(c, 64) == (16, 64)
    assert sft.bucket_lengths(c, 65) == (16, 64, 128)
    assert sft.bucket_lengths(c, 300) == (16, 64, 128, 300)


def test_pair_batches_pad_both_sides_to_one_bucket_with_their_reference_log_probs():
    pairs = [(([1, 2, 3], [False, True, True]), ([1, 4], [False, True])),
             (([5, 6], [False, True]), ([5, 7, 8, 9, 10], [False, True, True, True, True]))]
    ref = {"ref_chosen_logps": np.array([-1.0, -2.0], np.float32),
           "ref_rejected_logps": np.array([-3.0, -4.0], np.float32)}
    batch = next(dpo.PairBatches(pairs, ref, 2, (4, 8), seed=0))
    assert batch["chosen_tokens"].shape == batch["rejected_tokens"].shape == (2, 8)
    row = batch["chosen_tokens"][:, 0].tolist().index(5)  # pair 1, wherever shuffled to
    assert batch["chosen_tokens"][row].tolist() == [5, 6, 0, 0, 0, 0, 0, 0]
    assert batch["rejected_loss_mask"][row].tolist() == [False] + [True] * 4 + [False] * 3
    assert batch["rejected_segment_ids"][row].tolist() == [1] * 5 + [0] * 3
    assert batch["ref_chosen_logps"][row] == -2.0 and batch["ref_rejected_logps"][row] == -4.0
    assert batch["ref_chosen_logps"][1 - row] == -1.0


def test_online_pairs_leave_out_episodes_the_env_or_engine_broke():
    def episode(group, token, reward, finish="done"):
        t = _traj(f"task{group}", [1, token], reward, finish=finish)
        t.group_id = group
        return t
    crashed = episode(0, 3, 0.0, "env_error")  # 0 because the env died, not a bad reply
    aborted = episode(1, 6, -1.0, "abort")
    pairs, left_out = dpo.online_pairs([
        episode(0, 2, 1.0), crashed, episode(0, 4, 0.5),  # pair: 1.0 (token 2) vs 0.5 (4)
        episode(1, 5, 1.0), aborted, episode(1, 7, 1.0),  # scored rewards tie: no pair
        episode(2, 8, 1.0, "env_error"), episode(2, 9, 0.0, "abort")])  # nothing scored
    assert left_out == 4  # crashed, aborted and both of group 2
    assert pairs == [(([1, 2], [False, True]), ([1, 4], [False, True]))]


def test_preference_jsonl_is_token_exact_and_bad_lines_name_themselves(tmp_path):
    from rl_tpu.models.tiny_tokenizer import build_tokenizer
    from rl_tpu.models.tokenizer import ChatTokenizer
    tokenizer = ChatTokenizer(build_tokenizer(512))
    good = tmp_path / "pairs.jsonl"
    good.write_text(json.dumps({"prompt": "Which number is largest? 3 7", "chosen": "7",
                                "rejected": "3"}) + "\n\n")
    [(chosen, rejected)] = dpo.preference_pairs(str(good), tokenizer)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Which number is largest? 3 7"}], add_generation_prompt=True)
    assert chosen[0] == prompt + tokenizer.encode("7") + [tokenizer.eos_token_id]
    assert chosen[1] == [False] * len(prompt) + [True] * (len(chosen[0]) - len(prompt))
    assert rejected[0][:len(prompt)] == prompt
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x", "chosen": "7"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: .*'rejected'"):
        dpo.preference_pairs(str(bad), tokenizer)


def test_loop_config_checks_name_the_key():
    from rl_tpu.recipes.config import check
    c = config("rloop_largest")
    c.loop.rft_from = "middle"
    with pytest.raises(ValueError, match="loop.rft_from"):
        check(c)
    c = config("dpo_largest", "inpo,smoke")
    c.dpo.inpo_tau = 0.5  # eta * tau = 10 * 0.5
    with pytest.raises(ValueError, match="eta\\*tau"):
        check(c)
    c = config("quickstart")
    c.recipe = "ppo_loop"
    with pytest.raises(ValueError, match="recipe='ppo_loop'"):
        check(c)


# ----------------------------------------------------------------------------- end to end


def _train(config_arg, workdir, *overrides, timeout=900):
    return subprocess.run([sys.executable, "-m", "launch.train", "--config", config_arg,
                           "--workdir", str(workdir), *overrides], cwd=REPO, env=_cpu_env(),
                          capture_output=True, text=True, timeout=timeout)


def _rounds(workdir):
    return [r for r in read_metrics(str(workdir)) if "eval/success" in r]


@pytest.mark.slow
def test_expert_iteration_smoke_runs_its_rounds_and_a_rerun_trains_nothing(tmp_path):
    out = _train("configs/expert_iteration_largest.py:smoke", tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    rounds = _rounds(tmp_path)
    assert [r["step"] for r in rounds] == [0, 1, 2]
    assert rounds[1]["loop/kept"] > 0 and rounds[1]["loop/examples"] == rounds[1]["loop/kept"]
    assert rounds[2]["loop/total_sampled_tokens"] == (rounds[1]["loop/sampled_tokens"]
                                                      + rounds[2]["loop/sampled_tokens"])
    assert "sft/loss" in rounds[2]
    assert os.path.isfile(tmp_path / "round_1" / "policy_hf" / "config.json")
    again = _train("configs/expert_iteration_largest.py:smoke", tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [r["step"] for r in _rounds(tmp_path)] == [0, 1, 2]  # nothing logged twice


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["dpo", "inpo"])
def test_online_preference_smoke_trains_on_its_pairs(tmp_path, variant):
    out = _train(f"configs/dpo_largest.py:{variant},smoke", tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    rounds = _rounds(tmp_path)
    assert [r["step"] for r in rounds] == [0, 1, 2]
    trained = [r for r in rounds if r.get("loop/pairs", 0) > 0]
    assert trained, "the warm start's samples gave no pair with different rewards"
    assert all(np.isfinite(r["dpo/loss"]) and r["dpo/skipped"] == 0 for r in trained)


@pytest.mark.slow
def test_offline_dpo_from_a_jsonl(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    with open(pairs, "w") as f:
        for numbers in ([3, 7, 2], [9, 1, 4], [5, 8, 6], [0, 2, 1]):
            text = "Which number is largest? " + " ".join(map(str, numbers))
            f.write(json.dumps({"prompt": text, "chosen": str(max(numbers)),
                                "rejected": str(numbers[0])}) + "\n")
    out = _train("configs/dpo_largest.py:offline,smoke", tmp_path / "run",
                 f"--config.dpo.data_path={pairs}", "--config.loop.rounds=1")
    assert out.returncode == 0, out.stderr[-3000:]
    [start, after] = _rounds(tmp_path / "run")
    assert after["loop/pairs"] == 4
    loss, accuracy = after["dpo/loss"], after["dpo/reward_accuracy"]
    margin = after["dpo/reward_margin"]
    assert loss < np.log(2) + 1e-6  # from log 2 at the reference, it went down
    # The last step's 8 pair rows (the smoke's dpo.batch_size): accuracy counts eighths.
    assert accuracy * 8 == pytest.approx(round(accuracy * 8), abs=1e-5)
    # A pair of margin m <= 0 costs -log sigmoid(m) >= log 2, one of m > 0 costs > 0, so the
    # mean loss >= (1 - accuracy) * log 2; a loss below log 2 needs a pair ranked right.
    assert loss >= (1.0 - accuracy) * np.log(2) - 1e-5 and accuracy >= 1 / 8
    # -log sigmoid is convex: the mean loss is at least that of the mean margin (Jensen)
    assert loss >= np.log1p(np.exp(-margin)) - 1e-5
    assert margin == pytest.approx(after["dpo/chosen_reward"] - after["dpo/rejected_reward"],
                                   abs=1e-5)


SFT_STEPS = 24


def _sft_command(workdir):
    return [sys.executable, "-m", "launch.train", "--config", "configs/quickstart.py:smoke",
            "--workdir", str(workdir), "--config.recipe=sft", f"--config.sft.steps={SFT_STEPS}",
            "--config.checkpoint.every=2", "--config.sft.group_by_length=2"]


def _params(path):
    import jax

    from rl_tpu.models import hf
    _, params = hf.load(str(path))
    return {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_leaves_with_path(params)}


def _assert_same_params(a, b):
    a, b = _params(a), _params(b)
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(b[key], a[key], err_msg=key)


@pytest.mark.slow
def test_sft_run_killed_mid_way_resumes_exactly(tmp_path):
    straight = subprocess.run(_sft_command(tmp_path / "straight"), cwd=REPO, env=_cpu_env(),
                              capture_output=True, text=True, timeout=600)
    assert straight.returncode == 0, straight.stderr[-3000:]
    resumed = tmp_path / "resumed"
    kill_mid_run(_sft_command(resumed), resumed, tmp_path / "killed.log", _cpu_env(), after=4)
    again = subprocess.run(_sft_command(resumed), cwd=REPO, env=_cpu_env(),
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed SFT from step" in again.stdout  # information, not a warning
    a = [_finite(r) for r in read_metrics(str(tmp_path / "straight"))]
    b = [_finite(r) for r in read_metrics(str(resumed))]
    assert [r["step"] for r in a] == [r["step"] for r in b] == [10, 20, 24, 24]
    assert a == b
    _assert_same_params(tmp_path / "straight" / "final_hf", resumed / "final_hf")


def _rloop_command(workdir):
    return [sys.executable, "-m", "launch.train", "--config", "configs/rloop_largest.py:smoke",
            "--workdir", str(workdir), "--config.train.steps=4", "--config.sft.steps=30",
            "--config.loop.sft_steps=6", "--config.loop.reward_threshold=1.0"]


@pytest.mark.slow
def test_rloop_killed_mid_way_resumes_exactly(tmp_path):
    straight = subprocess.run(_rloop_command(tmp_path / "straight"), cwd=REPO, env=_cpu_env(),
                              capture_output=True, text=True, timeout=900)
    assert straight.returncode == 0, straight.stderr[-3000:]
    resumed = tmp_path / "resumed"
    # killed in round 0: mid-RL after its second checkpoint, or later in the round's fine-tune
    kill_mid_run(_rloop_command(resumed), resumed / "round_0" / "rl", tmp_path / "killed.log",
                 _cpu_env(), after=2, timeout_s=600)
    again = subprocess.run(_rloop_command(resumed), cwd=REPO, env=_cpu_env(),
                           capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    a = [_finite(r) for r in read_metrics(str(tmp_path / "straight"))]
    b = [_finite(r) for r in read_metrics(str(resumed))]
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1, 2]
    assert a[1]["loop/kept"] > 0, "round 0 kept nothing: the fine-tune was not exercised"
    assert a == b
    for r in (0, 1):
        rl_a = [_finite(x) for x in read_metrics(str(tmp_path / "straight" / f"round_{r}" / "rl"))]
        rl_b = [_finite(x) for x in read_metrics(str(resumed / f"round_{r}" / "rl"))]
        assert rl_a == rl_b
    _assert_same_params(tmp_path / "straight" / "round_1" / "policy_hf",
                        resumed / "round_1" / "policy_hf")


def test_preference_steps_are_counted_or_follow_the_pairs():
    c = config("dpo_largest", "")
    assert c.dpo.epochs == 4.0
    assert dpo.preference_steps(c.dpo, 153) == 20  # ceil(4 * 153 / 32) = ceil(19.1)
    assert dpo.preference_steps(c.dpo, 1) == 1
    c.dpo.epochs = 0.0
    assert dpo.preference_steps(c.dpo, 153) == c.dpo.steps == 60
