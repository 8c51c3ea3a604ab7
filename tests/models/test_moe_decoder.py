"""The Qwen3-MoE decoder against transformers' `Qwen3MoeForCausalLM` (fp32, random tiny
configs, 1e-4 max abs as the dense families' parity): logits, every sparse layer's router logits,
the load-balancing loss as the HF model reports it, with a dense layer among the sparse ones
(mlp_only_layers, decoder_sparse_step); routing replay through the whole model; the KV-cached
path; the checkpoint read and written as the hub's (one safetensors tensor per expert)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from rl_tpu.models import hf
from rl_tpu.models.moe import MoeConfig, load_balancing_loss, sown_routing
from rl_tpu.models.transformer import ModelConfig, Transformer, init_cache, unstack_layers

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
                       max_position_embeddings=hf_cfg.max_position_embeddings,
                       moe=MoeConfig(E, K, F_MOE, True, step, tuple(mlp_only), 0.01))
    return hf_cfg, ours


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def pair(request, tmp_path_factory):
    """transformers' model, saved as the hub's checkpoints are (one tensor per expert), and
    rl_tpu's hf.load of that directory."""
    hf_cfg, cfg = _configs(*LAYOUTS[request.param])
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # bigger than init (the router starts at zero: every choice a tie)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ids = np.random.RandomState(1).randint(0, V, (2, 24)).astype(np.int32)
    with torch.no_grad():
        out = model(torch.from_numpy(ids).long(), labels=torch.from_numpy(ids).long())
    out_dir = str(tmp_path_factory.mktemp(request.param))
    model.save_pretrained(out_dir)
    loaded_cfg, params = hf.load(out_dir)
    return dict(cfg=cfg, loaded_cfg=loaded_cfg, params=params, ids=ids, torch=out,
                hf_cfg=hf_cfg, dir=out_dir)


def test_config_json_reads_as_the_same_config(pair):
    assert pair["loaded_cfg"] == pair["cfg"]


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


def test_save_reloads_in_transformers_with_the_same_logits(pair, tmp_path):
    hf.save(str(tmp_path / "out"), pair["cfg"], pair["params"])
    with torch.no_grad():
        reloaded = Qwen3MoeForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
        logits = reloaded(torch.from_numpy(pair["ids"]).long()).logits.numpy()
    np.testing.assert_array_equal(logits, pair["torch"].logits.numpy())
    cfg, params = hf.load(str(tmp_path / "out"))  # and back: the same params
    assert cfg == pair["cfg"]
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(pair["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_checkpoint_missing_an_expert_is_refused_naming_it(pair, tmp_path):
    import shutil
    from safetensors.numpy import load_file, save_file
    shutil.copytree(pair["dir"], tmp_path / "m")
    file = str(tmp_path / "m" / "model.safetensors")
    tensors = load_file(file)
    first = min(pair["cfg"].moe.sparse_layers(pair["cfg"].num_layers))
    del tensors[f"model.layers.{first}.mlp.experts.5.up_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(hf.CheckpointError,
                       match=rf"missing tensors 'model.layers.{first}.mlp.experts.5.up_proj"):
        hf.check_model_dir(str(tmp_path / "m"))


def test_scanned_layers_read_route_replay_train_and_save_as_the_unscanned(pair, tmp_path):
    """Every layer sparse: the hub's checkpoint read into scanned layers ([L, X, ...] experts)
    gives transformers' logits and router logits, the same gradients as the unscanned
    layers, replays routing alike, and saves the hub's tensors back; dense layers among
    the sparse ones cannot scan and are refused naming them."""
    cfg, ids = pair["cfg"], jnp.asarray(pair["ids"])
    if len(cfg.moe.sparse_layers(cfg.num_layers)) != cfg.num_layers:
        with pytest.raises(ValueError, match=r"this one has dense layers \[\d"):
            cfg.replace(scan_layers=True)
        return
    scan_cfg, scanned = hf.load(pair["dir"], scan_layers=True)
    assert scanned["layers"]["mlp"]["gate_proj"].shape == (cfg.num_layers, E, D, F_MOE)
    logits, state = _apply(scan_cfg, scanned, ids)
    np.testing.assert_allclose(np.asarray(logits), pair["torch"].logits.numpy(), atol=TOL, rtol=0)
    router_logits, experts = sown_routing(state["intermediates"], cfg.num_layers)
    want_logits, want_state = _apply(cfg, pair["params"], ids)
    want_router, want_experts = sown_routing(want_state["intermediates"], cfg.num_layers)
    for ours, theirs in zip(router_logits, want_router, strict=True):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=TOL, rtol=0)
    np.testing.assert_array_equal(np.asarray(experts), np.asarray(want_experts))
    shifted = ((experts + 1) % E).reshape(ids.shape + experts.shape[1:])
    np.testing.assert_allclose(np.asarray(_apply(scan_cfg, scanned, ids, routing_replay=shifted)[0]),
                               np.asarray(_apply(cfg, pair["params"], ids,
                                                 routing_replay=shifted)[0]), atol=TOL, rtol=0)

    def loss(params, c):
        return jnp.sum(Transformer(c).apply({"params": params}, ids) ** 2)

    grads = unstack_layers(jax.grad(loss)(scanned, scan_cfg), cfg.num_layers)
    want = jax.grad(loss)(pair["params"], cfg)
    for path, g in jax.tree_util.tree_leaves_with_path(want):
        got = grads
        for key in path:
            got = got[key.key]
        # float32 sums in another order (a scan's loop): 1e-6 of the tensor's largest entry
        scale = float(np.abs(np.asarray(g)).max())
        np.testing.assert_allclose(np.asarray(got), np.asarray(g), atol=1e-6 * scale, rtol=0,
                                   err_msg=jax.tree_util.keystr(path))
    hf.save(str(tmp_path / "out"), scan_cfg, scanned)
    _, again = hf.load(str(tmp_path / "out"))
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(pair["params"]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_what_moe_does_not_support_yet_is_refused_by_name():
    _, cfg = _configs(2, 1, ())
    with pytest.raises(ValueError, match="arch qwen3_moe needs a MoeConfig"):
        cfg.replace(moe=None)
    with pytest.raises(ValueError, match="top_k=9 must be in"):
        MoeConfig(E, 9, F_MOE)
