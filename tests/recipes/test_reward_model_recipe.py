"""The reward-model recipe end to end: pairs from the env and from a JSONL, SSRM rounds, the
exported model read by transformers, a rerun that trains nothing, and RL against the model."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from test_rl import REPO, _cpu_env

from rl_tpu.metrics import read_metrics


def _train(config, workdir, *overrides, timeout=900):
    return subprocess.run([sys.executable, "-m", "launch.train", "--config", config,
                           "--workdir", str(workdir), "--config.log.plot=False", *overrides],
                          cwd=REPO, env=_cpu_env(), capture_output=True, text=True,
                          timeout=timeout)


def _rounds(workdir):
    return [r for r in read_metrics(str(workdir)) if "rm/eval_accuracy" in r]


@pytest.mark.slow
def test_env_pairs_ssrm_round_export_rerun_and_rl_against_the_model(tmp_path):
    rm_dir = tmp_path / "rm"
    out = _train("configs/reward_model_largest.py:ssrm,smoke", rm_dir)
    assert out.returncode == 0, out.stderr[-3000:]
    rounds = _rounds(rm_dir)
    assert [r["step"] for r in rounds] == [1, 2]  # step 0 is P_0's eval
    first, second = rounds
    assert first["rm/train_pairs"] == first["rm/labelled_pairs"] > 0
    assert second["ssrm/pool"] > 0
    assert second["rm/train_pairs"] == second["rm/labelled_pairs"] + second["ssrm/kept"]
    assert 0 <= second["rm/eval_accuracy"] <= 1 and second["rm/eval_pairs"] > 0
    final = rm_dir / "reward_model_hf"
    assert json.loads((final / "config.json").read_text())["architectures"] == [
        "Qwen2ForSequenceClassification"]

    again = _train("configs/reward_model_largest.py:ssrm,smoke", rm_dir)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [r["step"] for r in _rounds(rm_dir)] == [1, 2]  # nothing trained or logged twice

    # transformers reads the exported model and scores a sequence as rl_tpu's scorer does
    import torch
    from transformers import AutoModelForSequenceClassification

    from rl_tpu.rewards.scorer import RewardScorer
    ids = [3, 17, 42, 8, 5, 11]
    theirs = AutoModelForSequenceClassification.from_pretrained(str(final)).eval()
    with torch.no_grad():
        expected = float(theirs(torch.tensor([ids])).logits[0, 0])
    ours = RewardScorer.from_dir(str(final)).score([ids])[0, 0]
    assert ours == pytest.approx(expected, abs=1e-4)

    rl_dir = tmp_path / "rl"
    out = _train("configs/rlhf_largest.py:rm,smoke", rl_dir,
                 f"--config.reward.model_path={final}", "--config.reward.rule_weight=0.5",
                 "--config.algo.log_kl=true")
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [r for r in read_metrics(str(rl_dir)) if "rollout/reward" in r]
    assert len(steps) == 2
    for r in steps:  # the reward trained on is the declared mix of the two sources
        assert r["rollout/reward"] == pytest.approx(
            r["rollout/reward_model"] + 0.5 * r["rollout/reward_rule"], abs=1e-5)
    # train/kl, logged at kl_coef 0 (algo.log_kl): KL(policy || reference) where the reference
    # is the policy RL started from, so 0 at step 1 (the update runs on those very params) and
    # above 0 at step 2, after step 1 moved the policy (k3 is > 0 wherever the two differ)
    first, second = steps
    assert first["train/kl"] == pytest.approx(0.0, abs=1e-6)
    assert first["train/grad_norm"] > 0 and second["train/kl"] > 1e-7
    dpo_dir = tmp_path / "dpo"  # online iterative DPO, its pairs ranked by the model
    out = _train("configs/dpo_largest.py:rm,smoke", dpo_dir, f"--config.reward.model_path={final}")
    assert out.returncode == 0, out.stderr[-3000:]
    rounds = [r for r in read_metrics(str(dpo_dir)) if "loop/pairs" in r]
    assert len(rounds) == 2 and all(r["loop/pairs"] > 0 for r in rounds)

    curves = subprocess.run([sys.executable, "-m", "launch.overoptimisation",
                             f"--runs=smoke={rl_dir}", "--windows=2"], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert curves.returncode == 0 and "| smoke | 1 |" in curves.stdout, curves.stderr[-2000:]


@pytest.mark.slow
def test_pairs_from_a_jsonl_with_a_held_out_split(tmp_path):
    rows = []
    for i in range(12):
        digits = [(i + k) % 9 + 1 for k in range(5)]
        rows.append({"prompt": f"Which number is largest? {' '.join(map(str, digits))}",
                     "chosen": str(max(digits)), "rejected": str(digits[0] if digits[0] !=
                                                                  max(digits) else min(digits)),
                     **({"split": "eval"} if i % 4 == 0 else {})})
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = _train("configs/reward_model_largest.py:smoke", tmp_path / "run",
                 f"--config.reward_model.data_path={data}", "--config.sft.steps=0",
                 "--config.reward_model.eval_fraction=0")  # only the lines marked eval
    assert out.returncode == 0, out.stderr[-3000:]
    (only,) = _rounds(tmp_path / "run")
    assert only["rm/eval_pairs"] == 3 and only["rm/train_pairs"] == 9
    assert np.isfinite(only["rm/eval_bt_loss"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "q", "chosen": "a"}\n')
    out = _train("configs/reward_model_largest.py:smoke", tmp_path / "bad_run",
                 f"--config.reward_model.data_path={bad}", "--config.sft.steps=0")
    assert out.returncode != 0 and "bad.jsonl:1" in out.stderr
    assert not os.path.exists(tmp_path / "bad_run" / "round_0")
