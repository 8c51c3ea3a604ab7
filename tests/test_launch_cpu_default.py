"""Every launcher decides the CPU default (rl_tpu/__init__.py: JAX_PLATFORMS=cpu on a machine
with no accelerator device file) before anything imports JAX: set later, JAX's TPU plugin from
the dev extras has already been found and prints its warnings on a CPU machine."""

import glob
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHERS = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(REPO, "launch", "*.py"))
                   if not p.endswith("__init__.py"))
# Imports launch.<name> as `python -m` does; at the first `import jax` it reports whether
# rl_tpu (whose import sets the default) came first and what JAX_PLATFORMS was, then exits.
PROBE = """
import json, os, sys
class FirstJax:
    def find_spec(self, name, path=None, target=None):
        if name == "jax":
            print(json.dumps({"rl_tpu": "rl_tpu" in sys.modules,
                              "platforms": os.environ.get("JAX_PLATFORMS")}), flush=True)
            os._exit(0)
sys.meta_path.insert(0, FirstJax())
import importlib
importlib.import_module(sys.argv[1])
print(json.dumps(None))
"""
ACCELERATOR_FILES = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*", "/dev/kfd")


@pytest.mark.parametrize("name", LAUNCHERS)
def test_the_cpu_default_is_set_before_jax_is_imported(name):
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_PLATFORMS", "TPU_NAME", "COLAB_TPU_ADDR")}
    run = subprocess.run([sys.executable, "-c", PROBE, f"launch.{name}"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    first_jax = json.loads(run.stdout.strip().splitlines()[-1])
    if first_jax is None:
        return  # imports no JAX at start-up
    assert first_jax["rl_tpu"], f"launch.{name} imports JAX before rl_tpu sets the CPU default"
    if not any(glob.glob(pattern) for pattern in ACCELERATOR_FILES):
        assert first_jax["platforms"] == "cpu"
