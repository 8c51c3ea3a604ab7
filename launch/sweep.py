"""Sweeps: `python -m launch.sweep --config configs/X.py[:variant] --sweep k=v1,v2 --workdir W`.

Runs launch.train once per combination of the swept config overrides, one run after another,
each in a fresh process in its own workdir W/<k=v,...> (its output in W/<name>/launch.log);
then writes W/summary.md, W/summary.csv (each run's final metrics) and W/sweep_curves.png.

    python -m launch.sweep --config configs/quickstart.py:smoke --workdir /tmp/sweep \\
        --sweep optim.lr=1e-5,2e-5 --sweep seed=0,1 --set train.steps=1

`--sweep` flags form a grid (every combination), or with `--zip` run i takes each list's i-th
value; `--sweep_file F.json` gives grid, zip, explicit runs and fixed overrides in a file;
`--set k=v` applies to every run. `--print` prints one shell command per run and runs
nothing (for a cluster's job runner). Rerunning the same sweep skips the runs that finished
(W/<name>/sweep_done.json) and resumes the others from their last checkpoint. Every run's
config is built and checked before the first one starts; a mistake in the sweep stops it
with one line on stderr and exit status 2. The exit status is 1 when a run failed.
docs/sweeps.md has the details.
"""

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

import launch
from rl_tpu import sweep

flags.DEFINE_string("config", None, "Experiment config file (configs/X.py[:variant]).")
flags.DEFINE_string("workdir", None, "The sweep's directory: one workdir per run in it, and "
                    "sweep.json, summary.md, summary.csv, sweep_curves.png.")
flags.DEFINE_multi_string("sweep", [], "KEY=V1,V2,...: a config key and its values (repeat "
                          "for more keys); values with commas: KEY='[\"a,b\", \"c\"]' (JSON).")
flags.DEFINE_bool("zip", False, "Zip the --sweep lists (run i takes the i-th value of each; "
                  "equal lengths) instead of taking every combination.")
flags.DEFINE_string("sweep_file", "", "A JSON sweep file: {\"grid\": {...}, \"zip\": {...}, "
                    "\"runs\": [...], \"set\": {...}} or a list of runs (docs/sweeps.md).")
flags.DEFINE_multi_string("set", [], "KEY=VALUE applied to every run (the value taken whole, "
                          "commas included).")
flags.DEFINE_bool("print", False, "Print one shell command per run, one a line, and run "
                  "nothing.")
flags.DEFINE_string("python", "python", "The interpreter in the --print commands.")
flags.DEFINE_bool("stop_on_failure", False, "Stop at the first failed run (by default the "
                  "others still run).")
flags.DEFINE_list("summary_keys", list(sweep.DEFAULT_SUMMARY_KEYS),
                  "Metrics in the summary (globs allowed); each run's last logged value.")
flags.DEFINE_list("plot_keys", list(sweep.DEFAULT_PLOT_KEYS),
                  "Metrics in sweep_curves.png, one panel each (the ones logged).")
flags.mark_flags_as_required(["config", "workdir"])
FLAGS = flags.FLAGS


def plan_runs(argv) -> list:
    """The runs the flags ask for, each config built and checked as launch.train will; a
    mistake raises (one line: launch.one_line_errors)."""
    if len(argv) > 1:
        raise sweep.SweepError(f"unexpected arguments {argv[1:]}: quote a --sweep or --set "
                               "whose values hold spaces")
    pairs = [sweep.parse_sweep(text) for text in FLAGS.sweep]
    axes = [sweep.zip_axis(pairs)] if FLAGS.zip and pairs else sweep.grid_axes(pairs)
    fixed = {}
    if FLAGS.sweep_file:
        file_axes, fixed = sweep.load_sweep_file(FLAGS.sweep_file)
        axes += file_axes
    for key, value in map(sweep.parse_set, FLAGS.set):
        fixed[key] = value
    runs = sweep.plan(FLAGS.config, FLAGS.workdir, axes, fixed)

    path = FLAGS.config.split(":", 1)[0]
    if not os.path.isfile(path):  # ml_collections' own message for it is a paragraph
        raise sweep.SweepError(f"--config={path}: no such config file")
    # The config file once, for the keys: a mistyped one is named with its nearest keys.
    config = _parse(FLAGS.config, {})["config"].value
    given = {k: "--set" for k in fixed} | {k: "--sweep" for k in sweep.swept_keys(axes)}
    sweep.check_keys(config, given, where=lambda key: f"{given[key]} {key}")
    # Then each run's config with its overrides, as launch.train builds and checks it: a value
    # of the wrong type or a failed cross-key check stops the sweep before any run starts.
    verbosity = logging.get_verbosity()
    logging.set_verbosity(logging.ERROR)  # finish_config's notes, once per run, are noise here
    try:
        for run in runs:
            try:
                launch.finish_config(_parse(FLAGS.config, {**fixed, **dict(run.overrides)}))
            except launch.START_ERRORS as e:
                raise sweep.SweepError(f"run {run.name}: {launch.error_message(e)}") from e
    finally:
        logging.set_verbosity(verbosity)
    return runs


def _parse(config_arg: str, overrides: dict) -> flags.FlagValues:
    """A fresh flag set holding launch.train's --config and the overrides, parsed."""
    argv = ["launch.train", "--config", config_arg,
            *(f"--config.{k}={v}" for k, v in overrides.items())]
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=flag_values,
                                    sys_argv=argv, lock_config=True)
    flag_values(argv)
    return flag_values


def main(argv):
    runs = launch.one_line_errors(launch.START_ERRORS, plan_runs, argv)
    if FLAGS.print:
        for run in runs:
            print(run.command(FLAGS.python))
        return
    sweep.write_plan(FLAGS.workdir, FLAGS.config, runs, sys.executable)
    status = sweep.run_all(runs, stop_on_failure=FLAGS.stop_on_failure)
    table = sweep.summarise(FLAGS.workdir, runs, status, FLAGS.summary_keys, FLAGS.plot_keys)
    print(f"\n{table}\n\nwrote {FLAGS.workdir}/{{{sweep.SUMMARY_MD}, {sweep.SUMMARY_CSV}, "
          f"{sweep.CURVES_PNG}}}")
    failed = [name for name, state in status.items() if state.startswith("failed")]
    if failed:
        print(f"{len(failed)} of {len(runs)} runs failed: {', '.join(failed)} (each one's "
              f"output is in its {sweep.LOG_FILE})", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    launch.define_list_variants_flag()

    def parse(argv):
        launch.list_variants_if_asked(argv)
        return FLAGS(argv)

    app.run(main, flags_parser=lambda argv: launch.one_line_errors(
        launch.START_ERRORS, parse, argv))
