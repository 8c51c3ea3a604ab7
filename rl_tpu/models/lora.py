"""LoRA: low-rank adapters on a frozen base, with PEFT's definitions of rank, alpha, dropout
and init.

A targeted projection y = x W (+ b) becomes

    y = x W (+ b) + scale * (dropout(x) A) B,    scale = alpha / r   (alpha / sqrt(r): rsLoRA)

with A [in..., r] and B [r, out...] beside the kernel in the same module scope
(`.../q_proj/lora_a`, `.../q_proj/lora_b`), so the adapters of layer i of the attention's q
projection live at `layers_i/attn/q_proj/lora_{a,b}` (with `scan_layers`, one stacked
`layers/attn/q_proj/lora_{a,b}` whose leading dim is the layer). PEFT's `lora_A.weight`
[r, in] and `lora_B.weight` [out, r] are these transposed (peft_format.py).

Init as PEFT's `init_lora_weights`: True ("default") draws A from kaiming-uniform with
a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in)), and B = 0; "gaussian" draws A from a normal
of standard deviation 1/r.
B = 0 makes a fresh adapter the base model exactly.

Why a module of our own and not qwix's LoRA provider: qwix intercepts `lax.dot_general`
inside the module it rewrites, but the projections here run a custom-VJP dot
(dense.py: the CPU-ordered weight gradient), inside which the intercepted call would create
params under a custom_vjp trace; and the adapters must carry PEFT's init, names and layout
(for export and parity with `peft`), logical axis names (for sharding) and dtype (fp32 over
a bf16 base). That is ~100 lines here.

Adapters are always float32 params (`ADAPTER_DTYPE`), computed in the model's compute dtype:
a bf16 base keeps its memory, the adapters and their optimizer moments keep fp32.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
INITS = ("default", "gaussian")
ADAPTER_KEYS = ("lora_a", "lora_b")
ADAPTER_DTYPE = jnp.float32
# How the embedded sampler runs a LoRA policy (rollout/adapter_weights.py): "merge" folds each
# sync's adapters into a copy of the adapted kernels and runs the plain model; "lowrank" runs
# the adapters beside the frozen base, holding it once.
SAMPLER_MODES = ("merge", "lowrank")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """PEFT's `LoraConfig` fields that change the math: r, lora_alpha, lora_dropout,
    target_modules, init_lora_weights, use_rslora; and how the embedded sampler runs the
    adapters (`sampler`, one of SAMPLER_MODES: the run config's `model.lora.sampler`), which
    travels with them so that whoever builds a sampler reads it from the model config.
    Hashable (part of ModelConfig). Whether a model config has LoRA on: `is_on`."""

    rank: int = 8
    alpha: float = 8.0
    dropout: float = 0.0
    targets: tuple[str, ...] = TARGETS
    init: str = "default"  # default (PEFT's True: kaiming-uniform A) | gaussian
    rslora: bool = False  # scale alpha / sqrt(r) instead of alpha / r
    # > 0: a serving model's K adapter slots (adapter_slots.py): lora_a [K, in..., r] and
    # lora_b [K, r, out...], each row of a batch computing with the slot `adapter_rows` names
    slots: int = 0
    sampler: str = "merge"  # SAMPLER_MODES; changes no training math

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"lora rank={self.rank} must be >= 1 (model.lora.rank=0 turns "
                             "LoRA off)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora dropout={self.dropout} must be in [0, 1)")
        unknown = sorted(set(self.targets) - set(TARGETS))
        if unknown or not self.targets:
            raise ValueError(f"lora targets {list(self.targets)}: {unknown or 'none given'}; "
                             f"choose among {list(TARGETS)}")
        if self.init not in INITS:
            raise ValueError(f"lora init={self.init!r}; choose one of {INITS}")
        if self.slots < 0:
            raise ValueError(f"lora slots={self.slots} must be >= 0 (0: one adapter)")
        if self.sampler not in SAMPLER_MODES:
            raise ValueError(f"lora sampler={self.sampler!r}; choose one of {SAMPLER_MODES}")

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


def is_on(model_cfg) -> bool:
    """Whether LoRA is on for `model_cfg` (a ModelConfig: its `lora` is set): the one question
    to ask of a config. A run config turns it on with `model.lora.rank` > 0, read in one place
    only, where that block becomes a LoraConfig (recipes/policy_io.lora_config). Of a params
    tree, ask `has_adapters`."""
    return model_cfg.lora is not None


def init_a(key, shape, dtype, cfg: LoraConfig, in_ndim: int):
    """A [in..., r]: PEFT's kaiming-uniform(a=sqrt(5)) over fan_in = prod(in) (bound
    gain * sqrt(3 / fan_in) with gain sqrt(2 / (1 + 5)) = 1 / sqrt(fan_in)), or a normal of
    standard deviation 1/r."""
    if cfg.init == "gaussian":
        return jax.random.normal(key, shape, dtype) / cfg.rank
    fan_in = int(np.prod(shape[-1 - in_ndim:-1]))
    bound = 1.0 / math.sqrt(fan_in)
    return jax.random.uniform(key, shape, dtype, -bound, bound)


class LoraDenseGeneral(nn.DenseGeneral):
    """flax's DenseGeneral (same kernel, bias, names and init) plus, when `lora` is set, the
    adapters `lora_a` [in..., r] and `lora_b` [r, out...] and their low-rank path. `kernel_axes`
    are the kernel's logical names (input dims, then output dims), which the adapters share;
    the rank dim is never sharded."""

    lora: Optional[LoraConfig] = None
    kernel_axes: tuple = ()

    @nn.compact
    def __call__(self, inputs: Array, adapter_rows: Optional[Array] = None) -> Array:
        """inputs [B, ...]; adapter_rows [B] int32, with `lora.slots`, the slot each row's
        adapter is in (None: slot 0); ignored otherwise."""
        out = super().__call__(inputs)
        if self.lora is None:
            return out
        cfg = self.lora
        axis = (self.axis,) if isinstance(self.axis, int) else tuple(self.axis)
        axis = tuple(a % inputs.ndim for a in axis)
        in_shape = tuple(inputs.shape[a] for a in axis)
        features = (self.features,) if isinstance(self.features, int) else tuple(self.features)
        n_in = len(in_shape)
        slots = (cfg.slots,) if cfg.slots else ()
        slot_axis = (None,) * len(slots)
        a = self.param("lora_a", nn.with_logical_partitioning(
            lambda k, s, d: init_a(k, s, d, cfg, n_in),
            slot_axis + self.kernel_axes[:n_in] + (None,)),
            slots + in_shape + (cfg.rank,), ADAPTER_DTYPE)
        b = self.param("lora_b", nn.with_logical_partitioning(
            nn.initializers.zeros, slot_axis + (None,) + self.kernel_axes[n_in:]),
            slots + (cfg.rank,) + features, ADAPTER_DTYPE)
        x = inputs
        if cfg.dropout > 0 and self.has_rng("dropout"):  # only where a step passes a key
            x = nn.Dropout(cfg.dropout, deterministic=False)(x, rng=self.make_rng("dropout"))
        dtype = self.dtype or inputs.dtype
        first_a = len(slots)  # A's input dims start after the slot dim
        low = jax.lax.dot_general(x.astype(dtype), a.astype(dtype),
                                  ((axis, tuple(range(first_a, first_a + n_in))), ((), ())))
        if not cfg.slots:  # low [rows..., r]
            delta = jax.lax.dot_general(low, b.astype(dtype),
                                        (((low.ndim - 1,), (0,)), ((), ())))
            return out + (cfg.scale * delta).astype(out.dtype)
        # low [B, rows..., K, r]: every slot's down-projection (K thin matmuls, cheaper than
        # gathering a [B, in, r] adapter per row), then each row keeps its own slot's (a where,
        # not a product: another slot's values never reach this row) and B contracts slot and
        # rank at once
        rows = (jnp.zeros((inputs.shape[0],), jnp.int32) if adapter_rows is None
                else adapter_rows)
        mine = rows[:, None] == jnp.arange(cfg.slots)[None, :]  # [B, K]
        mine = mine.reshape((mine.shape[0],) + (1,) * (low.ndim - 3) + (cfg.slots, 1))
        low = jnp.where(mine, low, 0)
        delta = jax.lax.dot_general(low, b.astype(dtype),
                                    (((low.ndim - 2, low.ndim - 1), (0, 1)), ((), ())))
        return out + (cfg.scale * delta).astype(out.dtype)


# ----------------------------------------------------------------------------- param trees


def is_adapter_path(path: tuple[str, ...]) -> bool:
    return bool(path) and path[-1] in ADAPTER_KEYS


def flat_paths(tree) -> dict[tuple[str, ...], Any]:
    """{(key, ..., leaf name): leaf} of a nested-dict params tree."""
    return {tuple(k.key for k in kp): v for kp, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def nested(flat: dict[tuple[str, ...], Any]) -> dict:
    """The nested dicts `flat_paths` came from (any subset of its paths)."""
    out: dict = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


def select(params, trainable: frozenset[str]) -> dict:
    """The sub-tree of `params` whose leaves have a path element in `trainable` (e.g. the
    adapters' `lora_a`/`lora_b`, a value head's name), nested as in `params`."""
    return nested({p: v for p, v in flat_paths(params).items() if trainable.intersection(p)})


def merge_into(params, sub) -> dict:
    """`params` with the leaves of `sub` (a `select` of it, maybe updated) put back."""
    flat = flat_paths(params)
    for path, value in flat_paths(sub).items():
        if path not in flat:
            raise KeyError(f"{'/'.join(path)} is not a param of the model")
        flat[path] = value
    return nested(flat)


def adapters(params) -> dict:
    """Only the adapter leaves of `params` (lora_a, lora_b), nested as in `params`."""
    return select(params, frozenset(ADAPTER_KEYS))


def has_adapters(params) -> bool:
    """Whether the params tree `params` holds adapter leaves (lora_a, lora_b): the question for
    code handed a tree without its model config (a weight sync, a TrainState's trainable set),
    or checking that a tree is what its config says. Of a config, ask `is_on`."""
    return any(is_adapter_path(p) for p in flat_paths(params))


def without_adapters(params) -> dict:
    """`params` with every adapter leaf dropped (the base, as the plain model reads it)."""
    return nested({p: v for p, v in flat_paths(params).items() if not is_adapter_path(p)})


def merged_kernel(kernel: Array, a: Array, b: Array, scale: float) -> Array:
    """W + scale * A B for one kernel [in..., out...] (or a stacked [L, in..., out...] with
    A [L, in..., r] and B [L, r, out...]), in float32, cast back to the kernel's dtype."""
    if a.ndim + b.ndim - 2 == kernel.ndim + 1:  # scanned layers: one stacked leaf
        return jax.vmap(lambda k, x, y: merged_kernel(k, x, y, scale))(kernel, a, b)
    r = a.shape[-1]
    delta = a.reshape(-1, r).astype(jnp.float32) @ b.reshape(r, -1).astype(jnp.float32)
    return (kernel.astype(jnp.float32) + scale * delta.reshape(kernel.shape)).astype(kernel.dtype)


def merge(params, cfg: LoraConfig) -> dict:
    """Plain params (no adapter leaves) computing what `params` with adapters computes: every
    adapted kernel replaced by W + scale * A B. Jit it to run on device, in the kernels'
    shardings."""
    flat = flat_paths(params)
    out = {p: v for p, v in flat.items() if not is_adapter_path(p)}
    for path in [p for p in flat if p[-1] == "lora_a"]:
        module = path[:-1]
        out[module + ("kernel",)] = merged_kernel(flat[module + ("kernel",)], flat[path],
                                                  flat[module + ("lora_b",)], cfg.scale)
    return nested(out)


def adapter_count(params) -> int:
    """Number of adapter parameters (elements) in `params`."""
    return int(sum(np.prod(v.shape) for p, v in flat_paths(params).items() if is_adapter_path(p)))


def with_adapters(params, extra) -> dict:
    """`params` plus the leaves of `extra` (new adapters) at their paths."""
    return nested({**flat_paths(params), **flat_paths(extra)})


def init_adapters(model: nn.Module, shardings_of_params, seed: int) -> dict:
    """Fresh adapters of `model` (a Transformer, or a model over one, whose cfg has `lora`),
    each in its sharding: the module's own init under jit with only the adapters as outputs,
    so XLA never builds the random base it would otherwise draw (the base comes from a
    checkpoint). `shardings_of_params`: (abstract params, shardings) of `model`, as
    parallel.logical_axes_of + param_shardings give them."""
    abstract, shardings = shardings_of_params
    tokens = np.zeros((1, 1), np.int32)
    init = jax.jit(lambda key: adapters(nn.meta.unbox(model.init(key, tokens))["params"]),
                   out_shardings=adapters(shardings))
    return init(jax.random.fold_in(jax.random.key(seed), 0x10A))
