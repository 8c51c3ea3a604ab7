"""Fake CPU devices for the tests (a helper module, not a test file; imports no jax).

With N fake devices a collective is a rendezvous of N threads, run on XLA:CPU's intra-op thread
pool, which has max(cores, N) threads: on a 2-core machine with 8 devices, 8. Within one
program, XLA:CPU runs independent thunks concurrently, so one device can enter an all-reduce
at the top of the program while the others enter the one inside a scan: every pool thread then
waits in a rendezvous that needs a thread no one can get, and XLA aborts the process (SIGABRT,
no Python exception) after 40 s. POOL_THREADS sets the pool large enough for several
collectives in flight at once (PJRT_NPROC, read when the CPU client starts); the rendezvous
timeouts go up so a slow step on a loaded machine waits, while a real deadlock still ends the
process within minutes rather than hanging the run.
"""

POOL_THREADS = 32
# Tiny shapes make compilation, not execution, the cost of the suite. Skipping XLA's backend
# (LLVM) optimisation passes halves compile time on CPU; XLA:CPU's older loop-fusion emitters
# compile about a third faster again than its MLIR fusion emitters (measured on the sampler's
# and the policy update's programs). Neither changes what a program computes.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
COLLECTIVE_TIMEOUT_S = 300


def xla_flags(devices: int) -> str:
    return (f"--xla_force_host_platform_device_count={devices}"
            f" --xla_cpu_collective_call_terminate_timeout_seconds={COLLECTIVE_TIMEOUT_S}"
            f" --xla_cpu_collective_call_warn_stuck_timeout_seconds=60"
            f" --xla_cpu_collective_timeout_seconds={COLLECTIVE_TIMEOUT_S} {FAST_COMPILE}")
