"""Moved to rl_tpu/persistence/checkpoint_integrity.py. This name stays for one release, for code outside
rl_tpu that imports `rl_tpu.checkpoint_integrity`: it is the same module object, private names and
monkeypatching included. Nothing in the project imports it (tests/test_package_layers.py)."""

import sys

from rl_tpu.persistence import checkpoint_integrity

sys.modules[__name__] = checkpoint_integrity
