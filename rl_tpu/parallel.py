"""Device mesh, logical-axis rules and shardings: the one place that knows about the hardware.

Model code names the axes of every parameter and main activation logically (`embed`, `heads`,
`vocab`, `act_batch`...). A short rule table maps logical names to the mesh axes
`data` (pure data parallel), `fsdp` (data parallel with parameters sharded), `expert` (a
mixture of experts' experts split across it; for everything else another data axis) and
`tensor` (tensor/model parallel). The same model then runs on one CPU, a GPU, or a TPU pod slice,
only the mesh config changes.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
import threading
from typing import Any, Iterable, Mapping, Optional, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "expert", "tensor")
# The axes a batch's rows are split over: every data-parallel one. `expert` is a data axis for
# all but the experts, which gather their tokens over it (models/moe.py), as Megatron's
# all-gather token dispatcher does.
BATCH_AXES = ("data", "fsdp", "expert")

# Logical name -> mesh axis (or tuple of axes, or None = replicated). First match wins.
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    # activations
    ("act_batch", BATCH_AXES),
    ("act_len", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    # parameters: fsdp shards the model width, tensor the heads / mlp / vocab
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("kv", None),
    ("mlp", "tensor"),
    ("expert", "expert"),
    ("layers", None),
    ("norm", None),
)

# The embedded sampler's rules (on `sampler_mesh`): the model width unsharded, so no weight
# is gathered per decoded token; the rest as DEFAULT_RULES (rows on data, heads on tensor).
SAMPLER_RULES: tuple[tuple[str, Any], ...] = (("embed", None),) + tuple(
    r for r in DEFAULT_RULES if r[0] != "embed")

log = logging.getLogger(__name__)


def make_mesh(axes: Mapping[str, int], devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """Mesh over `devices` (default: all, across hosts) with axes data, fsdp, expert, tensor.

    `axes` maps each of MESH_AXES to a size; missing axes are 1 and one axis may be -1
    (= all remaining devices). Example: {'fsdp': -1, 'tensor': 2}.
    """
    unknown = set(axes) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"unknown mesh axes {sorted(unknown)}; the mesh axes are {MESH_AXES}")
    devices = list(jax.devices() if devices is None else devices)
    sizes = [int(axes.get(name, 1)) for name in MESH_AXES]
    if sizes.count(-1) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {dict(zip(MESH_AXES, sizes))}")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"{len(devices)} devices do not divide into mesh {dict(axes)}")
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) != len(devices):
        raise ValueError(
            f"mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, "
            f"there are {len(devices)}; use -1 for one axis to take the rest")
    try:  # topology-aware order on TPU/GPU (ICI rings); may refuse odd CPU layouts
        from jax.experimental import mesh_utils
        grid = mesh_utils.create_device_mesh(sizes, devices=devices)
    except (ValueError, NotImplementedError, AssertionError):
        grid = np.asarray(devices, dtype=object).reshape(sizes)
    return Mesh(grid, MESH_AXES)


def platform(mesh: Optional[Mesh]) -> str:
    """The platform a program runs on: its mesh's devices (an AOT compile's TPUs on a CPU
    host), else JAX's default devices."""
    devices = mesh.devices.flat if mesh is not None else jax.devices()
    return next(iter(devices)).platform


def sampler_mesh(devices: Sequence[jax.Device], kv_heads: int, tensor: int = 0) -> Mesh:
    """The embedded sampler's mesh over one host's `devices`: {data, tensor}, no fsdp.

    Decode reads every weight once a token, so weights sharded on fsdp (the trainer's layout)
    would be all-gathered every token; SAMPLER_RULES instead split heads, kv heads, mlp and
    vocab across `tensor` (Megatron-style: one all-reduce after attention and one after the
    MLP) and rows across `data`. `tensor` 0 picks the largest power of two dividing both
    kv_heads and the device count, so the KV cache, the largest thing decode holds, is split
    by kv head rather than replicated (Qwen2.5-7B, 4 kv heads, on a v5p host's 4 chips: 4;
    1.5B, 2 kv heads, on a v5e host's 8: tensor 2 x data 4).
    """
    devices = list(devices)
    if tensor <= 0:
        tensor = 1
        while len(devices) % (2 * tensor) == 0 and kv_heads % (2 * tensor) == 0:
            tensor *= 2
    if len(devices) % tensor:
        raise ValueError(f"rollout.sampler_tensor={tensor} does not divide the sampler's "
                         f"{len(devices)} devices; use a divisor, or 0 to pick one")
    return make_mesh({"data": -1, "tensor": tensor}, devices=devices)


def logical_rules(overrides: Optional[Iterable[Sequence[Any]]] = None) -> tuple:
    """DEFAULT_RULES with `overrides` ((logical, mesh_axes), ...) taking precedence."""
    overrides = tuple((name, _as_axes(axes)) for name, axes in (overrides or ()))
    for _, axes in overrides:
        for axis in axes or ():
            if axis not in MESH_AXES:
                raise ValueError(f"logical rule maps to unknown mesh axis {axis!r}; use {MESH_AXES}")
    overridden = {name for name, _ in overrides}
    return overrides + tuple(r for r in DEFAULT_RULES if r[0] not in overridden)


def _as_axes(axes) -> Optional[tuple[str, ...]]:
    if axes is None:
        return None
    return (axes,) if isinstance(axes, str) else tuple(axes)


def logical_to_spec(names: Sequence[Optional[str]], mesh: Mesh, rules=DEFAULT_RULES,
                    shape: Optional[Sequence[int]] = None) -> P:
    """PartitionSpec for an array whose dims have logical `names`.

    A mesh axis is used at most once per array, and only where it divides the dimension
    (e.g. 2 kv heads on a tensor axis of 4 stay replicated instead of failing): the rules say
    what is wanted, this says what is possible.
    """
    table = {name: _as_axes(axes) for name, axes in reversed(tuple(rules))}  # first match wins
    used: set[str] = set()
    spec = []
    for dim, name in enumerate(names):
        chosen = []
        size = None if shape is None else shape[dim]
        for axis in (table.get(name) or ()) if name is not None else ():
            if axis in used or mesh.shape[axis] == 1:
                continue
            width = math.prod(mesh.shape[a] for a in chosen) * mesh.shape[axis]
            if size is not None and size % width:
                continue
            chosen.append(axis)
        used.update(chosen)
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return P(*spec)


def logical_axes_of(model: nn.Module, *init_args, **init_kwargs):
    """(abstract params, logical names per param) of a Linen model, without allocating."""
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), *init_args, **init_kwargs))
    names = nn.get_partition_spec(boxed)["params"]
    return nn.meta.unbox(boxed)["params"], names


def constrain(x: jax.Array, names: Sequence[Optional[str]], mesh: Optional[Mesh],
              rules=None) -> jax.Array:
    """An activation `x` (dims named `names`, e.g. act_batch) constrained to the sharding the
    rules give it on `mesh` (`logical_to_spec`: an axis that does not divide a dim is left
    out). No-op without a mesh. Default rules: DEFAULT_RULES, so a model built with a mesh
    alone keeps its activations sharded. (flax's with_logical_constraint does nothing without
    rules: the trainer's model had no activation constraints, and XLA ran the fsdp MLP as
    partial sums over every row of the batch on every chip, Qwen2.5-1.5B's update of one
    8192-token row a v5e chip holding five [16, 8192, 8960] activations: 16.3 -> 5.8 GiB.)"""
    if mesh is None:
        return x
    spec = logical_to_spec(tuple(names), mesh, DEFAULT_RULES if rules is None else rules,
                           x.shape)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def param_shardings(abstract_params, logical_names, mesh: Mesh, rules=DEFAULT_RULES):
    """NamedSharding for every leaf of a params pytree."""
    def one(leaf, names):
        names = tuple(names) if names is not None else (None,) * len(leaf.shape)
        return NamedSharding(mesh, logical_to_spec(names, mesh, rules, leaf.shape))
    return jax.tree.map(one, abstract_params, logical_names,
                        is_leaf=lambda x: isinstance(x, P) or x is None)


def init_params(model: nn.Module, mesh: Mesh, rules, rng, *init_args, **init_kwargs):
    """Random params created directly in their shardings (never whole on one device)."""
    abstract, names = logical_axes_of(model, *init_args, **init_kwargs)
    shardings = param_shardings(abstract, names, mesh, rules)
    init = jax.jit(lambda key: nn.meta.unbox(model.init(key, *init_args, **init_kwargs))["params"],
                   out_shardings=shardings)
    return init(rng)


def bytes_per_device(tree) -> dict[jax.Device, int]:
    """Bytes of a pytree of global arrays that each device holds (for memory reports)."""
    held: dict[jax.Device, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return held


def maybe_initialize_distributed() -> bool:
    """Join a multi-host job when the environment describes one; no-op on a single host.

    Every host runs the same command. `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES` and
    `JAX_PROCESS_ID` (or a TPU pod's own metadata with `RL_TPU_DISTRIBUTED=1`) say how to join.
    """
    if jax.distributed.is_initialized():
        return True
    coordinator = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if coordinator:
        try:
            num_processes = int(os.environ["JAX_NUM_PROCESSES"])
            process_id = int(os.environ["JAX_PROCESS_ID"])
        except (KeyError, ValueError) as err:
            raise ValueError(
                "JAX_COORDINATOR_ADDRESS is set, so JAX_NUM_PROCESSES and JAX_PROCESS_ID must be "
                f"integers too: {err}") from err
        jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
    elif os.environ.get("RL_TPU_DISTRIBUTED") == "1":
        jax.distributed.initialize()  # cluster auto-detection (TPU pods, SLURM)
    else:
        return False
    log.info("process %d of %d, %d local / %d global devices", jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count())
    return True


class OffMainThreadCollectiveError(RuntimeError):
    """A cross-host helper was called off the main thread of a multi-process job."""


def require_main_thread(helper: str) -> None:
    """Raises when `helper`, a cross-host collective, runs off the main thread of a
    multi-process job (nothing on one process, where no collective is involved).

    Every host must issue its collectives in the same order. A thread (an async producer, a
    weight publisher) runs at its own pace on each host, so a collective there can pair with
    a different one on another host (wrong data, or a deadlock); the main thread's order is
    the program's order, the same on every host.
    """
    if jax.process_count() > 1 and threading.current_thread() is not threading.main_thread():
        raise OffMainThreadCollectiveError(
            f"parallel.{helper} is a cross-host collective and was called on thread "
            f"{threading.current_thread().name!r}, not the main thread, in a job of "
            f"{jax.process_count()} processes; hosts would issue their collectives in "
            "different orders. Call it on the main thread and hand the thread its result "
            "(e.g. the learner makes the engine's host-local copy, the producer only "
            "receives it).")


def data_parallel_size(mesh: Mesh) -> int:
    """Ways a batch's rows are split over `mesh`: the product of its BATCH_AXES (the tensor
    axis splits the model, not the rows)."""
    return math.prod(mesh.shape[axis] for axis in BATCH_AXES)


def batch_spec(ndim: int) -> P:
    """Batch arrays are split on the leading dim over all data-parallel axes."""
    return P(BATCH_AXES, *([None] * (ndim - 1)))


def host_to_global(batch, mesh: Mesh):
    """Host-local numpy batch (this host's rows) -> global jax arrays sharded on the batch axes.

    On one host this is a device_put; on N hosts each contributes its rows and the global
    leading dim is N times the local one, so every host must give as many rows. Main thread
    only with several processes: the arrays it makes feed the pod-wide programs.
    """
    require_main_thread("host_to_global")

    def one(x):
        x = np.asarray(x)
        return jax.make_array_from_process_local_data(NamedSharding(mesh, batch_spec(x.ndim)), x)
    return jax.tree.map(one, batch)


def gather_to_host(tree):
    """Global (possibly multi-host sharded) arrays -> full numpy arrays on every host.

    Arrays this process already holds whole (numpy, or jax arrays on its own devices) are
    read locally; only arrays spread over several processes are gathered, collectively, so
    every process must call this with the same tree.
    """
    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return np.asarray(x)
        require_main_thread("gather_to_host")
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return jax.tree.map(one, tree)


@functools.lru_cache(maxsize=8)
def _reshard_cached(leaves, treedef):
    return jax.jit(lambda t: t, out_shardings=jax.tree.unflatten(treedef, leaves))


def _reshard(shardings):
    """A jitted identity into `shardings`, compiled once per tree of shardings."""
    leaves, treedef = jax.tree.flatten(shardings)
    return _reshard_cached(tuple(leaves), treedef)


def host_copies(tree):
    """Global arrays -> this host's own full copy of each, on its local devices, with no
    parameter passing through host memory (for a per-host sampler fed by a pod-wide trainer).

    One process: the arrays themselves. Several: one jitted identity reshards every leaf
    onto a [hosts, local] view of the same devices, replicated over hosts and split over each
    host's devices (on the dim the leaf is sharded on when the local count divides it, else
    the first dim it divides, else replicated): XLA's all-gather across hosts, device to
    device. Each host then wraps its own shards as an
    array on a mesh of its local devices (`make_array_from_single_device_arrays`, no copy).
    The view is over the devices the tree lives on (an asynchronous learner's mesh leaves
    each host's sampler devices out), each host holding as many of them.
    A collective: every process calls it with the same tree at the same point, on the main
    thread.
    """
    if jax.process_count() == 1:
        return tree
    require_main_thread("host_copies")
    devices = sorted({d for leaf in jax.tree.leaves(tree) for d in leaf.sharding.device_set},
                     key=lambda d: (d.process_index, d.id))
    per_host = {}
    for d in devices:
        per_host[d.process_index] = per_host.get(d.process_index, 0) + 1
    if len(per_host) != jax.process_count() or len(set(per_host.values())) != 1:
        raise ValueError(f"host_copies needs a tree spread over every process alike; its "
                         f"devices per process are {dict(sorted(per_host.items()))}")
    grid = np.array(devices, dtype=object).reshape(jax.process_count(), -1)
    pod = Mesh(grid, ("hosts", "local"))
    local = Mesh(grid[jax.process_index()], ("local",))

    def split_spec(x) -> P:
        # split on the dim the source is sharded on where it can (an all-gather over hosts,
        # nothing moves within one), else on the first dim the local count divides
        source = tuple(getattr(x.sharding, "spec", ()))
        sharded = [d for d, entry in enumerate(source) if entry is not None]
        order = sharded + [d for d in range(x.ndim) if d not in sharded]
        dims = [None] * x.ndim
        for d in order:
            if x.shape[d] % local.size == 0:
                dims[d] = "local"
                break
        return P(*dims)

    shardings = jax.tree.map(lambda x: NamedSharding(pod, split_spec(x)), tree)
    moved = _reshard(shardings)(tree)

    def as_local(x, sharding):
        by_device = {shard.device: shard.data for shard in x.addressable_shards}
        return jax.make_array_from_single_device_arrays(
            x.shape, NamedSharding(local, sharding.spec),
            [by_device[d] for d in local.devices.flat])
    return jax.tree.map(as_local, moved, shardings)


# ----------------------------------------------------------------------------- across hosts
# Host-side values every process contributes to: the "one process or many" pattern in one
# place. Each is a collective when there are several processes, so every process must call it
# at the same point (never from a producer thread that runs at its own pace).


def across_hosts(value, reduce: str = "gather"):
    """`value` (a numpy-able scalar or array) combined over every process, the same result on
    each: "gather" -> [processes, ...], "sum", "max", "min", "any", "all". One process: no
    communication, `value` itself reduced over a leading axis of one."""
    reducers = {"gather": lambda g: g, "sum": lambda g: g.sum(axis=0),
                "max": lambda g: g.max(axis=0), "min": lambda g: g.min(axis=0),
                "any": lambda g: bool(np.any(g)),
                "all": lambda g: bool(np.all(g))}
    if reduce not in reducers:
        raise ValueError(f"reduce={reduce!r}; choose one of {sorted(reducers)}")
    require_main_thread("across_hosts")
    value = np.asarray(value)
    if reduce in ("any", "all"):
        value = value.astype(np.int32)
    if jax.process_count() == 1:
        gathered = value[None]
    else:
        from jax.experimental import multihost_utils
        gathered = np.asarray(multihost_utils.process_allgather(value)).reshape(
            (jax.process_count(),) + value.shape)
    return reducers[reduce](gathered)


def across_hosts_bytes(data: bytes) -> list[bytes]:
    """Every process's `data` (any length), in process order, on every process: how per-host
    lists (a loop's samples, its preference pairs) are gathered explicitly. One process: [data]."""
    if jax.process_count() == 1:
        return [bytes(data)]
    sizes = [int(n) for n in across_hosts(len(data), "gather")]
    padded = np.zeros(max(sizes), np.uint8)
    padded[:len(data)] = np.frombuffer(data, np.uint8)
    gathered = across_hosts(padded, "gather")
    return [gathered[i, :n].tobytes() for i, n in enumerate(sizes)]


def check_same_on_every_host(what: str, value) -> None:
    """Raises, on every host, when the hosts' `value` differ: for what a recipe assumes every
    host holds alike (each then takes its own slice of it), compared by a hash of its repr
    (made only when there are several hosts: an SFT set's repr is large)."""
    if jax.process_count() == 1:
        return
    digest = np.frombuffer(hashlib.sha256(repr(value).encode()).digest(), np.uint8)
    digests = across_hosts(digest, "gather")
    differ = [i for i in range(len(digests)) if not np.array_equal(digests[i], digests[0])]
    if differ:
        raise ValueError(
            f"{what} differ between hosts (processes {differ} hold other {what} than process "
            "0), but every host must hold the same and take its own share: is every host "
            "running the same command, config, code and data files?")


def sync_hosts(name: str) -> None:
    """A barrier over every process (nothing with one)."""
    require_main_thread("sync_hosts")
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)
