"""What a run tells its user, read from a launcher subprocess with stdout and stderr piped (a
log file, not a terminal): its first line at once, a progress line per step (at most one every
`log.every_s` seconds, the first and the last always), and, when it cannot write its
checkpoint, one clear last line, exit 2, with the checkpoints before it intact: the rerun
resumes from the last good one and finishes.

The write fault is real: a sitecustomize on the subprocess's PYTHONPATH sets a file-size limit
(RLIMIT_FSIZE, no root needed) when step 3's save starts, so the OS refuses that step's data
files (EFBIG) inside orbax's background threads, as a full disk refuses them (ENOSPC). With
root and a mountable tmpfs, the full disk itself is tried too."""

import os
import re
import shutil
import subprocess
import sys
import textwrap
import uuid

import pytest

from test_rl import REPO, _cpu_env, resumed_from

STEPS, FAIL_AT = 4, 3
TRAIN = [sys.executable, "-m", "launch.train", "--config", "configs/quickstart.py:smoke",
         f"--config.train.steps={STEPS}", f"--config.eval.every={STEPS}",
         "--config.log.plot=False", "--config.checkpoint.export_hf=False"]

# The RL run's step FAIL_AT save starts under a 64 KiB file-size limit; a write past it fails (SIGXFSZ
# ignored) with EFBIG. The model's arrays are bigger, the run's small files (metrics,
# TensorBoard events) are not.
HOOK = textwrap.dedent(f"""
    import resource, signal
    from rl_tpu.persistence import checkpoint

    _save = checkpoint.Checkpointer.save

    def save(self, step, *args, **kwargs):
        # the RL run's checkpoints, not the SFT warm start's (W/warm_start/checkpoints)
        if step == {FAIL_AT} and "warm_start" not in self.directory:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
        return _save(self, step, *args, **kwargs)

    checkpoint.Checkpointer.save = save
""")


def _train(workdir, hook_dir=None):
    env = _cpu_env()
    if hook_dir is not None:
        env["PYTHONPATH"] = f"{hook_dir}{os.pathsep}{env['PYTHONPATH']}"
    return subprocess.run(TRAIN + ["--workdir", str(workdir)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def _assert_one_clear_last_line(result, expected: str):
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr[-3000:]
    assert re.fullmatch(expected + re.escape("  (RL_TPU_DEBUG=1 shows the traceback)"),
                        lines[-1]), result.stderr[-3000:]
    # orbax's threads say it in a line each; no tracebacks from them, tensorstore, the
    # metrics writers or interpreter shutdown
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr, \
        result.stderr[-3000:]
    assert len(lines) <= 8, result.stderr[-3000:]


@pytest.mark.slow  # two launcher runs (~40 s)
def test_a_checkpoint_refused_by_the_os_ends_in_one_line_and_resumes_from_the_last_good(
        tmp_path):
    hook_dir = tmp_path / "hook"
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(HOOK)
    workdir = tmp_path / "run"
    failed = _train(workdir, hook_dir)
    _assert_one_clear_last_line(failed, re.escape(
        f"error: cannot write checkpoint step {FAIL_AT} to {workdir}/checkpoints/{FAIL_AT}: "
        "File too large; a file-size limit (ulimit -f) stopped it: raise the limit or pick "
        f"another --workdir; the last good checkpoint is step {FAIL_AT - 1}"))
    names = sorted(os.listdir(workdir / "checkpoints"))
    assert [n for n in names if n.isdigit()] == ["1", "2"], names  # 3 never completed
    # the rerun, with the limit gone, restores step 2 and trains to the end
    rerun = _train(workdir)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert resumed_from(rerun) == FAIL_AT - 1
    # its output: the first line before anything is built, then a line for its first step
    # and its last (steps under every_s = 5 s apart print no line between them)
    out = rerun.stdout.splitlines()
    assert out[0] == (f"rl_tpu: starting rl (grpo on largest) in {workdir}: {STEPS} steps, "
                      "1 cpu device; building the model and compiling..."), rerun.stdout
    progress = [line for line in out if re.match(r"step \d+/", line)]
    assert [line.split(":")[0] for line in progress][0] == f"step {FAIL_AT}/{STEPS}"
    assert progress[-1].startswith(f"step {STEPS}/{STEPS}: reward "), rerun.stdout
    assert ", loss " in progress[-1] and ", eval success " in progress[-1]


def _mount_tmpfs(path, size: str) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    path.mkdir(parents=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, timeout=30).returncode == 0


@pytest.mark.slow  # a launcher run (~20 s); needs root and a mountable tmpfs
def test_a_full_disk_ends_in_one_line(tmp_path):
    small = tmp_path / f"small-{uuid.uuid4().hex[:8]}"
    # the tiny model (~0.6 MB) and a checkpoint (~0.7 MB) fit, the next does not; which
    # write meets the full disk first (a step's arrays, a metrics line) is up to the sizes
    if not _mount_tmpfs(small, "2400k"):
        pytest.skip("needs root and `mount -t tmpfs` for a small filesystem")
    try:
        workdir = small / "run"
        result = _train(workdir)
        _assert_one_clear_last_line(result, re.escape("error: cannot write ") + ".* to "
                                    + re.escape(f"{workdir}/") + ".*"
                                    + re.escape(": No space left on device; free space there "
                                                "or pick another --workdir") + ".*")
    finally:
        subprocess.run(["umount", str(small)], capture_output=True, timeout=30)
