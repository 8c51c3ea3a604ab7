"""Sweeps of config overrides: expand them into runs, name each run's workdir, run the runs one
after another (or print their commands), skip the finished ones on a rerun, and summarise.

`python -m launch.sweep` (launch/sweep.py) is the command line and checks each run's config
as launch.train would; docs/sweeps.md is the user's guide. This module holds the rest and
needs no config, so its expansion, naming and command tests run in milliseconds.

A sweep is a product of axes. An axis is a list of override dicts, one per value: a grid key
`k=[a, b]` is the axis [{k: a}, {k: b}], a zip block is one axis whose i-th dict holds every
zipped key's i-th value, an explicit list of runs is one axis as given. Every run is one dict
from each axis, merged; the first axis varies slowest (itertools.product's order), so the
runs come out in the order the user wrote the axes.

Values stay the strings the user gave: `--config.k=v` goes to launch.train as written and
ml_collections parses it against the key's type there, exactly as on a launch.train command
line. Only the sweep file's JSON numbers and booleans are turned into strings (json.dumps).
"""

from __future__ import annotations

import csv
import dataclasses
import difflib
import fnmatch
import hashlib
import io
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
import time
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from rl_tpu import metrics as metrics_lib

DONE_FILE = "sweep_done.json"  # in a run's workdir, written only after launch.train exits 0
LOG_FILE = "launch.log"  # a run's stdout and stderr, appended to on every attempt
SWEEP_FILE = "sweep.json"
SUMMARY_MD, SUMMARY_CSV, CURVES_PNG = "summary.md", "summary.csv", "sweep_curves.png"
DEFAULT_SUMMARY_KEYS = ("eval/*", "rollout/reward", "train/entropy")
DEFAULT_PLOT_KEYS = ("eval/success", "rollout/reward", "train/entropy")
LAUNCHER = "launch.train"

Axis = list  # of dict[str, str]: one override dict per value
_NAME_CHARS = re.compile(r"[^A-Za-z0-9._+-]")  # what a name keeps of a key or value
_MAX_NAME = 120  # characters; longer names are cut and get the hash suffix


class SweepError(ValueError):
    """A mistake in the sweep's definition, found before any run starts (one line)."""


@dataclasses.dataclass(frozen=True)
class Run:
    name: str  # its workdir's name under the sweep's workdir
    overrides: tuple[tuple[str, str], ...]  # the swept keys' values, in axis order
    workdir: str
    args: tuple[str, ...]  # launch.train's command line after the interpreter

    @property
    def label(self) -> str:
        """The overrides as the user wrote them (a plot legend, a log line)."""
        return ", ".join(f"{k}={v}" for k, v in self.overrides) or "(no overrides)"

    def command(self, python: str = "python") -> str:
        """One shell line that runs this run (the same on every host of a pod)."""
        return shlex.join([python, *self.args])


# ---------------------------------------------------------------------------------------------
# Parsing the axes
# ---------------------------------------------------------------------------------------------

def _split_key(text: str, flag: str) -> tuple[str, str]:
    key, eq, rest = text.partition("=")
    key = key.strip()
    if not eq or not key or not re.fullmatch(r"[A-Za-z_][\w.]*", key):
        raise SweepError(f"{flag} {text!r}: expected KEY=VALUE with a config key such as "
                         "optim.lr (no --config. prefix)")
    if key.startswith("config."):
        raise SweepError(f"{flag} {text!r}: drop the 'config.' prefix (write {key[7:]}=...)")
    return key, rest


def _as_value(value: Any, where: str) -> str:
    """A sweep file's JSON value as the string launch.train gets: strings verbatim, other
    scalars and lists as JSON (true/false parse as booleans, [1, 2] as a list)."""
    if isinstance(value, str):
        return value
    if value is None or isinstance(value, dict):
        raise SweepError(f"{where}: {json.dumps(value)} is not a value to pass on; write it "
                         "as a string")
    return json.dumps(value)


def _values(key: str, values: Any, where: str) -> list[str]:
    if not isinstance(values, list):
        raise SweepError(f"{where}: {key}'s values must be a list, got {json.dumps(values)}")
    if not values:
        raise SweepError(f"{where}: {key} has an empty list of values; give at least one")
    out = [_as_value(v, f"{where}, {key}") for v in values]
    repeated = sorted({v for v in out if out.count(v) > 1})
    if repeated:
        raise SweepError(f"{where}: {key} lists {', '.join(map(repr, repeated))} more than "
                         "once; two runs would share a workdir")
    return out


def parse_sweep(text: str) -> tuple[str, list[str]]:
    """`--sweep KEY=V1,V2,...` -> (KEY, [V1, V2, ...]). Values that contain a comma: a JSON
    list, `KEY=["a,b", "c"]`. An empty item is refused (an empty string is `KEY=[""]`)."""
    key, rest = _split_key(text, "--sweep")
    if rest.lstrip().startswith("["):
        try:
            values = json.loads(rest)
        except ValueError as e:
            raise SweepError(f"--sweep {text!r}: the values are not a JSON list ({e})") from None
        return key, _values(key, values, f"--sweep {key}")
    items = rest.split(",")
    if any(not item.strip() for item in items):
        raise SweepError(f"--sweep {text!r}: an empty value; write KEY=V1,V2 (a value that "
                         'is an empty string or holds a comma: KEY=["", "a,b"])')
    return key, _values(key, [item.strip() for item in items], f"--sweep {key}")


def parse_set(text: str) -> tuple[str, str]:
    """`--set KEY=VALUE`: one value, taken whole (commas included)."""
    return _split_key(text, "--set")


def grid_axes(pairs: Iterable[tuple[str, list[str]]]) -> list[Axis]:
    """One axis per key: the cartesian product of every key's values."""
    return [[{key: v} for v in values] for key, values in pairs]


def zip_axis(pairs: Sequence[tuple[str, list[str]]], where: str = "--zip") -> Axis:
    """One axis: run i takes each key's i-th value; every list must be as long."""
    lengths = {key: len(values) for key, values in pairs}
    if len(set(lengths.values())) > 1:
        raise SweepError(f"{where}: zipped lists differ in length ("
                         + ", ".join(f"{k}: {n}" for k, n in lengths.items())
                         + "); give each key as many values, or drop --zip for a grid")
    return [dict(zip(lengths, values)) for values in zip(*(v for _, v in pairs))]


def load_sweep_file(path: str) -> tuple[list[Axis], dict[str, str]]:
    """A JSON sweep file -> (axes, fixed overrides). Either a list of runs (override dicts),
    or an object with any of "grid" {key: [values]}, "zip" {key: [values]} (one axis),
    "runs" [{key: value, ...}, ...] (one axis) and "set" {key: value}. docs/sweeps.md."""
    try:
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
    except OSError as e:
        raise SweepError(f"--sweep_file {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise SweepError(f"--sweep_file {path}: not JSON ({e})") from None
    where = f"--sweep_file {path}"
    if isinstance(spec, list):
        spec = {"runs": spec}
    if not isinstance(spec, dict):
        raise SweepError(f"{where}: expected a JSON object or a list of runs")
    unknown = sorted(set(spec) - {"grid", "zip", "runs", "set"})
    if unknown:
        raise SweepError(f"{where}: unknown section(s) {', '.join(unknown)}; use grid, zip, "
                         "runs, set")
    for section in spec:
        if not isinstance(spec[section], dict if section != "runs" else list):
            raise SweepError(f"{where}: \"{section}\" must be "
                             + ("a list of runs" if section == "runs" else "an object"))
    axes = grid_axes((k, _values(k, v, f"{where} grid")) for k, v in spec.get("grid", {}).items())
    if spec.get("zip"):
        axes.append(zip_axis([(k, _values(k, v, f"{where} zip"))
                              for k, v in spec["zip"].items()], f"{where} zip"))
    if "runs" in spec:
        if not spec["runs"]:
            raise SweepError(f"{where}: \"runs\" is an empty list; give at least one run")
        runs = []
        for i, run in enumerate(spec["runs"]):
            if not isinstance(run, dict):
                raise SweepError(f"{where}: run {i} is not an object of overrides")
            runs.append({k: _as_value(v, f"{where} run {i}, {k}") for k, v in run.items()})
        axes.append(runs)
    fixed = {k: _as_value(v, f"{where} set, {k}") for k, v in spec.get("set", {}).items()}
    return axes, fixed


# ---------------------------------------------------------------------------------------------
# Expanding and naming
# ---------------------------------------------------------------------------------------------

def swept_keys(axes: Sequence[Axis]) -> list[str]:
    """Every key some axis sets, in axis order; a key set by two axes is refused (the
    product would set it twice with different values)."""
    keys, owner = [], {}
    for i, axis in enumerate(axes):
        for key in dict.fromkeys(k for run in axis for k in run):
            if key in owner:
                raise SweepError(f"{key} is swept twice (in two --sweep flags or sweep file "
                                 "sections); give all its values in one")
            owner[key] = i
            keys.append(key)
    return keys


def expand(axes: Sequence[Axis]) -> list[dict[str, str]]:
    """The runs' override dicts: one dict from each axis, merged; the first axis slowest."""
    if not axes:
        raise SweepError("nothing to sweep: give --sweep KEY=V1,V2 or --sweep_file FILE")
    swept_keys(axes)
    return [dict(item for part in combo for item in part.items())
            for combo in itertools.product(*axes)]


def run_name(overrides: Mapping[str, str]) -> str:
    """The workdir name of a run: `k1=v1,k2=v2` in the overrides' order, readable and safe on
    any filesystem. A key or value with other characters than letters, digits and `._+-`
    has them replaced by `_`, and then (or when the name is over _MAX_NAME characters) the
    name ends in `@` and a hash of the exact overrides: two runs never share a name, and a
    run's name depends only on its own overrides (so a rerun finds its workdir)."""
    if not overrides:
        return "base"
    parts = [f"{_NAME_CHARS.sub('_', k)}={_NAME_CHARS.sub('_', v)}" for k, v in overrides.items()]
    name = ",".join(parts)
    lossy = any(_NAME_CHARS.search(k) or _NAME_CHARS.search(v) for k, v in overrides.items())
    if lossy or len(name) > _MAX_NAME:
        digest = hashlib.sha1(json.dumps(list(overrides.items())).encode()).hexdigest()[:8]
        name = f"{name[:_MAX_NAME - 9]}@{digest}"
    return name


def plan(config_arg: str, workdir: str, axes: Sequence[Axis],
         fixed: Optional[Mapping[str, str]] = None) -> list[Run]:
    """The sweep's runs, each with its workdir and launch.train command line. `fixed` are the
    --set overrides every run gets (before the swept ones)."""
    runs, fixed = expand(axes), dict(fixed or {})
    both = sorted(set(fixed) & set(swept_keys(axes)))
    if both:
        raise SweepError(f"{', '.join(both)} is both --set and swept; keep one")
    out, seen = [], {}
    for overrides in runs:
        name = run_name(overrides)
        if name in seen:
            raise SweepError(f"two runs with the same overrides ({name}); an explicit run "
                             "list repeats one, or repeats a grid's")
        seen[name] = overrides
        run_dir = os.path.join(workdir, name)
        args = ["-m", LAUNCHER, "--config", config_arg, "--workdir", run_dir]
        args += [f"--config.{k}={v}" for k, v in [*fixed.items(), *overrides.items()]]
        out.append(Run(name, tuple(overrides.items()), run_dir, tuple(args)))
    return out


def check_keys(config, keys: Iterable[str], where: Callable[[str], str] = str) -> None:
    """Every key names a leaf or block of `config` (a ConfigDict), else a SweepError that
    says which flag gave it and the nearest keys there are."""
    paths = list(_paths(config))
    for key in keys:
        if key in paths:
            continue
        leaf = key.rsplit(".", 1)[-1]
        near = [p for p in paths if p.rsplit(".", 1)[-1] == leaf]
        near += [p for p in difflib.get_close_matches(key, paths, n=3) if p not in near]
        hint = f"; did you mean {' or '.join(near[:3])}?" if near else ""
        raise SweepError(f"{where(key)}: no such config key {key!r}{hint}")


def _paths(config, prefix: str = "") -> Iterable[str]:
    for key, value in config.items():
        yield prefix + key
        if hasattr(value, "items") and not isinstance(value, (str, bytes)):
            yield from _paths(value, f"{prefix}{key}.")


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------

def write_plan(workdir: str, config_arg: str, runs: Sequence[Run], python: str) -> str:
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, SWEEP_FILE)
    metrics_lib.atomic_write_text(path, json.dumps({
        "config": config_arg,
        "runs": [{"name": r.name, "overrides": dict(r.overrides), "workdir": r.workdir,
                  "command": r.command(python)} for r in runs]}, indent=1) + "\n")
    return path


def _launch_args(run: Run) -> list[str]:
    """What decides whether a marker is this run's: the command without the workdir (so the
    same sweep given W as a relative or an absolute path still skips its finished runs)."""
    args = list(run.args)
    at = args.index("--workdir")
    return args[:at] + args[at + 2:]


def finished(run: Run) -> Optional[dict]:
    """The run's marker, when it says this very command exited 0; else None."""
    try:
        with open(os.path.join(run.workdir, DONE_FILE), encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    ok = marker.get("returncode") == 0 and marker.get("args") == _launch_args(run)
    return marker if ok else None


def run_all(runs: Sequence[Run], *, python: str = sys.executable, stop_on_failure: bool = False,
            env: Optional[Mapping[str, str]] = None,
            say: Callable[[str], None] = print) -> dict[str, str]:
    """Run each unfinished run's command in a subprocess, one after another; returns each
    run's status: "done", "skipped" (finished earlier), "failed (exit N)" or "not run" (after
    a failure with stop_on_failure). A run that exits 0 gets its marker."""
    status = {}
    for i, run in enumerate(runs, start=1):
        head = f"[{i}/{len(runs)}] {run.name}:"
        if status and stop_on_failure and any(s.startswith("failed") for s in status.values()):
            status[run.name] = "not run"
            continue
        if finished(run):
            say(f"{head} skipped, finished earlier ({os.path.join(run.workdir, DONE_FILE)})")
            status[run.name] = "skipped"
            continue
        os.makedirs(run.workdir, exist_ok=True)
        marker = os.path.join(run.workdir, DONE_FILE)
        if os.path.exists(marker):  # another command's (or a failed) marker: not this run's
            os.remove(marker)
        log = os.path.join(run.workdir, LOG_FILE)
        resumes = os.path.isdir(os.path.join(run.workdir, "checkpoints"))
        say(f"{head} {'resuming' if resumes else 'running'}, output in {log}")
        started = time.time()
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} {run.command(python)}\n")
            f.flush()
            code = subprocess.run([python, *run.args], stdout=f, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, env=env).returncode
        seconds = time.time() - started
        if code == 0:
            _write_marker(run, seconds)
            status[run.name] = "done"
            say(f"{head} done in {seconds:.0f} s")
        else:
            status[run.name] = f"failed (exit {code})"
            say(f"{head} FAILED with exit status {code} after {seconds:.0f} s; the end of "
                f"{log}:\n" + "".join(f"    {line}\n" for line in _tail(log, 5)).rstrip())
    return status


def _write_marker(run: Run, seconds: float) -> None:
    records = _records(run)
    metrics_lib.atomic_write_text(os.path.join(run.workdir, DONE_FILE), json.dumps({
        "name": run.name, "overrides": dict(run.overrides), "args": _launch_args(run),
        "returncode": 0, "seconds": round(seconds, 1),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "final_metrics": metrics_lib.final_values(records)}, indent=1) + "\n")


def _tail(path: str, lines: int) -> list[str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        return [line.rstrip("\n") for line in f.readlines()[-lines:]]


def _records(run: Run) -> list[dict]:
    try:
        return metrics_lib.read_metrics(run.workdir)
    except FileNotFoundError:  # a run that failed before logging anything
        return []
    except ValueError as e:  # a damaged file: the other runs' summary is still worth having
        print(f"warning: {run.name}'s metrics left out of the summary: {e}", file=sys.stderr)
        return []


# ---------------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------------

def summary_keys(records: Iterable[Sequence[Mapping]], patterns: Sequence[str]) -> list[str]:
    """The metric columns: each pattern's keys that some run logged, in pattern order (a glob
    such as eval/* gives its keys sorted), each once."""
    logged = sorted({k for rs in records for r in rs for k in r if k != "step"})
    keys: list[str] = []
    for pattern in patterns:
        keys += [k for k in logged if fnmatch.fnmatchcase(k, pattern) and k not in keys]
    return keys


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table of `rows` (cells as text) in which a column whose cell is the same in
    every row (two rows or more; the run's name and status always stay) is said once above
    the table, `Same in every run: key value, ...`, rather than repeated down a column (a
    smoke sweep's eval/num_tasks, eval/turns...). W/summary.csv keeps every column."""
    kept = [i for i, key in enumerate(header)
            if key in ("run", "status") or len(rows) < 2 or len({r[i] for r in rows}) > 1]
    same = [f"{header[i]} {rows[0][i] or '(none)'}" for i in range(len(header))
            if i not in kept]
    lines = [f"Same in every run: {', '.join(same)}", ""] if same else []
    lines += ["| " + " | ".join(header[i] for i in kept) + " |", "|" + "---|" * len(kept)]
    lines += ["| " + " | ".join(row[i] for i in kept) + " |" for row in rows]
    return "\n".join(lines)


def summarise(workdir: str, runs: Sequence[Run], status: Mapping[str, str],
              patterns: Sequence[str] = DEFAULT_SUMMARY_KEYS,
              plot_keys: Sequence[str] = DEFAULT_PLOT_KEYS) -> str:
    """W/summary.md, W/summary.csv (a row per run: its swept values, status and final
    metrics) and W/sweep_curves.png; returns the markdown table (`markdown_table`: columns
    equal in every row said once above it)."""
    records = {run.name: _records(run) for run in runs}
    keys = summary_keys(records.values(), patterns)
    swept = list(dict.fromkeys(k for run in runs for k, _ in run.overrides))
    header = ["run", *swept, "status", *keys]
    rows = []
    for run in runs:
        values = dict(run.overrides)
        final = metrics_lib.final_values(records[run.name], keys)
        state = status.get(run.name, "not run")
        rows.append([run.name, *(values.get(k, "") for k in swept),
                     "done" if state == "skipped" else state, *(final.get(k) for k in keys)])

    def cell(value) -> str:
        if value is None:
            return ""
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|")

    table = markdown_table(header, [[cell(v) for v in row] for row in rows])
    metrics_lib.atomic_write_text(os.path.join(workdir, SUMMARY_MD), table + "\n")
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(header)
    writer.writerows([["" if v is None else v for v in row] for row in rows])
    metrics_lib.atomic_write_text(os.path.join(workdir, SUMMARY_CSV), text.getvalue())
    figure = metrics_lib.overlay_figure({run.label: records[run.name] for run in runs},
                                        plot_keys)
    metrics_lib.save_figure(figure, os.path.join(workdir, CURVES_PNG))
    return table
