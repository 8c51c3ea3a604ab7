"""Several LoRA adapters served side by side on one frozen base: what rl_tpu's rollout server
does for SGLang's `/load_lora_adapter`, `/unload_lora_adapter` and a request's `lora_path`.

An asynchronous LoRA run keeps up to `max_staleness + 1` adapter versions on its servers
(weight_sync.py), and a request must finish under the version it started with while newer
requests run beside it. So the serving model holds every adapter at once, in slots
(`LoraConfig.slots = K`, lora.py): one stacked leaf per projection, lora_a [K, in..., R] and
lora_b [K, R, out...], R the server's most rank. Each row of a batch carries its slot
(`DecodeState.adapter`); every projection computes the K thin down-projections and each row
keeps its own (lora.py), so rows of different adapters share every decode step, as SGLang's
multi-LoRA batches do.

Slot 0 holds zeros: a request without `lora_path` samples the base exactly. An adapter of rank
r <= R is stored zero-padded (A's columns and B's rows r..R) with its scale (alpha / r, or
alpha / sqrt(r) for rsLoRA) multiplied into B, so every slot computes scale * (x A) B at the
model's scale 1 (an exact zero padding: the log-probs equal a model of that adapter alone to
float rounding, tests/rollout/test_adapter_slots.py).

Lifetimes as SGLang's (lora_registry): `unload` ends new use of a name at once; the slot it
held is reused only once every request holding it (`acquire` .. `release`) has ended, so a
running row never sees its adapter change. A slot's `salt` (a serial per load) keys the prefix
cache, so K/V computed under one adapter never serves another, nor a later load in that slot.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from rl_tpu import parallel
from rl_tpu.models import lora, peft_format
from rl_tpu.models.transformer import ModelConfig, Transformer


class AdapterSlotsError(ValueError):
    """A load, unload or `lora_path` the server cannot serve; the message says why and what to
    do (the server answers it with 400)."""


@dataclasses.dataclass(frozen=True)
class _Loaded:
    slot: int
    path: str


def slot_config(cfg: ModelConfig, max_rank: int, max_loaded: int,
                targets: tuple[str, ...] = lora.TARGETS) -> ModelConfig:
    """The serving model's config: `cfg` with room for `max_loaded` adapters of rank up to
    `max_rank` on `targets` (plus slot 0, the base), at scale 1 (each adapter's own scale is
    stored in its B)."""
    if max_loaded < 1:
        raise ValueError(f"max_loaded_loras={max_loaded}: a LoRA server holds at least one")
    return cfg.replace(lora=lora.LoraConfig(rank=max_rank, alpha=float(max_rank),
                                            targets=tuple(targets), slots=max_loaded + 1))


class AdapterSlots:
    """The adapters a serving sampler holds (`stacked`, in the sampler's shardings) and the
    names they were loaded under. Thread-safe."""

    def __init__(self, cfg: ModelConfig, mesh, rules):
        spec = cfg.lora
        if spec is None or not spec.slots or spec.scale != 1.0:
            raise ValueError("AdapterSlots needs a ModelConfig from slot_config (lora with slots, "
                             "scale 1)")
        self.cfg, self.mesh, self.spec = cfg, mesh, spec
        abstract, names = parallel.logical_axes_of(Transformer(cfg), np.zeros((1, 1), np.int32))
        self._abstract = lora.flat_paths(lora.adapters(abstract))
        shardings = lora.adapters(parallel.param_shardings(abstract, names, mesh, rules))
        self.stacked = jax.jit(lambda: lora.nested({
            p: jnp.zeros(x.shape, x.dtype) for p, x in self._abstract.items()}),
            out_shardings=shardings)()
        # slot: traced, one program for every slot
        self._write = jax.jit(lambda stacked, one, slot: jax.tree.map(
            lambda s, x: s.at[slot].set(x), stacked, one), out_shardings=shardings)
        self._lock = threading.Lock()  # names, references, salts, `stacked`
        self._load_lock = threading.Lock()  # one load at a time (a slot is chosen, then filled)
        self._names: dict[str, _Loaded] = {}
        self._refs = [0] * spec.slots
        self._salts = [0] * spec.slots
        self._serials = itertools.count(1)

    # -- what the server says about itself --------------------------------------------------

    @property
    def capacity(self) -> int:
        """Adapters that can be loaded at once (slot 0 is the base's)."""
        return self.spec.slots - 1

    def server_info(self) -> dict:
        """SGLang's `/server_info` LoRA fields, which weight_sync.lora_server_problem reads."""
        return {"enable_lora": True, "max_lora_rank": self.spec.rank,
                "lora_target_modules": list(self.spec.targets),
                "max_loaded_loras": self.capacity, "max_loras_per_batch": self.capacity}

    def loaded(self) -> dict[str, str]:
        """{name: path} of every adapter loaded now."""
        with self._lock:
            return {name: entry.path for name, entry in self._names.items()}

    # -- load and unload --------------------------------------------------------------------

    def load(self, name: str, path: str, base_cfg: ModelConfig, base_params) -> None:
        """Reads the PEFT dir `path` (peft_format.load_adapter, onto the serving base
        `base_params` of `base_cfg`) into a free slot under `name`; AdapterSlotsError when the
        name is taken, no slot is free, or the adapter does not fit this server."""
        if not name:
            raise AdapterSlotsError("load_lora_adapter needs 'lora_name'")
        with self._load_lock:
            with self._lock:
                if name in self._names:
                    raise AdapterSlotsError(
                        f"a LoRA adapter named {name!r} is loaded already "
                        f"({self._names[name].path}): unload it first, or load under a new name")
            try:
                adapter_cfg, params = peft_format.load_adapter(path, base_cfg, base_params,
                                                               mesh=self.mesh)
            except (OSError, ValueError) as err:
                raise AdapterSlotsError(f"cannot load the LoRA adapter {path}: {err}") from err
            one = self._padded(adapter_cfg.lora, lora.adapters(params), path)
            with self._lock:
                slot = self._free_slot()
            stacked = self._write(self.stacked, one, np.int32(slot))
            with self._lock:
                self.stacked = stacked
                self._salts[slot] = next(self._serials)
                self._names[name] = _Loaded(slot, path)

    def unload(self, name: str) -> None:
        """Forgets `name` now; its slot is reused once the requests holding it have ended."""
        with self._lock:
            if name not in self._names:
                raise AdapterSlotsError(f"no LoRA adapter named {name!r} is loaded (loaded: "
                                        f"{sorted(self._names) or 'none'})")
            del self._names[name]

    # -- requests ---------------------------------------------------------------------------

    def acquire(self, name: Optional[str]) -> int:
        """The slot of adapter `name` (0, the base, for None or ""), held until `release`."""
        if not name:
            return 0
        with self._lock:
            entry = self._names.get(name)
            if entry is None:
                raise AdapterSlotsError(
                    f"the LoRA adapter {name!r} in lora_path is not loaded (loaded: "
                    f"{sorted(self._names) or 'none'}): POST /load_lora_adapter first")
            self._refs[entry.slot] += 1
            return entry.slot

    def release(self, slot: int) -> None:
        if slot:
            with self._lock:
                self._refs[slot] -= 1

    def salt(self, slot: int) -> int:
        """The prefix-cache salt of what `slot` holds (0: the base); fixed while it is held."""
        with self._lock:
            return self._salts[slot]

    # -- internals --------------------------------------------------------------------------

    def _free_slot(self) -> int:
        named = {entry.slot for entry in self._names.values()}
        for slot in range(1, self.spec.slots):
            if slot not in named and self._refs[slot] == 0:
                return slot
        held = self.capacity - len(named)
        raise AdapterSlotsError(
            f"every one of this server's {self.capacity} LoRA slots is taken ({len(named)} "
            f"loaded, {held} unloaded but still used by running requests): unload one, or "
            "launch the server with a larger --max_loaded_loras")

    def _padded(self, spec: lora.LoraConfig, adapters, path: str) -> dict:
        """One slot's leaves for these adapters: A's rank zero-padded to R, B scaled by the
        adapter's scale and zero-padded, zeros for a projection the adapter leaves out."""
        if spec.rank > self.spec.rank:
            raise AdapterSlotsError(f"the LoRA adapter {path} has rank {spec.rank}, over this "
                                    f"server's --max_lora_rank {self.spec.rank}")
        missing = sorted(set(spec.targets) - set(self.spec.targets))
        if missing:
            raise AdapterSlotsError(f"the LoRA adapter {path} targets {missing}, which this "
                                    f"server's --lora_target_modules {list(self.spec.targets)} "
                                    "leave out")
        given = lora.flat_paths(adapters)
        out = {}
        for path_, want in self._abstract.items():
            value = np.zeros(want.shape[1:], np.float32)  # one slot's shape
            if path_ in given:
                x = np.asarray(given[path_], np.float32)
                if path_[-1] == "lora_a":
                    value[..., :spec.rank] = x
                else:
                    value[:spec.rank] = spec.scale * x
            out[path_] = value
        return lora.nested(out)
