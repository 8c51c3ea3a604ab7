"""LoRA in the loops around the update (policy_chain.py): each round trains fresh adapters on
its frozen P_r and P_{r+1} is P_r with them merged in. Checked end to end: the fine-tune's
checkpoints hold adapters and their moments only, a round changes the adapted kernels alone and
each by a matrix of rank <= the adapters' rank, and a loop resumed at a round boundary (which
loads P_r from disk and draws the round's adapters afresh) repeats the uninterrupted loop."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from test_rl import REPO, _cpu_env, _finite, config

from rl_tpu.metrics import read_metrics
from rl_tpu.models import hf, lora, reward_model
from rl_tpu.recipes import rl

RANK = 4
LORA_FLAGS = (f"--config.model.lora.rank={RANK}", "--config.model.lora.alpha=8",
              "--config.log.plot=False")


@pytest.fixture(scope="module")
def sft_base(tmp_path_factory):
    """The tiny model after a full 30-step SFT warm start, as an HF dir: the loops start their
    adapters on a model that already answers, as LoRA starts from a pretrained one (a random
    tiny model's replies all fail alike, and give no pair to prefer)."""
    workdir = tmp_path_factory.mktemp("sft_base")
    c = config("quickstart")
    c.sft.steps, c.train.steps = 30, 0
    rl.run(c, str(workdir))
    return str(workdir / "final_hf")


def _train(config_arg, workdir, base, *overrides, timeout=900):
    out = subprocess.run([sys.executable, "-m", "launch.train", "--config", config_arg,
                          "--workdir", str(workdir), *LORA_FLAGS, f"--config.model.path={base}",
                          "--config.sft.steps=0", *overrides], cwd=REPO,
                         env=_cpu_env(), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]


def _flat(params):
    return {jax.tree_util.keystr(p): np.asarray(x, np.float64)
            for p, x in jax.tree_util.tree_leaves_with_path(params)}


def _policy(path):
    return _flat(hf.load(str(path))[1])


def _assert_low_rank_round(before: dict, after: dict, adapted_keys) -> None:
    """`after` is `before` plus a merged adapter: every tensor outside the adapted kernels is
    bit-identical (the base is frozen), and each adapted kernel moved by a matrix of rank <=
    RANK (scale x A B, with A [in, RANK]), at least one of them by something."""
    assert before.keys() == after.keys()
    moved = 0
    for key in before:
        delta = after[key] - before[key]
        if not any(f"['{name}']" in key for name in adapted_keys):
            np.testing.assert_array_equal(delta, 0, err_msg=key)
            continue
        # a scanned layer stack [L, in, out]: each layer's own delta
        for matrix in delta.reshape((-1,) + delta.shape[-2:]):
            if np.abs(matrix).max() > 0:
                moved += 1
                assert np.linalg.matrix_rank(matrix, tol=1e-6) <= RANK, key
    assert moved, "no round moved an adapted kernel: the adapters never trained"


def _checkpoint_arrays(directory) -> list[tuple[str, int]]:
    """(name, size) of every array orbax wrote in the newest checkpoint under `directory`."""
    import orbax.checkpoint as ocp
    newest = max((d for d in os.listdir(directory) if d.isdigit()), key=int)
    meta = ocp.StandardCheckpointer().metadata(os.path.join(directory, newest, "state"))
    return [(jax.tree_util.keystr(path), int(np.prod(leaf.shape))) for path, leaf in
            jax.tree_util.tree_flatten_with_path(getattr(meta, "item_metadata", meta))[0]
            if len(leaf.shape) > 0]


@pytest.mark.slow
def test_expert_iteration_with_lora_merges_each_rounds_adapters(tmp_path, sft_base):
    _train("configs/expert_iteration_largest.py:smoke", tmp_path, sft_base,
           "--config.loop.sft_lr=0.01")
    rounds = [r for r in read_metrics(str(tmp_path)) if "eval/success" in r]
    assert [r["step"] for r in rounds] == [0, 1, 2] and rounds[1]["loop/kept"] > 0
    c = config("expert_iteration_largest", "smoke")
    targets = lora.TARGETS if c.model.lora.targets == "all" else c.model.lora.targets.split(",")
    p0 = _policy(tmp_path / "start" / "policy_hf")
    p1 = _policy(tmp_path / "round_0" / "policy_hf")
    p2 = _policy(tmp_path / "round_1" / "policy_hf")
    assert not any("lora" in key for key in p1)  # a plain HF model
    _assert_low_rank_round(p0, p1, targets)
    _assert_low_rank_round(p1, p2, targets)
    # the round's fine-tune checkpoint: adapters, Adam's mu and nu, nothing of the base
    arrays = _checkpoint_arrays(tmp_path / "round_1" / "rft" / "checkpoints")
    assert arrays and all(name.endswith(("['lora_a']", "['lora_b']")) for name, _ in arrays)
    cfg = json.loads((tmp_path / "start" / "policy_hf" / "config.json").read_text())
    d, inter, n_layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * (d // cfg["num_attention_heads"])
    shapes = {"q_proj": (d, d), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (d, d),
              "gate_proj": (d, inter), "up_proj": (d, inter), "down_proj": (inter, d)}
    per_layer = sum(RANK * (i + o) for name, (i, o) in shapes.items() if name in targets)
    assert sum(size for _, size in arrays) == 3 * n_layers * per_layer


@pytest.mark.slow
def test_online_dpo_with_lora_resumed_at_a_round_boundary_repeats_the_straight_loop(tmp_path,
                                                                                   sft_base):
    """Straight: 2 rounds in one process (round 1 starts from round 0's params merged, with
    fresh adapters: PolicyChain.next_start). Resumed: 1 round, then a rerun asking for 2,
    whose round 1 loads P_1 from its HF dir and draws the adapters from disk's side."""
    run = ("configs/dpo_largest.py:smoke", "--config.dpo.lr=0.01")
    _train(run[0], tmp_path / "straight", sft_base, *run[1:])
    _train(run[0], tmp_path / "resumed", sft_base, *run[1:], "--config.loop.rounds=1")
    _train(run[0], tmp_path / "resumed", sft_base, *run[1:])
    a = [_finite(r) for r in read_metrics(str(tmp_path / "straight")) if "eval/success" in r]
    b = [_finite(r) for r in read_metrics(str(tmp_path / "resumed")) if "eval/success" in r]
    drop = ("time/",)
    a = [{k: v for k, v in r.items() if not k.startswith(drop)} for r in a]
    b = [{k: v for k, v in r.items() if not k.startswith(drop)} for r in b]
    assert [r["step"] for r in a] == [0, 1, 2] and a == b
    assert any(r.get("loop/pairs", 0) > 0 for r in a), "no round had pairs: nothing trained"
    straight = _policy(tmp_path / "straight" / "round_1" / "policy_hf")
    resumed = _policy(tmp_path / "resumed" / "round_1" / "policy_hf")
    for key in straight:
        np.testing.assert_array_equal(resumed[key], straight[key], err_msg=key)
    c = config("dpo_largest", "smoke")
    targets = lora.TARGETS if c.model.lora.targets == "all" else c.model.lora.targets.split(",")
    _assert_low_rank_round(_policy(tmp_path / "straight" / "round_0" / "policy_hf"), straight,
                           targets)


@pytest.mark.slow
def test_reward_model_with_lora_trains_adapters_and_head_on_a_frozen_trunk(tmp_path, sft_base):
    _train("configs/reward_model_largest.py:ssrm,smoke", tmp_path, sft_base,
           "--config.reward_model.lr=0.01")
    rounds = [r for r in read_metrics(str(tmp_path)) if "rm/eval_accuracy" in r]
    assert [r["step"] for r in rounds] == [1, 2] and rounds[0]["rm/train_pairs"] > 0
    policy = _policy(tmp_path / "start" / "policy_hf")
    _, _, rm_params = reward_model.load(str(tmp_path / "reward_model_hf"))
    assert np.abs(np.asarray(rm_params["score"]["kernel"])).max() > 0  # the head trained
    trunk = {key.replace("['trunk']", "", 1): v for key, v in _flat(rm_params).items()
             if key.startswith("['trunk']")}
    c = config("reward_model_largest", "smoke")
    targets = lora.TARGETS if c.model.lora.targets == "all" else c.model.lora.targets.split(",")
    # two rounds of merged rank-RANK adapters: each adapted kernel moved by rank <= 2 x RANK
    policy = {k: v for k, v in policy.items() if k in trunk}
    assert policy.keys() == trunk.keys()
    for key in trunk:
        delta = trunk[key] - policy[key]
        if not any(f"['{name}']" in key for name in targets):
            np.testing.assert_array_equal(delta, 0, err_msg=key)
        else:
            for matrix in delta.reshape((-1,) + delta.shape[-2:]):
                assert np.linalg.matrix_rank(matrix, tol=1e-6) <= 2 * RANK, key
