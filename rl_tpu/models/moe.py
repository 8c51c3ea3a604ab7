"""A mixture-of-experts feed-forward layer as Qwen3-MoE defines it, with routing replay.

Shape letters (as transformer.py's, plus): E experts, k experts per token (top-k), M = N_tok * k
token-expert pairs, N_tok the tokens of a batch flattened ([B, T] -> B*T).

Routing (Qwen3-MoE, `Qwen3MoeTopKRouter`): the router's logits [N_tok, E] = x @ router; a softmax
over all E in float32; the top-k probabilities and their experts; with `norm_topk_prob` the k
probabilities are renormalised to sum to 1. The token's output is the sum over its k experts of
weight x SwiGLU expert(x). Qwen3-MoE has no shared expert.

Dispatch is ragged, not capacity-based: the M token-expert pairs are sorted by expert and each
expert multiplies exactly its own rows (`jax.lax.ragged_dot`), so no token is ever dropped and
no capacity factor exists to tune; a capacity-based dispatch pads every expert to a fixed
number of slots and drops the tokens beyond it, which changes the model's function with the
batch's routing (and a sampler's and a learner's batches route differently).

On a mesh whose `expert` axis is larger than one, each device holds num_experts / expert of the
experts (their matrices split on `tensor` too, as a dense MLP's are) and the layer runs in
`shard_map` (`expert_parallel_swiglu`): the tokens, split over every batch axis, expert
included, are all-gathered over `expert`; each device computes its own experts' pairs of them;
a reduce-scatter over `expert` (and a sum over `tensor`) brings every token its output back.
That is Megatron's all-gather token dispatcher: no all-to-all and no capacity, so still no
token is dropped; the tokens gathered are those of one expert group, the activations'
share of the data-parallel batch times `expert`.

Routing replay (R3, arXiv 2510.11370): `replay` [N_tok, k] names the experts to use instead of
the router's own top-k (the experts the sampler chose for these tokens). The weights are still
the learner's softmax probabilities at those experts (renormalised as above), so the router
trains through the replayed choice; only the discrete selection is taken from the rollout.

The load-balancing loss is transformers' `load_balancing_loss_func` (Switch Transformer's
eqs. 4-6): over every MoE layer's logits pooled (not a mean of per-layer losses), E x the dot
of the share of top-k assignments per expert with the mean router probability per expert,
padding rows left out by a mask.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from rl_tpu import parallel

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """The sparse layers of a Qwen3-MoE config.json: `num_experts`, `num_experts_per_tok`
    (top_k), `moe_intermediate_size`, `norm_topk_prob`, `decoder_sparse_step`,
    `mlp_only_layers`, `router_aux_loss_coef`. A layer is sparse as transformers decides it:
    not in mlp_only_layers and (layer + 1) a multiple of decoder_sparse_step; the others keep
    the dense MLP of width `intermediate_size`."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001

    def __post_init__(self):
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"moe: top_k={self.top_k} must be in [1, num_experts="
                             f"{self.num_experts}]")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"moe: decoder_sparse_step={self.decoder_sparse_step} must be >= 1")

    def is_sparse(self, layer: int) -> bool:
        return (layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def sparse_layers(self, num_layers: int) -> tuple[int, ...]:
        return tuple(i for i in range(num_layers) if self.is_sparse(i))


def route(router_logits: Array, top_k: int, norm_topk_prob: bool,
          replay: Optional[Array] = None) -> tuple[Array, Array]:
    """(weights [N_tok, k] float32, experts [N_tok, k] int32) of router_logits [N_tok, E]:
    the router's own top-k, or the `replay` experts [N_tok, k] weighted by the router's
    probabilities there. A token whose replay holds a negative id (nothing was recorded for
    it: a sampler's reused prefix, a sequence's last id, padding) takes the router's own."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if replay is not None:
        if replay.shape != probs.shape[:-1] + (top_k,):
            raise ValueError(f"routing replay of shape {replay.shape}: expected "
                             f"{probs.shape[:-1] + (top_k,)} (tokens, top-k)")
        recorded = jnp.all(replay >= 0, axis=-1, keepdims=True)
        experts = jnp.where(recorded, replay.astype(jnp.int32), experts)
        weights = jnp.take_along_axis(probs, experts, axis=-1)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def expert_swiglu(x: Array, experts: Array, weights: Array, gate: Array, up: Array,
                  down: Array) -> Array:
    """sum_j weights[n, j] * down_e(silu(gate_e(x_n)) * up_e(x_n)) with e = experts[n, j].

    x [N_tok, D]; experts, weights [N_tok, k]; gate, up [E, D, F]; down [E, F, D]. Every pair
    is computed: the pairs are sorted by expert (stable, so ties keep token order) and each
    expert's rows are one group of a ragged matmul (one device holding every expert)."""
    return _local_expert_swiglu(x, experts, weights, gate, up, down, first=0)


def _local_expert_swiglu(x: Array, experts: Array, weights: Array, gate: Array, up: Array,
                         down: Array, first: Array) -> Array:
    """expert_swiglu over the pairs whose expert is one of this device's, gate/up/down
    [E_local, ...] holding experts first .. first + E_local - 1; the other pairs add nothing.
    The local pairs are sorted to the front by expert and the ragged matmuls' groups cover
    only them (ragged_dot leaves rows past its groups zero)."""
    k = experts.shape[1]
    local_experts = gate.shape[0]
    local = experts.reshape(-1) - first
    mine = (local >= 0) & (local < local_experts)
    key = jnp.where(mine, local, local_experts)  # the others sort last, in a group of their own
    order = jnp.argsort(key, stable=True)
    token_of = order // k
    group_sizes = jnp.bincount(key, length=local_experts + 1)[:local_experts].astype(jnp.int32)
    rows = x[token_of]
    g = jax.lax.ragged_dot(rows, gate, group_sizes)
    u = jax.lax.ragged_dot(rows, up, group_sizes)
    y = jax.lax.ragged_dot(nn.silu(g) * u, down, group_sizes)
    pair_weight = jnp.where(mine, weights.reshape(-1), 0.0)[order]
    y = y * pair_weight[:, None].astype(y.dtype)
    return jnp.zeros_like(x).at[token_of].add(y)


def expert_parallel_swiglu(x: Array, experts: Array, weights: Array, gate: Array, up: Array,
                           down: Array, mesh, rules=None) -> Array:
    """expert_swiglu with the experts split over `mesh`'s `expert` axis (module docstring).

    x [N_tok, D], experts and weights [N_tok, k]: their rows split as the batch's are (the
    `act_batch` rule); gate, up [E, D, F] and down [E, F, D] split on `expert` (and F on
    `tensor`, where it divides); the weights' fsdp split, if any, is gathered at the boundary
    as an fsdp layer's is."""
    rules = parallel.DEFAULT_RULES if rules is None else rules
    num_experts = gate.shape[0]
    ep = mesh.shape["expert"]
    if num_experts % ep:
        raise ValueError(f"mesh.expert={ep} does not divide the {num_experts} experts; use a "
                         "divisor of the expert count")
    rows = parallel.logical_to_spec(("act_batch", None), mesh, rules, x.shape)[0]
    row_axes = () if rows is None else (rows,) if isinstance(rows, str) else tuple(rows)
    gathered = "expert" in row_axes  # else every expert device already holds the same tokens
    f = gate.shape[2]
    tensor = "tensor" if mesh.shape["tensor"] > 1 and f % mesh.shape["tensor"] == 0 else None
    local_experts = num_experts // ep

    def local(x, experts, weights, gate, up, down):
        if gathered:
            x, experts, weights = (jax.lax.all_gather(a, "expert", tiled=True)
                                   for a in (x, experts, weights))
        first = jax.lax.axis_index("expert") * local_experts
        y = _local_expert_swiglu(x, experts, weights, gate, up, down, first)
        if tensor:
            y = jax.lax.psum(y, "tensor")
        if gathered:
            return jax.lax.psum_scatter(y, "expert", scatter_dimension=0, tiled=True)
        return jax.lax.psum(y, "expert")

    row_spec = P(rows, None)
    return jax.shard_map(
        local, mesh=mesh,
        in_specs=(row_spec, row_spec, row_spec, P("expert", None, tensor),
                  P("expert", None, tensor), P("expert", tensor, None)),
        out_specs=row_spec, check_vma=False)(x, experts, weights, gate, up, down)


def load_balancing_loss(router_logits: Sequence[Array], top_k: int,
                        mask: Optional[Array] = None) -> Array:
    """transformers' load-balancing loss of the MoE layers' router_logits (each [N_tok, E]),
    `mask` [N_tok] (1 a real token, 0 padding) applying to every layer alike."""
    num_experts = router_logits[0].shape[-1]
    assigned = jnp.zeros((num_experts,), jnp.float32)  # top-k assignments per expert
    prob_sum = jnp.zeros((num_experts,), jnp.float32)
    rows = jnp.zeros((), jnp.float32)
    for logits in router_logits:
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        _, chosen = jax.lax.top_k(probs, top_k)
        weight = (jnp.ones(probs.shape[:1], jnp.float32) if mask is None
                  else mask.reshape(-1).astype(jnp.float32))
        one_hot = jax.nn.one_hot(chosen, num_experts, dtype=jnp.float32)  # [N_tok, k, E]
        assigned = assigned + jnp.einsum("nke,n->e", one_hot, weight)
        prob_sum = prob_sum + jnp.einsum("ne,n->e", probs, weight)
        rows = rows + jnp.sum(weight)
    return num_experts * jnp.sum((assigned / rows) * (prob_sum / rows))


class MoeMLP(nn.Module):
    """Qwen3-MoE's sparse block: router `router` [D, E] (HF `mlp.gate.weight` [E, D],
    transposed) and experts `gate_proj`, `up_proj` [E, D, F], `down_proj` [E, F, D] (HF's
    per-expert [F, D] / [D, F] matrices, transposed and stacked).

    __call__(x [B, T, D], replay [B, T, k] = None) -> (out [B, T, D],
        {"router_logits": [B*T, E], "experts": [B*T, k] int32}): the logits for the
    load-balancing loss and the experts chosen (the router's, or the replayed ones)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # F, transformers' moe_intermediate_size
    norm_topk_prob: bool
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    mesh: Any = None  # with an `expert` axis over one device: expert_parallel_swiglu
    rules: Any = None

    @nn.compact
    def __call__(self, x: Array, replay: Optional[Array] = None):
        b, t, d = x.shape
        e, f = self.num_experts, self.intermediate_size
        init = nn.initializers.normal(stddev=0.02)

        def param(name, shape, axes):
            return self.param(name, nn.with_logical_partitioning(init, axes), shape,
                              self.param_dtype).astype(self.dtype)

        router = param("router", (d, e), ("embed", None))
        gate = param("gate_proj", (e, d, f), ("expert", "embed", "mlp"))
        up = param("up_proj", (e, d, f), ("expert", "embed", "mlp"))
        down = param("down_proj", (e, f, d), ("expert", "mlp", "embed"))
        flat = x.astype(self.dtype).reshape(b * t, d)
        logits = flat @ router  # [N_tok, E]
        weights, experts = route(logits, self.top_k, self.norm_topk_prob,
                                 None if replay is None else replay.reshape(b * t, self.top_k))
        if self.mesh is not None and self.mesh.shape["expert"] > 1:
            out = expert_parallel_swiglu(flat, experts, weights, gate, up, down, self.mesh,
                                         self.rules)
        else:
            out = expert_swiglu(flat, experts, weights, gate, up, down)
        return out.reshape(b, t, d), {"router_logits": logits, "experts": experts}


def routing_mismatch(router_logits: Sequence[Array], recorded: Array, top_k: int,
                     mask: Array) -> tuple[Array, Array]:
    """(share, count): of the token-layer routings `recorded` [B, T, S, k] (a sampler's
    experts, -1 where none) on tokens where `mask` [B, T] is set, the share whose expert set
    differs from the router's own top-k of `router_logits` (each sparse layer's [B*T, E]),
    and how many were compared. Sets, not orders: top-k's order is that of the probabilities,
    which a replay does not keep."""
    b, t, s, k = recorded.shape
    own = jnp.stack([jax.lax.top_k(logits.astype(jnp.float32), top_k)[1]
                     for logits in router_logits], axis=1).reshape(b, t, s, k)
    same = jnp.all(jnp.sort(own, axis=-1) == jnp.sort(recorded, axis=-1), axis=-1)
    counted = jnp.all(recorded >= 0, axis=-1) & mask.astype(bool)[:, :, None]
    count = jnp.sum(counted)
    share = jnp.sum(counted & ~same) / jnp.maximum(count, 1)
    return share.astype(jnp.float32), count.astype(jnp.float32)


def sown_routing(intermediates: dict, num_layers: int) -> tuple[list[Array], Optional[Array]]:
    """(router logits of each sparse layer [N_tok, E], in layer order; their chosen experts
    stacked [N_tok, sparse layers, k], or None without sparse layers) from the "intermediates"
    a Transformer's apply(..., mutable=["intermediates"]) returns (scanned layers sow theirs
    stacked [L, ...] under "layers")."""
    if "layers" in intermediates:
        stacked = intermediates["layers"]
        return (list(stacked["router_logits"][0]),
                jnp.moveaxis(stacked["experts"][0], 0, 1))
    logits, experts = [], []
    for i in range(num_layers):
        sown = intermediates.get(f"layers_{i}", {})
        if "router_logits" in sown:
            logits.append(sown["router_logits"][0])
            experts.append(sown["experts"][0])
    return logits, (jnp.stack(experts, axis=1) if experts else None)
