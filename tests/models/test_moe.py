"""Qwen3-MoE's sparse block against transformers' own (`Qwen3MoeSparseMoeBlock`, fp32, random
weights): outputs, router logits, chosen experts, gradients and the load-balancing loss; and
routing replay, by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf_moe
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig

from rl_tpu.models.moe import MoeMLP, expert_swiglu, load_balancing_loss, route

D, F, E, K = 16, 12, 8, 2
B, T = 2, 5
ATOL = 2e-6  # fp32: sums of 16-12 products, added in another order than torch's


def _hf_block(norm_topk_prob: bool, seed: int = 0):
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=F, num_experts=E,
                            num_experts_per_tok=K, norm_topk_prob=norm_topk_prob,
                            hidden_act="silu")
    block = hf_moe.Qwen3MoeSparseMoeBlock(config).float()
    with torch.no_grad():  # HF starts the router at zeros; random, so the top-k is not a tie
        block.gate.weight.normal_(0, 0.5)
        block.experts.gate_up_proj.normal_(0, 0.3)
        block.experts.down_proj.normal_(0, 0.3)
    return block


def _our_params(block) -> dict:
    gate_up = block.experts.gate_up_proj.detach().numpy()  # [E, 2F, D]
    return {"router": block.gate.weight.detach().numpy().T,  # [D, E]
            "gate_proj": gate_up[:, :F, :].transpose(0, 2, 1),  # [E, D, F]
            "up_proj": gate_up[:, F:, :].transpose(0, 2, 1),
            "down_proj": block.experts.down_proj.detach().numpy().transpose(0, 2, 1)}  # [E, F, D]


def _ours(norm_topk_prob: bool) -> MoeMLP:
    return MoeMLP(num_experts=E, top_k=K, intermediate_size=F, norm_topk_prob=norm_topk_prob)


def _x(seed: int = 1) -> np.ndarray:
    return np.random.RandomState(seed).randn(B, T, D).astype(np.float32)


@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["normed", "raw"])
def test_outputs_router_logits_and_experts_equal_transformers(norm_topk_prob):
    block, x = _hf_block(norm_topk_prob), _x()
    with torch.no_grad():
        want = block(torch.from_numpy(x)).numpy()
        hf_logits, hf_weights, hf_experts = block.gate(torch.from_numpy(x).reshape(-1, D))
    out, aux = _ours(norm_topk_prob).apply({"params": _our_params(block)}, jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(out), want, atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(aux["router_logits"]), hf_logits.numpy(), atol=ATOL,
                               rtol=0)
    np.testing.assert_array_equal(np.asarray(aux["experts"]), hf_experts.numpy())
    weights, _ = route(aux["router_logits"], K, norm_topk_prob)
    np.testing.assert_allclose(np.asarray(weights), hf_weights.numpy(), atol=1e-6, rtol=0)
    if norm_topk_prob:
        np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, atol=1e-6)


def test_gradients_equal_transformers():
    """d sum(out * r) by x, the router and every expert matrix: the router trains through
    the top-k weights, each expert through its own tokens only."""
    block, x = _hf_block(True), _x()
    r = np.random.RandomState(2).randn(B, T, D).astype(np.float32)
    xt = torch.from_numpy(x).requires_grad_(True)
    (block(xt) * torch.from_numpy(r)).sum().backward()

    def loss(params, x):
        out, _ = _ours(True).apply({"params": params}, x)
        return jnp.sum(out * r)

    grads, dx = jax.grad(loss, argnums=(0, 1))(
        jax.tree.map(jnp.asarray, _our_params(block)), jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(dx), xt.grad.numpy(), atol=1e-5, rtol=0)
    hf_gate_up = block.experts.gate_up_proj.grad.numpy()
    want = {"router": block.gate.weight.grad.numpy().T,
            "gate_proj": hf_gate_up[:, :F, :].transpose(0, 2, 1),
            "up_proj": hf_gate_up[:, F:, :].transpose(0, 2, 1),
            "down_proj": block.experts.down_proj.grad.numpy().transpose(0, 2, 1)}
    for name, w in want.items():
        assert np.abs(w).max() > 0, name  # the check below compares something
        np.testing.assert_allclose(np.asarray(grads[name]), w, atol=1e-5, rtol=0, err_msg=name)


@pytest.mark.parametrize("masked", [False, True], ids=["all_tokens", "padding_masked"])
def test_load_balancing_loss_equals_transformers(masked):
    rng = np.random.RandomState(3)
    layers = [rng.randn(B * T, E).astype(np.float32) * 2 for _ in range(3)]
    mask = (rng.rand(B, T) > 0.3).astype(np.int64) if masked else None
    want = hf_moe.load_balancing_loss_func(
        tuple(torch.from_numpy(g) for g in layers), E, K,
        None if mask is None else torch.from_numpy(mask))
    got = load_balancing_loss([jnp.asarray(g) for g in layers], K,
                              None if mask is None else jnp.asarray(mask))
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)


def test_a_uniform_router_costs_exactly_top_k():
    """Worked by hand: equal logits give every expert probability 1/E, and the top-k
    assignments spread over the experts sum to k per token, so E x sum_e (share_e x 1/E) = k
    whatever the spread."""
    got = load_balancing_loss([jnp.zeros((B * T, E))], K)
    assert float(got) == pytest.approx(K, rel=1e-6)


def test_replaying_the_routers_own_choice_changes_nothing():
    block, x = _hf_block(True), jnp.asarray(_x())
    params = {"params": _our_params(block)}
    out, aux = _ours(True).apply(params, x)
    replayed, aux2 = _ours(True).apply(params, x, aux["experts"].reshape(B, T, K))
    np.testing.assert_array_equal(np.asarray(replayed), np.asarray(out))
    np.testing.assert_array_equal(np.asarray(aux2["experts"]), np.asarray(aux["experts"]))


def test_replayed_experts_are_weighted_by_the_learners_probabilities():
    """Replay experts 6 and 3 for every token: each token's output is, by hand (numpy), its
    router's probabilities at 6 and 3 renormalised, times those two experts' SwiGLU."""
    block, x = _hf_block(True), _x()
    p = _our_params(block)
    replay = np.broadcast_to(np.array([6, 3], np.int32), (B, T, K))
    out, aux = _ours(True).apply({"params": p}, jnp.asarray(x), jnp.asarray(replay))
    np.testing.assert_array_equal(np.asarray(aux["experts"]), replay.reshape(-1, K))
    flat = x.reshape(-1, D)
    logits = flat @ p["router"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    w = probs[:, [6, 3]] / probs[:, [6, 3]].sum(-1, keepdims=True)

    def expert(e, v):
        g, u = v @ p["gate_proj"][e], v @ p["up_proj"][e]
        return (g / (1 + np.exp(-g)) * u) @ p["down_proj"][e]

    want = w[:, :1] * expert(6, flat) + w[:, 1:] * expert(3, flat)
    np.testing.assert_allclose(np.asarray(out).reshape(-1, D), want, atol=1e-5, rtol=0)
    own = np.asarray(_ours(True).apply({"params": p}, jnp.asarray(x))[1]["experts"])
    assert not (own == replay.reshape(-1, K)).all()  # the replay changed the selection


def test_tokens_with_nothing_recorded_take_the_routers_own_experts():
    """-1 (a reused prefix, a last id, padding): those tokens route as without replay, the
    others take the replayed experts."""
    block, x = _hf_block(True), jnp.asarray(_x())
    params = {"params": _our_params(block)}
    own_out, own = _ours(True).apply(params, x)
    replay = np.broadcast_to(np.array([6, 3], np.int32), (B, T, K)).copy()
    replay[:, ::2] = -1  # every second token unrecorded
    out, aux = _ours(True).apply(params, x, jnp.asarray(replay))
    got, own_experts = np.asarray(aux["experts"]).reshape(B, T, K), np.asarray(
        own["experts"]).reshape(B, T, K)
    np.testing.assert_array_equal(got[:, ::2], own_experts[:, ::2])
    np.testing.assert_array_equal(got[:, 1::2], replay[:, 1::2])
    np.testing.assert_allclose(np.asarray(out)[:, ::2], np.asarray(own_out)[:, ::2],
                               atol=1e-6, rtol=0)


def test_no_pair_is_dropped_when_every_token_picks_the_same_experts():
    """The worst imbalance a capacity-based dispatch drops tokens in: all pairs on expert 0
    and 1. Ragged dispatch computes each of them: the output equals every token's own sum."""
    rng = np.random.RandomState(4)
    x = rng.randn(7, D).astype(np.float32)
    gate, up = (rng.randn(E, D, F).astype(np.float32) * 0.3 for _ in range(2))
    down = rng.randn(E, F, D).astype(np.float32) * 0.3
    experts = np.tile(np.array([[1, 0]], np.int32), (7, 1))
    weights = rng.rand(7, K).astype(np.float32)
    out = np.asarray(expert_swiglu(*map(jnp.asarray, (x, experts, weights, gate, up, down))))

    def expert(e, v):
        g, u = v @ gate[e], v @ up[e]
        return (g / (1 + np.exp(-g)) * u) @ down[e]

    want = weights[:, :1] * expert(1, x) + weights[:, 1:] * expert(0, x)
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=0)


def test_a_replay_of_the_wrong_shape_is_refused():
    with pytest.raises(ValueError, match=r"routing replay of shape \(10, 3\).*\(10, 2\)"):
        route(jnp.zeros((10, E)), K, True, jnp.zeros((10, 3), jnp.int32))
