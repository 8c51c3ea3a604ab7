"""Test-wide set-up: 8 fake CPU devices (before jax is imported), fp32-exact matmuls, and one
persistent compilation cache for the run."""

import os

from fake_devices import POOL_THREADS, xla_flags

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags(8)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("PJRT_NPROC", str(POOL_THREADS))  # inherited by every subprocess
# One persistent compilation cache for the whole run, workers and subprocesses included (they
# inherit the environment): the kill-and-resume tests, the multi-process runs and the smokes
# compile many of the same programs. A fresh directory, so no run depends on an earlier one.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache = tempfile.mkdtemp(prefix="rl_tpu_tests_jax_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)  # by its creator only
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
