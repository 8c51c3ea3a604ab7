"""Routing replay on the learner's side (a tiny Qwen3-MoE): the policy step replays a batch's
routed_experts, adds the routers' load-balancing loss, and measures how often its own routing
differs from the recorded one; episodes merge an engine's records and the batch stacks them."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rl_tpu.agent.loop import Episode
from rl_tpu.core.env import Task
from rl_tpu.core.trajectory import Trajectory
from rl_tpu.models import tiny
from rl_tpu.models.moe import load_balancing_loss, sown_routing
from rl_tpu.models.transformer import Transformer
from rl_tpu.rl.losses import PolicyLossConfig
from rl_tpu.train import steps
from rl_tpu.train.rollout_batch import trajectories_to_batch
from rl_tpu.train.state import TrainState

V, B, T = 96, 4, 12
CFG = tiny.tiny_config("qwen3_moe", vocab_size=V, hidden_size=32, intermediate_size=48,
                       head_dim=8)
MODEL = Transformer(CFG)
S, K, E = len(CFG.moe.sparse_layers(CFG.num_layers)), CFG.moe.top_k, CFG.moe.num_experts


@pytest.fixture(scope="module")
def params():
    return tiny.random_params(CFG, seed=0, scale=0.5)


@pytest.fixture(scope="module")
def batch(params):
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, V, (B, T)).astype(np.int32)
    mask = np.zeros((B, T), bool)
    mask[:, 4:] = True
    segment_ids = np.ones((B, T), np.int32)
    segment_ids[0, -3:] = 0  # a padded row end
    mask[0, -3:] = False
    _, state = MODEL.apply({"params": params}, jnp.asarray(tokens), mutable=["intermediates"])
    _, own = sown_routing(state["intermediates"], CFG.num_layers)
    return dict(tokens=tokens, loss_mask=mask, segment_ids=segment_ids,
                positions=np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy(),
                old_logprobs=np.full((B, T), -4.0, np.float32),
                advantages=rng.randn(B).astype(np.float32),
                routed_experts=np.asarray(own).reshape(B, T, S, K))


def _step(params, batch, replay: bool):
    step = steps.make_policy_step(MODEL, PolicyLossConfig(),
                                  steps.StepConfig(routing_replay=replay))
    state, metrics = jax.jit(step)(TrainState.create(params, optax.sgd(1.0)), batch)
    return state.params, {k: float(v) for k, v in metrics.items()}


def test_replaying_the_learners_own_routing_changes_nothing_and_mismatches_nowhere(params,
                                                                                  batch):
    plain, m_plain = _step(params, {k: v for k, v in batch.items()
                                    if k != "routed_experts"}, replay=False)
    replayed, m_replay = _step(params, batch, replay=True)
    assert m_replay["routing_mismatch"] == 0.0
    assert "routing_mismatch" not in m_plain  # nothing recorded, nothing measured
    assert m_replay["loss"] == m_plain["loss"]
    # the same function; the gradient reaches the router's probabilities through a gather
    # instead of top_k's values, which sums in another order: float32 rounding apart
    for a, b in zip(jax.tree.leaves(replayed), jax.tree.leaves(plain), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)


def test_a_different_recorded_routing_is_measured_and_replayed(params, batch):
    shifted = dict(batch, routed_experts=(batch["routed_experts"] + 1) % E)
    measured, m_measured = _step(params, shifted, replay=False)
    replayed, m_replayed = _step(params, shifted, replay=True)
    # top-2 of 8 moved by one: {a, b} -> {a+1, b+1} is never the same set, so against the
    # router's own routing every counted one differs; under replay the later layer's router
    # sees other hidden states (the first layer ran other experts) and may happen to agree
    assert m_measured["routing_mismatch"] == 1.0
    assert 0.9 < m_replayed["routing_mismatch"] <= 1.0
    plain, m_plain = _step(params, {k: v for k, v in batch.items() if k != "routed_experts"},
                           replay=False)
    assert m_measured["loss"] == m_plain["loss"]  # measured only: the forward is the router's
    assert m_replayed["loss"] != m_plain["loss"]  # replayed: other experts, another loss


def test_the_mismatch_share_counts_recorded_policy_tokens_only(params, batch):
    """Half of the routings moved, the rest unrecorded (-1) or outside the loss mask."""
    routed = batch["routed_experts"].copy()
    routed[:, 4:8] = (routed[:, 4:8] + 1) % E  # moved on 4 policy tokens a row
    routed[:, 8:10] = -1  # 2 policy tokens a row unrecorded
    _, m = _step(params, dict(batch, routed_experts=routed), replay=False)
    # rows 1-3: policy tokens 4..11 (8), row 0: 4..8 (5, the last 3 are padding); moved 4
    # a row; counted: 8 - 2 unrecorded = 6 a row, row 0: 5 - 1 (its token 9 is padding) = 4
    assert m["routing_mismatch"] == pytest.approx((4 * 4) / (6 * 3 + 4))


def test_the_router_aux_loss_is_transformers_over_the_real_tokens(params, batch):
    _, m = _step(params, batch, replay=False)
    _, state = MODEL.apply({"params": params}, jnp.asarray(batch["tokens"]),
                           mutable=["intermediates"])
    logits, _ = sown_routing(state["intermediates"], CFG.num_layers)
    want = load_balancing_loss(logits, K, jnp.asarray(batch["segment_ids"] > 0))
    assert m["router_aux_loss"] == pytest.approx(float(want), rel=1e-6)
    assert 0.9 < m["router_aux_loss"] < 1.5 * K  # top_k for a uniform router, ~1e-1 off


def test_a_replay_without_the_recorded_routing_is_refused(params, batch):
    with pytest.raises(ValueError, match="routing replay needs the batch's 'routed_experts'"):
        _step(params, {k: v for k, v in batch.items() if k != "routed_experts"}, replay=True)


def test_an_episode_merges_each_passes_routing_the_latest_winning():
    ep = Episode(0, Task("t"), group_id=0, sample_index=0)
    ep.extend([1, 2, 3], generated=False, turn=-1)
    ep.extend([4, 5], generated=True, turn=0, logprobs=[0.0, 0.0], versions=[0, 0])
    first = np.arange(4 * S * K, dtype=np.int32).reshape(4, S, K) % E  # ids 0-3 fed
    ep.record_routing(first)
    ep.extend([6, 7], generated=False, turn=0)  # an observation
    ep.extend([8], generated=True, turn=1, logprobs=[0.0], versions=[1])
    second = np.full((7, S, K), -1, np.int32)  # a reused prefix of 3 ids, then 3..6 computed
    second[3:] = 7
    ep.record_routing(second)
    got = ep.routed_experts()
    assert got.shape == (8, S, K)
    np.testing.assert_array_equal(got[:3], first[:3])  # not recomputed: the first pass's
    assert (got[3:7] == 7).all()  # recomputed (id 3) or first computed (4-6): the second's
    assert (got[7] == -1).all()  # the last id was never fed


def _trajectory(n, routed):
    return Trajectory(tokens=np.arange(n, dtype=np.int32), loss_mask=np.ones(n, bool),
                      behaviour_logprobs=np.zeros(n, np.float32),
                      turn_ids=np.zeros(n, np.int32), rewards=[1.0], reward=1.0, success=True,
                      num_turns=1, weight_versions=[0], task_id="t", group_id=0,
                      finish="done", messages=[], info={}, routed_experts=routed)


def test_the_batch_stacks_routing_with_minus_one_where_nothing_was_recorded():
    routed = np.full((3, S, K), 5, np.int32)
    batch = trajectories_to_batch([_trajectory(3, routed), _trajectory(2, None)],
                                  length_buckets=(4,), row_multiple=4)
    got = batch.check().routed_experts
    assert got.shape == (4, 4, S, K)
    assert (got[0, :3] == 5).all() and (got[0, 3:] == -1).all() and (got[1:] == -1).all()
    plain = trajectories_to_batch([_trajectory(3, None)], length_buckets=(4,))
    assert plain.routed_experts is None
