"""XLA_FLAGS for fake CPU devices (a helper module, not a test file; imports no jax).

With N fake devices every collective is a rendezvous of N threads, and XLA:CPU aborts the
whole process (SIGABRT, no Python exception) when one waits longer than its termination
timeout (a few tens of seconds). On a 2-core machine running two test workers, an SGLang
server and a JVM, one device's shard of a step can lag the others by that much: the rendezvous
timeouts go up to 30 minutes, so a slow step is slow, not a crashed worker.
"""

COLLECTIVE_TIMEOUT_S = 1800


def xla_flags(devices: int) -> str:
    return (f"--xla_force_host_platform_device_count={devices}"
            f" --xla_cpu_collective_call_terminate_timeout_seconds={COLLECTIVE_TIMEOUT_S}"
            f" --xla_cpu_collective_call_warn_stuck_timeout_seconds=60"
            f" --xla_cpu_collective_timeout_seconds={COLLECTIVE_TIMEOUT_S}")
