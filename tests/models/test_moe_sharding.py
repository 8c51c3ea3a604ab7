"""Qwen3-MoE with its experts split over the mesh's `expert` axis (8 fake CPU devices) equals
the same model on one device: logits, router logits, the load-balancing loss and the gradient
of every parameter, with and without routing replay; the rows split over `expert` (tokens
all-gathered, outputs reduce-scattered) and rows too few to split (every expert device holds
them all, outputs summed)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from rl_tpu import parallel
from rl_tpu.models.moe import MoeConfig, load_balancing_loss, sown_routing
from rl_tpu.models.transformer import ModelConfig, Transformer

# float32 sums in another order (a reduce-scatter instead of one scatter-add): 1e-5 relative
TOL = 1e-5
E, K = 8, 2
CFG = ModelConfig(arch="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=48,
                  num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                  moe=MoeConfig(E, K, 16, True, 1, (1,), 0.01))
SPARSE = len(CFG.moe.sparse_layers(CFG.num_layers))
MESHES = {  # name -> axes over the 8 devices
    "data2_expert4": {"data": 2, "expert": 4},
    "fsdp2_expert2_tensor2": {"fsdp": 2, "expert": 2, "tensor": 2},
}


def _loss(model, params, ids, replay):
    logits, state = model.apply({"params": params}, ids, routing_replay=replay,
                                mutable=["intermediates"])
    router_logits, experts = sown_routing(state["intermediates"], CFG.num_layers)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    nll = -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))
    aux = load_balancing_loss(router_logits, K)
    return nll + CFG.moe.router_aux_loss_coef * aux, (logits, router_logits, experts, aux)


def _run(mesh, params, ids, replay):
    model = Transformer(CFG, mesh=mesh)
    fn = jax.jit(jax.value_and_grad(lambda p, i, r: _loss(model, p, i, r), has_aux=True))
    (loss, (logits, router_logits, experts, aux)), grads = fn(params, ids, replay)
    return jax.tree.map(np.asarray, dict(loss=loss, logits=logits, router=router_logits,
                                         experts=experts, aux=aux, grads=grads))


@pytest.fixture(scope="module")
def params():
    ids = jnp.zeros((2, 8), jnp.int32)
    return nn.meta.unbox(jax.jit(Transformer(CFG).init)(jax.random.key(0), ids))["params"]


def _inputs(rows, length, seed):
    rng = np.random.RandomState(seed)
    ids = rng.randint(0, CFG.vocab_size, (rows, length)).astype(np.int32)
    # replayed experts: k distinct experts per token and sparse layer
    replay = np.stack([rng.permutation(E)[:K] for _ in range(rows * length * SPARSE)])
    return ids, replay.reshape(rows, length, SPARSE, K).astype(np.int32)


@pytest.mark.parametrize("replayed", [False, True], ids=["router", "replay"])
@pytest.mark.parametrize("rows,length", [(8, 12), (3, 5)], ids=["rows_split", "rows_whole"])
@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_experts_split_over_the_mesh_equal_one_device(params, mesh_name, rows, length, replayed):
    mesh = parallel.make_mesh(MESHES[mesh_name])
    ids, replay = _inputs(rows, length, seed=rows)
    replay = replay if replayed else None
    want = _run(None, params, ids, replay)
    abstract, names = parallel.logical_axes_of(Transformer(CFG, mesh=mesh), jnp.asarray(ids))
    sharded = jax.device_put(params, parallel.param_shardings(abstract, names, mesh))
    expert_weight = sharded["layers_0"]["mlp"]["gate_proj"]
    assert expert_weight.sharding.spec[0] == "expert"  # each device holds only its experts

    def rows_split(x):  # on the batch axes where the rows divide, else whole on every device
        names = ("act_batch",) + (None,) * (x.ndim - 1)
        return jax.device_put(x, NamedSharding(mesh, parallel.logical_to_spec(names, mesh,
                                                                               shape=x.shape)))
    got = _run(mesh, sharded, rows_split(ids), None if replay is None else rows_split(replay))
    np.testing.assert_allclose(got["logits"], want["logits"], rtol=TOL, atol=TOL)
    for ours, theirs in zip(got["router"], want["router"]):
        np.testing.assert_allclose(ours, theirs, rtol=TOL, atol=TOL)
    np.testing.assert_array_equal(got["experts"], want["experts"])
    if replay is not None:
        np.testing.assert_array_equal(got["experts"], replay.reshape(-1, SPARSE, K))
    np.testing.assert_allclose(got["aux"], want["aux"], rtol=TOL)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=TOL)
    flat_got = jax.tree_util.tree_leaves_with_path(got["grads"])
    flat_want = dict(jax.tree_util.tree_leaves_with_path(want["grads"]))
    for path, g in flat_got:
        np.testing.assert_allclose(g, flat_want[path], rtol=TOL, atol=TOL,
                                   err_msg=jax.tree_util.keystr(path))


def test_scanned_layers_split_over_the_mesh_equal_one_device():
    """Scanned layers (every one sparse) run the expert-parallel layer inside the scan."""
    cfg = ModelConfig(**{**CFG.__dict__, "moe": MoeConfig(E, K, 16, True, 1, (), 0.01),
                         "scan_layers": True})
    ids = jnp.asarray(_inputs(8, 12, seed=0)[0])
    mesh = parallel.make_mesh(MESHES["fsdp2_expert2_tensor2"])
    params = parallel.init_params(Transformer(cfg, mesh=mesh), mesh, parallel.DEFAULT_RULES,
                                  jax.random.key(1), ids)
    assert params["layers"]["mlp"]["gate_proj"].sharding.spec[:2] == (None, "expert")

    def loss(model, p):
        return jnp.mean(model.apply({"params": p}, ids) ** 2)

    got = jax.jit(jax.value_and_grad(lambda p: loss(Transformer(cfg, mesh=mesh), p)))(params)
    want = jax.jit(jax.value_and_grad(lambda p: loss(Transformer(cfg), p)))(
        jax.device_get(params))
    np.testing.assert_allclose(got[0], want[0], rtol=TOL)
    for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        scale = float(np.abs(np.asarray(w)).max())
        assert scale > 0
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=TOL * scale)


def test_an_expert_axis_that_does_not_divide_the_experts_is_refused(params):
    mesh = parallel.make_mesh({"data": 1, "expert": 8, "tensor": 1})
    small = ModelConfig(**{**CFG.__dict__, "moe": MoeConfig(4, K, 16, True, 1, (1,), 0.01)})
    ids = jnp.zeros((8, 4), jnp.int32)
    with pytest.raises(ValueError, match="mesh.expert=8 does not divide the 4 experts"):
        jax.eval_shape(lambda: Transformer(small, mesh=mesh).init(jax.random.key(0), ids))
