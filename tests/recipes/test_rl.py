"""The RL trainer end to end: every config's smoke variant, flags, exact resume after kill -9."""

import contextlib
import copy
import importlib
import io
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from fake_devices import xla_flags

from rl_tpu.metrics import read_metrics
from rl_tpu.recipes import rl

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = ["quickstart", "countdown_grpo", "babyai_grpo", "textcraft_bapo", "sciworld_ppo",
           "search_grpo", "agentgym:babyai", "agentgym:textcraft", "agentgym:sciworld",
           "agentgym:searchqa", "bapo_offpolicy:clip,replay",
           "tl_grpo_babyai", "siri_arithmetic", "babyai_cpu", "code_grpo", "tool_calling",
           "lora_largest:r8", "bapo_entropy:bapo,s8", "tl_grpo_guess:tl_grpo",
           "scaling_maze:hidden,staged", "siri_arithmetic:steps,siri", "real_gsm",
           "moe_replay:replay"]


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


def _config_arg(name, variant="smoke"):
    """The --config argument of `config(name, variant)`."""
    name, _, arg = name.partition(":")
    return f"configs/{name}.py:{arg + ',' if arg else ''}{variant}"


# Each smoke trains in a process of its own, so a crash fails its test instead of taking a test
# worker (and, with xdist's loadgroup scheduler, the whole run) down. With no XLA flags: one CPU
# device, what `python -m launch.train` gets on a user's machine (the README promises every
# smoke runs there; an asynchronous one shares the device between sampler and learner). Sharded
# runs are tested on fake devices elsewhere: 1 x 8 and 2 x 4 in test_two_processes_train_like_one
# below and tests/recipes/test_multihost.py, the asynchronous split in test_rl_async.py, the
# sharded scanned update compiled for TPU in tests/test_aot.py.
def _train_smoke(name, workdir):
    env = dict(os.environ, PYTHONPATH=REPO)  # the suite's compile cache
    env.pop("XLA_FLAGS", None)  # no fake devices
    command = [sys.executable, "-m", "launch.train", "--config", _config_arg(name),
               "--workdir", str(workdir)]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=1200)


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
    out = _train_smoke(name, tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    # the summary line, once, names what the config asks for (LoRA on or off in words)
    summary = [line for line in out.stdout.splitlines() if line.startswith("run: ")]
    assert len(summary) == 1, out.stdout[-2000:]
    for field in (f"recipe {c.recipe}, ", f"algorithm {c.algo.name}, ", f"env {c.env.name}, ",
                  "devices 1 x cpu on 1 host, ", f"warm start {c.sft.steps} SFT steps"
                  if c.sft.steps else "warm start none"):
        assert field in summary[0], summary[0]
    assert (f"LoRA rank {c.model.lora.rank} (" if c.model.lora.rank
            else "full fine-tuning") in summary[0]
    if c.sft.steps:  # the warm start's progress: its last step always has a line in a log
        assert f"warm start: SFT step {c.sft.steps}/{c.sft.steps}: loss " in out.stdout
    records = read_metrics(str(tmp_path))
    steps = [r["step"] for r in records if "rollout/reward" in r]
    assert steps == [1, 2]
    final_eval = [r for r in records if "eval/success" in r][-1]
    assert final_eval["step"] == 2
    last = [r for r in records if r["step"] == 2 and "train/loss" in r][0]
    assert last["train/skipped"] == 0
    # step 2 sampled with step 1's weights; k versions behind with a lock-step producer
    assert last["rollout/weight_version"] == max(0, 1 - c.rollout.max_staleness)
    assert os.path.isfile(tmp_path / "final_hf" / "config.json")
    if name == "sciworld_ppo":
        assert "critic/value_loss" in last
    if name.startswith("scaling_maze"):  # every episode trained on: at most a step a turn
        episodes = c.train.tasks_per_step * c.train.samples_per_task
        for r in (r for r in records if "rollout/env_steps" in r):
            assert 0 < r["rollout/env_steps"] <= round(r["rollout/turns"] * episodes)
    if name == "quickstart":
        # launch.eval's recipe, from the checkpoint and from the exported HF dir, measures
        # what the run's own final eval measured
        # (with eval.save_replies, the eval's replies are written beside its metrics)
        from rl_tpu.recipes import evaluate
        c.eval.save_replies = True
        from_ckpt = evaluate.run(c, workdir=str(tmp_path))
        c.eval.save_replies = False
        from_hf = evaluate.run(c, model_path=str(tmp_path / "final_hf"))
        assert from_ckpt["checkpoint_step"] == from_ckpt["weight_version"] == 2
        assert os.path.isfile(tmp_path / "evals" / "eval_step2.json")
        with open(tmp_path / "evals" / "eval_step2.replies.jsonl") as f:
            replies = [json.loads(line) for line in f]
        assert len(replies) == c.eval.num_tasks * (1 + c.eval.pass_k)
        assert sum(r["success"] for r in replies if r["kind"] == "greedy") == round(
            from_ckpt["success"] * c.eval.num_tasks)
        assert from_ckpt["success"] == from_hf["success"] == final_eval["eval/success"]
        assert from_ckpt["tokens"] == from_hf["tokens"] == final_eval["eval/tokens"]
        _rerun_of_a_finished_run(c, tmp_path, final_eval)


@pytest.mark.slow
def test_a_run_compiles_nothing_after_its_first_step(tmp_path):
    """Every program a single-turn run needs is built by the end of its first step: the
    sampler's buckets, the update, the eval's programs (step 0's eval) and the checkpoint's
    checksums (compiled at start-up, not at the first save), so steps 2-4 (each with a
    checkpoint, two with an eval) compile and load nothing (time/compiles and
    time/cache_loads are JAX's own counts). With progress lines every 0.05 s, a step running
    longer than 6 x that says which step and phase it is in."""
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop("XLA_FLAGS", None)
    out = subprocess.run([sys.executable, "-m", "launch.train", "--config",
                          "configs/quickstart.py:smoke", "--workdir", str(tmp_path),
                          "--config.train.steps=4", "--config.log.every_s=0.05"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"^step 1/4, \d+ s, (rollout|scoring|update|weight sync)$", out.stdout,
                     re.MULTILINE), out.stdout[-2000:]
    built = {r["step"]: r["time/compiles"] + r["time/cache_loads"]
             for r in read_metrics(str(tmp_path)) if "time/compiles" in r}
    assert sorted(built) == [1, 2, 3, 4]
    assert built[1] > 0  # the counter counts (the first step builds everything)
    assert {step: n for step, n in built.items() if step > 1} == {2: 0, 3: 0, 4: 0}


def _rerun_of_a_finished_run(c, workdir, final_eval):
    """A rerun of the finished run trains nothing and says where the results are; a config
    change is refused as a resume refuses it; a raised train.steps trains on."""
    records = read_metrics(str(workdir))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        again = rl.finished_run(c, str(workdir))
    assert again == {k: v for k, v in final_eval.items() if k.startswith("eval/")}
    assert f"{workdir} finished at step 2" in out.getvalue()
    assert f"{workdir / 'curves.png'}, {workdir / 'final_hf'}" in out.getvalue()
    assert read_metrics(str(workdir)) == records
    changed = copy.deepcopy(c)
    changed.optim.lr *= 2
    with pytest.raises(ValueError, match="optim.lr"):
        rl.finished_run(changed, str(workdir))
    longer = copy.deepcopy(c)
    longer.train.steps = 3
    assert rl.finished_run(longer, str(workdir)) is None


# Enough steps that a kill within two step-times of the second checkpoint lands long before
# the last one, on a slow machine or a fast one (a step of the smoke config is ~0.3 s on CPU).
KILL_STEPS = 12


def _train_command(workdir, async_save):
    return [sys.executable, "-m", "launch.train", "--config", "configs/quickstart.py:smoke",
            "--workdir", str(workdir), f"--config.train.steps={KILL_STEPS}",
            "--config.checkpoint.every=1",
            # a warm start, so rewards differ within groups and the updates move the params
            "--config.sft.steps=30",
            f"--config.checkpoint.async_save={'true' if async_save else 'false'}"]


def _cpu_env():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    env.pop("XLA_FLAGS", None)
    return env


@pytest.fixture(scope="module")
def uninterrupted_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("straight")
    result = subprocess.run(_train_command(workdir, async_save=True), cwd=REPO, env=_cpu_env(),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir


def _latest_checkpoint(directory) -> int:
    """The latest complete checkpoint step (orbax renames a step's folder to its number only
    once it is complete), 0 if none."""
    if not directory.exists():
        return 0
    return max((int(p.name) for p in directory.iterdir() if p.name.isdigit()), default=0)


def _wait_for_checkpoint(proc, directory, step, log_path, deadline):
    while _latest_checkpoint(directory) < step:
        assert proc.poll() is None, (f"training exited ({proc.returncode}) before checkpoint "
                                     f"{step}:\n{log_path.read_text()[-3000:]}")
        assert time.time() < deadline, f"no checkpoint {step} after 300 s"
        time.sleep(0.02)


def kill_mid_run(command, workdir, log_path, env, after: int, timeout_s: float = 300) -> int:
    """Starts `command`, SIGKILLs it at a random moment of a step after checkpoint `after`
    (mid-rollout, mid-update, mid-eval or mid-save: all must be survivable; timed by the rate
    of checkpoints after-1 -> after), checks it died of the signal while still running, and
    returns the latest checkpoint that was complete before the kill."""
    checkpoints = workdir / "checkpoints"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log_file,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + timeout_s
        _wait_for_checkpoint(proc, checkpoints, after - 1, log_path, deadline)
        first = time.time()
        _wait_for_checkpoint(proc, checkpoints, after, log_path, deadline)
        delay = random.Random(os.getpid()).uniform(0.0, 2 * (time.time() - first))
        time.sleep(delay)
        assert proc.poll() is None, (f"training ended {delay:.2f}s after checkpoint {after}, "
                                     "before the kill; run more steps")
        complete = _latest_checkpoint(checkpoints)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, log_path.read_text()[-3000:]
    return complete


def resumed_from(result) -> int:
    """The k of the one "resumed from step k" the rerun logged."""
    # a plain line on stdout: information, not a warning
    found = [int(k) for k in re.findall(r"^resumed from step (\d+)$", result.stdout, re.M)]
    assert len(found) == 1, (result.stderr + result.stdout)[-3000:]
    return found[0]


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [True, False], ids=["async_save", "sync_save"])
def test_kill_9_and_rerun_resumes_exactly(tmp_path, uninterrupted_run, async_save):
    resumed = tmp_path / "resumed"
    complete = kill_mid_run(_train_command(resumed, async_save), resumed,
                            tmp_path / "killed.log", _cpu_env(), after=2)

    result = subprocess.run(_train_command(resumed, async_save), cwd=REPO, env=_cpu_env(),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    # at or after the last checkpoint seen complete before the kill, and before the end
    k = resumed_from(result)
    assert complete <= k < KILL_STEPS, (complete, k)

    a = [_finite(r) for r in read_metrics(str(uninterrupted_run))]
    b = [_finite(r) for r in read_metrics(str(resumed))]
    assert any(r.get("train/grad_norm", 0) > 0 for r in a), "no update moved the params"
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert ra == rb, f"step {ra['step']} differs after resume"
    straight, after_kill = _final_params(uninterrupted_run), _final_params(resumed)
    assert straight.keys() == after_kill.keys()
    for key in straight:
        np.testing.assert_array_equal(after_kill[key], straight[key], err_msg=key)


@pytest.mark.slow
def test_two_runs_of_one_command_give_the_same_numbers(tmp_path, uninterrupted_run):
    """A seeded run is a function of its command on a machine: a second run, in a fresh
    process and workdir (tiny model, tokenizer, SFT demos, warm start, GRPO, evals all made
    anew), logs every metric and ends with every weight as the first did."""
    again = tmp_path / "again"
    result = subprocess.run(_train_command(again, async_save=True), cwd=REPO, env=_cpu_env(),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    a = [_finite(r) for r in read_metrics(str(uninterrupted_run))]
    b = [_finite(r) for r in read_metrics(str(again))]
    assert a == b
    first, second = _final_params(uninterrupted_run), _final_params(again)
    for key in first:
        np.testing.assert_array_equal(second[key], first[key], err_msg=key)


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
        cwd=REPO, env=dict(env, XLA_FLAGS=xla_flags(8)),
        capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr[-3000:]

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [subprocess.Popen(
        [sys.executable, "-m", "launch.train", *common, "--workdir", str(tmp_path / "two")],
        cwd=REPO, env=dict(env, XLA_FLAGS=xla_flags(4),
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
