"""The asynchronous trainer end to end, killed with SIGKILL mid-run and rerun: deterministic
(lock-step) runs resume number for number, replay buffer included; free-running runs lose and
repeat no task of the stream.

Asynchronous runs need two devices (the sampler takes one, the learner the other): on a CPU,
XLA_FLAGS=--xla_force_host_platform_device_count=2.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from fake_devices import xla_flags
from rl_tpu.metrics import read_metrics
from test_rl import REPO, _final_params, _finite, config, kill_mid_run, resumed_from

# The kill comes within two step-times of checkpoint KILL_AFTER, timed from the step before
# it (steps 1 and 2 compile: replay grows the batch at step 2), and long before the last step
# (a step of these smoke configs takes well under a second on a CPU, after compilation).
KILL_AFTER = 4
STEPS = 12


def _two_device_env(**extra):
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO,
                XLA_FLAGS=xla_flags(2), **extra)


def _kill_mid_run(command, workdir, log_path, env) -> int:
    """`kill_mid_run` after checkpoint KILL_AFTER; the host states (producer, replay) are
    copied to `workdir`/host_at_kill, since the rerun prunes old ones."""
    complete = kill_mid_run(command, workdir, log_path, env, after=KILL_AFTER, timeout_s=400)
    shutil.copytree(workdir / "checkpoints" / "host", workdir / "host_at_kill")
    return complete


def _host_state(directory, step):
    from rl_tpu.persistence import host_state
    return host_state.read(host_state.path(str(directory), step, 0))


# ---------------------------------------------------------------- deterministic, with replay


def _deterministic_command(workdir):
    """BAPO, lock-step at staleness 2, plus replay. More SFT than the smoke variant's 4 steps,
    so that some rewards (and gradients) are non-zero and the params comparison means
    something."""
    return [sys.executable, "-m", "launch.train",
            "--config", "configs/bapo_offpolicy.py:bapo,s2,smoke", "--workdir", str(workdir),
            f"--config.train.steps={STEPS}", "--config.checkpoint.every=1",
            "--config.train.replay.capacity=8", "--config.sft.steps=30"]


@pytest.mark.slow
def test_kill_9_resumes_exactly_async_deterministic_with_replay(tmp_path):
    """A lock-step asynchronous run (max_staleness 2) with a replay buffer, SIGKILLed after its
    fourth checkpoint and rerun, logs every non-time metric of every step and ends with the
    params of an uninterrupted run, bit for bit: the checkpoint of step k holds the chunks
    k + 1, k + 2 already played (trajectories and their rollout metrics), the stream position
    after them and the replay buffer (checkpoints/host/<k>.process0.hoststate)."""
    straight = tmp_path / "straight"
    result = subprocess.run(_deterministic_command(straight), cwd=REPO, env=_two_device_env(),
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]

    resumed = tmp_path / "resumed"
    complete = _kill_mid_run(_deterministic_command(resumed), resumed, tmp_path / "killed.log",
                             _two_device_env())
    result = subprocess.run(_deterministic_command(resumed), cwd=REPO, env=_two_device_env(),
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    k = resumed_from(result)
    assert 0 < k < STEPS and complete <= k, (complete, k)

    # what the resume started from: the two chunks after k, played, and the replay buffer
    saved = _host_state(resumed / "host_at_kill", k)
    assert saved["producer"]["mode"] == "deterministic"
    assert sorted(saved["producer"]["chunks"]) == [k + 1, k + 2]
    assert saved["replay"], "the replay buffer was empty at the checkpoint"

    a = [_finite(r) for r in read_metrics(str(straight))]
    b = [_finite(r) for r in read_metrics(str(resumed))]
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        differ = {key: (ra.get(key), rb.get(key)) for key in sorted(ra.keys() | rb.keys())
                  if ra.get(key) != rb.get(key)}
        assert not differ, f"step {ra['step']} differs after resume from step {k}: {differ}"
    trained = [r for r in a if "train/loss" in r and r["step"] > 0]
    assert [r["step"] for r in trained] == list(range(1, STEPS + 1))
    assert any(r["train/grad_norm"] > 0 for r in trained if r["step"] > k), \
        "no gradient after the resume: the params comparison would be vacuous"
    assert any(r["replay/groups"] > 0 for r in trained if r["step"] > k)
    assert all(r["rollout/staleness_max"] == min(2, r["step"] - 1) for r in trained)

    before, after = _final_params(straight), _final_params(resumed)
    assert before.keys() == after.keys()
    for key in before:
        np.testing.assert_array_equal(after[key], before[key], err_msg=key)


# ---------------------------------------------------------------- free-running

# launch.train with Trainer.rollout wrapped to append the group ids (stream positions) each
# step trains on to $RL_TPU_TEST_TRACE, one JSON line per step, flushed before training.
TRACE_SCRIPT = """
import json, os, runpy, sys
from rl_tpu.recipes import rl

# one file a process in a multi-process job (tests/recipes/test_multihost.py): TRACE.<process>
suffix = "." + os.environ["JAX_PROCESS_ID"] if "JAX_PROCESS_ID" in os.environ else ""
trace = open(os.environ["RL_TPU_TEST_TRACE"] + suffix, "a")
rollout = rl.Trainer.rollout

def traced(self, step):
    trajectories, metrics = rollout(self, step)
    groups = list(dict.fromkeys(int(t.group_id) for t in trajectories))
    trace.write(json.dumps({"step": step, "groups": groups}) + "\\n")
    trace.flush()
    return trajectories, metrics

rl.Trainer.rollout = traced
sys.argv = ["launch.train", *sys.argv[1:]]
runpy.run_module("launch.train", run_name="__main__", alter_sys=True)
"""
FREE_ARGS = ["--config", "configs/quickstart.py:smoke", f"--config.train.steps={STEPS}",
             "--config.checkpoint.every=1", "--config.rollout.max_staleness=1",
             "--config.rollout.deterministic=False"]


def _read_trace(path) -> dict[int, list[int]]:
    by_step = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # the line the kill cut short
            continue
        assert record["step"] not in by_step, f"step {record['step']} traced twice"
        by_step[record["step"]] = record["groups"]
    return by_step


def _pending(host_state) -> list[int]:
    return [int(position) for position, _ in host_state["producer"]["pending"]]


def _read_positions(host_state, tasks_per_step) -> int:
    """How many stream positions the producer had read (one host: step s read [0, s * n))."""
    return host_state["producer"]["stream"]["step"] * tasks_per_step


def _assert_partition(read, trained, pending, dropped_count, what):
    """`read` (stream positions, in the order read) is exactly `trained` + `pending` + as many
    other positions as `dropped_count`: nothing trained twice, nothing lost."""
    assert len(trained) == len(set(trained)), f"{what}: a task trained twice: {trained}"
    assert len(pending) == len(set(pending)), f"{what}: a task pending twice: {pending}"
    assert not set(trained) & set(pending), f"{what}: trained and still pending"
    assert set(trained) | set(pending) <= set(read), f"{what}: trained a task never read"
    dropped = set(read) - set(trained) - set(pending)
    assert len(dropped) == dropped_count, (f"{what}: {sorted(dropped)} were read, neither "
                                           f"trained nor pending, {dropped_count} dropped stale")
    return dropped


@pytest.mark.slow
def test_free_running_resume_loses_and_repeats_no_task(tmp_path):
    """A free-running asynchronous run (max_staleness 1), SIGKILLed after its fourth checkpoint
    and rerun, trains every task of the stream at most once and loses none.

    Observed: the group ids (= stream positions) each step trains on, traced by a wrapper of
    launch.train; the host state of the restored checkpoint k and of the final one N
    (pending tasks: read from the stream, not yet trained; the stream position); the per-step
    `rollout/dropped_stale` counts. The producer's contract, checked exactly:
    - at checkpoint k, the positions read from the stream ([0, read_k)) are the tasks trained
      in steps 1..k, the pending ones, and as many others as steps 1..k dropped as stale,
      with no position in two of these (and none trained twice);
    - after the resume, the pending tasks of k are played first, then the stream from read_k:
      positions pending_k + [read_k, read_N) are exactly the tasks trained in steps k+1..N,
      the ones pending at N, and as many others as steps k+1..N dropped;
    - so no task trained up to checkpoint k is trained again, and every task read but not
      trained at k (ready, or in flight at the save) is trained (or dropped) after resume.
    Steps the killed run trained after checkpoint k are not in the checkpoint: their tasks
    are pending at k and trained again after the resume, as they must be."""
    script = tmp_path / "traced_train.py"
    script.write_text(TRACE_SCRIPT)
    workdir = tmp_path / "run"
    command = [sys.executable, str(script), "--workdir", str(workdir), *FREE_ARGS]
    killed_trace, resumed_trace = tmp_path / "killed.jsonl", tmp_path / "resumed.jsonl"

    complete = _kill_mid_run(command, workdir, tmp_path / "killed.log",
                             _two_device_env(RL_TPU_TEST_TRACE=str(killed_trace)))
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900,
                            env=_two_device_env(RL_TPU_TEST_TRACE=str(resumed_trace)))
    assert result.returncode == 0, result.stderr[-3000:]
    k = resumed_from(result)
    assert 0 < k < STEPS and complete <= k, (complete, k)

    n = config("quickstart").train.tasks_per_step
    at_k = _host_state(workdir / "host_at_kill", k)
    at_end = _host_state(workdir / "checkpoints" / "host", STEPS)
    assert at_k["producer"]["mode"] == at_end["producer"]["mode"] == "free"
    killed, resumed = _read_trace(killed_trace), _read_trace(resumed_trace)
    assert set(range(1, k + 1)) <= killed.keys()
    assert sorted(resumed) == list(range(k + 1, STEPS + 1))
    for step, groups in {**{s: killed[s] for s in range(1, k + 1)}, **resumed}.items():
        assert len(groups) == n, f"step {step} trained {len(groups)} groups, not {n}"
    dropped = {r["step"]: int(r["rollout/dropped_stale"]) for r in read_metrics(str(workdir))
               if "rollout/dropped_stale" in r}
    assert sorted(dropped) == list(range(1, STEPS + 1))

    # up to the checkpoint k
    trained_k = [g for s in range(1, k + 1) for g in killed[s]]
    pending_k = _pending(at_k)
    assert len(pending_k) >= n, "nothing in flight at the checkpoint: the test shows nothing"
    read_k = list(range(_read_positions(at_k, n)))
    _assert_partition(read_k, trained_k, pending_k, sum(dropped[s] for s in range(1, k + 1)),
                      f"at checkpoint {k}")

    # after the resume: the pending tasks, then the stream from where it stood at k
    trained_after = [g for s in range(k + 1, STEPS + 1) for g in resumed[s]]
    read_after = pending_k + list(range(len(read_k), _read_positions(at_end, n)))
    dropped_after = _assert_partition(
        read_after, trained_after, _pending(at_end),
        sum(dropped[s] for s in range(k + 1, STEPS + 1)), f"after resuming from {k}")
    assert not set(trained_k) & set(trained_after), "a task trained before the checkpoint " \
        "was trained again after the resume"
    if not dropped_after:  # replayed first, in the order they were read
        assert trained_after[:len(pending_k)] == pending_k
    # chunk numbers still those of the stream steps (the producer's own test of this is in
    # tests/offpolicy/test_producer.py: free-running resume keeps chunk numbers)
    if _pending(at_end):
        assert at_end["producer"]["next_chunk"] == at_end["producer"]["stream"]["step"]
