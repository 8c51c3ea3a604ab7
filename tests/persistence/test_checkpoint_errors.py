"""A checkpoint step that cannot be written: one CheckpointWriteError naming the step, the
path, the cause and the last good step, no tracebacks from orbax's writer threads, and the
steps before it restore (rl_tpu/persistence/checkpoint_errors.py and checkpoint.py)."""

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_tpu.persistence.checkpoint import Checkpointer
from rl_tpu.persistence.checkpoint_errors import (CheckpointWriteError, is_storage_error,
                                                  storage_cause)

REPO = Path(__file__).resolve().parents[2]

# Step 2 is written under a file-size limit (RLIMIT_FSIZE, no root needed): the OS refuses its
# data file (EFBIG) inside orbax's background threads, a real write failure like a full disk's.
# In a subprocess: the limit is per process, and pytest's capture files must not be under it.
WRITE_FAILURE_SCRIPT = textwrap.dedent("""
    import json, resource, signal, sys
    import jax, jax.numpy as jnp
    from rl_tpu.persistence.checkpoint import Checkpointer, CheckpointWriteError
    ckpt = Checkpointer(sys.argv[1], keep=3)
    ckpt.save(1, {"w": jnp.ones((512, 512))}, {"step": 1})
    ckpt.wait()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails, not kills
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
    try:
        # random bits: 1 MiB that no compression brings under the limit
        ckpt.save(2, {"w": jax.random.normal(jax.random.key(0), (512, 512))}, {"step": 2})
        ckpt.wait()
    except CheckpointWriteError as e:
        print(json.dumps({"error": str(e), "code": e.code, "last_good": e.last_good}))
    ckpt.close()  # raises nothing more
""")


def test_a_step_that_cannot_be_written_is_one_error_and_leaves_the_earlier_ones(tmp_path):
    directory = tmp_path / "ckpt"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", WRITE_FAILURE_SCRIPT, str(directory)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {
        "error": f"cannot write checkpoint step 2 to {directory}{os.sep}2: File too large; a "
                 "file-size limit (ulimit -f) stopped it: raise the limit or pick another "
                 "--workdir; the last good checkpoint is step 1",
        "code": errno.EFBIG, "last_good": 1}
    # orbax's threads report it in a line each, no tracebacks (tensorstore's late callbacks
    # into the closed event loop included)
    assert "Traceback" not in proc.stderr and "Event loop is closed" not in proc.stderr, \
        proc.stderr[-3000:]
    ckpt = Checkpointer(str(directory))
    assert ckpt.all_steps() == [1]
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = {"w": jax.ShapeDtypeStruct((512, 512), jnp.float32, sharding=one_device)}
    step, restored, meta = ckpt.restore(target)
    assert (step, meta) == (1, {"step": 1})
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.ones((512, 512), np.float32))
    ckpt.close()


def test_the_cause_of_a_failed_write_is_read_from_tensorstore_or_the_os():
    """storage_cause on the messages seen: tensorstore's (the OS error inside it), an OSError."""
    seen = ('RESOURCE_EXHAUSTED: Error writing local file "/w/checkpoints/3.orbax-checkpoint-tmp'
            '/state.orbax-checkpoint-tmp/_sharding": Failed writing: "/w/checkpoints/3.orbax-'
            'checkpoint-tmp/state.orbax-checkpoint-tmp/_sharding.__lock": Failed to write 7653 '
            "bytes to file 8: No space left on device [os_error_code='28']")
    assert storage_cause(ValueError(seen)) == (errno.ENOSPC, "No space left on device")
    assert is_storage_error(ValueError(seen)) and not is_storage_error(ValueError("a bug"))
    denied = PermissionError(errno.EACCES, "Permission denied", "/w/checkpoints/host/3.0")
    assert storage_cause(denied) == (errno.EACCES, "Permission denied")
    # wrapped by orbax in another exception: the cause is found down the chain
    try:
        try:
            raise OSError(errno.EROFS, "Read-only file system")
        except OSError as inner:
            raise RuntimeError("save failed") from inner
    except RuntimeError as outer:
        wrapped = outer
    assert str(CheckpointWriteError("checkpoint step 3", "/w/checkpoints/3", wrapped, None)) == (
        "cannot write checkpoint step 3 to /w/checkpoints/3: Read-only file system; its "
        "filesystem is read-only: pick another --workdir; no checkpoint was written before it")
    assert str(CheckpointWriteError("checkpoint step 3", "/w/checkpoints/3", ValueError(seen),
                                    2)) == (
        "cannot write checkpoint step 3 to /w/checkpoints/3: No space left on device; free "
        "space there or pick another --workdir; the last good checkpoint is step 2")


def test_a_final_export_the_disk_refuses_is_one_line_naming_the_path(tmp_path):
    from rl_tpu.persistence.checkpoint_errors import RunWriteError
    from rl_tpu.models import hf, tiny
    from rl_tpu.models.tokenizer import load_tokenizer
    from rl_tpu.recipes import policy_io

    model_dir = tmp_path / "model"
    tiny.write_tiny_model(str(model_dir))
    cfg, params = hf.load(str(model_dir))
    tokenizer = load_tokenizer(str(model_dir))
    (tmp_path / "blocked").write_text("a file where the export's parent directory would be")
    target = tmp_path / "blocked" / "final_hf"
    with pytest.raises(RunWriteError) as e:
        policy_io.export_hf(str(target), cfg, params, tokenizer)
    assert str(e.value).startswith(f"cannot write the final HF export to {target}: Not a "
                                   "directory; ")
    assert str(e.value).endswith("the checkpoints are intact: rerun the same command to "
                                 "export again")
    policy_io.export_hf(str(tmp_path / "final_hf"), cfg, params, tokenizer)  # the good path
    assert (tmp_path / "final_hf" / "config.json").is_file()
