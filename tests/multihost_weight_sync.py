"""One host of a multi-host weight sync (see test_parallel.py): joins the job named by the JAX_*
environment, loads a model sharded over the 2-host mesh (the trainer's params), and syncs it
into a sampler on this host's 4 devices with `parallel.host_copies` while JAX refuses any
transfer between host and device; then samples greedily and writes the outputs and the sync's
time to OUT.<process>.json.

  python tests/multihost_weight_sync.py MODEL_DIR OUT   (with JAX_COORDINATOR_ADDRESS etc. set)
"""

import contextlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from rl_tpu import parallel  # noqa: E402
from rl_tpu.core.engine import GenerateRequest, SamplingParams  # noqa: E402
from rl_tpu.models import hf  # noqa: E402
from rl_tpu.rollout.sampler import JaxSampler  # noqa: E402

PROMPTS = [[5, 6, 7], list(range(10, 30)), [100, 101, 102, 103, 104], [7] * 9]


@contextlib.contextmanager
def no_host_transfers():
    """Any transfer between host and device, explicit or implicit, raises."""
    with jax.transfer_guard_device_to_host("disallow_explicit"), \
            jax.transfer_guard_host_to_device("disallow_explicit"):
        yield


def main(model_dir, out_prefix):
    assert parallel.maybe_initialize_distributed()
    assert jax.device_count() == 8 and jax.local_device_count() == 4, jax.devices()
    trainer_mesh = parallel.make_mesh({"fsdp": -1})  # both hosts' devices
    cfg, params = hf.load(model_dir, mesh=trainer_mesh)
    sampler = JaxSampler(cfg, parallel.host_copies(params), version="v0", max_batch=4,
                         mesh=parallel.make_mesh({"fsdp": -1}, devices=jax.local_devices()))
    # the trainer's next weights: another set, still sharded over both hosts
    doubled = jax.jit(lambda p: jax.tree.map(lambda x: x * 1.5, p))(params)
    times = []
    for version in ("v1", "v2"):  # the second one is the warm one
        new = params if version == "v2" else doubled
        with no_host_transfers():
            start = time.perf_counter()
            sampler.update_weights(parallel.host_copies(new), version)
            jax.block_until_ready(sampler.weights()[0])
            times.append(time.perf_counter() - start)
    # The guard does catch a host round trip: the old sync gathered the params to numpy on
    # every host, then the sampler put them back on its devices. (On CPU the device-to-host
    # half is not guarded, device memory being host memory; the host-to-device half is.)
    caught = ""
    on_host = jax.tree.map(np.asarray, multihost_utils.process_allgather(params, tiled=True))
    with no_host_transfers():
        try:
            sampler.update_weights(on_host, "round trip")
        except Exception as err:  # noqa: BLE001 (XLA's runtime error)
            caught = f"{type(err).__name__}: {str(err)[:120]}"
    results = sampler.generate([GenerateRequest(p, SamplingParams(
        max_new_tokens=8, temperature=0.0, ignore_eos=True)) for p in PROMPTS])
    held = sum(x.nbytes for x in jax.tree.leaves(sampler.weights()[0])) // 4
    with open(f"{out_prefix}.{jax.process_index()}.json", "w") as f:
        json.dump(dict(outputs=[r.output_ids for r in results], version=results[0].weight_version,
                       sync_s=times, caught=caught, bytes_per_device=held), f)
    print(f"process {jax.process_index()}: sync {times[0]:.3f} s cold, {times[1]:.3f} s warm")


if __name__ == "__main__":
    # Read when the backend starts (first device query), so setting them here is in time.
    from fake_devices import xla_flags  # this file's folder is on sys.path when it is run

    os.environ["XLA_FLAGS"] = xla_flags(4)
    os.environ["JAX_PLATFORMS"] = "cpu"
    main(*sys.argv[1:3])
