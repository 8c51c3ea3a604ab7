"""The embedded sampler's own copy of the trainer's params (sampler.py's weights contract).

The sampler never samples from the trainer's buffers: a compiled train step donates its state,
so the buffers the sampler was handed may be gone the moment `update_weights` returns.
`OwnCopy(params)` copies params without adapters (a whole policy, or a LoRA policy's frozen
base: adapter_weights.py) on device, with no host round trip, into the sampler's shardings:
scanned layers unstacked, floats cast to the sampler's dtype when it has its own, and never
sharing a buffer with the source.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from rl_tpu import parallel
from rl_tpu.models.transformer import ModelConfig, Transformer, unstack_layers


def _owned_copy(params, num_layers: int, dtype: Optional[str]):
    """Jitted with the sampler's out_shardings: unstacked, cast, and in buffers of its own.
    `jnp.array(copy=True)` keeps the output from being the input itself (jit may forward an
    output that is an unchanged input); XLA never aliases a non-donated input to an output."""
    def own(x):
        return jnp.array(x, dtype=dtype if jnp.issubdtype(x.dtype, jnp.floating) else None,
                         copy=True)
    return jax.tree.map(own, unstack_layers(params, num_layers))


class OwnCopy:
    """Copies params of `cfg`'s model (no adapters; scanned or not, on any mesh) into the
    sampler's shardings on `mesh` (`shardings`), cast to `dtype` (None: as given)."""

    def __init__(self, cfg: ModelConfig, mesh, rules, dtype: Optional[str]):
        self.cfg, self.mesh = cfg, mesh
        abstract, names = parallel.logical_axes_of(Transformer(cfg, mesh=mesh, rules=rules),
                                                   np.zeros((1, 1), np.int32))
        self._abstract = abstract
        self.shardings = parallel.param_shardings(abstract, names, mesh, rules)
        self._copy = jax.jit(functools.partial(_owned_copy, num_layers=cfg.num_layers,
                                               dtype=dtype), out_shardings=self.shardings)

    def __call__(self, params):
        self._check_layout(params)
        devices = set(self.mesh.devices.flat)
        if any(not isinstance(x, jax.Array) or x.sharding.device_set != devices
               for x in jax.tree.leaves(params)):
            # Another device set (a trainer mesh over more chips) cannot feed one compiled
            # program: move there first, device to device. device_put may hand back the source's
            # own buffer for a shard already in place (e.g. a replicated leaf), even with
            # may_alias=False, so the copy below still runs.
            params = jax.device_put(params, self._layout_shardings(params))
        return self._copy(params)

    def _layout_shardings(self, params):
        """The sampler's shardings for params laid out as given: stacked [L, ...] leaves under
        'layers' (scan_layers) take layer 0's sharding with the layer axis unsharded."""
        if "layers" not in params:  # (_check_layout has made sure params is the model's dict)
            return self.shardings
        out = {k: v for k, v in self.shardings.items() if not k.startswith("layers_")}
        out["layers"] = jax.tree.map(
            lambda s: NamedSharding(s.mesh, PartitionSpec(None, *s.spec)),
            self.shardings["layers_0"])
        return out

    def _check_layout(self, params):
        want = self._abstract
        if isinstance(params, dict) and "layers" in params:  # scanned: [L, ...] per leaf
            want = {k: v for k, v in want.items() if not k.startswith("layers_")}
            want["layers"] = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct((self.cfg.num_layers,) + x.shape, x.dtype),
                self._abstract["layers_0"])
        if jax.tree.structure(params) != jax.tree.structure(want) or any(
                np.shape(x) != y.shape for x, y in zip(jax.tree.leaves(params),
                                                        jax.tree.leaves(want))):
            raise ValueError(
                f"params do not fit the sampler's model ({self.cfg.num_layers} layers, vocab "
                f"{self.cfg.vocab_size}, hidden {self.cfg.hidden_size}): pass the params of the "
                "model the sampler was built for (same ModelConfig), scanned or not")
