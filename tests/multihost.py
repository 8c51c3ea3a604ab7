"""Runs one launcher command as a job of N processes on loopback (a helper module for the
tests, not a test file): each process gets fake CPU devices of its own and joins the job
through jax.distributed, as the hosts of a pod slice do.

A hang must fail a test, never stall the suite: `run_job` waits for every process up to one
deadline, then kills them all and says which were still running, with each one's log tail.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import time
from typing import Optional

from fake_devices import xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass
class Job:
    returncodes: list[int]
    logs: list[str]

    @property
    def ok(self) -> bool:
        return all(code == 0 for code in self.returncodes)

    def tail(self, chars: int = 3000) -> str:
        return "\n".join(f"--- process {i} (exit {code}) ---\n{log[-chars:]}"
                         for i, (code, log) in enumerate(zip(self.returncodes, self.logs)))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def job_env(processes: int, devices: int, process_id: int, port: int) -> dict:
    """`devices` fake CPU devices a process; 0: one plain CPU device, no XLA flags at all (as a
    user's laptop, and the single-process runs other tests compare with)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO,
               XLA_FLAGS=xla_flags(devices))
    if not devices:
        env.pop("XLA_FLAGS")
    if processes > 1:
        env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                   JAX_NUM_PROCESSES=str(processes), JAX_PROCESS_ID=str(process_id))
    return env


def start_job(args: list[str], processes: int, devices: int, log_dir: str,
              module: Optional[str] = "launch.train") -> list[subprocess.Popen]:
    """Starts `python -m module *args` (module None: `python *args`, a script) as `processes`
    processes of `devices` fake devices each; their output goes to <log_dir>/process<i>.log."""
    os.makedirs(log_dir, exist_ok=True)
    port = free_port()
    procs = []
    for pid in range(processes):
        with open(os.path.join(log_dir, f"process{pid}.log"), "w") as log:
            procs.append(subprocess.Popen(
                [sys.executable, *(["-m", module] if module else []), *args], cwd=REPO,
                env=job_env(processes, devices, pid, port), stdout=log,
                stderr=subprocess.STDOUT))
    return procs


def wait_job(procs: list[subprocess.Popen], log_dir: str, timeout_s: float) -> Job:
    """Waits for every process until one deadline; on a hang kills them all and fails."""
    deadline = time.time() + timeout_s
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            break
    hung = [i for i, p in enumerate(procs) if p.poll() is None]
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    logs = []
    for i in range(len(procs)):
        with open(os.path.join(log_dir, f"process{i}.log")) as f:
            logs.append(f.read())
    job = Job([p.returncode for p in procs], logs)
    if hung:
        raise AssertionError(f"processes {hung} of {len(procs)} still ran after {timeout_s:.0f} s "
                             f"(a hang or deadlock); killed\n{job.tail()}")
    return job


def run_job(args: list[str], processes: int, devices: int, log_dir: str,
            timeout_s: float = 600, module: Optional[str] = "launch.train") -> Job:
    return wait_job(start_job(args, processes, devices, log_dir, module), log_dir, timeout_s)
