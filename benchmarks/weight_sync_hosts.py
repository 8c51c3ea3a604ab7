"""The multi-host weight sync: a trainer sharded over every host feeding each host's sampler.

  python benchmarks/weight_sync_hosts.py --shapes tiny,small,rl_step --hosts 2 --devices 4

Starts --hosts processes of --devices CPU devices each on loopback, one JAX job, as the hosts of
a pod. Each holds random params of the shape sharded over the whole mesh (the trainer's) and a
`JaxSampler` on its own devices, then times a weight sync two ways (median of --repeats):

  device   `parallel.host_copies`: one jitted reshard across hosts, no host memory (the trainer's)
  host     the old route: every host gathers the params to numpy, then puts them on its devices

and process 0 prints a markdown table row per shape. On CPU devices "device" memory is host
memory too, so the two differ here by the copies and the collective, not by a PCIe or DCN link.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

flags.DEFINE_string("shapes", "tiny,small,rl_step", "Model shapes (benchmarks/common.py SHAPES).")
flags.DEFINE_integer("hosts", 2, "Processes (hosts) in the job.")
flags.DEFINE_integer("devices", 4, "CPU devices a process.")
flags.DEFINE_integer("repeats", 5, "Timed syncs of each route (median reported).")
flags.DEFINE_bool("worker", False, "Internal: run as one host of the job.")


def worker(shapes: list[str], repeats: int) -> None:
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from benchmarks.common import model_config, print_table
    from rl_tpu import parallel
    from rl_tpu.models import tiny
    from rl_tpu.rollout.sampler import JaxSampler

    assert parallel.maybe_initialize_distributed()
    rows = []
    for shape in shapes:
        cfg = model_config(shape)
        mesh = parallel.make_mesh({"fsdp": -1})
        params = tiny.random_params(cfg, seed=0, mesh=mesh, scale=0.02)
        sampler = JaxSampler(cfg, parallel.host_copies(params), max_batch=1,
                             mesh=parallel.make_mesh({"fsdp": -1}, devices=jax.local_devices()))
        routes = {
            "device": lambda: parallel.host_copies(params),
            "host": lambda: jax.tree.map(
                np.asarray, multihost_utils.process_allgather(params, tiled=True)),
        }
        ms = {}
        for name, to_engine in routes.items():
            times = []
            for i in range(repeats + 1):  # the first compiles
                multihost_utils.sync_global_devices(f"{shape}-{name}-{i}")
                start = time.perf_counter()
                sampler.update_weights(to_engine(), f"{name}{i}")
                jax.block_until_ready(sampler.weights()[0])
                times.append(time.perf_counter() - start)
            ms[name] = 1000 * float(np.median(times[1:]))
        mb = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)) / 2 ** 20
        rows.append([shape, f"{mb:.1f}", f"{jax.process_count()} x {jax.local_device_count()}",
                     f"{ms['device']:.1f}", f"{ms['host']:.1f}",
                     f"{ms['host'] / ms['device']:.2f}x"])
    if jax.process_index() == 0:
        print_table(["shape", "params MiB", "hosts x devices", "host_copies ms",
                     "via host numpy ms", "speed-up"], rows)


def main(argv):
    del argv
    f = flags.FLAGS
    if f.worker:
        worker(f.shapes.split(","), f.repeats)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for pid in range(f.hosts):
        env = dict(os.environ, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                   JAX_NUM_PROCESSES=str(f.hosts), JAX_PROCESS_ID=str(pid), JAX_PLATFORMS="cpu",
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={f.devices}")
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker",
                                       f"--shapes={f.shapes}", f"--repeats={f.repeats}"],
                                      env=env))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"a host failed: exit codes {codes}")


if __name__ == "__main__":
    app.run(main)
