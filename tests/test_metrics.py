"""MetricsWriter, read_metrics, plot_curves, progress and the step log on real files."""

import glob
import io
import json
import logging
import errno
import os
import struct

import jax.numpy as jnp
import numpy as np
import pytest

from rl_tpu.persistence.checkpoint_errors import RunWriteError
from rl_tpu.metrics import (METRICS_FILE, TENSORBOARD_DIR, MetricsWriter, StepLog,
                            curves_figure, plot_curves, progress, read_metrics)


def read_events(workdir):
    """Every Event in W/tensorboard/*, parsed from the TFRecord framing: u64 length,
    u32 crc of the length, the Event proto, u32 crc of the data."""
    from tensorboardX.proto import event_pb2

    events = []
    for path in sorted(glob.glob(os.path.join(workdir, TENSORBOARD_DIR, "events.out.tfevents.*"))):
        data = open(path, "rb").read()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[offset + 12:offset + 12 + length])
            events.append(event)
            offset += 12 + length + 4
    return events


def scalars(events):
    return [(e.step, v.tag, v.simple_value) for e in events for v in e.summary.value]


def test_write_read_round_trip_of_python_numpy_and_jax_scalars(tmp_path):
    with MetricsWriter(str(tmp_path), tensorboard=False) as writer:
        writer.write(1, {"rollout/reward": 0.5, "train/steps": 3, "rollout/success": True,
                         "train/loss": np.float32(0.25), "train/entropy": jnp.asarray(1.5),
                         "train/grad_norm": jnp.asarray([2.0])})
        writer.write(2, {"rollout/reward": np.float64(0.75)})
    assert read_metrics(str(tmp_path)) == [
        {"step": 1, "rollout/reward": 0.5, "train/steps": 3, "rollout/success": 1,
         "train/loss": 0.25, "train/entropy": 1.5, "train/grad_norm": 2.0},
        {"step": 2, "rollout/reward": 0.75},
    ]
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert lines[1] == '{"step": 2, "rollout/reward": 0.75}'  # one object per line, step first
    assert read_metrics(str(tmp_path / METRICS_FILE)) == read_metrics(str(tmp_path))


def test_lines_are_on_disk_after_each_write(tmp_path):
    writer = MetricsWriter(str(tmp_path), tensorboard=False)
    writer.write(0, {"a": 1.0})
    assert read_metrics(str(tmp_path)) == [{"step": 0, "a": 1.0}]  # before close
    writer.close()


def test_resumed_run_file_equals_uninterrupted_run_file(tmp_path):
    def log_steps(writer, steps):
        for step in steps:
            writer.write(step, {"rollout/reward": step / 10, "train/loss": 1 / (step + 1)})

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    with MetricsWriter(str(straight), tensorboard=False) as writer:
        log_steps(writer, range(10))
    with MetricsWriter(str(resumed), tensorboard=False) as writer:
        log_steps(writer, range(7))  # the run got to step 6, its checkpoint is at step 4
    with open(resumed / METRICS_FILE, "a") as f:
        f.write('{"step": 7, "rollout/rew')  # and was killed mid-write
    with MetricsWriter(str(resumed), resume_step=5, tensorboard=False) as writer:
        log_steps(writer, range(5, 10))
    assert (resumed / METRICS_FILE).read_bytes() == (straight / METRICS_FILE).read_bytes()
    assert not [p for p in os.listdir(resumed) if p.startswith(".tmp-")]  # no temp file left


def test_nan_and_inf_become_null_with_one_warning_per_key(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="rl_tpu.metrics"):
        with MetricsWriter(str(tmp_path), tensorboard=False) as writer:
            writer.write(1, {"train/loss": float("nan"), "train/kl": 0.1})
            writer.write(2, {"train/loss": jnp.asarray(jnp.inf), "train/kl": np.float32("-inf")})
    assert read_metrics(str(tmp_path)) == [{"step": 1, "train/loss": None, "train/kl": 0.1},
                                           {"step": 2, "train/loss": None, "train/kl": None}]
    assert "null" in (tmp_path / METRICS_FILE).read_text()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2
    assert "'train/loss' is nan at step 1" in warnings[0]
    assert "'train/kl' is -inf at step 2" in warnings[1]


def test_bad_metrics_are_named(tmp_path):
    with MetricsWriter(str(tmp_path), tensorboard=False) as writer:
        with pytest.raises(TypeError, match=r"metric 'train/adv' at step 3 .* shape \(4,\)"):
            writer.write(3, {"train/adv": np.zeros(4)})
        with pytest.raises(TypeError, match="metric 'note'"):
            writer.write(3, {"note": "text"})
        with pytest.raises(ValueError, match='"step" is the record'):
            writer.write(3, {"step": 1})
    assert not (tmp_path / METRICS_FILE).read_text()  # nothing half-written


def test_damaged_middle_line_is_reported(tmp_path):
    (tmp_path / METRICS_FILE).write_text('{"step": 1, "a": 1}\nnot json\n{"step": 3, "a": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2: .*fix or delete that line"):
        read_metrics(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no metrics file"):
        read_metrics(str(tmp_path / "elsewhere"))


def test_disabled_writer_writes_nothing(tmp_path):
    workdir = tmp_path / "process1"
    writer = MetricsWriter(str(workdir), resume_step=3, enabled=False)
    writer.write(1, {"a": 1.0})
    writer.close()
    assert not workdir.exists()


def test_tensorboard_event_file_holds_the_scalars_and_resume_purges(tmp_path):
    with MetricsWriter(str(tmp_path)) as writer:
        writer.write(1, {"rollout/reward": 0.5, "train/loss": float("nan")})
        writer.write(2, {"rollout/reward": 0.75})
    assert scalars(read_events(str(tmp_path))) == [(1, "rollout/reward", 0.5),
                                                    (2, "rollout/reward", 0.75)]
    with MetricsWriter(str(tmp_path), resume_step=2) as writer:
        writer.write(2, {"rollout/reward": 0.25})
    events = read_events(str(tmp_path))
    # TensorBoard drops the earlier events at steps >= 2 when it meets this START marker.
    purge = [e for e in events if e.HasField("session_log")]
    assert [(e.step, e.session_log.status) for e in purge] == [(2, purge[0].session_log.START)]
    assert (2, "rollout/reward", 0.25) in scalars(events)


def write_curve_records(workdir):
    with MetricsWriter(str(workdir), tensorboard=False) as writer:
        for step in range(60):
            metrics = {"rollout/reward": np.sin(step / 5), "rollout/success": step / 60,
                       "train/loss": 1.0}
            if step % 20 == 0:
                metrics["eval/success"] = step / 100
            writer.write(step, metrics)


def test_plot_curves_draws_one_panel_per_present_key(tmp_path):
    import matplotlib.image

    write_curve_records(tmp_path)
    fig = curves_figure(read_metrics(str(tmp_path)))
    assert [ax.get_title() for ax in fig.axes] == ["rollout/reward", "rollout/success",
                                                   "eval/success"]  # train/entropy absent
    path = plot_curves(str(tmp_path))
    assert path == str(tmp_path / "curves.png")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)
    assert image.shape[:2] == (3 * 240, 800)  # three 2.4-inch panels at 100 dpi, 8 inches wide


def test_plot_curves_with_no_known_key_still_writes_a_png(tmp_path, caplog):
    write_curve_records(tmp_path)
    with caplog.at_level(logging.WARNING, logger="rl_tpu.metrics"):
        path = plot_curves(str(tmp_path), keys=("value/loss",), out_name="value.png")
    assert os.path.getsize(path) > 0 and path.endswith("value.png")
    assert "none of ['value/loss']" in caplog.text


def test_progress_bar_iterates_and_updates_when_disabled():
    # Under pytest stderr is captured (no tty), so the bar is disabled but still works.
    assert list(progress(range(5), "rollout")) == [0, 1, 2, 3, 4]
    assert list(progress([1, 2], "eval", enabled=False)) == [1, 2]
    with progress(3, "update") as bar:
        for _ in range(3):
            bar.update(1)
    assert bar.disable


def test_json_lines_are_strict_json(tmp_path):
    with MetricsWriter(str(tmp_path), tensorboard=False) as writer:
        writer.write(1, {"x": float("inf")})
    for line in (tmp_path / METRICS_FILE).read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


def test_compile_counter_counts_compiles_and_persistent_cache_loads():
    import jax

    from rl_tpu.metrics import CompileCounter

    counter = CompileCounter()
    f = jax.jit(lambda x: x * 3.0 + 0.25)  # a program no other test builds (numpy inputs:
    # a jnp constructor would be a program of its own)
    f(np.ones((3, 7), np.float32))
    first = counter.take()
    assert first["time/compiles"] + first["time/cache_loads"] == 1
    f(np.ones((3, 7), np.float32))  # the same shape: jit's own cache, no build
    assert counter.take() == {"time/compiles": 0.0, "time/cache_loads": 0.0,
                              "time/compile_s": 0.0}
    f(np.ones((4, 7), np.float32))  # a new shape compiles
    assert counter.take()["time/compiles"] == 1
    jax.clear_caches()  # in-memory caches gone: the persistent cache (conftest) serves it
    f(np.ones((4, 7), np.float32))
    loaded = counter.take()
    assert (loaded["time/compiles"], loaded["time/cache_loads"]) == (0.0, 1.0)


def test_eval_curves_carry_their_yardsticks_and_axis_labels():
    records = [{"step": -3, "sft/loss": 2.0},
               {"step": 0, "eval/success": 0.4, "eval/teacher_success": 0.47},
               {"step": 1, "rollout/reward": 0.3},
               {"step": 10, "eval/success": 0.9, "rollout/reward": 0.8}]
    fig = curves_figure(records, ["rollout/reward", "eval/success"])
    reward, success = fig.axes
    assert reward.get_ylabel() == "reward" and success.get_ylabel() == "success"
    assert reward.get_legend() is None  # a per-step curve has no yardstick
    labels = [t.get_text() for t in success.get_legend().get_texts()]
    assert labels == ["eval/success", "teacher 0.470", "SFT warm start 0.400"]
    # without a warm start (no negative steps) the line is the start of RL
    fig = curves_figure(records[1:], ["eval/success"])
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels[-1] == "start of RL 0.400"


def test_a_metrics_line_the_disk_refuses_is_one_error_naming_the_file(tmp_path):
    """The writer's open metrics.jsonl is swapped for /dev/full (dup2 onto its descriptor):
    every write fails with ENOSPC, as on a full disk. The error names the step, the file and
    the cause; closing afterwards is quiet."""
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    writer = MetricsWriter(str(tmp_path), tensorboard=False)
    full = os.open("/dev/full", os.O_WRONLY)
    os.dup2(full, writer._file.fileno())  # pylint: disable=protected-access
    os.close(full)
    with pytest.raises(RunWriteError) as raised:
        writer.write(3, {"rollout/reward": 0.5})
    assert str(raised.value) == (f"cannot write the metrics of step 3 to {tmp_path}/"
                                 f"{METRICS_FILE}: No space left on device; free space there "
                                 "or pick another --workdir")
    writer.close()  # its final flush fails the same way: not raised again


def test_step_log_prints_the_first_and_last_step_and_at_most_one_line_per_interval():
    """A fake clock: steps at t = 0, 1, 5, 6, 7, 11 s of a 10-step run, every_s = 5."""
    out, times = io.StringIO(), iter([0.0, 1.0, 5.0, 6.0, 7.0, 11.0])
    log = StepLog(10, every_s=5.0, shown=False, clock=lambda: next(times), out=out)
    record = {"rollout/reward": 0.25, "train/loss": 0.012345, "time/step_s": 1.5,
              "rollout/success": 1.0}
    printed = [log(step, record) for step in (1, 2, 3, 4, 10)]
    assert printed == ["step 1/10: reward 0.250, loss 0.01235, step 1.50s", None,
                       "step 3/10: reward 0.250, loss 0.01235, step 1.50s", None,
                       "step 10/10: reward 0.250, loss 0.01235, step 1.50s"]
    assert out.getvalue().splitlines() == [p for p in printed if p]
    # an eval's success joins the line; a record without the keys still names the step
    assert log(11, {"eval/success": 0.5}) == "step 11/10: eval success 0.500"
    # where the bar shows progress, or on another process than 0: nothing
    for quiet in (StepLog(10, shown=True, out=out), StepLog(10, enabled=False, out=out)):
        assert quiet(1, record) is None


def test_the_first_line_says_what_runs_where_and_on_what(capsys):
    import jax
    from rl_tpu.metrics import announce_start
    from rl_tpu.recipes.config import base_config

    config = base_config("grpo")
    n, platform = len(jax.devices()), jax.devices()[0].platform
    line = announce_start(config, "/w", 200)
    assert line == (f"rl_tpu: starting rl (grpo on {config.env.name}) in /w: 200 steps, {n} "
                    f"{platform} device{'s' if n != 1 else ''}; building the model and "
                    "compiling...")
    assert capsys.readouterr().out == line + "\n"
    assert announce_start(config, "/w", 5, "SFT steps", what="sft (on x)").startswith(
        "rl_tpu: starting sft (on x) in /w: 5 SFT steps, ")


def _swap_for_dev_full(path_part: str) -> None:
    """Every descriptor of this process open on a path containing path_part now writes to
    /dev/full (ENOSPC on every write), as the file would on a full disk."""
    full = os.open("/dev/full", os.O_WRONLY)
    try:
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if path_part in target:
                os.dup2(full, int(fd))
    finally:
        os.close(full)


@pytest.mark.parametrize("error_in_flight", [False, True], ids=["alone", "beside_an_error"])
def test_a_close_that_meets_a_full_disk_never_hides_the_error_being_raised(tmp_path, caplog,
                                                                           error_in_flight):
    """The warm start's checkpoint meets a full disk; the trainer closes its metrics writer on
    the way out, and TensorBoard's final flush meets the same disk. The user must read the
    checkpoint's one-line error, not the flush's OSError (seen in a full-suite run: exit 1
    and a traceback instead of the one line and exit 2). A close failing on its own still
    raises. The event file's descriptor is swapped for /dev/full after a flush (so
    tensorboardX's thread holds nothing unwritten, and no timing decides which call meets
    the swap): the close's flush then fails there (/dev/full refuses an fsync with EINVAL,
    a write with ENOSPC)."""
    if not os.path.exists("/dev/full") or not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /dev/full and /proc")
    writer = MetricsWriter(str(tmp_path), tensorboard=True)
    writer.write(1, {"rollout/reward": 0.5})
    writer._tb.flush()  # pylint: disable=protected-access - waits for its writer thread
    _swap_for_dev_full("events.out.tfevents")
    checkpoint_error = RunWriteError("checkpoint step 2", str(tmp_path / "checkpoints" / "2"),
                                     OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    if not error_in_flight:
        with pytest.raises(OSError) as raised:
            writer.close()
        assert raised.value.errno in (errno.EINVAL, errno.ENOSPC), raised.value
        assert raised.value is not checkpoint_error
        return
    with caplog.at_level(logging.DEBUG, logger="rl_tpu.metrics"):
        with pytest.raises(RunWriteError) as raised:
            try:
                raise checkpoint_error
            except RunWriteError:
                writer.close()
                raise
    assert raised.value is checkpoint_error
    assert "closing _tb after a failed write" in caplog.text  # the close did fail, quietly
