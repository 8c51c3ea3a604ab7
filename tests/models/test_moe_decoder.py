"""The Qwen3-MoE decoder against transformers' `Qwen3MoeForCausalLM` (fp32, random tiny
configs, 1e-4 max abs as the dense families' parity): logits, every sparse layer's router logits,
the load-balancing loss as the HF model reports it, with a dense layer among the sparse ones
(mlp_only_layers, decoder_sparse_step); routing replay through the whole model; the KV-cached
path. The weights are mapped by hand here (HF checkpoint loading of MoE is the next step)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from rl_tpu.models import hf
from rl_tpu.models.moe import MoeConfig, load_balancing_loss, sown_routing
from rl_tpu.models.transformer import ModelConfig, Transformer, init_cache

TOL = 1e-4
V, D, F_DENSE, F_MOE, E, K = 96, 32, 48, 16, 8, 2
LAYOUTS = {  # name -> (layers, decoder_sparse_step, mlp_only_layers)
    "all_sparse": (2, 1, ()),
    "dense_between": (3, 1, (1,)),
    "every_second": (4, 2, ()),
}


def _configs(layers, step, mlp_only):
    hf_cfg = Qwen3MoeConfig(vocab_size=V, hidden_size=D, intermediate_size=F_DENSE,
                            moe_intermediate_size=F_MOE, num_hidden_layers=layers,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=E, num_experts_per_tok=K, norm_topk_prob=True,
                            decoder_sparse_step=step, mlp_only_layers=list(mlp_only),
                            tie_word_embeddings=False, output_router_logits=True,
                            router_aux_loss_coef=0.01)
    ours = ModelConfig(arch="qwen3_moe", vocab_size=V, hidden_size=D, intermediate_size=F_DENSE,
                       num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                       rope_theta=hf_cfg.rope_parameters["rope_theta"],
                       rms_norm_eps=hf_cfg.rms_norm_eps,
                       moe=MoeConfig(E, K, F_MOE, True, step, tuple(mlp_only), 0.01))
    return hf_cfg, ours


def _nested_set(tree, path, value):
    *parents, leaf = path.split("/")
    for name in parents:
        tree = tree.setdefault(name, {})
    tree[leaf] = value


def _params_of(model, cfg) -> dict:
    """HF's in-memory tensors -> rl_tpu's params: the dense table's rules (hf.py) for all but
    a sparse layer's MLP, whose router is transposed and experts split and transposed."""
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    params = {}
    for rule in hf.active_rules(cfg):
        for i in (range(cfg.num_layers) if rule.per_layer else (None,)):
            name = rule.hf.format(i=i)
            if i is not None and cfg.moe.is_sparse(i) and rule.path.startswith("mlp/"):
                continue
            path = rule.path if i is None else f"layers_{i}/{rule.path}"
            _nested_set(params, path, jnp.asarray(hf.hf_to_ours(state[name], rule, cfg)))
    for i in cfg.moe.sparse_layers(cfg.num_layers):
        mlp = f"model.layers.{i}.mlp."
        gate_up = state[mlp + "experts.gate_up_proj"]  # [E, 2F, D]
        for name, value in (("router", state[mlp + "gate.weight"].T),
                            ("gate_proj", gate_up[:, :F_MOE].transpose(0, 2, 1)),
                            ("up_proj", gate_up[:, F_MOE:].transpose(0, 2, 1)),
                            ("down_proj", state[mlp + "experts.down_proj"].transpose(0, 2, 1))):
            _nested_set(params, f"layers_{i}/mlp/{name}", jnp.asarray(value))
    return params


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def pair(request):
    hf_cfg, cfg = _configs(*LAYOUTS[request.param])
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # bigger than init (the router starts at zero: every choice a tie)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ids = np.random.RandomState(1).randint(0, V, (2, 24)).astype(np.int32)
    with torch.no_grad():
        out = model(torch.from_numpy(ids).long(), labels=torch.from_numpy(ids).long())
    return dict(cfg=cfg, params=_params_of(model, cfg), ids=ids, torch=out, hf_cfg=hf_cfg)


def _apply(cfg, params, ids, **kw):
    return Transformer(cfg).apply({"params": params}, jnp.asarray(ids),
                                  mutable=["intermediates"], **kw)


def test_logits_router_logits_and_aux_loss_equal_transformers(pair):
    cfg = pair["cfg"]
    logits, state = _apply(cfg, pair["params"], pair["ids"])
    np.testing.assert_allclose(np.asarray(logits), pair["torch"].logits.numpy(), atol=TOL, rtol=0)
    router_logits, experts = sown_routing(state["intermediates"], cfg.num_layers)
    sparse = cfg.moe.sparse_layers(cfg.num_layers)
    assert len(router_logits) == len(pair["torch"].router_logits) == len(sparse)
    for ours, theirs in zip(router_logits, pair["torch"].router_logits):
        np.testing.assert_allclose(np.asarray(ours), theirs.numpy(), atol=TOL, rtol=0)
    assert experts.shape == (pair["ids"].size, len(sparse), K)
    aux = load_balancing_loss(router_logits, K)
    np.testing.assert_allclose(float(aux), float(pair["torch"].aux_loss), rtol=1e-5)


def test_parameter_count_matches_transformers(pair):
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(pair["hf_cfg"])
    assert pair["cfg"].num_params() == sum(p.numel() for p in model.parameters())


def test_replaying_the_models_own_routing_repeats_its_logits_and_another_changes_them(pair):
    cfg, ids = pair["cfg"], pair["ids"]
    logits, state = _apply(cfg, pair["params"], ids)
    _, experts = sown_routing(state["intermediates"], cfg.num_layers)
    replay = experts.reshape(ids.shape + experts.shape[1:])  # [B, T, sparse layers, k]
    again, state2 = _apply(cfg, pair["params"], ids, routing_replay=replay)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(logits))
    shifted = (replay + 1) % E  # every token's experts moved to the next ones
    moved, state3 = _apply(cfg, pair["params"], ids, routing_replay=shifted)
    np.testing.assert_array_equal(np.asarray(sown_routing(state3["intermediates"],
                                                          cfg.num_layers)[1]),
                                  np.asarray(shifted.reshape(experts.shape)))
    assert np.abs(np.asarray(moved) - np.asarray(logits)).max() > 1e-3


def test_cached_decoding_equals_the_full_forward(pair):
    """Prefill 16 tokens into a cache, then 8 tokens one at a time: each step's logits are the
    full forward's at that position (the experts route each token on its own)."""
    cfg, ids = pair["cfg"], pair["ids"]
    model = Transformer(cfg)
    full = np.asarray(model.apply({"params": pair["params"]}, jnp.asarray(ids)))
    cache = init_cache(cfg, ids.shape[0], ids.shape[1])
    pos = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape)
    out, cache = model.apply({"params": pair["params"]}, jnp.asarray(ids[:, :16]),
                             jnp.asarray(pos[:, :16]), cache=cache)
    np.testing.assert_allclose(np.asarray(out), full[:, :16], atol=TOL, rtol=0)
    for t in range(16, ids.shape[1]):
        out, cache = model.apply({"params": pair["params"]}, jnp.asarray(ids[:, t:t + 1]),
                                 jnp.asarray(pos[:, t:t + 1]), cache=cache)
        np.testing.assert_allclose(np.asarray(out)[:, 0], full[:, t], atol=TOL, rtol=0)


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_rematerialised_layers_give_the_same_logits_and_gradients(pair, remat):
    cfg, ids = pair["cfg"], jnp.asarray(pair["ids"])

    def loss(params, c):
        return jnp.sum(Transformer(c).apply({"params": params}, ids) ** 2)

    plain, again = (jax.value_and_grad(loss)(pair["params"], c)
                    for c in (cfg, cfg.replace(remat=remat)))
    np.testing.assert_allclose(float(again[0]), float(plain[0]), rtol=1e-6)
    for x, y in zip(jax.tree.leaves(again[1]), jax.tree.leaves(plain[1])):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5, rtol=1e-5)


def test_what_moe_does_not_support_yet_is_refused_by_name():
    _, cfg = _configs(2, 1, ())
    with pytest.raises(ValueError, match="scan_layers=True with a mixture of experts"):
        cfg.replace(scan_layers=True)
    with pytest.raises(ValueError, match="arch qwen3_moe needs a MoeConfig"):
        cfg.replace(moe=None)
    with pytest.raises(ValueError, match="top_k=9 must be in"):
        MoeConfig(E, 9, F_MOE)
