"""TrainState and the optimizer: everything an update changes, as one pytree.

`TrainState(step, params, opt_state, master)` is a flax.struct dataclass, so it passes through
jit with donation and its shardings are a pytree of the same shape. With bf16 params, `master`
keeps an fp32 copy the optimizer updates (bf16 cannot represent small updates of large
weights: they would round away); params are the master cast down after each update.

`trainable` (static; None = every param) names the path elements of the params that train,
e.g. LoRA's `lora_a`/`lora_b` (models/lora.py): the optimizer state and master copy then
cover only those leaves, a step differentiates only them (XLA drops the frozen weights'
gradient matmuls), and a checkpoint (`checkpoint_view`) holds only them; the rest of
`params` is the frozen base, which the step passes through unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec as P

from rl_tpu.models import lora

SCHEDULES = ("constant", "cosine", "linear")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-6
    schedule: str = "constant"  # after warm-up: constant | cosine | linear decay
    warmup_steps: int = 0
    total_steps: int = 1000  # where cosine/linear decay ends (in schedule steps, see below)
    # Optimizer updates per schedule step. An RL step makes epochs x minibatches updates, but
    # its schedule (warm-up, decay, total) is configured in RL steps: the schedule sees
    # update_count // updates_per_step, so every update of one RL step shares one lr.
    updates_per_step: int = 1
    end_lr_ratio: float = 0.1  # final lr = lr * end_lr_ratio
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    grad_clip: Optional[float] = 1.0  # global-norm clipping; None = off

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"optim.schedule={self.schedule!r}; choose one of {SCHEDULES}")
        if self.lr <= 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise ValueError("optim.warmup_steps must be >= 0 and optim.total_steps >= 1")
        if self.updates_per_step < 1:
            raise ValueError(f"updates_per_step={self.updates_per_step} must be >= 1")


def learning_rate_schedule(cfg: OptimConfig) -> optax.Schedule:
    """Linear warm-up from 0, then constant, cosine or linear decay to lr * end_lr_ratio, as a
    function of the optimizer's update count (schedule step = count // updates_per_step)."""
    per_step = step_schedule(cfg)
    if cfg.updates_per_step == 1:
        return per_step
    return lambda count: per_step(count // cfg.updates_per_step)


def step_schedule(cfg: OptimConfig) -> optax.Schedule:
    """The schedule over schedule steps (RL steps): what `learning_rate_schedule` stretches."""
    decay_steps = max(cfg.total_steps - cfg.warmup_steps, 1)
    end = cfg.lr * cfg.end_lr_ratio
    if cfg.schedule == "constant":
        after = optax.constant_schedule(cfg.lr)
    elif cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(cfg.lr, decay_steps, alpha=cfg.end_lr_ratio)
    else:
        after = optax.linear_schedule(cfg.lr, end, decay_steps)
    if cfg.warmup_steps == 0:
        return after
    warmup = optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps)
    return optax.join_schedules([warmup, after], [cfg.warmup_steps])


def advance_schedule(opt_state):
    """`opt_state` with the lr schedule's update count one ahead and nothing else changed:
    what a skipped (non-finite) update leaves. The schedule then counts updates made or
    skipped, so a skip does not shift the lr of every later update by one (a run's lr at
    update n is the same whether or not an update before it was skipped). Adam's moments and
    its bias-correction count stay: they saw no gradient."""
    is_schedule = lambda node: isinstance(node, optax.ScaleByScheduleState)  # noqa: E731
    return jax.tree.map(
        lambda node: node._replace(count=optax.safe_int32_increment(node.count))
        if is_schedule(node) else node, opt_state, is_leaf=is_schedule)


@jax.jit
def all_finite(tree) -> jax.Array:
    """One bool scalar: every element of every float leaf of `tree` is finite. A reduction
    where the shards are (jnp reductions of sharded arrays are global under jit), so a check
    after each update costs one pass over the params and one scalar read."""
    flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
             if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(flags)) if flags else jnp.asarray(True)


def _decay_mask(params):
    """Weight decay on matrices only: norms' scales and biases (1-D) are left alone."""
    return jax.tree.map(lambda x: x.ndim > 1, params)


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """AdamW with the schedule, behind global-norm clipping."""
    adamw = optax.adamw(learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay, mask=_decay_mask)
    if cfg.grad_clip is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw)


@struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any
    master: Any = None  # fp32 copy of the trained bf16 params, or None when they are fp32
    tx: optax.GradientTransformation = struct.field(pytree_node=False, default=None)
    trainable: Optional[frozenset] = struct.field(pytree_node=False, default=None)

    @classmethod
    def create(cls, params, tx: optax.GradientTransformation,
               trainable: Optional[frozenset] = None) -> "TrainState":
        """Optimizer state (and the fp32 master copy, for low-precision params) beside params;
        with `trainable`, over the leaves it names only.

        Call under jit with sharded params: XLA gives the optimizer moments the params'
        shardings, and `shardings_of(state)` reads them back for the step's in/out shardings.
        """
        target = trained_part(params, trainable)
        low_precision = any(x.dtype != jnp.float32 for x in jax.tree.leaves(target)
                            if jnp.issubdtype(x.dtype, jnp.floating))
        master = jax.tree.map(lambda x: x.astype(jnp.float32), target) if low_precision else None
        opt_state = tx.init(master if low_precision else target)
        return cls(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state,
                   master=master, tx=tx, trainable=trainable)

    def trained(self):
        """The params the optimizer updates (all of them unless `trainable` is set)."""
        return trained_part(self.params, self.trainable)

    def with_trained(self, trained):
        """The full params with `trained` (a tree like `trained()`) in place of those leaves."""
        return trained if self.trainable is None else lora.merge_into(self.params, trained)

    def apply_gradients(self, grads) -> "TrainState":
        """One optimizer update from `grads`, a tree like `trained()`."""
        target = self.trained() if self.master is None else self.master
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, target)
        updates, opt_state = self.tx.update(grads, self.opt_state, target)
        target = optax.apply_updates(target, updates)
        if self.master is None:
            return self.replace(step=self.step + 1, params=self.with_trained(target),
                                opt_state=opt_state)
        params = jax.tree.map(lambda m, p: m.astype(p.dtype), target, self.trained())
        return self.replace(step=self.step + 1, params=self.with_trained(params),
                            opt_state=opt_state, master=target)

    def checkpoint_view(self) -> "TrainState":
        """What a checkpoint holds: this state, its params cut to the trained ones (a LoRA
        run saves adapters and their moments, not the base it reloads at start)."""
        return self if self.trainable is None else self.replace(params=self.trained())

    def from_checkpoint(self, restored: "TrainState") -> "TrainState":
        """This state with a restored `checkpoint_view` in place (the frozen params kept)."""
        if self.trainable is None:
            return restored
        return restored.replace(params=self.with_trained(restored.params))


def trained_part(params, trainable: Optional[frozenset]):
    """The leaves of `params` a state with `trainable` trains (all when None)."""
    return params if trainable is None else lora.select(params, trainable)


def create_state(params, tx: optax.GradientTransformation,
                 trainable: Optional[frozenset] = None) -> TrainState:
    """TrainState built under jit, every optimizer leaf sharded like the param it belongs to
    (Adam's moments like their weights; counts replicated), so no device ever holds a full
    copy of the optimizer state. `params` are donated (their buffers become the state's).

    The shardings are explicit: XLA does not carry a param's sharding over to a
    `zeros_like` of it, and left alone would replicate every moment on every device.
    """
    create = lambda p: TrainState.create(p, tx, trainable)  # noqa: E731
    if not isinstance(jax.tree.leaves(params)[0].sharding, NamedSharding):
        return jax.jit(create, donate_argnums=0)(params)
    return jax.jit(create, out_shardings=state_shardings(params, tx, trainable),
                   donate_argnums=0)(params)


def state_shardings(params, tx: optax.GradientTransformation,
                    trainable: Optional[frozenset] = None) -> TrainState:
    """The shardings of the TrainState of `params` (arrays or ShapeDtypeStructs, each with a
    NamedSharding): every optimizer leaf like its param, counts and the step replicated."""
    param_shardings = jax.tree.map(lambda x: x.sharding, params)
    replicated = NamedSharding(jax.tree.leaves(param_shardings)[0].mesh, P())
    abstract = jax.eval_shape(lambda p: TrainState.create(p, tx, trainable), params)
    trained_shardings = trained_part(param_shardings, trainable)
    opt_shardings = optax.tree_map_params(
        tx, lambda _, sharding: sharding, abstract.opt_state, trained_shardings,
        transform_non_params=lambda _: replicated)
    return TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings,
                      master=None if abstract.master is None else trained_shardings, tx=tx,
                      trainable=trainable)


def abstract_state(params, tx: optax.GradientTransformation,
                   trainable: Optional[frozenset] = None) -> TrainState:
    """The TrainState `create_state(params, tx, trainable)` would make, as ShapeDtypeStructs
    with their shardings: what an ahead-of-time compile lowers against, allocating nothing."""
    shapes = jax.eval_shape(lambda p: TrainState.create(p, tx, trainable), params)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        shapes, state_shardings(params, tx, trainable))


def shardings_of(tree):
    """The shardings of a pytree of (committed) arrays, e.g. a TrainState, for jit."""
    return jax.tree.map(lambda x: x.sharding, tree)
