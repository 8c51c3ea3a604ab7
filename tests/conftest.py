"""Test-wide set-up: 8 fake CPU devices (before jax is imported), fp32-exact matmuls, one
persistent compilation cache for the run, quick CPU code generation, a run that ends when a
worker dies, and real SGLang's venv installed in the background when its tests are collected."""

import os

import pytest
from fake_devices import POOL_THREADS, xla_flags
from suite_order import sglang_venv_tests_last

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
# XLA:CPU's LLVM code generation at -O0, without its expensive passes (JAX's own switch for
# "compiling costs more than running"): a cold smoke run compiles in ~40% less time and runs
# 22% faster end to end here, and the suite's tiny programs run in microseconds either way.
# It changes no HLO pass (fusion, layout, rematerialisation), so what the tests check of a
# program is what users run; the TPU compiles of tests/test_aot.py turn it off.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_configure(config):
    # A worker that dies (a native abort) ends the run at once with its test named, unless
    # --max-worker-restart says otherwise: pytest-xdist 3.8's loadgroup scheduler re-queues a
    # dead worker's finished work as empty units and can wait on them forever (pytest-xdist
    # issues 1323 and 1378), which turned one crash into a CI run that never ended.
    if getattr(config.option, "maxworkerrestart", "") is None:  # xdist is on, the flag unset
        config.option.maxworkerrestart = "0"


@pytest.hookimpl(trylast=True)  # after `-m`/`-k` deselect: only the tests that will run count
def pytest_collection_modifyitems(config, items):
    """Tests marked `sglang_venv` start real SGLang, whose one-time venv install
    (tests/rollout/sglang_server.py: ~4 min, mostly download and unpacking) begins here in the
    background, on one process of the run (the first xdist worker), as soon as such a test is
    collected; the first of them waits on the install's file lock and raises its error, if any.
    They also go last (stable order otherwise): xdist's loadgroup runs the `rollout_servers`
    group (the largest, so it starts first) on one worker in collection order, and its tests
    of rl_tpu's own server then run while the install finishes instead of after it."""
    if not sglang_venv_tests_last(items):
        return
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0":
        return
    import sys
    import threading

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "rollout"))
    import sglang_server  # as the server tests import it

    if sglang_server.venv_is_ready():
        return

    def install():
        try:
            sglang_server.ensure_sglang_venv()
        except Exception:  # noqa: BLE001 - the server test's own call reports it
            pass

    threading.Thread(target=install, name="sglang-venv-install", daemon=True).start()


def pytest_runtest_setup(item):
    # before the item's fixtures: a module-scoped server fixture starts inside the first test
    # that uses it. sglang_server.ensure_sglang_venv refuses a test not marked sglang_venv, so
    # none can start SGLang outside the install and the ordering above.
    os.environ["RL_TPU_TEST_MARKED_SGLANG_VENV"] = (
        "1" if item.get_closest_marker("sglang_venv") else "")
