"""The env registry (rl_tpu/core/env.py): a name is taken once; the same definition run again
(a notebook cell re-run) replaces itself; a missing name lists the known ones."""

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
