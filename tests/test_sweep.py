"""launch.sweep and rl_tpu.sweep: expansion, names, commands, up-front errors, skip / rerun,
the summary; one slow test runs a real 2 x 2 sweep of the quickstart smoke and reruns it."""

import csv
import json
import os
import re
import subprocess
import sys

import ml_collections
import pytest

from rl_tpu import sweep
from rl_tpu.recipes import rl
from rl_tpu.sweep import Run, SweepError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = "configs/quickstart.py:smoke"


def launch_sweep(*args, timeout=120, wait=True):
    """`python -m launch.sweep` as a user runs it: one CPU device (test_rl.py's convention),
    the suite's compilation cache (inherited)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.Popen([sys.executable, "-m", "launch.sweep", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if not wait:
        return proc
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# ----------------------------------------------------------------------------- expansion


def test_sweep_values_split_on_commas_or_come_as_a_json_list():
    assert sweep.parse_sweep("optim.lr=1e-4, 3e-4") == ("optim.lr", ["1e-4", "3e-4"])
    assert sweep.parse_sweep('model.path=["/a,b", ""]') == ("model.path", ["/a,b", ""])
    assert sweep.parse_sweep("train.length_buckets=[[64, 128], [96]]") == (
        "train.length_buckets", ["[64, 128]", "[96]"])
    assert sweep.parse_sweep("algo.dynamic_sampling=[true, false]")[1] == ["true", "false"]
    assert sweep.parse_set("model.path=/a,b") == ("model.path", "/a,b")  # one value, whole


@pytest.mark.parametrize("text,named", [
    ("optim.lr", "expected KEY=VALUE"),
    ("=1,2", "expected KEY=VALUE"),
    ("optim.lr=", "an empty value"),
    ("optim.lr=1,,2", "an empty value"),
    ("optim.lr=[1, 2", "not a JSON list"),
    ("optim.lr=[]", "empty list"),
    ("seed=1,2,1", "'1' more than once"),
    ("config.seed=1", "drop the 'config.' prefix"),
])
def test_a_malformed_sweep_is_refused_naming_it(text, named):
    with pytest.raises(SweepError, match=named.replace("[", r"\[")):
        sweep.parse_sweep(text)


def test_grid_is_every_combination_first_axis_slowest():
    axes = sweep.grid_axes([("optim.lr", ["1e-4", "3e-4"]), ("algo.name", ["grpo", "bapo", "ppo"])])
    runs = sweep.expand(axes)
    assert len(runs) == 6
    assert runs[:4] == [{"optim.lr": "1e-4", "algo.name": "grpo"},
                        {"optim.lr": "1e-4", "algo.name": "bapo"},
                        {"optim.lr": "1e-4", "algo.name": "ppo"},
                        {"optim.lr": "3e-4", "algo.name": "grpo"}]


def test_zip_takes_the_ith_value_of_each_list():
    axis = sweep.zip_axis([("optim.lr", ["1e-4", "3e-4"]), ("seed", ["0", "1"])])
    assert sweep.expand([axis]) == [{"optim.lr": "1e-4", "seed": "0"},
                                    {"optim.lr": "3e-4", "seed": "1"}]
    with pytest.raises(SweepError, match="differ in length .optim.lr: 2, seed: 3"):
        sweep.zip_axis([("optim.lr", ["1e-4", "3e-4"]), ("seed", ["0", "1", "2"])])


def test_nothing_to_sweep_and_a_key_swept_twice_are_refused():
    with pytest.raises(SweepError, match="nothing to sweep"):
        sweep.expand([])
    with pytest.raises(SweepError, match="seed is swept twice"):
        sweep.expand(sweep.grid_axes([("seed", ["0"]), ("seed", ["1"])]))


def test_sweep_file_combines_grid_zip_runs_and_set(tmp_path):
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({
        "grid": {"optim.lr": [1e-4, "3e-4"]},
        "zip": {"algo.name": ["grpo", "bapo"], "algo.clip_high": ["0.2", "0.28"]},
        "runs": [{"seed": 0}, {"seed": 1, "algo.dynamic_sampling": True}],
        "set": {"train.steps": 4, "model.path": "/m,1"}}))
    axes, fixed = sweep.load_sweep_file(str(path))
    runs = sweep.expand(axes)
    assert len(runs) == 2 * 2 * 2
    assert runs[0] == {"optim.lr": "0.0001", "algo.name": "grpo", "algo.clip_high": "0.2",
                       "seed": "0"}
    assert runs[-1] == {"optim.lr": "3e-4", "algo.name": "bapo", "algo.clip_high": "0.28",
                        "seed": "1", "algo.dynamic_sampling": "true"}
    assert fixed == {"train.steps": "4", "model.path": "/m,1"}
    path.write_text(json.dumps([{"seed": "0"}, {"seed": "1"}]))  # a bare list of runs
    assert sweep.expand(sweep.load_sweep_file(str(path))[0]) == [{"seed": "0"}, {"seed": "1"}]


@pytest.mark.parametrize("content,named", [
    ('{"grid": {"seed": []}}', "empty list"),
    ('{"grid": {"seed": "0,1"}}', "must be a list"),
    ('{"zip": {"seed": [0, 1], "optim.lr": [1]}}', "differ in length"),
    ('{"grd": {"seed": [0]}}', "unknown section.* grd"),
    ('{"runs": []}', "empty list"),
    ('{"runs": [{"seed": null}]}', "write it as a string"),
    ('{"grid": {"seed": [0]', "not JSON"),
])
def test_a_bad_sweep_file_is_refused_naming_it(tmp_path, content, named):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(SweepError, match=named):
        sweep.load_sweep_file(str(path))
    with pytest.raises(SweepError, match="No such file"):
        sweep.load_sweep_file(str(tmp_path / "missing.json"))


# ----------------------------------------------------------------------------- names, commands


def test_names_are_the_overrides_readable_and_filesystem_safe():
    assert sweep.run_name({"optim.lr": "1e-4", "algo.name": "grpo"}) == (
        "optim.lr=1e-4,algo.name=grpo")
    assert sweep.run_name({}) == "base"
    odd = sweep.run_name({"model.path": "/ckpt/a b", "seed": "0"})
    assert odd.startswith("model.path=_ckpt_a_b,seed=0@") and "/" not in odd
    # Lossy names carry a hash of the exact overrides: never the same name for two runs.
    assert odd != sweep.run_name({"model.path": "/ckpt/a_b", "seed": "0"})
    assert odd == sweep.run_name({"model.path": "/ckpt/a b", "seed": "0"})  # stable
    long = sweep.run_name({f"k{i}": "v" * 20 for i in range(10)})
    assert len(long) <= 120 and "@" in long


def test_plan_gives_each_run_its_workdir_and_command():
    axes = sweep.grid_axes([("optim.lr", ["1e-4", "3e-4"]), ("seed", ["0"])])
    runs = sweep.plan(SMOKE, "/w", axes, {"train.steps": "4"})
    assert [r.name for r in runs] == ["optim.lr=1e-4,seed=0", "optim.lr=3e-4,seed=0"]
    assert runs[0].workdir == "/w/optim.lr=1e-4,seed=0"
    assert runs[0].command() == (
        f"python -m launch.train --config {SMOKE} --workdir /w/optim.lr=1e-4,seed=0 "
        "--config.train.steps=4 --config.optim.lr=1e-4 --config.seed=0")
    assert runs[1].label == "optim.lr=3e-4, seed=0"
    with pytest.raises(SweepError, match="seed is both --set and swept"):
        sweep.plan(SMOKE, "/w", axes, {"seed": "1"})
    with pytest.raises(SweepError, match="two runs with the same overrides"):
        sweep.plan(SMOKE, "/w", [[{"seed": "0"}, {"seed": "0"}]])


def test_an_unknown_key_names_the_flag_and_the_nearest_keys():
    c = ml_collections.ConfigDict({"seed": 0, "optim": {"lr": 1e-4}, "sft": {"lr": 1e-3}})
    sweep.check_keys(c, ["seed", "optim.lr", "optim"])
    with pytest.raises(SweepError, match=r"--sweep algo.lr: no such config key 'algo.lr'; "
                                         r"did you mean optim.lr or sft.lr\?"):
        sweep.check_keys(c, ["algo.lr"], where=lambda key: f"--sweep {key}")


# ----------------------------------------------------------------------------- running


def fake_run(tmp_path, name, exit_code=0, reward=0.5):
    """A Run whose command is a short Python script in place of launch.train: it logs two
    metrics records to its workdir and exits with exit_code."""
    workdir = str(tmp_path / name)
    script = ("import json, os, sys; w = sys.argv[-1]; print('trained', w); "
              "f = open(os.path.join(w, 'metrics.jsonl'), 'a'); "
              f"f.write(json.dumps({{'step': 0, 'eval/success': 0.25}}) + '\\n'); "
              f"f.write(json.dumps({{'step': 1, 'rollout/reward': {reward}}}) + '\\n'); "
              f"sys.exit({exit_code})")
    return Run(name, (("seed", name[-1]),), workdir, ("-c", script, "--workdir", workdir))


def attempts(run):
    """How many times the run's command started (one header line in launch.log each)."""
    with open(os.path.join(run.workdir, sweep.LOG_FILE)) as f:
        return sum(line.startswith("# ") for line in f)


def test_finished_runs_are_skipped_failed_ones_reported_and_rerun(tmp_path):
    runs = [fake_run(tmp_path, "seed=0"), fake_run(tmp_path, "seed=1", exit_code=3),
            fake_run(tmp_path, "seed=2")]
    said = []
    status = sweep.run_all(runs, say=said.append)
    assert status == {"seed=0": "done", "seed=1": "failed (exit 3)", "seed=2": "done"}
    assert "FAILED with exit status 3" in said[3] and "trained" in said[3]  # the log's tail
    marker = json.load(open(os.path.join(runs[0].workdir, sweep.DONE_FILE)))
    assert marker["returncode"] == 0 and marker["final_metrics"] == {
        "eval/success": 0.25, "rollout/reward": 0.5}
    assert not os.path.exists(os.path.join(runs[1].workdir, sweep.DONE_FILE))

    said.clear()
    status = sweep.run_all(runs, say=said.append)  # the rerun: only the failed run starts
    assert status["seed=0"] == status["seed=2"] == "skipped"
    assert [attempts(r) for r in runs] == [1, 2, 1]
    assert sum("skipped, finished earlier" in line for line in said) == 2

    # A marker of another command (the sweep's --set changed) does not count as finished.
    changed = Run(runs[0].name, runs[0].overrides, runs[0].workdir,
                  runs[0].args[:2] + ("--config.train.steps=8",) + runs[0].args[2:])
    assert sweep.run_all([changed], say=said.append) == {"seed=0": "done"}
    assert attempts(changed) == 2


def test_stop_on_failure_leaves_the_rest_not_run(tmp_path):
    runs = [fake_run(tmp_path, "seed=0", exit_code=1), fake_run(tmp_path, "seed=1")]
    status = sweep.run_all(runs, stop_on_failure=True, say=lambda _: None)
    assert status == {"seed=0": "failed (exit 1)", "seed=1": "not run"}
    assert not os.path.exists(runs[1].workdir)


def test_summary_table_csv_and_curves(tmp_path):
    runs = [fake_run(tmp_path, "seed=0", reward=0.5), fake_run(tmp_path, "seed=1", reward=0.75),
            fake_run(tmp_path, "seed=2")]
    status = sweep.run_all(runs[:2], say=lambda _: None)
    table = sweep.summarise(str(tmp_path), runs, status)
    assert table.splitlines() == [
        "| run | seed | status | eval/success | rollout/reward |",
        "|---|---|---|---|---|",
        "| seed=0 | 0 | done | 0.25 | 0.5 |",
        "| seed=1 | 1 | done | 0.25 | 0.75 |",
        "| seed=2 | 2 | not run |  |  |"]
    assert (tmp_path / sweep.SUMMARY_MD).read_text() == table + "\n"
    rows = list(csv.reader(open(tmp_path / sweep.SUMMARY_CSV)))
    assert rows[0] == ["run", "seed", "status", "eval/success", "rollout/reward"]
    assert rows[2] == ["seed=1", "1", "done", "0.25", "0.75"] and rows[3][2:] == ["not run", "", ""]
    assert (tmp_path / sweep.CURVES_PNG).read_bytes()[:4] == b"\x89PNG"
    chosen = sweep.summarise(str(tmp_path), runs, status, patterns=["rollout/*"])
    assert chosen.splitlines()[0] == "| run | seed | status | rollout/reward |"


def test_a_column_equal_in_every_row_is_said_once_above_the_table(tmp_path):
    runs = [fake_run(tmp_path, "seed=0", reward=0.5), fake_run(tmp_path, "seed=1", reward=0.75)]
    status = sweep.run_all(runs, say=lambda _: None)
    table = sweep.summarise(str(tmp_path), runs, status)
    # eval/success is 0.25 in both: said once; run and status stay, however alike
    assert table.splitlines() == [
        "Same in every run: eval/success 0.25",
        "",
        "| run | seed | status | rollout/reward |",
        "|---|---|---|---|",
        "| seed=0 | 0 | done | 0.5 |",
        "| seed=1 | 1 | done | 0.75 |"]
    assert (tmp_path / sweep.SUMMARY_MD).read_text() == table + "\n"
    rows = list(csv.reader(open(tmp_path / sweep.SUMMARY_CSV)))  # every column, as before
    assert rows[0] == ["run", "seed", "status", "eval/success", "rollout/reward"]
    # one run: nothing to compare, every column stays
    one = sweep.summarise(str(tmp_path), runs[:1], status)
    assert one.splitlines()[0] == "| run | seed | status | eval/success | rollout/reward |"


# ----------------------------------------------------------------------------- the launcher

# Command lines run together, once for the module (each pays JAX's and the config's import):
# (arguments, the exit status, what the output must hold).
LAUNCHER_CASES = {
    "print": (["--sweep", "optim.lr=1e-5,2e-5", "--sweep", "seed=0,1", "--set", "train.steps=1",
               "--print"], 0, []),
    "print_zip": (["--sweep", "optim.lr=1e-5,2e-5", "--sweep", "seed=0,1", "--zip", "--print",
                   "--python", "python3"], 0, []),
    "unknown_key": (["--sweep", "algo.lr=1e-4,3e-4"], 2, ["--sweep algo.lr", "optim.lr"]),
    "unknown_set_key": (["--sweep", "seed=0,1", "--set", "train.stesp=1"], 2,
                        ["--set train.stesp", "train.steps"]),
    "unequal_zip": (["--sweep", "seed=0,1", "--sweep", "optim.lr=1e-4", "--zip"], 2,
                    ["differ in length", "seed: 2, optim.lr: 1"]),
    "wrong_type": (["--sweep", "seed=0,abc"], 2, ["run seed=abc", "--config.seed=abc"]),
    "failed_check": (["--sweep", "train.steps=1,0", "--set", "sft.steps=0"], 2,
                     ["run train.steps=0", "nothing would be trained"]),
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    root = tmp_path_factory.mktemp("launcher")
    procs = {name: launch_sweep("--config", SMOKE, "--workdir", str(root / name), *args,
                                wait=False) for name, (args, _, _) in LAUNCHER_CASES.items()}
    return {name: (root / name, *proc.communicate(timeout=300), proc.returncode)
            for name, proc in procs.items()}


# The fixture's readers on one xdist worker (--dist loadgroup): its processes start once.
@pytest.mark.slow  # the sweep launcher as subprocesses
@pytest.mark.xdist_group("sweep_launcher")
def test_print_gives_one_command_per_run_and_runs_nothing(launched):
    workdir, out, err, code = launched["print"]
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 4
    assert lines[1] == (f"python -m launch.train --config {SMOKE} --workdir {workdir}/"
                        "optim.lr=1e-5,seed=1 --config.train.steps=1 --config.optim.lr=1e-5 "
                        "--config.seed=1")
    assert not os.path.exists(workdir)
    workdir, out, err, code = launched["print_zip"]
    assert code == 0, err
    assert [line.split()[:1] + line.split()[6:7] for line in out.splitlines()] == [
        ["python3", f"{workdir}/optim.lr=1e-5,seed=0"],
        ["python3", f"{workdir}/optim.lr=2e-5,seed=1"]]


@pytest.mark.slow  # the sweep launcher as subprocesses
@pytest.mark.xdist_group("sweep_launcher")
@pytest.mark.parametrize("name", [n for n, case in LAUNCHER_CASES.items() if case[1] == 2])
def test_a_sweep_mistake_is_one_line_exit_2_before_any_run(launched, name):
    workdir, out, err, code = launched[name]
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for named in LAUNCHER_CASES[name][2]:
        assert named in lines[0]
    assert not os.path.exists(workdir) and not out


def test_python_m_launch_lists_the_sweep(capsys):
    from launch import __main__ as entry_points

    entry_points.main()
    assert re.search(r"^  sweep +Sweeps: `python -m launch.sweep ", capsys.readouterr().out,
                     re.MULTILINE)


@pytest.mark.slow
def test_a_2x2_smoke_sweep_runs_summarises_and_a_rerun_skips_or_resumes(tmp_path):
    """4 tiny training runs, a rerun that starts none, and one that resumes the run whose
    marker was deleted: 5 launch.train processes in all."""
    args = ["--config", SMOKE, "--workdir", str(tmp_path), "--sweep", "optim.lr=1e-5,2e-5",
            "--sweep", "seed=0,1", "--set", "train.steps=1", "--set", "sft.steps=0"]
    first = launch_sweep(*args, timeout=1200)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    names = ["optim.lr=1e-5,seed=0", "optim.lr=1e-5,seed=1", "optim.lr=2e-5,seed=0",
             "optim.lr=2e-5,seed=1"]
    plan = json.load(open(tmp_path / sweep.SWEEP_FILE))
    assert [r["name"] for r in plan["runs"]] == names
    assert plan["runs"][3]["overrides"] == {"optim.lr": "2e-5", "seed": "1"}
    for name in names:
        marker = json.load(open(tmp_path / name / sweep.DONE_FILE))
        assert marker["returncode"] == 0 and "eval/success" in marker["final_metrics"]
        assert os.path.isfile(tmp_path / name / "metrics.jsonl")
    table = (tmp_path / sweep.SUMMARY_MD).read_text().splitlines()
    # metrics equal in every run (a smoke's eval/num_tasks...) are said once above the table
    same = table[0] if table[0].startswith("Same in every run: ") else ""
    table = table[2:] if same else table
    assert table[0].startswith("| run | optim.lr | seed | status | ")
    assert "eval/num_tasks 16" in same and "eval/num_tasks" not in table[0]
    for key in ("eval/success", "rollout/reward", "train/entropy"):
        assert (f" {key} |" in table[0]) != (f"{key} " in same), (key, same, table[0])
    assert [row.split(" | ")[:4] for row in table[2:]] == [
        [f"| {n}", n.split(",")[0].split("=")[1], n[-1], "done"] for n in names]
    rows = list(csv.DictReader(open(tmp_path / sweep.SUMMARY_CSV)))
    assert [r["run"] for r in rows] == names and all(r["eval/success"] != "" for r in rows)
    assert (tmp_path / sweep.CURVES_PNG).stat().st_size > 10_000
    assert table[0] in first.stdout  # the table is printed too

    again = launch_sweep(*args, timeout=300)  # everything finished: no run starts
    assert again.returncode == 0, again.stderr[-3000:]
    assert sum("skipped, finished earlier" in line for line in again.stdout.splitlines()) == 4
    for name in names:
        log = (tmp_path / name / sweep.LOG_FILE).read_text()
        assert sum(line.startswith("# ") for line in log.splitlines()) == 1

    # As if killed after its last checkpoint, before launch.train had finished (no
    # W/finished.json) and so before the sweep's marker: the rerun resumes it.
    os.remove(tmp_path / names[2] / sweep.DONE_FILE)
    os.remove(tmp_path / names[2] / rl.FINISHED_FILE)
    resumed = launch_sweep(*args, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"{names[2]}: resuming" in resumed.stdout
    assert sum("skipped" in line for line in resumed.stdout.splitlines()) == 3
    log = (tmp_path / names[2] / sweep.LOG_FILE).read_text()
    assert "resumed from step 1" in log
    assert os.path.isfile(tmp_path / names[2] / sweep.DONE_FILE)
