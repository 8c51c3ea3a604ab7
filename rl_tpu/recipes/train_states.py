"""The optimizers and TrainStates a recipe trains: the `optim.*` block as an OptimConfig (an
RL learner's counted in updates per RL step), and the policy's and the critic's states (with
LoRA, only the adapters, and a critic's value head, train).
"""

from __future__ import annotations

from typing import Optional

import jax
import ml_collections
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rl_tpu.models import lora
from rl_tpu.models.transformer import ModelConfig
from rl_tpu.models.value import value_params_from
from rl_tpu.train.state import OptimConfig, TrainState, create_state, make_optimizer


def optim_config(lr: float, config: ml_collections.ConfigDict, total_steps: int,
                 warmup_steps: Optional[int] = None, updates_per_step: int = 1) -> OptimConfig:
    """The optimizer at learning rate `lr` over `total_steps` steps, as `optim.*` describes it
    (`warmup_steps`: default `optim.warmup_steps`)."""
    o = config.optim
    return OptimConfig(lr=lr, schedule=o.schedule,
                       warmup_steps=o.warmup_steps if warmup_steps is None else warmup_steps,
                       total_steps=max(total_steps, 1), weight_decay=o.weight_decay,
                       grad_clip=o.grad_clip or None, updates_per_step=updates_per_step)


def rl_optim_config(config: ml_collections.ConfigDict, lr: float) -> OptimConfig:
    """The optimizer of an RL learner (policy or critic): its schedule is configured in RL
    steps, and each RL step makes epochs x minibatches optimizer updates."""
    t = config.train
    return optim_config(lr, config, t.steps, updates_per_step=t.epochs * t.minibatches)


def new_state(params, optim: OptimConfig, heads: tuple[str, ...] = ()) -> TrainState:
    """A TrainState over `params`; params with LoRA adapters train only those (and `heads`,
    e.g. a critic's value head, trained whole beside its trunk's adapters)."""
    trainable = frozenset(lora.ADAPTER_KEYS + heads) if lora.has_adapters(params) else None
    return create_state(params, make_optimizer(optim), trainable)


def new_critic_state(config: ml_collections.ConfigDict, policy_params, model_cfg: ModelConfig,
                     mesh: Mesh) -> TrainState:
    """The critic's TrainState: the policy's trunk copied, a zero head (values start at 0),
    with its own learning rate `algo.value_lr`."""
    def on_mesh(x):  # the fresh head is not on the mesh yet: replicate it there
        if isinstance(getattr(x, "sharding", None), NamedSharding):
            return x
        return jax.device_put(x, NamedSharding(mesh, P()))

    params = jax.tree.map(on_mesh, value_params_from(policy_params, model_cfg))
    return new_state(params, rl_optim_config(config, config.algo.value_lr), heads=("head",))
