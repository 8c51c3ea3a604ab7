"""The CPU default for JAX on a machine with no accelerator: `default_to_cpu()`.

rl_tpu's dev and tpu-aot extras install libtpu (it compiles for TPU slices on any machine:
launch.compile_check). With libtpu present, JAX's first backend lookup on a plain CPU machine
also tries the TPU plugin, which looks for TPU workers and can print warnings on every
command. The launchers call `default_to_cpu()` before anything imports JAX (launch/__init__.py
does it first thing, and every `python -m launch.<name>` runs it before the launcher's own
imports). Importing rl_tpu itself changes nothing: a library sets no process-wide state
behind its caller's back. Code that imports rl_tpu on such a machine without a launcher (a
notebook, a script) calls it itself, before its first JAX computation:

    from rl_tpu.jax_platform import default_to_cpu
    default_to_cpu()
"""

import glob
import os
import sys

# Device files of an attached accelerator: TPU VMs (/dev/accel*, /dev/vfio/<n>), NVIDIA and
# AMD GPUs.
ACCELERATOR_FILES = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*", "/dev/kfd")
# A platform chosen by the user, or a TPU reached over the network: left alone.
USER_CHOICES = ("JAX_PLATFORMS", "TPU_NAME", "COLAB_TPU_ADDR")


def has_accelerator() -> bool:
    """Whether this machine has a TPU or GPU device file."""
    return any(glob.glob(pattern) for pattern in ACCELERATOR_FILES)


def default_to_cpu() -> bool:
    """Sets JAX_PLATFORMS=cpu on a machine with no accelerator device file, unless the
    environment already says where JAX runs (USER_CHOICES). Returns whether it set it. If JAX
    is already imported its config has read the environment, so it is updated too (effective
    until JAX's first computation picks a backend)."""
    if any(name in os.environ for name in USER_CHOICES) or has_accelerator():
        return False
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:
        sys.modules["jax"].config.update("jax_platforms", "cpu")
    return True
