"""Test-wide set-up: 8 fake CPU devices (before jax is imported) and fp32-exact matmuls."""

import os

from fake_devices import xla_flags

# Tiny shapes make compilation, not execution, the cost of the suite: skip XLA's backend
# (LLVM) optimisation passes, which halves compile time on CPU and changes no semantics.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags(8)
                           + " --xla_backend_optimization_level=0").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
