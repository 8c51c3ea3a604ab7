"""rl_tpu.jax_platform: the CPU default is a call, not an import side effect. Importing
rl_tpu leaves JAX_PLATFORMS alone; `default_to_cpu()` sets it on a machine with no
accelerator device file and respects a platform the user chose."""

import json
import os
import subprocess
import sys

import pytest

from rl_tpu.jax_platform import USER_CHOICES, has_accelerator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Reports JAX_PLATFORMS after importing rl_tpu, then after calling default_to_cpu().
PROBE = """
import json, os
import rl_tpu
after_import = os.environ.get("JAX_PLATFORMS")
{call}
print(json.dumps([after_import, os.environ.get("JAX_PLATFORMS")]))
"""
CALL = "from rl_tpu.jax_platform import default_to_cpu; default_to_cpu()"


def probe(call: str = "", **env) -> list:
    clean = {k: v for k, v in os.environ.items() if k not in USER_CHOICES}
    run = subprocess.run([sys.executable, "-c", PROBE.format(call=call)], cwd=REPO,
                         env=dict(clean, **env), capture_output=True, text=True, timeout=60,
                         check=True)
    return json.loads(run.stdout)


def test_importing_rl_tpu_sets_no_platform():
    assert probe() == [None, None]


@pytest.mark.skipif(has_accelerator(), reason="this machine has an accelerator device file")
def test_default_to_cpu_sets_cpu_where_there_is_no_accelerator():
    assert probe(CALL) == [None, "cpu"]


@pytest.mark.parametrize("choice", [{"JAX_PLATFORMS": "cuda"}, {"TPU_NAME": "my-tpu"}])
def test_default_to_cpu_leaves_a_users_choice_alone(choice):
    expected = choice.get("JAX_PLATFORMS")
    assert probe(CALL, **choice) == [expected, expected]
