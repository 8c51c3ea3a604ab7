"""Metrics out of a run: a JSONL file (the record), TensorBoard scalars, curves, progress bars.

`<workdir>/metrics.jsonl` holds one JSON object per logged step, `{"step": s, "key": value}`,
values finite numbers or null (NaN and inf are not JSON; they are named in a warning once per
key). It is the source of truth: `read_metrics` and `plot_curves` read it, and after a restart
from a checkpoint `MetricsWriter(workdir, resume_step=s)` first drops the lines of steps >= s,
which the resumed run logs again, so the file ends up as an uninterrupted run's would be.

TensorBoard event files go to `<workdir>/tensorboard/` (tensorboardX); on resume the writer
asks TensorBoard to discard the earlier events at steps >= s (`purge_step`). With a W&B project
(`wandb_project=`, the config's `log.wandb_project`) the same scalars also go to a Weights &
Biases run (rl_tpu/metrics_wandb.py). A line or event that cannot be written (a full disk)
raises RunWriteError, one line naming the file and the cause.

`StepLog` prints a progress line per step (at most one every few seconds) when the output is
not a terminal, where the progress bar is off.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import tempfile
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import jax
import numpy as np

from rl_tpu.metrics_wandb import WandbWriter  # wandb itself is imported when a run asks for it
from rl_tpu.persistence.checkpoint_errors import RunWriteError

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
DEFAULT_CURVES = ("rollout/reward", "rollout/success", "train/entropy", "eval/success",
                  "rollout/violation_rate", "eval/violation_rate")


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------

def _metrics_path(path_or_workdir: Union[str, os.PathLike]) -> str:
    path = os.fspath(path_or_workdir)
    return os.path.join(path, METRICS_FILE) if os.path.isdir(path) else path


def _read_lines(path: str) -> tuple[list[tuple[str, dict]], bool]:
    """(raw line, record) pairs in file order, and whether a cut-short last line was dropped.

    Only the last line may be malformed, and only when no newline follows it: that is a write
    killed mid-way. Anything else is damage that is reported, not skipped.
    """
    with open(path, encoding="utf-8") as f:
        text = f.read()
    lines = text.split("\n")
    out, partial = [], False
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError('not an object with an integer "step"')
        except ValueError as err:
            if number == len(lines):  # no newline after it
                log.warning("%s: dropping the last line, cut short by an interrupted write: %r",
                            path, line[:80])
                partial = True
                continue
            raise ValueError(f"{path}, line {number}: {err}; fix or delete that line") from err
        out.append((line, record))
    return out, partial


def read_metrics(path_or_workdir) -> list[dict]:
    """The records of a metrics.jsonl (given, or in the given workdir), in file order."""
    path = _metrics_path(path_or_workdir)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no metrics file at {path}; give a workdir that a run with "
                                "MetricsWriter logged to, or the path of its metrics.jsonl")
    return [record for _, record in _read_lines(path)[0]]


def last_eval(workdir: str, step: int) -> dict[str, float]:
    """The eval/ metrics of the latest eval at or before `step` in W/metrics.jsonl ({} for a
    fresh run), so a resumed run, even one resumed at its end, reports its last eval."""
    path = os.path.join(workdir, METRICS_FILE)
    if step == 0 or not os.path.exists(path):
        return {}
    evals = [r for r in read_metrics(path) if "eval/success" in r and r["step"] <= step]
    return {k: v for k, v in evals[-1].items() if k.startswith("eval/")} if evals else {}


def atomic_write_text(path: str, text: str) -> None:
    """Write via a temp file in the same directory and os.replace: readers (and a crash) see
    the old file or the new one, never a mix."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".tmp-",
                               suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------

class MetricsWriter:
    """Append `{"step": s, **metrics}` lines to W/metrics.jsonl and scalars to TensorBoard
    (and to W&B with a `wandb_project`).

    enabled=False (every process but process 0 of a multi-host run) writes nothing.
    resume_step=s drops the file's lines of steps >= s first (atomically); None appends.
    """

    def __init__(self, workdir: str, *, resume_step: Optional[int] = None,
                 tensorboard: bool = True, enabled: bool = True, wandb_project: str = "",
                 wandb_config: Optional[Mapping[str, Any]] = None):
        self.workdir = os.fspath(workdir)
        self.path = os.path.join(self.workdir, METRICS_FILE)
        self.enabled = bool(enabled)
        self._file = None
        self._tb = None
        self._wandb = None
        self._failed = False  # a write failed: closing may fail the same way, quietly
        self._warned_nonfinite: set[str] = set()
        if not self.enabled:
            return
        os.makedirs(self.workdir, exist_ok=True)
        self._trim(resume_step)
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
            except ImportError as err:
                raise ImportError("TensorBoard logging needs tensorboardX: `pip install "
                                  "tensorboardX`, or pass tensorboard=False") from err
            self._tb = SummaryWriter(logdir=os.path.join(self.workdir, TENSORBOARD_DIR),
                                     purge_step=resume_step)
        if wandb_project:
            self._wandb = WandbWriter(self.workdir, wandb_project, wandb_config)
        self._file = open(self.path, "a", encoding="utf-8")

    def _trim(self, resume_step: Optional[int]) -> None:
        if not os.path.exists(self.path):
            return
        lines, partial = _read_lines(self.path)
        if resume_step is None:
            if lines:
                log.warning("%s already has %d lines (last step %d); appending. Pass "
                            "resume_step= to drop the steps a resumed run logs again.",
                            self.path, len(lines), lines[-1][1]["step"])
            kept = lines
        else:
            kept = [(line, record) for line, record in lines if record["step"] < resume_step]
            if len(kept) < len(lines):
                log.info("%s: dropping %d lines of steps >= %d, which the resumed run redoes",
                         self.path, len(lines) - len(kept), resume_step)
        if partial or len(kept) < len(lines):
            atomic_write_text(self.path, "".join(line + "\n" for line, _ in kept))

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Log `metrics` (Python/numpy/jax scalars) at `step`; flushed before returning."""
        if not self.enabled:
            return
        if self._file is None:
            raise RuntimeError(f"MetricsWriter({self.workdir!r}) is closed; make a new one")
        if "step" in metrics:
            raise ValueError('"step" is the record\'s own key; rename that metric')
        # One explicit transfer for all device values (allowed under jax_transfer_guard).
        values = jax.device_get(dict(metrics))
        record: dict[str, Any] = {"step": int(step)}
        for key, value in values.items():
            record[key] = self._scalar(key, value, int(step))
        line = json.dumps(record, allow_nan=False) + "\n"
        try:
            self._file.write(line)
            self._file.flush()
        except OSError as err:
            self._failed = True
            raise RunWriteError(f"the metrics of step {step}", self.path, err) from err
        if self._tb is not None:
            try:
                for key, value in record.items():
                    if key != "step" and value is not None:
                        self._tb.add_scalar(key, float(value), int(step))
                self._tb.flush()
            except OSError as err:
                self._failed = True
                raise RunWriteError(f"the TensorBoard events of step {step}",
                                    os.path.join(self.workdir, TENSORBOARD_DIR), err) from err
        if self._wandb is not None:
            self._wandb.write(step, {k: v for k, v in record.items()
                                     if k != "step" and v is not None})

    def _scalar(self, key, value, step: int):
        if not isinstance(key, str):
            raise TypeError(f"metric names must be strings, got {key!r} at step {step}")
        array = np.asarray(value)
        if array.size != 1 or array.dtype.kind not in "biuf":
            raise TypeError(f"metric {key!r} at step {step} is {type(value).__name__} of shape "
                            f"{array.shape} and dtype {array.dtype}; log numeric scalars "
                            "(reduce arrays to a mean/max first)")
        item = array.reshape(()).item()
        if array.dtype.kind == "b":
            return int(item)
        if array.dtype.kind == "f" and not math.isfinite(item):
            if key not in self._warned_nonfinite:
                self._warned_nonfinite.add(key)
                log.warning("metric %r is %s at step %d; written as null (warned once per key)",
                            key, item, step)
            return None
        return item

    def close(self) -> None:
        """Closes the file and the TensorBoard writer. After a failed write (raised already),
        or while another error is on its way out (a checkpoint the full disk refused, closed
        from an `except` or `finally`), their final flushes fail the same way: that is logged
        at DEBUG, not raised over the error the user must read."""
        failed_already = self._failed or sys.exc_info()[1] is not None
        for name in ("_file", "_tb", "_wandb"):
            writer, _ = getattr(self, name), setattr(self, name, None)
            if writer is None:
                continue
            try:
                writer.close()
            except OSError:
                if name == "_tb":  # or its exit hook flushes (and fails) again
                    _abandon_event_files(writer)
                if not failed_already:
                    raise
                log.debug("closing %s after a failed write", name, exc_info=True)

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _abandon_event_files(summary_writer) -> None:
    """tensorboardX's close failed (its flush met a full or failing disk): its logger
    threads are stopped and its event files marked closed, so its exit hook does not flush
    into the same failure again and print a traceback after the run's error."""
    for file_writer in (getattr(summary_writer, "all_writers", None) or {}).values():
        events = getattr(file_writer, "event_writer", None)
        if events is None or getattr(events, "_closed", True):
            continue
        try:
            events._worker.stop()  # pylint: disable=protected-access
        except Exception:  # pylint: disable=broad-except - the thread may have died already
            pass
        events._closed = True  # pylint: disable=protected-access


# ---------------------------------------------------------------------------------------------
# Curves
# ---------------------------------------------------------------------------------------------

_PANEL_INCHES = (8.0, 2.4)  # width, height of one key's panel
_DPI = 100


def _series(records: Sequence[Mapping[str, Any]], key: str) -> np.ndarray:
    """[n, 2] float64 (step, value) of the records that have `key` (null values skipped)."""
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return np.asarray(points, dtype=np.float64).reshape(-1, 2)


def final_values(records: Sequence[Mapping[str, Any]],
                 keys: Optional[Iterable[str]] = None) -> dict[str, Any]:
    """Each key's value in the last record that has it (not null): a run's final metrics, as
    keys are logged at different cadences (eval every few steps, rollout every step). All the
    records' keys but "step" when `keys` is None; a key no record has is left out."""
    out: dict[str, Any] = {}
    for record in records:
        for key, value in record.items():
            if key != "step" and value is not None:
                out[key] = value
    if keys is not None:
        out = {key: out[key] for key in keys if key in out}
    return out


def curves_figure(records: Sequence[Mapping[str, Any]], keys: Iterable[str] = DEFAULT_CURVES):
    """A matplotlib Figure (Agg, no pyplot state) with one panel per key present in records."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    keys = list(keys)
    series = {key: _series(records, key) for key in keys}
    series = {key: xy for key, xy in series.items() if len(xy)}
    panels = max(len(series), 1)
    fig = Figure(figsize=(_PANEL_INCHES[0], _PANEL_INCHES[1] * panels), dpi=_DPI)
    FigureCanvasAgg(fig)
    if not series:
        ax = fig.add_subplot(1, 1, 1)
        ax.text(0.5, 0.5, f"none of {keys} logged yet", ha="center", va="center")
        ax.set_axis_off()
        return fig
    axes = fig.subplots(panels, 1, sharex=True, squeeze=False)[:, 0]
    for ax, (key, xy) in zip(axes, series.items()):
        steps, values = xy[:, 0], xy[:, 1]
        sparse = len(steps) < 50  # eval points: show each one
        ax.plot(steps, values, marker="o" if sparse else None, markersize=3, linewidth=1,
                alpha=1.0 if len(steps) < 20 else 0.35, label=key)
        if len(steps) >= 20:  # noisy per-step curves: a moving average shows the trend
            window = max(2, len(steps) // 25)
            smooth = np.convolve(values, np.ones(window) / window, mode="valid")
            ax.plot(steps[window - 1:], smooth, linewidth=1.8, label=f"mean of {window}")
            ax.legend(loc="best", fontsize="small")
        _reference_lines(ax, records, key, steps, values)
        ax.set_title(key, fontsize="medium")
        ax.set_ylabel(_axis_label(key))
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    return fig


# A run's yardsticks, drawn flat across the panel of the key they compare with: the teacher
# the warm start imitated (logged once at step 0 by a run with a teacher).
REFERENCE_KEYS = {"eval/success": (("eval/teacher_success", "teacher"),)}


def _axis_label(key: str) -> str:
    return key.rsplit("/", 1)[-1].replace("_", " ")


def _reference_lines(ax, records, key: str, steps: np.ndarray, values: np.ndarray) -> None:
    """Horizontal lines a curve is read against: its REFERENCE_KEYS, and for an eval curve
    the policy RL started from (step 0; after the SFT warm start when the run had one, whose
    metrics sit at negative steps)."""
    drawn = False
    for ref_key, label in REFERENCE_KEYS.get(key, ()):
        ref = _series(records, ref_key)
        if len(ref):
            ax.axhline(ref[-1, 1], color="0.35", linestyle="--", linewidth=1,
                       label=f"{label} {ref[-1, 1]:.3f}")
            drawn = True
    if key.startswith("eval/") and len(steps) > 1 and steps[0] == 0:
        warm_started = any(r["step"] < 0 for r in records)
        start = "SFT warm start" if warm_started else "start of RL"
        ax.axhline(values[0], color="C2", linestyle=":", linewidth=1.2,
                   label=f"{start} {values[0]:.3f}")
        drawn = True
    if drawn:
        ax.legend(loc="best", fontsize="small")


def plot_curves(workdir: str, keys: Iterable[str] = DEFAULT_CURVES,
                out_name: str = "curves.png") -> str:
    """Plot `keys` from W/metrics.jsonl (absent keys skipped) to W/out_name; returns the path."""
    records = read_metrics(workdir)
    keys = list(keys)
    if not any(r.get(k) is not None for r in records for k in keys):
        log.warning("none of %s is in %s yet; the plot says so", keys, _metrics_path(workdir))
    return save_figure(curves_figure(records, keys), os.path.join(os.fspath(workdir), out_name))


def overlay_figure(runs: Mapping[str, Sequence[Mapping[str, Any]]], keys: Iterable[str]):
    """A Figure (Agg) comparing runs: one panel per key that some run logged, one line per
    run (`runs` maps a label to its records), x = step, the legend on the right."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    keys = [key for key in keys if any(len(_series(records, key)) for records in runs.values())]
    panels = max(len(keys), 1)
    fig = Figure(figsize=(_PANEL_INCHES[0], _PANEL_INCHES[1] * panels + 0.4), dpi=_DPI,
                 layout="constrained")
    FigureCanvasAgg(fig)
    if not keys:
        ax = fig.add_subplot(1, 1, 1)
        ax.text(0.5, 0.5, "none of the keys logged by any run yet", ha="center", va="center")
        ax.set_axis_off()
        return fig
    axes = fig.subplots(panels, 1, sharex=True, squeeze=False)[:, 0]
    colours = [f"C{i % 10}" for i in range(len(runs))]
    # Past 10 runs the colours repeat; the line style tells the next ten apart.
    styles = [("-", "--", ":", "-.")[(i // 10) % 4] for i in range(len(runs))]
    for ax, key in zip(axes, keys):
        for colour, style, (label, records) in zip(colours, styles, runs.items()):
            xy = _series(records, key)
            if len(xy):
                ax.plot(xy[:, 0], xy[:, 1], color=colour, linestyle=style, linewidth=1.3,
                        marker="o" if len(xy) < 50 else None, markersize=3, label=label)
        ax.set_title(key, fontsize="medium")
        ax.set_ylabel(_axis_label(key))
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("step")
    # One legend for the figure: every run, whichever panels it has lines in.
    handles = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(list(handles.values()), list(handles), loc="outside right upper",
               fontsize="small")
    return fig


def save_figure(fig, path: str) -> str:
    """fig as a png at `path` via a temp file and os.replace, so a notebook or a browser
    reading the png never sees half of one; returns the path."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".tmp-",
                               suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path


# ---------------------------------------------------------------------------------------------
# Progress bars
# ---------------------------------------------------------------------------------------------

def _interactive() -> bool:
    """A terminal, or a notebook kernel (whose stderr is no tty but shows widgets)."""
    try:
        if sys.stderr is not None and sys.stderr.isatty():
            return True
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False
    return "ipykernel" in sys.modules


def progress(iterable_or_total: Union[Iterable, int], desc: str, enabled: bool = True):
    """A tqdm bar over an iterable, or of `total` steps for manual `.update(n)`.

    Disabled (a no-op bar that still iterates, updates and closes) when `enabled` is False or
    output is not interactive, so logs of batch jobs carry no carriage-return clutter, or
    when TQDM_DISABLE is set (tqdm's own switch, which an explicit `disable=` would override).
    """
    from tqdm.auto import tqdm

    disable = not (enabled and _interactive()) or bool(os.environ.get("TQDM_DISABLE"))
    if isinstance(iterable_or_total, (int, np.integer)):
        return tqdm(total=int(iterable_or_total), desc=desc, disable=disable, dynamic_ncols=True)
    return tqdm(iterable_or_total, desc=desc, disable=disable, dynamic_ncols=True)


def progress_bar_shown(enabled: bool = True) -> bool:
    """Whether `progress(..., enabled=enabled)` shows a bar (else it is a silent no-op)."""
    return enabled and _interactive() and not os.environ.get("TQDM_DISABLE")


def announce_start(config, workdir: str, steps: int, unit: str = "steps",
                   what: str = "") -> Optional[str]:
    """The run's first line, printed (process 0) as soon as the recipe starts, before the
    model is built and the first step compiles (which take the longest): what runs (`what`,
    else the config's recipe, algorithm and env), where, for how long and on what."""
    if jax.process_index() != 0:
        return None
    devices = jax.devices()
    what = what or f"{config.recipe} ({config.algo.name} on {config.env.name})"
    line = (f"rl_tpu: starting {what} in "
            f"{workdir}: {steps} {unit}, {len(devices)} {devices[0].platform} device"
            f"{'s' if len(devices) != 1 else ''}; building the model and compiling...")
    print(line, flush=True)
    return line


# What a step's progress line shows, in this order, when the record has it: (key, label,
# format). The step time is the whole step's; eval success only at an eval.
STEP_LINE_KEYS = (("rollout/reward", "reward", "{:.3f}"), ("train/loss", "loss", "{:.4g}"),
                  ("sft/loss", "loss", "{:.4g}"), ("eval/success", "eval success", "{:.3f}"),
                  ("time/step_s", "step", "{:.2f}s"))


class StepLog:
    """A progress line per step for a log file, where the progress bar is off (stdout or
    stderr not a terminal): `step 3/10: reward 0.250, loss 0.0123, step 1.52s`. The first
    and the last step always; between them at most one line every `every_s` seconds, so a run
    of fast steps writes a line every few seconds, not thousands. Prints nothing where the bar
    shows progress (`shown=None`: decided as `progress` decides) or when not `enabled`."""

    def __init__(self, total: int, *, every_s: float = 5.0, enabled: bool = True,
                 shown: Optional[bool] = None, clock=None, out=None, what: str = "step"):
        import time

        self.total, self.every_s, self.what = int(total), float(every_s), what
        self.active = enabled and not (progress_bar_shown(enabled) if shown is None else shown)
        self._clock = clock or time.monotonic
        self._out = out
        self._last: Optional[float] = None  # when the last line was printed

    def __call__(self, step: int, record: Mapping[str, Any]) -> Optional[str]:
        """Prints (and returns) step `step`'s line when one is due, else returns None."""
        if not self.active:
            return None
        now = self._clock()
        due = (self._last is None or step >= self.total
               or now - self._last >= self.every_s)
        if not due:
            return None
        self._last = now
        shown, parts = set(), []
        for key, label, fmt in STEP_LINE_KEYS:
            value = record.get(key)
            if value is not None and label not in shown:
                shown.add(label)
                parts.append(f"{label} {fmt.format(float(value))}")
        line = f"{self.what} {step}/{self.total}" + (": " + ", ".join(parts) if parts else "")
        print(line, file=self._out or sys.stdout, flush=True)
        return line


# ---------------------------------------------------------------------------------------------
# Compiles
# ---------------------------------------------------------------------------------------------

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # a build, compiled or loaded
_CACHE_HIT = "/jax/compilation_cache/cache_hits"  # ... loaded from the persistent cache


class CompileCounter:
    """XLA programs built in this process since the last `take()`, from jax.monitoring's
    events: `time/compiles` (compiled), `time/cache_loads` (taken from the persistent
    compilation cache instead) and `time/compile_s` (the seconds both took). A run whose
    shapes are all known at start compiles in its first steps and never again: a compile in
    step 200 is a new shape (a length bucket, a batch size) worth finding."""

    _counts = {"builds": 0, "hits": 0, "seconds": 0.0}
    _installed = False

    def __init__(self):
        if not CompileCounter._installed:
            jax.monitoring.register_event_duration_secs_listener(CompileCounter._on_duration)
            jax.monitoring.register_event_listener(CompileCounter._on_event)
            CompileCounter._installed = True
        self._last = dict(self._counts)

    @staticmethod
    def _on_duration(event: str, duration: float, **_):
        if event == _BACKEND_COMPILE:
            CompileCounter._counts["builds"] += 1
            CompileCounter._counts["seconds"] += duration

    @staticmethod
    def _on_event(event: str, **_):
        if event == _CACHE_HIT:
            CompileCounter._counts["hits"] += 1

    def take(self) -> dict[str, float]:
        now = dict(self._counts)
        delta = {k: now[k] - self._last[k] for k in now}
        self._last = now
        return {"time/compiles": float(delta["builds"] - delta["hits"]),
                "time/cache_loads": float(delta["hits"]), "time/compile_s": delta["seconds"]}
