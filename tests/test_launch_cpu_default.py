"""Every launcher calls rl_tpu.jax_platform.default_to_cpu (JAX_PLATFORMS=cpu on a machine
with no accelerator device file) before anything imports JAX: set later, JAX's TPU plugin from
the dev extras has already been found and prints its warnings on a CPU machine. Importing
rl_tpu itself sets nothing (tests/test_jax_platform.py)."""

import glob
import json
import os
import subprocess
import sys

import pytest

from rl_tpu.jax_platform import USER_CHOICES, has_accelerator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHERS = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(REPO, "launch", "*.py"))
                   if not p.endswith("__init__.py"))
# Imports launch.<name> as `python -m` does, with default_to_cpu wrapped to record its call;
# at the first `import jax` it reports whether the launcher had called it and what
# JAX_PLATFORMS was, then exits.
PROBE = """
import json, os, sys
from rl_tpu import jax_platform
called = []
default_to_cpu = jax_platform.default_to_cpu
jax_platform.default_to_cpu = lambda: called.append(True) or default_to_cpu()
class FirstJax:
    def find_spec(self, name, path=None, target=None):
        if name == "jax":
            print(json.dumps({"called": bool(called),
                              "platforms": os.environ.get("JAX_PLATFORMS")}), flush=True)
            os._exit(0)
sys.meta_path.insert(0, FirstJax())
import importlib
importlib.import_module(sys.argv[1])
print(json.dumps(None))
"""


@pytest.mark.parametrize("name", LAUNCHERS)
def test_the_cpu_default_is_set_before_jax_is_imported(name):
    env = {k: v for k, v in os.environ.items() if k not in USER_CHOICES}
    run = subprocess.run([sys.executable, "-c", PROBE, f"launch.{name}"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    first_jax = json.loads(run.stdout.strip().splitlines()[-1])
    if first_jax is None:
        return  # imports no JAX at start-up
    assert first_jax["called"], f"launch.{name} imports JAX before it calls default_to_cpu()"
    if not has_accelerator():
        assert first_jax["platforms"] == "cpu"
