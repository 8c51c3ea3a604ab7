"""Parity of the decoder with transformers' own Llama / Qwen2 / Qwen3 (fp32, 1e-4 max abs)."""

import jax
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rl_tpu.core.engine import GenerateRequest, SamplingParams
from rl_tpu.models import hf
from rl_tpu.models.transformer import Transformer, init_cache
from rl_tpu.rollout.sampler import JaxSampler

TOL = 1e-4
V = 96
# Each family with its own switches; between them tied and untied heads and llama3 scaling.
FAMILIES = {
    "llama": dict(tie_word_embeddings=False, rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=16)),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(tie_word_embeddings=False, head_dim=16),
}


def make_hf_model(arch, out_dir, **extra):
    torch.manual_seed(0)
    config = AutoConfig.for_model(arch, vocab_size=V, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=3, num_attention_heads=4,
                                  num_key_value_heads=2, **{**FAMILIES[arch], **extra})
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # bigger than init so that every part of the net moves the logits
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out_dir)
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    torch_model = make_hf_model(request.param, str(out))
    cfg, params = hf.load(str(out))
    model = Transformer(cfg)
    forward = jax.jit(lambda p, ids, pos, seg: model.apply({"params": p}, ids, pos, seg))
    return dict(dir=str(out), torch=torch_model, cfg=cfg, params=params, model=model,
                forward=forward)


def torch_logits(model, ids, mask=None, positions=None):
    with torch.no_grad():
        out = model(torch.tensor(ids), attention_mask=None if mask is None else torch.tensor(mask),
                    position_ids=None if positions is None else torch.tensor(positions))
    return out.logits.numpy()


def test_config_read_from_hf(family):
    cfg = family["cfg"]
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.num_layers) == (4, 2, 3)
    assert cfg.qkv_bias == (cfg.arch == "qwen2") and cfg.qk_norm == (cfg.arch == "qwen3")
    if cfg.arch == "llama":
        assert cfg.rope_scaling.rope_type == "llama3" and cfg.rope_scaling.factor == 8.0


def test_full_forward_matches_transformers(family):
    ids = np.random.RandomState(1).randint(0, V, (2, 40)).astype(np.int32)  # past 16: llama3 ramp
    pos = np.broadcast_to(np.arange(40, dtype=np.int32), ids.shape)
    ours = family["forward"](family["params"], ids, pos, np.ones_like(ids))
    np.testing.assert_allclose(ours, torch_logits(family["torch"], ids), atol=TOL, rtol=0)


def test_padding_matches_transformers(family):
    """Right and left padding: the valid positions match HF with its attention mask."""
    rng = np.random.RandomState(2)
    ids = rng.randint(0, V, (2, 12)).astype(np.int32)
    valid = np.zeros_like(ids)
    valid[0, :7] = 1  # right padded
    valid[1, 4:] = 1  # left padded
    positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0).astype(np.int32)
    ours = np.asarray(family["forward"](family["params"], ids, positions, valid))
    ref = torch_logits(family["torch"], ids, mask=valid, positions=positions)
    np.testing.assert_allclose(ours[valid == 1], ref[valid == 1], atol=TOL, rtol=0)


def test_packed_segments_match_separate_sequences(family):
    rng = np.random.RandomState(3)
    a, b = rng.randint(0, V, 5), rng.randint(0, V, 9)
    packed = np.concatenate([a, b, [0, 0]])[None].astype(np.int32)
    segments = np.array([[1] * 5 + [2] * 9 + [0, 0]], np.int32)
    positions = np.array([list(range(5)) + list(range(9)) + [0, 1]], np.int32)
    ours = np.asarray(family["forward"](family["params"], packed, positions, segments))[0]
    np.testing.assert_allclose(ours[:5], torch_logits(family["torch"], a[None])[0], atol=TOL, rtol=0)
    np.testing.assert_allclose(ours[5:14], torch_logits(family["torch"], b[None])[0], atol=TOL,
                               rtol=0)


def test_scan_and_remat_give_the_same_logits(family):
    cfg, params = hf.load(family["dir"], scan_layers=True, remat="dots")
    assert params["layers"]["attn"]["q_proj"]["kernel"].shape[0] == cfg.num_layers
    ids = np.random.RandomState(4).randint(0, V, (2, 9)).astype(np.int32)
    ours = Transformer(cfg).apply({"params": params}, ids)
    np.testing.assert_allclose(ours, torch_logits(family["torch"], ids), atol=TOL, rtol=0)
    grads = jax.grad(lambda p: Transformer(cfg).apply({"params": p}, ids).mean())(params)
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))


def test_blocked_causal_attention_matches_transformers_and_dense(family):
    """Query blocks of 16 over 40 packed tokens (a segment crosses two block edges): the
    logits match HF's, and the gradient matches one dense block's."""
    rng = np.random.RandomState(7)
    a, b = rng.randint(0, V, 13), rng.randint(0, V, 25)
    ids = np.concatenate([a, b, [0, 0]])[None].astype(np.int32)
    segments = np.array([[1] * 13 + [2] * 25 + [0, 0]], np.int32)
    positions = np.array([list(range(13)) + list(range(25)) + [0, 1]], np.int32)
    blocked = Transformer(family["cfg"].replace(attention_block=16))
    dense = Transformer(family["cfg"].replace(attention_block=0))
    ours = np.asarray(blocked.apply({"params": family["params"]}, ids, positions, segments))[0]
    np.testing.assert_allclose(ours[13:38], torch_logits(family["torch"], b[None])[0],
                               atol=TOL, rtol=0)
    grads = [jax.grad(lambda p, m=m: m.apply({"params": p}, ids, positions, segments)[0, :38]
                      .std())(family["params"]) for m in (blocked, dense)]
    for g_blocked, g_dense in zip(*(jax.tree.leaves(g) for g in grads)):
        np.testing.assert_allclose(g_blocked, g_dense, atol=1e-5, rtol=1e-4)


def test_prefill_in_query_blocks_matches_transformers_and_writes_the_same_cache(family):
    """A 37-token prefill into a 48-slot cache in query blocks of 8 (rows starting at slots 0
    and 5, as prefix reuse starts them): the logits match HF's on each row's tokens, and the
    logits and the cache written match one dense block's."""
    rng = np.random.RandomState(8)
    ids = rng.randint(0, V, (2, 37)).astype(np.int32)
    positions = np.stack([np.arange(37), np.arange(5, 42)]).astype(np.int32)
    outs = []
    for block in (8, 0):
        model = Transformer(family["cfg"].replace(attention_block=block))
        cache = init_cache(family["cfg"], 2, 48)
        outs.append(model.apply({"params": family["params"]}, ids, positions, cache=cache))
    (blocked, blocked_cache), (dense, dense_cache) = outs
    # row 0 starts at slot 0 of an empty cache: a plain forward of its tokens
    np.testing.assert_allclose(np.asarray(blocked)[0], torch_logits(family["torch"], ids[:1])[0],
                               atol=TOL, rtol=0)
    np.testing.assert_allclose(blocked, dense, atol=1e-5, rtol=0)
    for a, b in zip(jax.tree.leaves(blocked_cache), jax.tree.leaves(dense_cache)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_save_reload_in_transformers(family, tmp_path):
    hf.save(str(tmp_path / "out"), family["cfg"], family["params"])
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    ids = np.random.RandomState(5).randint(0, V, (2, 20)).astype(np.int32)
    ours = Transformer(family["cfg"]).apply({"params": family["params"]}, ids)
    np.testing.assert_allclose(ours, torch_logits(reloaded, ids), atol=TOL, rtol=0)
    np.testing.assert_allclose(torch_logits(reloaded, ids), torch_logits(family["torch"], ids),
                               atol=TOL, rtol=0)


def test_bf16_compute_stays_close(family):
    cfg, params = hf.load(family["dir"], dtype="bfloat16")
    ids = np.random.RandomState(6).randint(0, V, (2, 9)).astype(np.int32)
    ours = np.asarray(Transformer(cfg).apply({"params": params}, ids))
    ref = torch_logits(family["torch"], ids)
    assert ours.dtype == np.float32  # logits always come back in fp32
    assert np.abs(ours - ref).max() < 0.1 * np.abs(ref).max()


def test_kv_cache_greedy_equals_repeated_full_forward(family):
    """16 greedy tokens with the cache == argmax of a full forward re-run after every token,
    for a batch of prompts of different lengths (right-padded, slot = position)."""
    rng = np.random.RandomState(7)
    prompts = [rng.randint(0, V, n).tolist() for n in (3, 8, 5)]
    sampler = JaxSampler(family["cfg"], family["params"])  # the KV-cache decode path
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    cached = [r.output_ids for r in sampler.generate([GenerateRequest(p, greedy)
                                                      for p in prompts])]
    for row, prompt in enumerate(prompts):
        seq = list(prompt)
        width = len(prompt) + 16  # one fixed shape (pad is causal-invisible): one compile
        for _ in range(16):
            x = np.zeros((1, width), np.int32)
            x[0, :len(seq)] = seq
            logits = family["forward"](family["params"], x, np.arange(width)[None],
                                       np.ones_like(x))
            seq.append(int(np.argmax(logits[0, len(seq) - 1])))
        assert cached[row] == seq[len(prompt):], f"row {row}"
