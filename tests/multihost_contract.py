"""One host of the multi-host contract's check (see test_parallel.py): joins the job named by
the JAX_* environment and writes what each cross-host helper did to OUT.<process>.json:
- a collective called off the main thread raises, naming the helper and the thread;
- per-host bytes of different lengths are gathered in process order;
- data that differs between hosts is caught by its hash, on every host;
- `host_copies` of a tree that lives on some of each host's devices (an asynchronous
  learner's mesh, the sampler holding the others) gives each host its own whole copy.

  python tests/multihost_contract.py OUT   (with JAX_COORDINATOR_ADDRESS etc. set)
"""

import json
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from rl_tpu import parallel  # noqa: E402


def main(out_prefix):
    parallel.maybe_initialize_distributed()
    me = jax.process_index()
    result = {}

    caught = []
    thread = threading.Thread(target=lambda: _catch(caught, parallel.across_hosts, 1, "sum"),
                              name="rollout-producer")
    thread.start()
    thread.join()
    result["off_thread"] = caught[0]
    result["on_main"] = int(parallel.across_hosts(me + 1, "sum"))

    payload = b"x" * (3 + 5 * me)  # 3 bytes on host 0, 8 on host 1
    result["gathered"] = [b.decode() for b in parallel.across_hosts_bytes(payload)]

    parallel.check_same_on_every_host("tasks", ["the same", "everywhere"])
    try:
        parallel.check_same_on_every_host("examples", [f"host {me}"])
        result["differ"] = "not caught"
    except ValueError as e:
        result["differ"] = str(e)

    # the learner's mesh: device 1 of each host (device 0 is each host's sampler's)
    learner = [d for d in jax.devices() if d.id % jax.local_device_count() != 0]
    mesh = parallel.make_mesh({"fsdp": -1}, devices=learner)
    value = np.arange(24, dtype=np.float32).reshape(6, 4)
    tree = {"w": jax.device_put(value, NamedSharding(mesh, P("fsdp", None)))}
    local = parallel.host_copies(tree)
    result["copy_devices"] = sorted(d.id for d in local["w"].sharding.device_set)
    result["copy_equal"] = bool(np.array_equal(np.asarray(local["w"]), value))
    result["learner_devices"] = sorted(d.id for d in learner if d.process_index == me)
    with open(f"{out_prefix}.{me}.json", "w") as f:
        json.dump(result, f)


def _catch(caught, fn, *args):
    try:
        fn(*args)
        caught.append("not raised")
    except parallel.OffMainThreadCollectiveError as e:
        caught.append(str(e))


if __name__ == "__main__":
    main(sys.argv[1])
