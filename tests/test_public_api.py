"""The public API of rl_tpu.models, .rl, .rollout and .train, named in their __init__.py
(rl_tpu/lazy_api.py): every name of `__all__` is the object its module defines and is said in
the package docstring, and importing the packages stays free of JAX, FastAPI and torch until a
name is asked for."""

import importlib
import inspect
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("rl_tpu.models", "rl_tpu.rl", "rl_tpu.rollout", "rl_tpu.train")
HEAVY = ("jax", "fastapi", "uvicorn", "torch", "transformers")


@pytest.mark.parametrize("name", PACKAGES)
def test_every_public_name_is_its_modules_own_and_documented(name):
    package = importlib.import_module(name)
    assert package.__all__, f"{name} names no public API"
    for public in package.__all__:
        value = getattr(package, public)
        if inspect.isclass(value) or inspect.isfunction(value):  # its defining module's own
            assert getattr(importlib.import_module(value.__module__), public) is value
        assert public in package.__doc__, f"{name}'s docstring does not say what {public} is"
    assert set(package.__all__) <= set(dir(package))
    with pytest.raises(AttributeError, match=f"{name!r} has no attribute 'no_such_name'"):
        getattr(package, "no_such_name")


def test_rollout_hands_out_the_engine_contract_from_core():
    from rl_tpu.core import engine
    import rl_tpu.rollout as rollout

    for contract in ("RolloutEngine", "SamplingParams", "GenerateRequest", "GenerateResult",
                     "RolloutError"):
        assert getattr(rollout, contract) is getattr(engine, contract)


# In a fresh process: what importing the packages loads, then what one light name loads.
PROBE = """
import json, sys
import rl_tpu.models, rl_tpu.rl, rl_tpu.rollout, rl_tpu.train
heavy = {heavy!r}
after_import = [m for m in heavy if m in sys.modules]
from rl_tpu.rollout import SamplingParams
after_contract = [m for m in heavy if m in sys.modules]
from rl_tpu.rollout import JaxSampler
print(json.dumps([after_import, after_contract, "jax" in sys.modules]))
"""


def test_importing_the_packages_loads_nothing_heavy_until_a_name_is_asked_for():
    run = subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    after_import, after_contract, jax_after_sampler = json.loads(run.stdout)
    assert after_import == [], "importing the packages loaded these"
    assert after_contract == [], "the engine contract (rl_tpu.core.engine) loaded these"
    assert jax_after_sampler  # and asking for the sampler does import it
