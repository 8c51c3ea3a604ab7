"""rl_tpu: JAX-first reinforcement learning for LLM policies and agents."""

import glob as _glob
import os as _os
import sys as _sys


def _cpu_unless_an_accelerator_is_attached() -> None:
    """On a machine with no TPU or GPU device file, JAX_PLATFORMS defaults to cpu.

    rl_tpu's dev and tpu-aot extras install libtpu (it compiles for TPU slices anywhere,
    launch.compile_check). With libtpu present, JAX's first backend lookup on a plain CPU
    machine also tries the TPU plugin, which looks for TPU workers and can print warnings on
    every command. A machine without /dev/accel* or /dev/vfio/<n> (TPU VMs), /dev/nvidia* or
    /dev/kfd (GPUs) has nothing for it to find. An explicit JAX_PLATFORMS, and a TPU reached
    over the network (TPU_NAME, COLAB_TPU_ADDR), are left alone.
    """
    if any(k in _os.environ for k in ("JAX_PLATFORMS", "TPU_NAME", "COLAB_TPU_ADDR")):
        return
    devices = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*", "/dev/kfd")
    if any(_glob.glob(pattern) for pattern in devices):
        return
    _os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in _sys.modules:  # imported first: its config has read the environment already
        _sys.modules["jax"].config.update("jax_platforms", "cpu")


_cpu_unless_an_accelerator_is_attached()
