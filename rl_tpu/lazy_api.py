"""A package's public names, each imported from its module when first asked for (PEP 562).

rl_tpu.models, .rl, .rollout and .train name their public API in their `__init__.py`
(`from rl_tpu.rollout import JaxSampler`), yet importing one of them stays as cheap as
importing an empty package: most of their modules import JAX, rollout.server imports FastAPI
and uvicorn, and code that wants one contract (a SamplingParams, a RolloutEngine) should not
pay for the rest. So a package lists which module defines each name, and `lazy_api` gives it
the module-level `__getattr__` and `__dir__` that import that module on the first access.
"""

from __future__ import annotations

import importlib
import sys


def lazy_api(package: str, homes: dict[str, tuple[str, ...]]):
    """`(__getattr__, __dir__)` for `package`, whose public names are `homes`' values, each
    defined by the module its key names (relative to the package with a leading dot, e.g.
    `.sampler`, or absolute)."""
    home_of = {name: module for module, names in homes.items() for name in names}

    def __getattr__(name: str):
        if name not in home_of:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home_of[name], package), name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(home_of))

    return __getattr__, __dir__


def public_names(homes: dict[str, tuple[str, ...]]) -> list[str]:
    """The package's `__all__`: every name of `homes`, in the order listed."""
    return [name for names in homes.values() for name in names]
