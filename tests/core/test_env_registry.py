"""The env registry (rl_tpu/core/env.py): a name is taken once; the same definition run again
(a notebook cell re-run) replaces itself; a missing name lists the known ones; rl_tpu's own
envs are found by name from anywhere, though the contract does not import them."""

import subprocess
import sys

import pytest

from rl_tpu.core import env as env_lib


def _define(body: int):
    # The same module and qualified name each call, as a re-run notebook cell gives.
    class TwiceDefined:
        value = body
    return TwiceDefined


@pytest.fixture
def name():
    yield "test_registry_env"
    env_lib._REGISTRY.pop("test_registry_env", None)


def test_a_rerun_definition_replaces_itself_and_another_is_refused(name):
    first, again = _define(1), _define(2)
    env_lib.register(name)(first)
    env_lib.register(name)(again)
    assert env_lib.factory(name) is again and env_lib.factory(name).value == 2

    class Other:
        pass
    with pytest.raises(ValueError, match="registered twice.*pick another name"):
        env_lib.register(name)(Other)
    assert env_lib.factory(name) is again


def test_an_unknown_env_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown env 'no_such_env'; known envs: .*largest"):
        env_lib.factory("no_such_env")


def test_a_builtin_env_is_made_by_name_in_a_process_that_imported_only_the_contract():
    # A fresh interpreter: nothing of rl_tpu.envs is loaded until an env is asked for by name,
    # and then only that env's module (the registry reads rl_tpu.envs.ENV_MODULES).
    script = """
import sys
from rl_tpu.core import env
assert not any(m.startswith("rl_tpu.envs") for m in sys.modules), sorted(sys.modules)
made = env.make("largest")
loaded = sorted(m for m in sys.modules if m.startswith("rl_tpu.envs"))
print(type(made).__module__, loaded)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.split() == ["rl_tpu.envs.largest", "['rl_tpu.envs',", "'rl_tpu.envs.largest']"]
