"""Critic for PPO/GAE: the policy's transformer trunk with a scalar head per token.

Shape letters: B batch, T length, D model width.

Params are `{'trunk': <Transformer params>, 'head': {'kernel' [D, 1], 'bias' [1]}}`, so a
critic starts from any HF checkpoint: `value_params_from(policy_params)` reuses its weights
and adds a zero head (values start at 0, the natural baseline before any return is seen).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from rl_tpu.models.transformer import ModelConfig, Transformer


class ValueModel(nn.Module):
    """__call__(tokens [B, T], positions, segment_ids) -> values [B, T] float32."""

    cfg: ModelConfig
    mesh: Any = None
    rules: Any = None

    @nn.compact
    def __call__(self, tokens, positions=None, segment_ids=None):
        hidden = Transformer(self.cfg, self.mesh, self.rules, name="trunk")(
            tokens, positions, segment_ids, return_hidden=True)  # [B, T, D]
        head = nn.Dense(
            1, dtype=jnp.float32, param_dtype=self.cfg.params_dtype, name="head",
            kernel_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed", None)),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (None,)))
        return head(hidden.astype(jnp.float32))[..., 0]


def value_params_from(policy_params, cfg: ModelConfig) -> dict:
    """Critic params whose trunk is a copy of the policy's (without its LM head, which the
    critic never calls) and whose head is zero."""
    dtype = cfg.params_dtype
    trunk = {name: p for name, p in policy_params.items() if name != "lm_head"}
    return {
        "trunk": jax.tree.map(jnp.copy, trunk),
        "head": {"kernel": jnp.zeros((cfg.hidden_size, 1), dtype), "bias": jnp.zeros((1,), dtype)},
    }
