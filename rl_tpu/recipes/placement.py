"""Where a run's work goes: the learner's mesh, which devices the embedded sampler gets,
and the host counts a mode cannot run on. Recipes call these first, before any model is
built (rl_tpu/aot.py too, on a TPU topology's abstract devices).
"""

from __future__ import annotations

import logging
from typing import Optional

import jax
import ml_collections
from jax.sharding import Mesh

from rl_tpu import parallel

log = logging.getLogger(__name__)


def make_mesh(config: ml_collections.ConfigDict, devices=None) -> Mesh:
    """The training mesh over `devices` (default: every device of every host)."""
    m = config.mesh
    return parallel.make_mesh({"data": m.data, "fsdp": m.fsdp, "expert": m.expert,
                               "tensor": m.tensor}, devices=devices)


def split_devices(config: ml_collections.ConfigDict, devices: Optional[list] = None,
                  process_index: Optional[int] = None) -> tuple[list, list]:
    """(learner devices, host `process_index`'s embedded-sampler devices) among `devices`.

    `devices`: every device of every host, each knowing its host (`process_index`); default
    jax.devices(), and launch.compile_check passes a TPU topology's abstract devices (rl_tpu/
    aot.py). `process_index`: default this process's. A host's devices are those of `devices`
    on it, in order (as jax.local_devices() lists them).

    Synchronous (and with SGLang servers, which sample elsewhere) both span every device, the
    sampler `rollout.sampler_devices` of them (0 = all local): they take turns. Asynchronous
    with the embedded sampler they run at once, so they get devices of their own: the sampler
    takes the first `rollout.sampler_devices` local devices of each host (0 = half of them)
    and the learner's mesh every other device of every host. A host of one device (a plain
    CPU: what `python -m launch.train` gets without XLA flags) cannot split: there the
    asynchronous producer's sampler shares the device with the learner, each on its own copy
    of the weights as in a synchronous run, and the two take turns on it instead of
    overlapping (the learner's mesh and the sampler are one device either way, so a lock-step
    run's numbers are those of a two-device host's).
    """
    r = config.rollout
    devices = list(jax.devices() if devices is None else devices)
    host = jax.process_index() if process_index is None else process_index
    local = [d for d in devices if d.process_index == host]
    if r.max_staleness == 0 or r.engine != "jax":
        return devices, local[:r.sampler_devices] if r.sampler_devices else local
    if len(local) == 1 and r.sampler_devices in (0, 1):
        log.warning("rollout.max_staleness=%d on a host of one device: the embedded sampler "
                    "shares it with the learner and they take turns (on a CPU, "
                    "XLA_FLAGS=--xla_force_host_platform_device_count=2 gives each its own)",
                    r.max_staleness)
        return devices, local
    n = r.sampler_devices or len(local) // 2
    if not 1 <= n < len(local):
        allowed = ("rollout.sampler_devices to 0 (the one device, shared)" if len(local) == 1
                   else f"rollout.sampler_devices to 0 (half of them) or 1 <= "
                        f"rollout.sampler_devices < {len(local)}")
        raise ValueError(
            f"rollout.sampler_devices={r.sampler_devices}, but this host has {len(local)} "
            f"device(s): rollout.max_staleness={r.max_staleness} runs the embedded sampler "
            f"beside the learner on the first rollout.sampler_devices of them, the learner on "
            f"the rest. Set {allowed}")
    # every host gives its first n devices to its sampler: the rest of all hosts form the mesh
    by_host: dict[int, list] = {}
    for d in devices:
        by_host.setdefault(d.process_index, []).append(d)
    sampler_ids = {d.id for on_host in by_host.values() for d in on_host[:n]}
    return ([d for d in devices if d.id not in sampler_ids],
            [d for d in local if d.id in sampler_ids])


def check_hosts(config: ml_collections.ConfigDict) -> None:
    """Refuses, before anything is built, a mode that cannot be run on this many hosts.

    Lock-step asynchronous rollouts (`rollout.deterministic`) on SGLang servers that several
    hosts share: the servers hold one weight version at a time, process 0 swaps it, and each
    host's producer thread starts its chunks at its own pace, so one host's chunk could be
    sampled with the version another host's chunk needs; agreeing on the swaps would take a
    collective in the producer threads. (Free-running tolerates it: every token's version is
    reported and counted, and with LoRA a host names a version only after a barrier on the
    main thread says process 0 loaded it, which unloads none another host may still name:
    `core.shared_weights.wait_for_shared_weights`; synchronous runs swap on the main thread, hosts waiting
    together.)"""
    r = config.rollout
    if (jax.process_count() > 1 and r.engine == "sglang" and r.max_staleness > 0
            and r.deterministic):
        raise ValueError(
            f"rollout.deterministic=True with rollout.max_staleness={r.max_staleness} and "
            f"SGLang servers cannot run on {jax.process_count()} hosts: the hosts share the "
            "servers' one weight version, and their producers would swap it under each "
            "other. Set rollout.deterministic=False (free-running: every token's version "
            "is tracked), rollout.max_staleness=0, or use the embedded JAX sampler "
            "(--rollout_urls unset)")
