"""Training against env servers (`env.remote_url`): `configs/agentgym.py:babyai,smoke` plays its
episodes on `launch.serve_env` subprocesses on 127.0.0.1, spread over two of them; a server
SIGKILLed in the middle of a rollout turns the episodes it held into `env_error` episodes and
the run goes on to its last step. Config mistakes fail before any compute."""

import importlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from fake_devices import xla_flags

from rl_tpu.metrics import read_metrics
from rl_tpu.recipes import env_factory, rl

pytest.importorskip("minigrid")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "rollout"))
from sglang_server import REPO, free_port, start_subprocess_server  # noqa: E402


def smoke_config():
    sys.path.insert(0, REPO)
    try:
        return importlib.import_module("configs.agentgym").get_config("babyai,smoke")
    finally:
        sys.path.remove(REPO)


def serve_env(name: str):
    """`python -m launch.serve_env --env <name>` on a free loopback port, once /health answers.
    The name is the config's, read at run time: whatever the env is registered as today."""
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    env.pop("XLA_FLAGS", None)
    return start_subprocess_server(
        [sys.executable, "-m", "launch.serve_env", "--env", name, "--port", str(port)], port,
        env=env, name="serve_env", timeout=120, ready_path="/health")


def health(server) -> dict:
    with urllib.request.urlopen(server.url + "/health", timeout=5) as reply:
        return json.loads(reply.read())


def dead_url() -> str:
    with socket.socket() as probe:  # free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


# --- mistakes a user can make: each named, before any compute ---------------------------------


@pytest.mark.parametrize("url", ["ftp://127.0.0.1:1", "http://127.0.0.1:port", " , "])
def test_bad_url_fails_before_anything_is_built(tmp_path, url):
    c = smoke_config()
    c.env.remote_url = url
    with pytest.raises(ValueError, match="env.remote_url"):
        rl.run(c, str(tmp_path))
    assert not os.path.exists(tmp_path / "init_model")


def test_remote_timeout_must_fit_the_step_timeout(tmp_path):
    c = smoke_config()
    c.env.remote_url = "http://127.0.0.1:1"
    c.env.remote_timeout_s = c.env.step_timeout_s + 1
    with pytest.raises(ValueError, match="env.remote_timeout_s"):
        rl.run(c, str(tmp_path))


def test_a_server_that_does_not_answer_is_named():
    c = smoke_config()
    url = dead_url()
    c.env.remote_url = f"{url}"
    c.env.remote_retries, c.env.remote_backoff_s = 1, 0.01
    with pytest.raises(ValueError, match=rf"env.remote_url: the env server at {url} does not"):
        env_factory.make_env_factory(c)


# --- end to end -------------------------------------------------------------------------------


def _rollout_records(workdir):
    return [r for r in read_metrics(str(workdir)) if "rollout/reward" in r]


@pytest.mark.slow
def test_smoke_trains_against_two_env_servers(tmp_path):
    c = smoke_config()
    servers = [serve_env(c.env.name), serve_env(c.env.name)]
    try:
        c.env.remote_url = ",".join(s.url for s in servers)
        result = rl.run(c, str(tmp_path))
        records = _rollout_records(tmp_path)
        assert [r["step"] for r in records] == [1, 2]
        assert all(r["rollout/env_error_frac"] == 0 for r in records), records
        assert result["eval/env_errors"] == 0
        assert os.path.isfile(tmp_path / "final_hf" / "config.json")
        seen = [health(s) for s in servers]
    finally:
        for server in servers:
            server.stop()
    # Every episode played remotely, spread over both servers, and every instance was freed:
    # 2 steps x 2 tasks x 2 samples, plus the evals at steps 0 and 2.
    per_step = c.train.tasks_per_step * c.train.samples_per_task
    assert sum(h["created"] for h in seen) >= 2 * per_step + 2 * c.eval.num_tasks, seen
    assert all(h["created"] > 0 and h["steps"] > 0 for h in seen), seen
    assert all(h["instances"] == 0 for h in seen), seen


def train_in_subprocess(workdir, *overrides: str, timeout: float = 900):
    """`python -m launch.train --config configs/agentgym.py:babyai,smoke` on 2 fake devices in
    a process of its own: a native abort in it (XLA's own message is in its stderr) fails this
    test alone instead of taking the pytest worker, and with it the test run, down."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO, XLA_FLAGS=xla_flags(2))
    proc = subprocess.run(
        [sys.executable, "-m", "launch.train", "--config", "configs/agentgym.py:babyai,smoke",
         "--workdir", str(workdir), *overrides],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    return proc


@pytest.mark.slow
def test_server_killed_mid_rollout_gives_env_errors_not_a_crash(tmp_path):
    c = smoke_config()
    server = serve_env(c.env.name)

    # The kill lands inside the first training rollout, told from the server's side (no hook
    # into the trainer): the step-0 eval creates one instance an episode, so an instance past
    # those is a training episode's; once an env step follows, SIGKILL, while the other
    # episodes of the batch are still being played.
    eval_episodes = c.eval.num_tasks * (1 + c.eval.pass_k)
    if c.model.get("tiny_corpus_tasks", 0) > 0:  # the tiny tokenizer reads the env's text
        eval_episodes += 1
    stop, killed = threading.Event(), []

    def kill_mid_rollout():
        deadline = time.monotonic() + 900
        while health(server)["created"] <= eval_episodes:
            if stop.wait(0.01) or time.monotonic() > deadline:
                return
        before = health(server)["steps"]
        while health(server)["steps"] == before:
            if stop.wait(0.01) or time.monotonic() > deadline:
                return
        killed.append(health(server))
        server.kill()  # SIGKILL, process group and all

    killer = threading.Thread(target=kill_mid_rollout, daemon=True)
    killer.start()
    try:
        # Every episode fails once the server is dead: this checks the trainer lives through
        # that to its last step; stopping a run on all-failed steps is
        # tests/agent/test_env_failures.py's
        train_in_subprocess(tmp_path, f"--config.env.remote_url={server.url}",
                            "--config.env.remote_timeout_s=5", "--config.env.remote_retries=1",
                            "--config.env.remote_backoff_s=0.05",
                            "--config.env.max_failed_steps=0")
    finally:
        stop.set()
        killer.join(60)
        server.stop()
    assert killed, "the server was never killed: no training rollout reached it"
    assert killed[0]["created"] > eval_episodes and killed[0]["steps"] >= 1, killed
    records = _rollout_records(tmp_path)
    assert [r["step"] for r in records] == [1, 2]  # the run went on to its last step
    # Step 1 lost the episodes still in flight; by step 2 no episode could start at all.
    assert records[0]["rollout/env_error_frac"] > 0
    assert records[1]["rollout/env_error_frac"] == 1.0
    (last_eval,) = [r for r in read_metrics(str(tmp_path)) if r["step"] == 2
                    and "eval/env_errors" in r]
    assert last_eval["eval/env_errors"] == c.eval.num_tasks
    assert os.path.isfile(tmp_path / "final_hf" / "config.json")
