"""The embedded sampler's weights when the policy trains LoRA adapters on a frozen base.

The base never changes during a run, so the sampler copies it once and every later weight
update moves only the adapters (the trainer's `lora_a`/`lora_b` leaves: for a 7B model at
rank 8, ~20M parameters against 7B). What the sampler then samples with is one of:

  * "merge": W + scale * A B computed on device into the sampler's own merged kernels; decode
    runs the plain model, at full-fine-tuning speed, and holds a second copy of every adapted
    kernel (base + merged; embeddings, head and norms are shared);
  * "lowrank": the base and the adapters as they are; every adapted projection adds
    scale * (x A) B in prefill and decode (two thin matmuls a projection), and the sampler holds
    the base once.

benchmarks/lora_sampler.py measures both (tokens/s and update time by shape); the policy's
LoraConfig carries the choice (`sampler`, from the config's `model.lora.sampler`; docs/lora.md
gives the numbers).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from rl_tpu import parallel
from rl_tpu.models import lora
from rl_tpu.models.transformer import ModelConfig, Transformer, unstack_layers

def _owned(tree, num_layers: int):
    """Unstacked (scanned layers) fp32 adapters in buffers of their own (see sampler.py's
    `_owned_copy` in own_copy.py: an output is never the input itself)."""
    return jax.tree.map(lambda x: jnp.array(x, copy=True), unstack_layers(tree, num_layers))


class AdapterWeights:
    """Holds the base copy and turns each update's adapters into the params the sampler's
    model (`model_cfg`) reads. `copy_base(params)` is the sampler's own copy of plain params
    (layout checks, unstacking, dtype, shardings); `base_shardings` its shardings, which
    the merged kernels take too."""

    def __init__(self, cfg: ModelConfig, mesh, rules, copy_base: Callable, base_shardings):
        if not lora.is_on(cfg):
            raise ValueError("AdapterWeights needs a ModelConfig with lora set")
        # the LoraConfig says how (lora.SAMPLER_MODES), validated where it was built
        self.cfg, self.mode, self._copy_base = cfg, cfg.lora.sampler, copy_base
        self.model_cfg = cfg.replace(lora=None) if self.mode == "merge" else cfg
        abstract, names = parallel.logical_axes_of(Transformer(cfg), np.zeros((1, 1), np.int32))
        shardings = lora.adapters(parallel.param_shardings(abstract, names, mesh, rules))
        self._adapter_abstract = lora.adapters(abstract)
        self._copy_adapters = jax.jit(functools.partial(_owned, num_layers=cfg.num_layers),
                                      out_shardings=shardings)
        # only the adapted kernels come out of the merge: the rest of the merged params are
        # the base's own buffers (a jit output is always a new buffer, so merging the whole
        # tree would hold a second embedding, head and norms)
        kernel_shardings = lora.select(base_shardings, frozenset(("kernel",)))
        self._merge = jax.jit(lambda base, a: _merged_kernels(base, a, cfg.lora),
                              out_shardings=_adapted_only(kernel_shardings, shardings))
        self._devices = set(mesh.devices.flat)
        self._replicated = NamedSharding(mesh, PartitionSpec())
        self._base = None
        self.last_sync_bytes = 0

    def own_copy(self, params):
        """The sampler's params for `params` (base + adapters, the trainer's layout; after the
        first call, the adapters alone will do: `lora.adapters(params)`). The first call copies
        the base too; later ones only the adapters (the base is frozen)."""
        if not lora.has_adapters(params):
            raise ValueError("the sampler was built for LoRA (model.lora.rank > 0) but the params "
                             "hold no adapters (lora_a / lora_b): pass the trainer's params")
        moved, base = 0, lora.without_adapters(params)
        if self._base is None:
            if not base:
                raise ValueError("the sampler's first weights must hold the base as well as the "
                                 "adapters (later updates may pass the adapters alone)")
            self._base = self._copy_base(base)
            moved += _nbytes(self._base)
        adapters = lora.adapters(params)
        self._check(adapters)
        if any(not isinstance(x, jax.Array) or x.sharding.device_set != self._devices
               for x in jax.tree.leaves(adapters)):
            # from the learner's devices (an asynchronous run's), or host arrays: the adapters
            # are small, so replicated onto the sampler's devices, device to device
            adapters = jax.device_put(adapters, self._replicated)
        adapters = self._copy_adapters(adapters)
        self.last_sync_bytes = moved + _nbytes(adapters)
        if self.mode == "merge":
            return lora.merge_into(self._base, self._merge(self._base, adapters))
        return lora.with_adapters(self._base, adapters)

    def extra_bytes(self) -> int:
        """Bytes held beside the params the sampler's model reads: in merge mode, the base's
        adapted kernels (the merged ones replace them in what the model reads)."""
        if self.mode != "merge" or self._base is None:
            return 0
        adapted = _adapted_only(lora.select(self._base, frozenset(("kernel",))),
                                self._adapter_abstract)
        return _nbytes(adapted)

    def _check(self, adapters) -> None:
        want = self._adapter_abstract
        got = unstack_layers(adapters, self.cfg.num_layers) if "layers" in adapters else adapters
        if jax.tree.structure(got) != jax.tree.structure(want) or any(
                np.shape(x) != y.shape
                for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want))):
            raise ValueError(
                f"the adapters do not fit the sampler's LoRA (rank {self.cfg.lora.rank}, "
                f"targets {list(self.cfg.lora.targets)}): pass params of the ModelConfig the "
                "sampler was built with")


def _adapted_only(kernels, adapters) -> dict:
    """The leaves of `kernels` ({.../kernel}) whose module has adapters in `adapters`."""
    modules = {path[:-1] for path in lora.flat_paths(adapters)}
    return lora.nested({p: v for p, v in lora.flat_paths(kernels).items() if p[:-1] in modules})


def _merged_kernels(base, adapters, cfg: lora.LoraConfig) -> dict:
    """W + scale * A B of every adapted kernel of `base`, nested as in `base`."""
    flat_a = lora.flat_paths(adapters)
    flat_b = lora.flat_paths(base)
    return lora.nested({module + ("kernel",): lora.merged_kernel(
        flat_b[module + ("kernel",)], flat_a[module + ("lora_a",)],
        flat_a[module + ("lora_b",)], cfg.scale)
        for module in {p[:-1] for p in flat_a}})


def _nbytes(tree) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))
