"""Reward models: parity with transformers' Llama / Qwen2 / Qwen3 ForSequenceClassification
(fp32, 1e-4 max abs, as the decoder's parity tests), HF round trips both ways, the pooling
rules worked by hand, and the errors for a directory of the other kind."""

import json
import os

import jax
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

from rl_tpu import parallel
from rl_tpu.models import hf, reward_model as rm, tiny
from rl_tpu.models.transformer import Transformer
from test_transformer import FAMILIES

TOL = 1e-4
V = 96
PAD = 0
# The decoder parity tests' families: between them llama3 rope scaling, QKV bias with a config
# that says tied (a classifier has no lm_head to tie, so nothing may be read or written for
# it), q/k norm with head_dim apart.
CASES = [(arch, labels) for arch in sorted(FAMILIES) for labels in (1, 3)]


def hf_config(arch, **extra):
    return AutoConfig.for_model(arch, vocab_size=V, hidden_size=32, intermediate_size=64,
                                num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, **{**FAMILIES[arch], **extra})


def make_hf_reward_model(arch, num_labels, out_dir):
    torch.manual_seed(0)
    config = hf_config(arch, num_labels=num_labels, pad_token_id=PAD)
    model = AutoModelForSequenceClassification.from_config(config).eval()
    with torch.no_grad():  # bigger than init, so every part of the net moves the scores
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out_dir)
    return model


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-{n}labels" for a, n in CASES])
def family(request, tmp_path_factory):
    arch, labels = request.param
    out = str(tmp_path_factory.mktemp(f"{arch}{labels}"))
    torch_model = make_hf_reward_model(arch, labels, out)
    cfg, head, params = rm.load(out)
    model = rm.RewardModel(cfg, head.num_labels)
    forward = jax.jit(lambda p, ids, pos, seg: model.apply({"params": p}, ids, pos, seg))
    return dict(arch=arch, labels=labels, dir=out, torch=torch_model, cfg=cfg, head=head,
                params=params, forward=forward)


def right_padded(seed, lengths=(12, 7, 3), t=12):
    """Rows of random non-pad tokens, right padded with PAD to t."""
    ids = np.random.RandomState(seed).randint(1, V, (len(lengths), t)).astype(np.int32)
    valid = (np.arange(t)[None] < np.array(lengths)[:, None]).astype(np.int32)
    return np.where(valid == 1, ids, PAD).astype(np.int32), valid


def torch_scores(model, ids, valid):
    """(pooled [B, C], per-token [B, T, C]) from transformers."""
    with torch.no_grad():
        pooled = model(torch.tensor(ids), attention_mask=torch.tensor(valid)).logits
        hidden = model.model(torch.tensor(ids), attention_mask=torch.tensor(valid))
        per_token = model.score(hidden.last_hidden_state)
    return pooled.numpy(), per_token.numpy()


def ours(family, params, ids, valid):
    positions = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape)
    return np.asarray(family["forward"](params, ids, positions, valid))


def test_config_and_head_read_from_hf(family):
    cfg, head, params = family["cfg"], family["head"], family["params"]
    assert cfg.arch == family["arch"] and cfg.num_layers == 2
    assert head.num_labels == family["labels"] and head.pad_token_id == PAD
    assert head.labels == tuple(f"LABEL_{i}" for i in range(family["labels"]))
    assert params["score"]["kernel"].shape == (32, family["labels"])
    assert "lm_head" not in params["trunk"]
    np.testing.assert_array_equal(params["score"]["kernel"],
                                  family["torch"].score.weight.detach().numpy().T)


def test_scores_match_transformers_with_right_padding(family):
    ids, valid = right_padded(1)
    scores = ours(family, family["params"], ids, valid)
    assert scores.shape == (3, 12, family["labels"]) and scores.dtype == np.float32
    pooled, per_token = torch_scores(family["torch"], ids, valid)
    np.testing.assert_allclose(scores[valid == 1], per_token[valid == 1], atol=TOL, rtol=0)
    by_pad = np.asarray(rm.sequence_scores(scores, ids, PAD))
    np.testing.assert_allclose(by_pad, pooled, atol=TOL, rtol=0)
    by_length = np.asarray(rm.sequence_scores(scores, lengths=valid.sum(1)))
    np.testing.assert_array_equal(by_length, by_pad)
    assert np.abs(pooled).max() > 100 * TOL  # scores far from 0: the comparison means something


def test_export_loads_in_transformers_with_the_same_scores(family, tmp_path):
    out = str(tmp_path / "exported")
    rm.save(out, family["cfg"], family["params"], family["head"])
    config = json.load(open(os.path.join(out, "config.json")))
    arch_class = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[family["arch"]]
    assert config["architectures"] == [arch_class + "ForSequenceClassification"]
    assert config["pad_token_id"] == PAD and len(config["id2label"]) == family["labels"]
    reloaded = AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert type(reloaded).__name__ == arch_class + "ForSequenceClassification"
    assert reloaded.num_labels == family["labels"]
    ids, valid = right_padded(2, lengths=(5, 12, 9))
    scores = ours(family, family["params"], ids, valid)
    np.testing.assert_allclose(np.asarray(rm.sequence_scores(scores, ids, PAD)),
                               torch_scores(reloaded, ids, valid)[0], atol=TOL, rtol=0)
    # ... and back into rl_tpu, bit for bit, and as scanned layers, the same scores
    cfg, head, params = rm.load(out)
    assert (cfg, head) == (family["cfg"], family["head"])
    jax.tree.map(np.testing.assert_array_equal, params, family["params"])
    cfg_s, _, scanned = rm.load(out, scan_layers=True)
    assert scanned["trunk"]["layers"]["mlp"]["up_proj"]["kernel"].shape[0] == 2
    scanned_scores = rm.RewardModel(cfg_s, head.num_labels).apply(
        {"params": scanned}, ids, None, valid)
    np.testing.assert_allclose(np.asarray(scanned_scores)[valid == 1], scores[valid == 1],
                               atol=1e-5, rtol=0)


def test_last_non_pad_token_rule_by_hand():
    # scores[b, t] = 10 b + t for label 0 and its negative for label 1
    grid = 10 * np.arange(5)[:, None] + np.arange(5)[None]
    scores = np.stack([grid, -grid], axis=-1).astype(np.float32)  # [5, 5, 2]
    tokens = np.array([[7, 8, 9, 0, 0],    # right padded: last non-pad t=2 -> 2
                       [0, 0, 4, 5, 0],    # padded both sides: t=3 -> 13
                       [7, 0, 9, 0, 0],    # a pad id inside the text is skipped: t=2 -> 22
                       [0, 0, 0, 0, 0],    # all pad: index 0 (transformers' argmax) -> 30
                       [3, 4, 5, 6, 7]])   # no pad: the last token -> 44
    got = np.asarray(rm.sequence_scores(scores, tokens, pad_token_id=0))
    np.testing.assert_array_equal(got, [[2, -2], [13, -13], [22, -22], [30, -30], [44, -44]])
    jitted = jax.jit(rm.sequence_scores, static_argnums=2)(scores, tokens, 0)
    np.testing.assert_array_equal(jitted, got)
    by_length = np.asarray(rm.sequence_scores(scores, lengths=np.array([3, 4, 1, 0, 5])))
    np.testing.assert_array_equal(by_length[:, 0], [2, 13, 20, 30, 44])  # t = length - 1
    # Without a pad id only one row can be pooled (its last token), as in transformers
    np.testing.assert_array_equal(rm.sequence_scores(scores[1:2], tokens[1:2]), [[14, -14]])
    with pytest.raises(ValueError, match="5 rows and no pad_token_id"):
        rm.sequence_scores(scores, tokens)
    with pytest.raises(ValueError, match="exactly one of them"):
        rm.sequence_scores(scores, tokens, 0, lengths=np.array([1, 1, 1, 1, 1]))


def test_scores_at_by_hand():
    grid = 10 * np.arange(2)[:, None] + np.arange(4)[None]
    scores = np.stack([grid, -grid], axis=-1).astype(np.float32)  # [2, 4, 2]: 10 b + t
    positions = np.array([[1, 3], [2, -1]])  # row 1 has one step, padded with -1
    values, mask = rm.scores_at(scores, positions)
    np.testing.assert_array_equal(values, [[[1, -1], [3, -3]], [[12, -12], [0, 0]]])
    np.testing.assert_array_equal(mask, [[True, True], [True, False]])
    with pytest.raises(ValueError, match=r"positions \[4\] are past the last token \(3\)"):
        rm.scores_at(scores, np.array([[4, 0], [1, 1]]))
    with pytest.raises(ValueError, match=r"must be \[B, K\]"):
        rm.scores_at(scores, np.array([1, 2]))
    # Under jit an out-of-range position cannot raise: it is masked, not clipped onto t=3
    values, mask = jax.jit(rm.scores_at)(scores, np.array([[4, 0], [1, 1]]))
    np.testing.assert_array_equal(mask, [[False, True], [True, True]])
    np.testing.assert_array_equal(values[0], [[0, 0], [0, -0]])


def test_reward_params_from_a_policy():
    cfg = tiny.tiny_config("qwen2", vocab_size=64)  # untied: the policy has an lm_head
    policy = tiny.random_params(cfg)
    params = rm.reward_params_from(policy, cfg, num_labels=2)
    abstract, _ = parallel.logical_axes_of(rm.RewardModel(cfg, 2), np.zeros((1, 1), np.int32))
    assert jax.tree.structure(params) == jax.tree.structure(abstract)
    jax.tree.map(lambda p, a: np.testing.assert_equal(p.shape, a.shape), params, abstract)
    jax.tree.map(np.testing.assert_array_equal, params["trunk"],
                 {k: v for k, v in policy.items() if k != "lm_head"})
    ids = np.random.RandomState(5).randint(0, 64, (2, 6)).astype(np.int32)
    scores = rm.RewardModel(cfg, 2).apply({"params": params}, ids)
    np.testing.assert_array_equal(scores, np.zeros((2, 6, 2)))  # zero head: every score 0
    # A normal head: scores are the policy's final hidden states times it
    params = rm.reward_params_from(policy, cfg, num_labels=2, stddev=0.02)
    kernel = np.asarray(params["score"]["kernel"])
    assert 0.015 < kernel.std() < 0.025
    hidden = Transformer(cfg).apply({"params": policy}, ids, return_hidden=True)
    np.testing.assert_allclose(rm.RewardModel(cfg, 2).apply({"params": params}, ids),
                               np.asarray(hidden) @ kernel, atol=1e-5, rtol=1e-5)


def test_a_directory_of_the_other_kind_is_named(tmp_path):
    torch.manual_seed(0)
    policy_dir = str(tmp_path / "policy")
    AutoModelForCausalLM.from_config(hf_config("qwen2")).save_pretrained(policy_dir)
    for reader in (rm.load, rm.check_reward_dir):
        with pytest.raises(hf.CheckpointError, match=(
                r"architectures \['Qwen2ForCausalLM'\] is a causal LM \(a policy\), not a "
                r"sequence classifier \(a reward model\) as asked; load it with "
                r"rl_tpu\.models\.hf\.load \(a reward model can start from its trunk: "
                r"reward_model\.reward_params_from\)")):
            reader(policy_dir)
    reward_dir = str(tmp_path / "reward")
    make_hf_reward_model("llama", 1, reward_dir)
    for reader in (hf.load, hf.check_model_dir, hf.read_config):
        with pytest.raises(hf.CheckpointError, match=(
                r"architectures \['LlamaForSequenceClassification'\] is a sequence classifier "
                r"\(a reward model\), not a causal LM \(a policy\) as asked; load it with "
                r"rl_tpu\.models\.reward_model\.load")):
            reader(reward_dir)
    assert rm.check_reward_dir(reward_dir)[1] == rm.RewardHead(1, PAD, ("LABEL_0",))


def test_head_and_score_mismatches_are_named(tmp_path):
    reward_dir = str(tmp_path / "reward")
    make_hf_reward_model("qwen3", 3, reward_dir)
    file = os.path.join(reward_dir, "config.json")
    config = json.load(open(file))
    config["id2label"] = {"0": "bad", "1": "good"}  # 2 labels, but score.weight has 3 rows
    config["label2id"] = {"bad": 0, "good": 1}
    json.dump(config, open(file, "w"))
    with pytest.raises(hf.CheckpointError, match=r"tensor 'score\.weight' has shape \[3, 32\], "
                                                 r"config\.json implies \[2, 32\]"):
        rm.load(reward_dir)
    with pytest.raises(hf.CheckpointError, match="num_labels=3 but id2label has 2 labels"):
        rm.RewardHead.from_hf({**config, "num_labels": 3})
    assert rm.RewardHead.from_hf({}).num_labels == 2  # transformers' default, no id2label
    # A non-finite score head is never exported (hf.save's check covers head tensors)
    cfg = tiny.tiny_config("llama", vocab_size=64)
    params = rm.reward_params_from(tiny.random_params(cfg), cfg, num_labels=1)
    params["score"]["kernel"] = params["score"]["kernel"].at[3, 0].set(np.nan)
    with pytest.raises(ValueError, match=r"tensor score\.weight holds 1 NaN or inf value"):
        rm.save(str(tmp_path / "nan"), cfg, params, rm.RewardHead(1, PAD))
    assert not os.path.exists(tmp_path / "nan")


def test_a_zero_score_bias_for_sglang_is_written_and_a_trained_one_refused(tmp_path):
    """SGLang's Qwen2/Qwen3 classification heads carry a bias transformers' lack: the export
    writes it as zeros (so SGLang adds nothing), and a checkpoint whose bias is not zero is
    refused rather than scored without it."""
    from safetensors.numpy import load_file, save_file
    cfg = tiny.tiny_config("qwen2", vocab_size=V, hidden_size=32, intermediate_size=64,
                           num_layers=1, head_dim=8)
    params = rm.reward_params_from(tiny.random_params(cfg, seed=0), cfg, 2, stddev=0.1)
    out = str(tmp_path / "rm")
    rm.save(out, cfg, params, rm.RewardHead(2))
    tensors = load_file(os.path.join(out, "model.safetensors"))
    np.testing.assert_array_equal(tensors[rm.SCORE_BIAS], [0.0, 0.0])
    rm.load(out)  # a zero bias is accepted
    tensors[rm.SCORE_BIAS] = np.asarray([0.5, 0.0], np.float32)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(hf.CheckpointError, match="score.bias is \\[0.5, 0.0\\]"):
        rm.load(out)
