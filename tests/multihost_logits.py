"""One host of a multi-host run (see test_parallel.py): joins the job named by the JAX_*
environment, loads a model sharded over the global mesh, computes logits of a global batch to
which this host contributes its own rows, and (process 0) saves them for the test to compare.

  python tests/multihost_logits.py MODEL_DIR OUT.npy [MESH]   (with JAX_COORDINATOR_ADDRESS
  etc. set; MESH the mesh's axes, default fsdp=4,tensor=2)
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from rl_tpu import parallel  # noqa: E402
from rl_tpu.models import hf  # noqa: E402
from rl_tpu.models.transformer import Transformer  # noqa: E402


def global_batch():
    return np.random.RandomState(0).randint(0, 320, (8, 12)).astype(np.int32)


def main(model_dir, out_file, mesh_axes="fsdp=4,tensor=2"):
    assert parallel.maybe_initialize_distributed()
    assert jax.device_count() == 8 and jax.local_device_count() == 4, jax.devices()
    mesh = parallel.make_mesh({axis: int(size) for axis, size in
                               (item.split("=") for item in mesh_axes.split(","))})
    cfg, params = hf.load(model_dir, mesh=mesh)
    held = sum(parallel.bytes_per_device(params).values())  # this host's devices only
    rows = global_batch()
    per_host = len(rows) // jax.process_count()
    local = rows[jax.process_index() * per_host:(jax.process_index() + 1) * per_host]
    ids = parallel.host_to_global(local, mesh)
    model = Transformer(cfg, mesh=mesh, rules=parallel.DEFAULT_RULES)
    logits = jax.jit(lambda p, x: model.apply({"params": p}, x))(params, ids)
    logits = parallel.gather_to_host(logits)
    print(f"process {jax.process_index()}: holds {held} param bytes, logits {logits.shape}")
    if jax.process_index() == 0:
        np.save(out_file, logits)


if __name__ == "__main__":
    # Read when the backend starts (first device query), so setting them here is in time.
    from fake_devices import xla_flags  # this file's folder is on sys.path when it is run

    os.environ["XLA_FLAGS"] = xla_flags(4)
    os.environ["JAX_PLATFORMS"] = "cpu"
    main(*sys.argv[1:4])
