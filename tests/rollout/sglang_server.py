"""Rollout servers as subprocesses for tests: real SGLang 0.5.23 on CPU, or rl_tpu's own.

Real SGLang lives in its own cached venv (`~/.cache/rl_tpu/sglang-0.5.23-venv`, or
`$RL_TPU_SGLANG_VENV`), installed on first use: about 4 minutes and 11 GB, under a file lock so
parallel pytest workers install it once. PyPI has no CPU build of SGLang's kernel package, so a
stand-in `sgl_kernel` module (the one function the CPU path calls, written here in torch) goes
first on the server's PYTHONPATH.

    with start_sglang_server(model_dir) as server:   # or start_rollout_server(model_dir)
        ... server.url ...
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.error
import urllib.request
from typing import Optional, Sequence

SGLANG_VERSION = "0.5.23"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# SGLang's CPU start (tokenizer manager, scheduler, model load) takes ~1 min alone and over
# 3 min when the other pytest worker is compiling; a deadline is a hang guard, not a speed test.
SGLANG_START_TIMEOUT_S = 600.0
_READY = ".rl_tpu_ready"  # written into the venv once sglang is installed and importable

SGL_KERNEL_STUB = textwrap.dedent('''\
    """Stand-in for SGLang's kernel package on CPU (written by rl_tpu's tests): PyPI has no CPU
    build, and SGLang's CPU path needs only `assign_req_to_token_pool_cpu`."""


    def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset,
                                     out_cache_loc, stride):
        """For each request i, writes the next end_offset[i] - start_offset[i] entries of
        out_cache_loc into req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]."""
        del stride  # the row stride of req_to_token; torch indexing knows it
        pos = 0
        for i in range(len(req_pool_indices)):
            start, end = int(start_offset[i]), int(end_offset[i])
            req_to_token[int(req_pool_indices[i]), start:end] = out_cache_loc[pos:pos + end - start]
            pos += end - start


    class _Missing:
        """A kernel this stand-in does not have: importable (SGLang imports many CPU kernels
        up front), but calling it raises."""

        def __init__(self, name):
            self.__name__ = self.__qualname__ = name

        def __call__(self, *args, **kwargs):
            raise RuntimeError(
                f"sgl_kernel.{self.__name__}: rl_tpu's CPU stand-in for sgl_kernel (tests only) "
                "implements only assign_req_to_token_pool_cpu; this SGLang code path needs the "
                "real kernel package.")

        def __repr__(self):
            return f"<missing sgl_kernel.{self.__name__}>"


    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(name)
''')


def venv_dir() -> str:
    return os.environ.get("RL_TPU_SGLANG_VENV") or os.path.join(
        os.path.expanduser("~"), ".cache", "rl_tpu", f"sglang-{SGLANG_VERSION}-venv")


def _installed_version(python: str) -> Optional[str]:
    if not os.path.exists(python):
        return None
    probe = subprocess.run(
        [python, "-c", "import importlib.metadata as m; print(m.version('sglang'))"],
        capture_output=True, text=True)
    return probe.stdout.strip() if probe.returncode == 0 else None


def venv_is_ready() -> bool:
    return os.path.exists(os.path.join(venv_dir(), _READY))


def ensure_sglang_venv(timeout: float = 3600.0) -> str:
    """Python of a venv with sglang==0.5.23, installing it once (file-locked); returns its path."""
    in_a_test = (os.environ.get("PYTEST_CURRENT_TEST")
                 and threading.current_thread() is threading.main_thread())
    if in_a_test and not os.environ.get("RL_TPU_TEST_MARKED_SGLANG_VENV"):
        raise RuntimeError(  # tests/conftest.py's pytest_runtest_setup sets the flag
            f"{os.environ['PYTEST_CURRENT_TEST'].split(' ')[0]} uses real SGLang without "
            "@pytest.mark.sglang_venv: mark it, so the run installs the venv in the background "
            "and orders the test after its group's others")
    venv = venv_dir()
    python = os.path.join(venv, "bin", "python")
    if venv_is_ready():
        return python
    os.makedirs(os.path.dirname(os.path.abspath(venv)), exist_ok=True)
    with open(os.path.abspath(venv) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second worker waits here for the first's install
        try:
            if os.path.exists(os.path.join(venv, _READY)):
                return python
            if _installed_version(python) != SGLANG_VERSION:
                started = time.time()
                if not os.path.exists(python):
                    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
                log_path = os.path.abspath(venv) + ".install.log"
                print(f"installing sglang=={SGLANG_VERSION} into {venv} (one time, ~4 min, "
                      f"~11 GB; log: {log_path})", file=sys.stderr)
                with open(log_path, "w") as log:
                    subprocess.run([python, "-m", "pip", "install", "--upgrade", "pip"],
                                   stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
                    # byte-compiled here, by pip: with PYTHONDONTWRITEBYTECODE set (this
                    # machine sets it) no server start would ever write a .pyc, and each would
                    # compile torch's and SGLang's sources again (3 processes a server; one run
                    # with `pip install --no-compile`: ~100 s server starts, not ~37 s)
                    done = subprocess.run([python, "-m", "pip", "install",
                                           f"sglang=={SGLANG_VERSION}"],
                                          stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
                if done.returncode != 0:
                    raise RuntimeError(f"pip install sglang=={SGLANG_VERSION} into {venv} failed "
                                       f"(exit {done.returncode}); see {log_path}")
                print(f"installed sglang in {time.time() - started:.0f}s", file=sys.stderr)
            with open(os.path.join(venv, _READY), "w") as f:
                f.write(SGLANG_VERSION + "\n")
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return python


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_status(url: str, timeout: float = 5.0) -> Optional[int]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, ValueError):
        return None


class ServerProcess:
    """A server subprocess in its own process group (so its children die with it), its log in
    a file, and its base URL on loopback. A context manager: `stop()` at exit."""

    def __init__(self, cmd: Sequence[str], port: int, *, env: Optional[dict] = None,
                 cwd: Optional[str] = None, name: str = "server", cleanup: Sequence[str] = ()):
        self.name, self.port, self.cmd = name, port, list(cmd)
        self.url = f"http://127.0.0.1:{port}"
        self._dir = tempfile.mkdtemp(prefix=f"rl_tpu_{name}_")
        self._cleanup = [self._dir, *cleanup]  # removed at stop()
        self.log_path = os.path.join(self._dir, "server.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, cwd=cwd or REPO, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)

    def log_tail(self, chars: int = 4000) -> str:
        self._log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()[-chars:]

    def wait_ready(self, timeout: float = 180.0, path: str = "/health_generate") -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                self.stop()
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode} before "
                                   f"it was ready; log tail:\n{tail}")
            if _get_status(self.url + path) == 200:
                return self
            time.sleep(0.5)
        tail = self.log_tail()
        self.stop()
        raise RuntimeError(f"{self.name} at {self.url} not ready after {timeout:g}s; log tail:\n"
                           f"{tail}")

    def kill(self) -> None:
        """SIGKILL the whole process group at once (a crash, as a test wants it)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()

    def stop(self, grace: float = 10.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=grace)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:  # children (SGLang's scheduler, detokenizer) may outlive the leader
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._log.close()
        for path in self._cleanup:
            shutil.rmtree(path, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def start_subprocess_server(cmd: Sequence[str], port: int, *, env: Optional[dict] = None,
                            name: str = "server", timeout: float = 180.0,
                            ready_path: str = "/health_generate") -> ServerProcess:
    """Starts `cmd` (which must listen on 127.0.0.1:`port`) and waits until `ready_path`
    answers 200; the log tail is in the error if it dies or never gets ready."""
    server = ServerProcess(cmd, port, env=env, name=name)
    return server.wait_ready(timeout, ready_path)


def start_rollout_server(model_dir: str, *flags: str, timeout: float = 300.0) -> ServerProcess:
    """rl_tpu's own SGLang-compatible JAX server: `python -m launch.serve_rollout`, without
    its start-up warm-up (12-50 s of compiles on this CPU) unless `flags` ask for it
    (--warmup): each test compiles only the programs its requests need."""
    if not any(f.startswith(("--warmup", "--nowarmup")) for f in flags):
        flags = ("--nowarmup",) + flags
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
    env.pop("XLA_FLAGS", None)  # the test process's fake 8-device setting is not the server's
    return start_subprocess_server(
        [sys.executable, "-m", "launch.serve_rollout", "--model_path", model_dir,
         "--port", str(port), *flags], port, env=env, name="serve_rollout", timeout=timeout)


def write_sgl_kernel_stub(directory: str) -> str:
    """Writes the stand-in `sgl_kernel` package into `directory`; returns `directory`."""
    package = os.path.join(directory, "sgl_kernel")
    os.makedirs(package, exist_ok=True)
    with open(os.path.join(package, "__init__.py"), "w") as f:
        f.write(SGL_KERNEL_STUB)
    return directory


def start_sglang_server(model_dir: str, *flags: str, timeout: float = SGLANG_START_TIMEOUT_S,
                        env: Optional[dict] = None) -> ServerProcess:
    """A real SGLang 0.5.23 server on CPU serving `model_dir` (the CPU flags below;
    `--dtype float32` so a float32 tiny model is served as saved). `env` adds variables to the
    server's environment (e.g. SGLANG_RETURN_ORIGINAL_LOGPROB).

    One OpenMP thread and `--sleep-on-idle`, because pytest runs two workers on two cores:
    torch's default threads spin-wait whenever another process holds a core (8 rows x 16
    tokens of SmolLM2 took 46 s with them, 2.6 s with one), and an idle scheduler otherwise
    spins a core of its own between requests."""
    env_overrides = dict(env or {})
    python = ensure_sglang_venv()
    port = free_port()
    stub_dir = write_sgl_kernel_stub(tempfile.mkdtemp(prefix="rl_tpu_sgl_kernel_"))
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "PYTHONPATH", "JAX_PLATFORMS") and not k.startswith("PYTEST")}
    env.update(PYTHONPATH=stub_dir, SGLANG_USE_CPU_ENGINE="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    env.update(env_overrides)
    cmd = [python, "-m", "sglang.launch_server", "--model-path", model_dir, "--device", "cpu",
           "--attention-backend", "torch_native", "--disable-overlap-schedule",
           "--max-total-tokens", "4096", "--dtype", "float32", "--host", "127.0.0.1",
           "--port", str(port), "--sleep-on-idle", *flags]
    return ServerProcess(cmd, port, env=env, name="sglang", cleanup=[stub_dir]).wait_ready(timeout)


# SGLang serving LoRA adapters on CPU (rl_tpu/rollout/weight_sync.py says what it needs).
PIN_MEMORY_SHIM = '''\
"""Written by rl_tpu's tests: SGLang 0.5.23's LoRA layers pin host memory unconditionally
(sglang/srt/lora/layers.py), which torch refuses without an NVIDIA driver. Pinning only speeds
host-to-GPU copies: without a GPU, make it a no-op."""
import functools

import torch

if not torch.cuda.is_available():
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self

    def _unpinned(make):
        @functools.wraps(make)
        def wrapper(*args, **kwargs):
            kwargs.pop("pin_memory", None)
            return make(*args, **kwargs)
        return wrapper

    for _name in ("tensor", "empty", "zeros", "ones", "full", "arange", "empty_like",
                  "zeros_like", "ones_like", "full_like", "empty_strided"):
        setattr(torch, _name, _unpinned(getattr(torch, _name)))
'''


def lora_server_env(directory: str, shim: bool = True) -> dict:
    """The environment of a CPU SGLang server that serves LoRA: PYTHONPATH with the sgl_kernel
    stand-in and (`shim`) the pin_memory sitecustomize, both written into `directory`."""
    write_sgl_kernel_stub(directory)
    if shim:
        with open(os.path.join(directory, "sitecustomize.py"), "w") as f:
            f.write(PIN_MEMORY_SHIM)
    return {"PYTHONPATH": directory}


def lora_flags(rank: int = 8) -> tuple[str, ...]:
    """A CPU SGLang server's LoRA flags: adapters up to `rank` on every projection, the
    plain-torch backend (the others run triton kernels)."""
    return ("--enable-lora", "--max-lora-rank", str(rank), "--lora-target-modules", "all",
            "--lora-backend", "torch_native")
