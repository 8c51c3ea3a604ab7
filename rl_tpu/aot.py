"""Ahead-of-time compiles of a config's device programs for a TPU slice, on any machine.

`libtpu` can compile for a TPU topology it is not running on:
`jax.experimental.topologies.get_topology_desc(platform="tpu", topology_name="v5p:4x4x4")`
gives the slice's abstract devices, a mesh over them lowers the real jitted functions against
ShapeDtypeStructs (nothing allocated), and `compiled.memory_analysis()` says what each program
needs per chip: a run is checked before anyone pays for a pod (as MaxText does).

`check(config, topology)` compiles, at the config's own shapes and with the same builders the
trainer uses:

  policy_update    the learner's update: epochs x minibatches of the policy step, micro-batched
  score            old (and reference) log-probs of the whole rollout batch
  critic_update,   PPO's value step and value pass, when the config has a critic
  values
  sampler_prefill  the embedded sampler's prefill of rollout.max_batch prompts of the longest
  sampler_decode   bucket, and one decode chunk, on one host's sampler chips (its mesh)

`plan(config, topology)` gives those shapes by the functions the trainer calls: the learner's
and the sampler's chips (placement.split_devices: asynchronous with the embedded sampler,
each host gives rollout.sampler_devices of its chips to the sampler, 0 = half; else the learner
has every chip and the sampler a host's) and a step's global rows (shapes.step_rows).

Memory per chip = arguments + outputs - donated (aliased) buffers + temporaries: a program's
own `total`. Its `peak` adds what the chip `held` for the rest of the run meanwhile
(`held_by`): the learner's other trees (the policy's optimizer state beside the score pass, a
critic's state, the KL reference's copy of the params), and where the embedded sampler shares
the learner's chips (a synchronous run) its weights and prefix pool beside the learner's
programs and the learner's state beside the sampler's. A program fits when its peak does.

LoRA (`model.lora.rank` > 0) is checked as the trainer runs it: the TrainState trains the
adapters alone (a critic: its adapters and value head: no fp32 master, moments or weight
gradients of the frozen base), the sampler is a LoRA sampler (its LoraConfig's `sampler`, from
`model.lora.sampler`: "merge" holds merged kernels beside its base, "lowrank" the base once),
and a weight sync moves the adapters alone (`Report.sync`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import time
from typing import Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rl_tpu import parallel
from rl_tpu.core.batch import RolloutBatch, abstract_batch
from rl_tpu.models import hf, lora
from rl_tpu.models.presets import preset_config
from rl_tpu.models.tiny import tiny_config
from rl_tpu.models.transformer import ModelConfig, Transformer
from rl_tpu.models.value import ValueModel
from rl_tpu.recipes import algorithms, placement, policy_io, shapes, train_states
from rl_tpu.rollout import decoding as sampling
from rl_tpu.train.learner import Learner
from rl_tpu.train.state import abstract_state, make_optimizer

GIB = 2 ** 30
# HBM per chip, GiB, as Google's Cloud TPU pages list it; keyed by the topology name's prefix.
CHIP_HBM_GIB = {"v4": 32, "v5e": 16, "v5litepod": 16, "v5p": 95, "v6e": 32}


@dataclasses.dataclass
class ProgramMemory:
    """One compiled program's footprint on one chip (bytes) and its compile time (s). When the
    TPU compiler itself refuses the program (its temporaries exceed the chip's HBM), `refused`
    holds its message and `temp` the size it names."""

    name: str
    compile_s: float
    argument: int
    output: int
    alias: int
    temp: int
    refused: str = ""
    shape: str = ""  # rows x tokens (/ micro-batches) it was compiled for
    mesh: str = ""  # its mesh, when not the trainer's (the sampler's, on one host)
    held: int = 0  # what the chip keeps for the run's other device state meanwhile (held_by)

    @property
    def total(self) -> int:
        return self.argument + self.output - self.alias + self.temp

    @property
    def peak(self) -> int:
        return self.total + self.held


@dataclasses.dataclass
class Report:
    topology: str
    chips: int
    hbm: int  # bytes per chip
    model: str
    mesh: dict  # the learner's
    programs: list[ProgramMemory]
    learner_chips: int = 0  # of `chips` (0: all); an asynchronous run's sampler has the rest
    sync: str = ""  # what one weight sync moves (`sync_of`)
    notes: list[str] = dataclasses.field(default_factory=list)  # what `held` counts

    def misfits(self) -> list[ProgramMemory]:
        return [p for p in self.programs if p.refused or p.peak > self.hbm]

    def table(self) -> str:
        rows = [f"{self.model} on {self.topology} ({self.chips} chips, {self.hbm / GIB:.1f} GiB "
                f"HBM each), mesh {self.mesh}",
                f"{'program':<17}{'shape':>16}{'compile s':>10}{'args GiB':>10}"
                f"{'temp GiB':>10}{'total GiB':>11}{'held GiB':>10}{'peak GiB':>10}  fits"]
        for p in self.programs:
            rows.append(f"{p.name:<17}{p.shape:>16}{p.compile_s:>10.1f}{p.argument / GIB:>10.2f}"
                        f"{p.temp / GIB:>10.2f}{p.total / GIB:>11.2f}{p.held / GIB:>10.2f}"
                        f"{p.peak / GIB:>10.2f}  "
                        f"{'yes' if not p.refused and p.peak <= self.hbm else 'NO'}"
                        + (f" (XLA: {p.refused})" if p.refused else ""))
        rows += sorted({f"{p.name.split('_')[0]} programs on mesh {p.mesh}"
                        for p in self.programs if p.mesh})
        if self.learner_chips and self.learner_chips < self.chips:
            rows.append(f"learner programs on {self.learner_chips} of the {self.chips} chips "
                        "(the embedded sampler runs beside it on the others)")
        rows += self.notes
        if self.sync:
            rows.append(f"a weight sync moves {self.sync}")
        return "\n".join(rows)

    @property
    def fsdp_chips(self) -> int:
        """The fsdp size that shards the learner's params over all its chips: its chips over
        the axes that must stay (an expert axis splits experts, tensor the heads)."""
        kept = self.mesh.get("expert", 1) * self.mesh.get("tensor", 1)
        return (self.learner_chips or self.chips) // kept


def topology_devices(name: str) -> tuple[list, int]:
    """(abstract devices of the TPU slice `name`, e.g. "v5p:2x2x4", HBM bytes per chip)."""
    chip = name.split(":")[0].lower()
    if chip not in CHIP_HBM_GIB or ":" not in name:
        raise ValueError(f"topology {name!r}: use <chip>:<shape> with chip one of "
                         f"{sorted(CHIP_HBM_GIB)}, e.g. v5p:4x4x4 or v5e:4x4")
    try:
        from jax.experimental import topologies
        topo = topologies.get_topology_desc(platform="tpu", topology_name=name)
    except Exception as err:  # noqa: BLE001 (libtpu's errors have no common type)
        raise RuntimeError(
            f"cannot describe TPU topology {name!r} ({type(err).__name__}: {err}); compiling "
            "for a TPU needs libtpu: pip install 'libtpu==0.0.42.*' (jax 0.10.2's pin)"
        ) from err
    return list(topo.devices), CHIP_HBM_GIB[chip] * GIB


def model_config(config: ml_collections.ConfigDict, model: str = "") -> tuple[str, ModelConfig]:
    """(name, ModelConfig) of the policy a run of `config` trains: the preset `model`, else
    `model.path`'s config.json, else the config's tiny random model; with the config's
    numerics (dtype, remat, scanned layers, attention block) and LoRA adapters
    (`model.lora.*`, as policy_io.load_policy adds them)."""
    m = config.model
    numerics = dict(dtype=m.dtype, param_dtype=m.dtype, remat=m.remat,
                    scan_layers=m.scan_layers, attention_block=m.attention_block,
                    attention_impl=m.attention_impl)
    if model:
        name, cfg = model, preset_config(model, **numerics)
    elif m.path:
        name, cfg = m.path, hf.read_config(m.path, **numerics)
    else:
        name, cfg = "tiny", tiny_config(m.tiny_arch, m.tiny_vocab,
                                        **policy_io.tiny_shape(config), **numerics)
    return name, cfg.replace(lora=policy_io.lora_config(config))


def abstract_params(cfg: ModelConfig, mesh: Mesh, rules=parallel.DEFAULT_RULES, module=None):
    """The params of `module` (default: the policy Transformer of `cfg`) as ShapeDtypeStructs
    in their shardings on `mesh`."""
    module = Transformer(cfg) if module is None else module
    abstract, names = parallel.logical_axes_of(module, np.zeros((1, 1), np.int32))
    shardings = parallel.param_shardings(abstract, names, mesh, rules)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        abstract, shardings)


def _sds(shape, dtype, sharding):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def chip_bytes(tree) -> int:
    """Bytes one chip holds of `tree` (ShapeDtypeStructs or arrays in NamedShardings): each
    leaf's shard, the largest where a dim does not divide evenly."""
    return int(sum(math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(tree)))


def _size(n: float) -> str:
    """A byte count in GiB, MiB or KiB, whichever reads best."""
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 2 ** 10:.1f} KiB"


def _nbytes(tree) -> int:
    return int(sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(tree)))


def trainable(params, heads: tuple[str, ...] = ()) -> Optional[frozenset]:
    """What a TrainState of `params` trains, as train_states.new_state picks it: with LoRA
    adapters in `params`, the adapters (and `heads`, e.g. a critic's value head); else all."""
    return frozenset(lora.ADAPTER_KEYS + heads) if lora.has_adapters(params) else None


def sync_of(params) -> str:
    """What one weight sync to the sampler moves for `params` (global, abstract): the adapters
    alone when they hold adapters (the sampler copies the frozen base once), else every
    param in its dtype (engines.engine_weights)."""
    if not lora.has_adapters(params):
        dtypes = sorted({str(jnp.dtype(x.dtype)) for x in jax.tree.leaves(params)})
        return f"{_size(_nbytes(params))} (every param, {'/'.join(dtypes)})"
    base = lora.without_adapters(params)
    return (f"{_size(_nbytes(lora.adapters(params)))} (the adapters, float32; the "
            f"{_size(_nbytes(base))} base once, at the first sync)")


def rollout_batch(rows: int, length: int, mesh: Mesh, keys) -> RolloutBatch:
    """An RL batch of `rows` x `length` carrying the fields `keys` as the trainer builds it
    (core.batch declares their dtypes and shapes), sharded on rows."""
    return abstract_batch(rows, length, NamedSharding(mesh, parallel.batch_spec(1)), keys)


_UNITS = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}
# XLA:TPU's refusal, e.g. "the total memory required for HLO temporaries (252.22G) exceeds
# available HBM (15.75G)"
_REFUSAL = re.compile(r"\(([\d.]+)([KMGT])\) exceeds available HBM")


def _memory(name: str, lowered, weights: int = 0) -> ProgramMemory:
    """`lowered` compiled and measured. When XLA refuses it, only its temporaries are known:
    `weights` (bytes a chip holds of its params or state) stands for its arguments then."""
    start = time.time()
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as err:
        found = _REFUSAL.search(str(err))
        if "RESOURCE_EXHAUSTED" not in str(err) or not found:
            raise
        needed = int(float(found.group(1)) * _UNITS[found.group(2)])
        message = str(err).split("RESOURCE_EXHAUSTED: ")[-1].splitlines()[0]
        return ProgramMemory(name, time.time() - start, weights, 0, 0, needed, refused=message)
    seconds = time.time() - start
    m = compiled.memory_analysis()
    return ProgramMemory(name, seconds, m.argument_size_in_bytes, m.output_size_in_bytes,
                         m.alias_size_in_bytes, m.temp_size_in_bytes)


def _bucket(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


@dataclasses.dataclass
class Plan:
    """What `check` compiles for a config on a topology, worked out as the trainer works it out
    on that slice: the learner's and the sampler's devices (placement.split_devices: an
    asynchronous run's embedded sampler takes rollout.sampler_devices of each host's chips, 0 =
    half, and the learner the rest), the learner on its mesh, and one step's global rows
    (recipes/shapes.step_rows: fresh, replayed and self-play's rows, padded to the learner's
    row multiple) x the longest length bucket."""

    topology: str
    hosts: int
    learner_devices: list
    sampler_devices: list  # host 0's: every host's sampler runs the same programs
    mesh: Mesh
    row_multiple: int
    rows: int
    length: int
    learner: Learner = dataclasses.field(repr=False, compare=False)
    params: dict = dataclasses.field(repr=False, compare=False)  # the policy's, abstract

    @property
    def learner_chips(self) -> int:
        return len(self.learner_devices)

    @property
    def sampler_chips(self) -> int:
        return len(self.sampler_devices)


def plan(config: ml_collections.ConfigDict, topology: str, cfg: Optional[ModelConfig] = None,
         devices: Optional[list] = None) -> Plan:
    """The `Plan` of `config` on `topology` with the policy `cfg` (default: `model_config`'s;
    `devices`: the topology's, when the caller has them). Builds the learner on abstract
    state (nothing allocated, nothing compiled)."""
    devices = topology_devices(topology)[0] if devices is None else devices
    cfg = model_config(config)[1] if cfg is None else cfg
    learner_devices, sampler_devices = placement.split_devices(
        config, devices, devices[0].process_index)
    mesh = placement.make_mesh(config, learner_devices)
    learner, params = _abstract_learner(config, cfg, mesh)
    t = config.train
    hosts = len({d.process_index for d in learner_devices})
    multiple = learner.row_multiple()
    return Plan(topology, hosts, learner_devices, sampler_devices, mesh, multiple,
                rows=shapes.step_rows(config, multiple, hosts),
                length=max(t.length_buckets) if t.length_buckets else
                config.env.max_context_tokens, learner=learner, params=params)


def _abstract_learner(config, cfg: ModelConfig, mesh: Mesh) -> tuple[Learner, dict]:
    """The trainer's Learner on `mesh` over abstract states, and the abstract policy params
    (with LoRA, the base and its adapters, and states that train the adapters alone)."""
    algo = config.algo
    model = Transformer(cfg, mesh=mesh)
    params = abstract_params(cfg, mesh)
    tx = make_optimizer(train_states.rl_optim_config(config, config.optim.lr))
    state = abstract_state(params, tx, trainable(params))
    update_cfg = algorithms.update_config(config)
    loss_cfg = algorithms.loss_config(algo, config.env.max_new_tokens)
    critic = value_model = None
    if algorithms.uses_critic(algo):
        value_model = ValueModel(cfg, mesh=mesh)
        # its shapes traced off the mesh, as the policy's: on a TPU mesh a 1-token trace would
        # take the splash kernel, which refuses it
        critic_params = abstract_params(cfg, mesh, module=ValueModel(cfg))
        critic = abstract_state(critic_params,
                                make_optimizer(train_states.rl_optim_config(config, algo.value_lr)),
                                trainable(critic_params, heads=("head",)))
    # the KL reference: the initial params (LoRA: its adapters, on the policy's base); held_by
    reference = lora.adapters(params) if lora.is_on(cfg) else params
    learner = Learner(model, state, mesh, loss_cfg, update_cfg, critic=critic,
                      value_model=value_model,
                      reference_params=reference if update_cfg.use_reference else None)
    return learner, params


def learner_resident(learner: Learner) -> int:
    """Bytes a learner chip holds between programs: policy state, critic state, reference."""
    trees = (learner.policy, learner.critic, learner.reference_params)
    return sum(chip_bytes(t) for t in trees if t is not None)


def held_by(learner: Learner) -> dict[str, int]:
    """Bytes a learner chip holds for the rest of the run while each learner program runs: the
    learner's trees (`learner_resident`) less that program's own arguments."""
    policy, critic, every = learner.policy, learner.critic, learner_resident(learner)
    return {"policy_update": every - chip_bytes(policy),
            "score": every - chip_bytes(policy.params),
            "critic_update": every - (chip_bytes(critic) if critic else 0),
            "values": every - (chip_bytes(critic.params) if critic else 0)}


def learner_programs(planned: Plan, beside: int = 0) -> list[ProgramMemory]:
    """policy_update and score (and critic_update, values) at the plan's batch shape; `beside`:
    bytes a learner chip holds besides the learner's own (a synchronous run's sampler)."""
    learner, rows, length = planned.learner, planned.rows, planned.length
    lower = functools.partial(learner.lower, rows=rows, length=length,
                              batch_keys=learner.carried_fields())
    policy, critic = learner.policy, learner.critic
    out = [_memory("policy_update", lower("policy_update"), chip_bytes(policy)),
           _memory("score", lower("logprobs"), chip_bytes(policy.params))]
    if critic is not None:
        out += [_memory("critic_update", lower("value_update"), chip_bytes(critic)),
                _memory("values", lower("values"), chip_bytes(critic.params))]
    micro = {"policy_update": learner.update_micro_batches(rows, length),
             "score": learner.score_micro_batches(rows, length)}
    micro.update(critic_update=micro["policy_update"], values=micro["score"])
    held = held_by(learner)
    for p in out:
        p.shape = f"{rows}x{length}/{micro[p.name]}"
        p.held = held[p.name] + beside
    return out


# One host's chips as a slice of its own, by chip count: libtpu has refused to compile a program
# for a subset of a multi-host topology's devices (its replica groups must number the chips
# 0..n-1), so the sampler compiles for such a slice where the chip has one of that size.
_HOST_SHAPES = {"2d": {1: "1x1", 2: "1x2", 4: "2x2", 8: "2x4"},
                "3d": {1: "1x1x1", 2: "1x2x1", 4: "2x2x1", 8: "2x2x2"}}


def sampler_slice(topology: str, devices: list, sampler: list) -> list:
    """The abstract chips to compile the embedded sampler for: its devices `sampler` (one
    host's, from placement.split_devices) among the topology's `devices`; when they are not
    the whole topology, a one-host slice of as many chips of the same kind, else (no such
    slice: v5p's 2 chips) `sampler` itself."""
    if len(sampler) == len(devices):
        return sampler
    chip, shape = topology.lower().split(":")
    name = _HOST_SHAPES["3d" if shape.count("x") == 2 else "2d"].get(len(sampler))
    if name:
        try:
            return topology_devices(f"{chip}:{name}")[0]
        except RuntimeError:  # libtpu knows no such slice of this chip
            pass
    return sampler


@dataclasses.dataclass
class SamplerWeights:
    """The embedded sampler's model and abstract params on one host's chips, as JaxSampler
    builds them (unrolled layers, no remat, `model.sampler_dtype`, `rollout.kv_dtype`; a LoRA
    policy's per `model.lora.sampler`), and what else it keeps there for the run."""

    cfg: ModelConfig  # the model it runs
    mesh: Mesh
    model: Transformer
    params: dict
    base_copy: int  # bytes a chip keeps of a merge sampler's copy of the base
    prefix_pool: int  # bytes a chip keeps of the prefix cache's pool

    @property
    def held(self) -> int:
        """Bytes a sampler chip keeps beside the params its programs read."""
        return self.base_copy + self.prefix_pool

    @property
    def resident(self) -> int:
        """Bytes a sampler chip holds between batches."""
        return chip_bytes(self.params) + self.held

    def describe(self) -> str:
        parts = [f"weights {_size(chip_bytes(self.params))}"]
        if self.base_copy:
            parts.append(f"the base it merges from {_size(self.base_copy)}")
        if self.prefix_pool:
            parts.append(f"prefix pool {_size(self.prefix_pool)}")
        return (f"the embedded sampler holds {_size(self.resident)} a chip between batches ("
                + ", ".join(parts) + ")")


def sampler_weights(config, cfg: ModelConfig, host: list) -> SamplerWeights:
    """The `SamplerWeights` of policy `cfg` on one host's chips `host` (a LoRA policy's in the
    mode its LoraConfig names, as JaxSampler reads it)."""
    r = config.rollout
    mesh = parallel.sampler_mesh(host, cfg.num_kv_heads, r.sampler_tensor)  # as make_engine
    cfg = cfg.replace(scan_layers=False, remat="none")
    if config.model.sampler_dtype:
        dtype = str(jnp.dtype(config.model.sampler_dtype))
        cfg = cfg.replace(dtype=dtype, param_dtype=dtype)
    if r.kv_dtype:
        cfg = cfg.replace(cache_dtype=str(jnp.dtype(r.kv_dtype)))
    base_copy = pool = 0
    if lora.is_on(cfg) and cfg.lora.sampler == "merge":
        cfg = cfg.replace(lora=None)
        # AdapterWeights keeps the base and merges each sync's adapters into a new tree:
        # every param of it a buffer of its own (jit copies the unadapted ones too)
        base_copy = chip_bytes(abstract_params(cfg, mesh, parallel.SAMPLER_RULES))
    if r.prefix_reuse and r.prefix_cache_tokens:
        pool = _prefix_pool_bytes(cfg, mesh, r.prefix_cache_tokens)
    return SamplerWeights(cfg, mesh, Transformer(cfg, mesh=mesh, rules=parallel.SAMPLER_RULES),
                          abstract_params(cfg, mesh, parallel.SAMPLER_RULES), base_copy, pool)


def _prefix_pool_bytes(cfg: ModelConfig, mesh: Mesh, tokens: int) -> int:
    """Bytes a chip holds of the prefix cache's pool (prefix_cache.py: K and V pages of every
    layer, allocated whole at its first use, kv heads split as the cache's)."""
    page = 16  # JaxSampler's prefix_page_size, which make_engine leaves at its default
    shape = ((tokens // page), cfg.num_kv_heads, page, cfg.head_dim)
    spec = parallel.logical_to_spec((None, "kv_heads", None, "kv"), mesh,
                                    parallel.SAMPLER_RULES, shape)
    pool = _sds(shape, cfg.kv_dtype, NamedSharding(mesh, spec))
    return 2 * cfg.num_layers * chip_bytes(pool)


def sampler_programs(config, cfg: ModelConfig, host: list,
                     beside: int = 0) -> list[ProgramMemory]:
    """The embedded sampler's prefill and one decode chunk on one host's chips (`host`), at
    rollout.max_batch rows of the longest prompt bucket (as `JaxSampler` pads them); `beside`:
    bytes a sampler chip holds besides the sampler's own (a synchronous run's learner)."""

    r, env = config.rollout, config.env
    weights = sampler_weights(config, cfg, host)
    mesh, model, params = weights.mesh, weights.model, weights.params
    new = _bucket(env.max_new_tokens, 16)
    prompt = _bucket(max(env.max_context_tokens - env.max_new_tokens, 1), 16)
    b = _bucket(r.max_batch, 1)
    while r.kv_tokens_per_device and b > 1 and b * (prompt + new) > (
            r.kv_tokens_per_device * len(host)):  # as JaxSampler._batches splits them
        b //= 2
    rep = NamedSharding(mesh, P())
    i32, f32 = jnp.int32, jnp.float32
    keys = jax.eval_shape(lambda: jax.vmap(jax.random.key)(jnp.zeros((b,), jnp.uint32)))
    args = [_sds((b, prompt), i32, rep)] + [_sds((b,), i32, rep)] * 3 + [
        _sds((b,), f32, rep)] * 2 + [_sds((b,), i32, rep)] + [_sds((b, 2), i32, rep)] * 2 + [
        _sds(keys.shape, keys.dtype, rep), _sds((b,), i32, rep)]
    prefill = _memory("sampler_prefill",
                      sampling.prefill.lower(model, params, *args, max_steps=new,
                                             chunk=r.prefill_chunk), chip_bytes(params))
    # The decode state's shardings are the compiler's choice for prefill's outputs; they do not
    # depend on the prompt's length, so a 16-token prefill (cheap, and it always fits) gives
    # them even when the real one does not fit.
    short = [_sds((b, 16), i32, rep)] + args[1:]
    shardings = sampling.prefill.lower(model, params, *short,
                                       max_steps=new).compile().output_shardings
    shapes = jax.eval_shape(functools.partial(sampling.prefill, model, max_steps=new),
                            params, *args)
    state = jax.tree.map(lambda x, s: _sds(x.shape, x.dtype, s), shapes, shardings)
    decode = _memory("sampler_decode", sampling.decode.lower(model, params, state, chunk=64),
                     chip_bytes(params))
    prefill.shape = f"{b}x{prompt}"
    decode.shape = f"{b}x{prompt + new}"
    where = {k: v for k, v in mesh.shape.items() if v > 1} or {"data": 1}
    prefill.mesh = decode.mesh = f"{where} (one host's {len(host)} chips)"
    prefill.held = decode.held = weights.held + beside
    return [prefill, decode]


def check(config: ml_collections.ConfigDict, topology: str, model: str = "",
          programs: Optional[set] = None) -> Report:
    """Compiles the config's programs (all, or the names in `programs`) for `topology`."""
    devices, hbm = topology_devices(topology)
    name, cfg = model_config(config, model)
    planned = plan(config, topology, cfg, devices)
    learner = planned.learner
    sampler, host, shared = None, [], False
    if config.rollout.engine == "jax":
        host = sampler_slice(topology, devices, planned.sampler_devices)
        sampler = sampler_weights(config, cfg, host)
        # a synchronous run's sampler and learner take turns on the same chips: each program
        # there runs beside the other's weights (an asynchronous run's have chips of their own)
        shared = bool(set(planned.sampler_devices) & set(planned.learner_devices))
    out = []
    if programs is None or programs & {"policy_update", "score", "critic_update", "values"}:
        out += learner_programs(planned, sampler.resident if shared else 0)
    if sampler and (programs is None or programs & {"sampler_prefill", "sampler_decode"}):
        out += sampler_programs(config, cfg, host, learner_resident(learner) if shared else 0)
    if programs is not None:
        out = [p for p in out if p.name in programs]
    notes = [f"the learner holds {_size(learner_resident(learner))} a chip between programs"
             + (f" (the KL reference's copy of the params or adapters: "
                f"{_size(chip_bytes(learner.reference_params))})"
                if learner.reference_params is not None else "")]
    if sampler:
        notes.append(sampler.describe() + ("; on learner chips (a synchronous run)"
                                           if shared else ""))
    return Report(topology, len(devices), hbm, _model_name(name, cfg, planned.params),
                  dict(planned.mesh.shape), out, learner_chips=planned.learner_chips,
                  sync=sync_of(planned.params), notes=notes)


def _model_name(name: str, cfg: ModelConfig, params) -> str:
    """E.g. "qwen2.5-7b (7.62B params) + LoRA rank 8 on 7 projections (20.2M adapter params)"."""
    n = cfg.num_params()
    name = f"{name} ({n / 1e9:.2f}B params)" if n >= 1e8 else f"{name} ({n / 1e6:.1f}M params)"
    if not lora.is_on(cfg):
        return name
    count = lora.adapter_count(params)
    count = f"{count / 1e6:.1f}M" if count >= 1e5 else f"{count / 1e3:.1f}K"
    return (f"{name} + LoRA rank {cfg.lora.rank} on {len(cfg.lora.targets)} projections "
            f"({count} adapter params)")


def advice(report: Report, config: ml_collections.ConfigDict) -> list[str]:
    """For each program that does not fit, the config keys that would shrink it."""
    lines = []
    for p in report.misfits():
        over = f"{p.name} needs {p.peak / GIB:.1f} GiB of {report.hbm / GIB:.1f} GiB"
        keys = []
        if p.refused:  # the compiler names the temporaries alone
            over = f"{p.name} needs {p.temp / GIB:.1f} GiB of temporaries ({p.refused})"
        if p.name.startswith("sampler"):
            kv = config.rollout.kv_tokens_per_device
            keys += [f"rollout.kv_tokens_per_device={kv // 2}" if kv else
                     f"rollout.max_batch={max(1, config.rollout.max_batch // 2)}"]
            if p.name == "sampler_prefill" and not config.rollout.prefill_chunk:
                keys.append("rollout.prefill_chunk=2048")
            if not config.model.sampler_dtype and config.model.dtype == "float32":
                keys.append("model.sampler_dtype=bfloat16")
                if not config.rollout.kv_dtype:
                    keys.append("rollout.kv_dtype=bfloat16 (the cache alone)")
        else:
            if p.argument > p.temp and report.mesh.get("fsdp", 1) < report.fsdp_chips:
                keys.append(f"mesh.fsdp={report.fsdp_chips} (shard params and optimizer "
                            "state)")
            t = config.train
            budget = (t.tokens_per_device if p.name.endswith("update") else
                      t.score_tokens_per_device or t.tokens_per_device)
            keys.append(f"train.{'' if p.name.endswith('update') else 'score_'}"
                        f"tokens_per_device={budget // 2}" if budget else
                        f"train.micro_batches={2 * t.micro_batches}")
            if config.model.remat != "full" and p.name.endswith("update"):  # backward only
                keys.append("model.remat=" + ("dots" if config.model.remat == "none"
                                              else "full"))
            if p.argument <= p.temp and report.mesh.get("fsdp", 1) < report.fsdp_chips:
                keys.append(f"mesh.fsdp={report.fsdp_chips}")
            if p.argument + p.held > p.temp and policy_io.lora_config(config) is None:
                # last: it changes what trains, not only how (docs/lora.md)
                keys.append("model.lora.rank=8 (adapters on a frozen base: no optimizer state "
                            "or fp32 master of the base)")
        lines.append(f"{over}: try " + ", ".join(f"--config.{k}" for k in keys))
    return lines
