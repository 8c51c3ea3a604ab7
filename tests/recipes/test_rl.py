"""The RL trainer end to end: every config's smoke variant, flags, exact resume after kill -9."""

import importlib
import os
import random
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from rl_tpu.metrics import read_metrics
from rl_tpu.recipes import rl

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = ["quickstart", "countdown_grpo", "babyai_grpo", "textcraft_bapo", "sciworld_ppo",
           "search_grpo", "agentgym:babyai", "agentgym:textcraft", "agentgym:sciworld",
           "agentgym:searchqa"]


def config(name, variant="smoke"):
    """configs/<file>.py's get_config; "file:arg" names an experiment whose arg picks the env,
    and gets ",smoke" appended."""
    name, _, arg = name.partition(":")
    sys.path.insert(0, REPO)
    try:
        return importlib.import_module(f"configs.{name}").get_config(
            f"{arg},{variant}" if arg else variant)
    finally:
        sys.path.remove(REPO)


def launch(*args, timeout=600, **kw):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    env.pop("XLA_FLAGS", None)  # one CPU device, as a user's laptop
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout, **kw)


def test_launch_lists_entry_points():
    out = launch("launch").stdout
    for name in ("train", "sft", "eval", "serve_rollout", "serve_env", "make_tiny_model"):
        assert f"  {name} " in out


@pytest.mark.parametrize("override,named", [
    ("--config.algo.clip_hgh=0.3", "clip_hgh"),
    ("--config.train.steps=abc", "steps"),
])
def test_bad_override_fails_before_anything_compiles(tmp_path, override, named):
    started = time.time()
    result = launch("launch.train", "--config", "configs/quickstart.py:smoke",
                    "--workdir", str(tmp_path), override)
    assert result.returncode != 0
    assert named in result.stderr
    assert not os.path.exists(tmp_path / "init_model")  # nothing was built
    assert time.time() - started < 60


def test_cross_key_check_names_the_keys(tmp_path):
    c = config("quickstart")
    c.train.samples_per_task = 1
    with pytest.raises(ValueError, match="samples_per_task"):
        rl.run(c, str(tmp_path))


def _finite(record):
    return {k: v for k, v in record.items() if not k.startswith("time/")}


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_smoke_variant_trains_end_to_end(tmp_path, name):
    if "sciworld" in name:
        from rl_tpu.envs import sciworld
        try:
            sciworld._require_java()
        except Exception as e:  # noqa: BLE001
            pytest.skip(f"ScienceWorld needs Java: {e}")
    c = config(name)
    result = rl.run(c, str(tmp_path))
    records = read_metrics(str(tmp_path))
    steps = [r["step"] for r in records if "rollout/reward" in r]
    assert steps == [1, 2]
    assert "eval/success" in result
    last = [r for r in records if r["step"] == 2 and "train/loss" in r][0]
    assert last["train/skipped"] == 0
    assert last["rollout/weight_version"] == 1  # step 2 sampled with step 1's weights
    assert os.path.isfile(tmp_path / "final_hf" / "config.json")
    if name == "sciworld_ppo":
        assert "critic/value_loss" in last
    if name == "quickstart":
        # launch.eval's recipe, from the checkpoint and from the exported HF dir, measures
        # what the run's own final eval measured
        from rl_tpu.recipes import evaluate
        from_ckpt = evaluate.run(c, workdir=str(tmp_path))
        from_hf = evaluate.run(c, model_path=str(tmp_path / "final_hf"))
        assert from_ckpt["checkpoint_step"] == 2
        assert from_ckpt["success"] == from_hf["success"] == result["eval/success"]
        assert from_ckpt["tokens"] == from_hf["tokens"] == result["eval/tokens"]


def _train(workdir, *extra, timeout=600):
    return launch("launch.train", "--config", "configs/quickstart.py:smoke", "--workdir",
                  str(workdir), "--config.train.steps=4", "--config.checkpoint.every=1",
                  "--config.checkpoint.async_save=false", *extra, timeout=timeout)


@pytest.mark.slow
def test_kill_9_and_rerun_resumes_exactly(tmp_path):
    straight = tmp_path / "straight"
    result = _train(straight)
    assert result.returncode == 0, result.stderr[-3000:]

    resumed = tmp_path / "resumed"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.train", "--config", "configs/quickstart.py:smoke",
         "--workdir", str(resumed), "--config.train.steps=4", "--config.checkpoint.every=1",
         "--config.checkpoint.async_save=false"], cwd=REPO, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # Kill at a random moment after the first RL checkpoint exists (mid-step, mid-eval or
    # mid-save: all must be survivable).
    deadline = time.time() + 300
    while not (resumed / "checkpoints").exists() or not any(
            p.name.isdigit() for p in (resumed / "checkpoints").iterdir()):
        assert proc.poll() is None, "training ended before its first checkpoint"
        assert time.time() < deadline
        time.sleep(0.2)
    time.sleep(random.Random(os.getpid()).uniform(0.0, 3.0))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    result = _train(resumed)
    assert result.returncode == 0, result.stderr[-3000:]

    a = [_finite(r) for r in read_metrics(str(straight))]
    b = [_finite(r) for r in read_metrics(str(resumed))]
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert ra == rb, f"step {ra['step']} differs after resume"


def _final_params(workdir):
    from rl_tpu.models import hf
    _, params = hf.load(str(workdir / "final_hf"))
    import jax
    return {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_leaves_with_path(params)}


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path):
    """2 processes x 4 CPU devices on loopback (jax.distributed) train 3 steps and end with the
    params of 1 process x 8 devices on the same global batch."""
    common = ["--config", "configs/quickstart.py:smoke", "--config.train.steps=3",
              "--config.train.tasks_per_step=4", "--config.eval.num_tasks=8",
              "--config.rollout.sampler_devices=1", "--config.checkpoint.async_save=false"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    single = subprocess.run(
        [sys.executable, "-m", "launch.train", *common, "--workdir", str(tmp_path / "one")],
        cwd=REPO, env=dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=8"),
        capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr[-3000:]

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [subprocess.Popen(
        [sys.executable, "-m", "launch.train", *common, "--workdir", str(tmp_path / "two")],
        cwd=REPO, env=dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=4",
                           JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
                           JAX_PROCESS_ID=str(pid)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for pid in range(2)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=600)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]

    one, two = _final_params(tmp_path / "one"), _final_params(tmp_path / "two")
    assert one.keys() == two.keys()
    for key in one:
        np.testing.assert_allclose(two[key], one[key], atol=1e-5, rtol=0, err_msg=key)
    a = [_finite(r) for r in read_metrics(str(tmp_path / "one")) if r["step"] >= 0]
    b = [_finite(r) for r in read_metrics(str(tmp_path / "two")) if r["step"] >= 0]
    assert [r["rollout/reward"] for r in a if "rollout/reward" in r] == \
        [r["rollout/reward"] for r in b if "rollout/reward" in r]
