"""Test-wide set-up: 8 fake CPU devices (before jax is imported), fp32-exact matmuls, and one
persistent compilation cache for the run."""

import os

from fake_devices import POOL_THREADS, xla_flags

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags(8)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("PJRT_NPROC", str(POOL_THREADS))  # inherited by every subprocess
# One persistent compilation cache for the whole run, workers and subprocesses included (they
# inherit the environment): the kill-and-resume tests, the multi-process runs and the smokes
# compile many of the same programs. Beside it, the memo of transformers' config.json records
# (rl_tpu.models.hf.config_memo_dir): every run that writes a tiny model or an export would
# otherwise import torch to build one. A fresh directory, so no run depends on an earlier one.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _run_caches = tempfile.mkdtemp(prefix="rl_tpu_tests_caches_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(_run_caches, "jax")
    os.environ.setdefault("RL_TPU_HF_CONFIG_CACHE", os.path.join(_run_caches, "hf_configs"))
    atexit.register(shutil.rmtree, _run_caches, ignore_errors=True)  # by its creator only
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
