"""The launchers' shared start: one-line errors, name overrides that rebuild their block,
and launchers that refuse to overwrite or create what the user did not ask for."""

import json
import os
import socket
import subprocess
import sys

import pytest
from absl import flags
from ml_collections import config_flags

import launch
from rl_tpu.persistence import workdir_lock
from rl_tpu.env_serving.server import make_server
from rl_tpu.models import hf, tiny
from rl_tpu.recipes import algorithms, env_factory, evaluate, input_checks, resume, rl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TYPO = "no_such_workdir"  # under each test's tmp_path
DEBUG_ENV = "RL_TPU_DEBUG"  # docs/training.md

# A user's mistake per launcher run: (launcher, arguments, what stderr must name). The runs
# are started together, once for the module: each pays JAX's import.
MISTAKES = {
    "unknown_key": ("launch.train", ["--config.algo.clip_hgh=0.3"], ["clip_hgh", "clip_high"]),
    "wrong_type": ("launch.sft", ["--config.train.steps=abc"], ["train.steps", "abc"]),
    "bad_env_kwarg": ("launch.train", ["--config.env.kwargs.nm_items=3"],
                      ["nm_items", "'largest'", "num_items, "]),
    "bad_config_path": ("launch.eval", ["--config", "configs/nope.py"], ["configs/nope.py"]),
    # caught by config.check (each of these failed after writing to the workdir before)
    "sft_batch_size": ("launch.train", ["--config.sft.steps=2", "--config.sft.batch_size=0"],
                       ["sft.batch_size=0 must be >= 1"]),
    "rollout_urls": ("launch.train", ["--rollout_urls=notaurl"], ["--rollout_urls", "'notaurl'"]),
    # caught by the start-up check of what the config points at ({model}, {dead}: see below)
    "missing_model": ("launch.sft", ["--config.model.path={model}/nope"],
                      ["model.path=", "/nope", "no such directory"]),
    "truncated_model": ("launch.train", ["--config.model.path={model}/truncated"],
                        ["truncated/model.safetensors: truncated: tensor", "copy or download"]),
    "dead_env_server": ("launch.train", ["--config.env.remote_url={dead}"],
                        ["no env server answers at {dead}", "python -m launch.serve_env --env "
                         "largest"]),
    "eval_without_a_policy": ("launch.eval", ["--config", "configs/quickstart.py:smoke"],
                              ["--workdir=W", "--model_path=D"]),
}
NO_WORKDIR = ("eval_without_a_policy",)  # runs without --workdir


def dead_url() -> str:
    with socket.socket() as probe:  # free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


def truncated_model(dst):
    """A tiny HF dir at `dst` whose safetensors file lost its last 100 bytes (a cut copy)."""
    tiny.write_tiny_model(str(dst), vocab_size=320)
    file = os.path.join(dst, "model.safetensors")
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) - 100)
    return str(dst)


def start(module, *args, env=None):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO, **(env or {}))
    env.pop("XLA_FLAGS", None)
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def mistakes(tmp_path_factory):
    root = tmp_path_factory.mktemp("mistakes")
    truncated_model(root / "models" / "truncated")
    places = {"model": str(root / "models"), "dead": dead_url()}
    runs = {}
    for name, (module, args, _) in MISTAKES.items():
        args = [a.format(**places) for a in args]
        config = [] if "--config" in args else ["--config", "configs/quickstart.py:smoke"]
        workdir = [] if name in NO_WORKDIR else ["--workdir", str(root / name / TYPO)]
        runs[name] = (root / name, start(module, *config, *args, *workdir))
    # a rerun of a finished run under another learning rate (the record rl.Trainer writes)
    finished = root / "finished"
    finished.mkdir()
    record = resume.config_record(finish("--config", "configs/quickstart.py:smoke"))
    (finished / rl.FINISHED_FILE).write_text(json.dumps(
        {"step": 2, "config": record, "eval": {"eval/success": 0.5}, "outputs": ["final_hf"]}))
    runs["changed_resume"] = (finished, start(
        "launch.train", "--config", "configs/quickstart.py:smoke", "--config.optim.lr=1e-3",
        "--workdir", str(finished)))
    runs["help"] = (root / "help", start("launch.train", "--help"))
    runs["debug"] = (root / "debug", start(
        "launch.train", "--config", "configs/quickstart.py:smoke", "--config.algo.clip_hgh=0.3",
        "--workdir", str(root / "debug"), env={DEBUG_ENV: "1"}))
    # eval from a workdir without a checkpoint, under another algorithm than the file's
    runs["eval"] = (root / "eval", start(
        "launch.eval", "--config", "configs/countdown_grpo.py:smoke", "--config.algo.name=ppo",
        "--workdir", str(root / "eval" / TYPO)))
    (root / "model").mkdir()
    (root / "model" / "keep.txt").write_text("mine")
    runs["make_tiny_model"] = (root / "model", start("launch.make_tiny_model",
                                                     "--out", str(root / "model")))
    done = {name: (workdir, *proc.communicate(timeout=300), proc.returncode)
            for name, (workdir, proc) in runs.items()}
    return {name: (workdir, out, err.replace(places["dead"], "{dead}"), code)
            for name, (workdir, out, err, code) in done.items()}


@pytest.mark.slow  # the launchers as subprocesses
@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_a_users_mistake_is_one_line_and_exit_2(mistakes, name):
    workdir, _, stderr, returncode = mistakes[name]
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert returncode == 2, stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    for named in MISTAKES[name][2]:
        assert named in lines[0]
    assert DEBUG_ENV in lines[0]  # how to see the traceback
    assert not os.path.exists(workdir)  # nothing was built or created


@pytest.mark.slow  # the launchers as subprocesses
def test_a_resume_under_a_changed_config_is_one_line_and_exit_2(mistakes):
    workdir, _, stderr, returncode = mistakes["changed_resume"]
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert returncode == 2, stderr
    assert len(lines) == 1 and lines[0].startswith("error: cannot resume the run in "), stderr
    assert "optim.lr: saved 0.0005, now 0.001" in lines[0] and "new --workdir" in lines[0]
    # the finished run's files untouched; the lock file (empty, released) is the refused
    # rerun's only trace
    assert sorted(os.listdir(workdir)) == sorted([rl.FINISHED_FILE, workdir_lock.LOCK_FILE])


@pytest.mark.slow  # the launchers as subprocesses
def test_help_prints_the_flags_and_exits_0(mistakes):
    _, stdout, stderr, returncode = mistakes["help"]
    assert returncode == 0, stderr
    assert "--workdir" in stdout and "--rollout_urls" in stdout


@pytest.mark.slow  # the launchers as subprocesses
def test_the_debug_variable_shows_the_traceback(mistakes):
    _, _, stderr, returncode = mistakes["debug"]
    assert returncode != 0
    assert "Traceback (most recent call last)" in stderr and "clip_hgh" in stderr


@pytest.mark.slow  # the launchers as subprocesses
def test_eval_launcher_rebuilds_an_overridden_algo_block_then_needs_a_checkpoint(mistakes):
    workdir, _, stderr, returncode = mistakes["eval"]
    assert "--config.algo.name=ppo: the algo block is rebuilt from ppo's defaults" in stderr
    assert "advantage 'grpo' -> 'gae'" in stderr
    assert returncode == 2 and "error: no checkpoint in" in stderr and "--model_path" in stderr
    assert not os.path.exists(workdir)  # no workdir, no random model in it


@pytest.mark.slow  # the launchers as subprocesses
def test_make_tiny_model_refuses_a_non_empty_directory(mistakes):
    out, _, stderr, returncode = mistakes["make_tiny_model"]
    assert returncode != 0 and "--overwrite" in stderr
    assert os.listdir(out) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"


def finish(*args):
    """launch.finish_config over a fresh flag set, as a launcher's command line would."""
    argv = ["launcher", *args]
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=flag_values, sys_argv=argv)
    flag_values(argv)
    return launch.finish_config(flag_values)


def test_algo_name_on_the_command_line_brings_that_algorithms_defaults():
    c = finish("--config", "configs/countdown_grpo.py:smoke", "--config.algo.clip_high=0.3",
               "--config.algo.name=ppo", "--config.algo.bapo.variant=verl")
    assert (c.algo.name, c.algo.advantage, c.algo.lam) == ("ppo", "gae", 0.95)
    assert algorithms.uses_critic(c.algo)
    assert c.algo.clip_high == 0.3 and c.algo.bapo.variant == "verl"  # the other overrides
    assert finish("--config", "configs/countdown_grpo.py:smoke",
                  "--config.algo.name=grpo").algo.advantage == "grpo"


def test_env_kwargs_are_settable_from_the_command_line():
    c = finish("--config", "configs/quickstart.py:smoke", "--config.env.kwargs.num_items=3")
    env = env_factory.make_env_factory(c)()
    assert len(env.tasks().get("eval", 0).data["numbers"]) == 3


def test_env_name_on_the_command_line_brings_that_envs_kwargs():
    c = finish("--config", "configs/quickstart.py:smoke", "--config.env.kwargs.eval_size=7",
               "--config.env.name=countdown")
    assert c.env.name == "countdown" and c.env.kwargs.eval_size == 7
    assert "num_items" not in c.env.kwargs and "score_timeout_s" in c.env.kwargs
    with pytest.raises(ValueError, match="env 'countdown' takes no keyword argument num_items"):
        finish("--config", "configs/quickstart.py:smoke", "--config.env.kwargs.num_items=3",
               "--config.env.name=countdown")


def test_a_failed_check_stops_the_start():
    with pytest.raises(ValueError, match="train.steps=-5 must be >= 0"):
        finish("--config", "configs/quickstart.py:smoke", "--config.train.steps=-5")


def test_eval_without_a_checkpoint_creates_nothing(tmp_path):
    c = finish("--config", "configs/quickstart.py:smoke")
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        evaluate.run(c, str(tmp_path / TYPO))
    assert not os.path.exists(tmp_path / TYPO)


def test_write_tiny_model_replaces_a_directory_only_when_asked(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        tiny.write_tiny_model(str(tmp_path), vocab_size=320)
    tiny.write_tiny_model(str(tmp_path), vocab_size=320, overwrite=True)
    assert (tmp_path / "config.json").exists() and not (tmp_path / "keep.txt").exists()


# --- mistakes caught before anything is written: config.check and the start-up check -----------


@pytest.mark.parametrize("override,message", [
    ("--config.sft.batch_size=0", "sft.batch_size=0 must be >= 1"),
    ("--config.sft.batch_size=-4", "sft.batch_size=-4 must be >= 1"),
    ("--config.optim.lr=-1", r"optim.lr=-1.0 must be > 0 \(a learning rate\)"),
    ("--config.optim.lr=0", "optim.lr=0.0 must be > 0"),
    ("--config.rollout.temperature=-1", "rollout.temperature=-1.0 must be > 0"),
    ("--config.rollout.top_p=0", r"rollout.top_p=0.0 must be in \(0, 1\]"),
    ("--config.env.remote_url=garbage", "env.remote_url: 'garbage' is not a URL; give the env "
                                        "server's http://host:port"),
    ("--config.rollout.urls=notaurl", r"rollout.urls \(--rollout_urls\): .*'notaurl'"),
])
def test_a_bad_value_is_refused_by_check_naming_its_key(override, message):
    with pytest.raises(ValueError, match=message):
        finish("--config", "configs/quickstart.py:smoke", override)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A good tiny HF dir, a cut copy of it and one whose config.json is not JSON."""
    root = tmp_path_factory.mktemp("models")
    tiny.write_tiny_model(str(root / "good"), vocab_size=320)
    truncated_model(root / "truncated")
    tiny.write_tiny_model(str(root / "bad_json"), vocab_size=320)
    (root / "bad_json" / "config.json").write_text('{"vocab_size": 320,')
    return root


@pytest.mark.parametrize("name,message", [
    ("nope", "model.path='.*/nope': no such directory; point it at an HF model directory"),
    ("truncated", r"truncated/model\.safetensors: truncated: tensor '.*' ends at byte \d+ but "
                  r"the file has \d+; copy or download it again"),
    ("bad_json", r"bad_json/config\.json: unreadable JSON \(.*\); fix or replace the file"),
])
def test_a_model_dir_that_cannot_load_is_named_before_anything_is_written(models, tmp_path, name,
                                                                          message):
    c = finish("--config", "configs/quickstart.py:smoke", f"--config.model.path={models / name}")
    with pytest.raises(hf.CheckpointError, match=message):
        input_checks.check_inputs(c)
    with pytest.raises(hf.CheckpointError, match=message.replace("model.path", "--model_path")):
        evaluate.run(c, model_path=str(models / name))  # launch.eval --model_path
    input_checks.check_inputs(finish(  # the good one passes
        "--config", "configs/quickstart.py:smoke", f"--config.model.path={models / 'good'}"))


@pytest.fixture(scope="module")
def countdown_server():
    server = make_server("countdown")
    url = server.start()
    yield url
    server.shutdown()


@pytest.mark.parametrize("override,message", [
    ("--config.sft.data_path={tmp}/chats.jsonl", "sft.data_path='.*/chats.jsonl': no such file; "
                                                 "give a JSONL of chats, or leave it empty"),
    ("--config.env.dataset_dir={tmp}/data", "env.dataset_dir='.*/data': no such directory"),
])
def test_a_data_path_that_is_not_there_is_named_before_anything_is_written(tmp_path, override,
                                                                          message):
    c = finish("--config", "configs/quickstart.py:smoke", "--config.sft.steps=2",
               override.format(tmp=tmp_path))
    with pytest.raises(FileNotFoundError, match=message):
        input_checks.check_inputs(c)


def test_env_servers_are_probed_before_anything_is_written(countdown_server):
    c = finish("--config", "configs/countdown_grpo.py:smoke",
               f"--config.env.remote_url={countdown_server}")
    input_checks.check_inputs(c)  # up, and serving env.name
    c = finish("--config", "configs/quickstart.py:smoke",
               f"--config.env.remote_url={countdown_server}")
    with pytest.raises(ValueError, match=rf"the env server at {countdown_server} serves "
                                         r"'countdown', but env.name is 'largest'; point "
                                         r"env.remote_url at a server of 'largest'"):
        input_checks.check_inputs(c)
    dead = dead_url()
    c = finish("--config", "configs/quickstart.py:smoke", f"--config.env.remote_url={dead}")
    with pytest.raises(ValueError, match=rf"env.remote_url: no env server answers at {dead} "
                                         r"within 5s \(ConnectError: .*\); start it with "
                                         r"`python -m launch.serve_env --env largest"):
        input_checks.check_inputs(c)


def test_the_env_server_probe_sends_the_runs_key(monkeypatch):
    server = make_server("countdown", api_key="sesame")
    url = server.start()
    try:
        c = finish("--config", "configs/countdown_grpo.py:smoke", f"--config.env.remote_url={url}")
        monkeypatch.delenv("RL_TPU_ENV_API_KEY", raising=False)
        with pytest.raises(ValueError, match=rf"the env server at {url} wants an API key: set "
                                             r"RL_TPU_ENV_API_KEY"):
            input_checks.check_inputs(c)
        monkeypatch.setenv("RL_TPU_ENV_API_KEY", "open")
        with pytest.raises(ValueError, match="refused the key in RL_TPU_ENV_API_KEY"):
            input_checks.check_inputs(c)
        monkeypatch.setenv("RL_TPU_ENV_API_KEY", "sesame")
        input_checks.check_inputs(c)
    finally:
        server.shutdown()


def test_a_failed_start_removes_only_a_workdir_with_nothing_in_it(tmp_path):
    empty = tmp_path / "empty"
    (empty / "checkpoints").mkdir(parents=True)
    (empty / "metrics.jsonl").write_text("")
    launch.remove_if_nothing_written(str(empty))
    assert not empty.exists()
    kept = tmp_path / "kept"
    (kept / "init_model").mkdir(parents=True)
    (kept / "init_model" / "config.json").write_text("{}")
    launch.remove_if_nothing_written(str(kept))
    assert (kept / "init_model" / "config.json").read_text() == "{}"


def test_help_exits_0_and_a_flag_error_keeps_its_status(capsys):
    from absl import app

    flag_values = flags.FlagValues()
    flags.DEFINE_integer("n", 1, "", flag_values=flag_values)
    flag_values[app.HelpFlag.NAME] = app.HelpFlag()  # absl's: prints the usage, exits 1
    with pytest.raises(SystemExit) as e:
        launch.parse_flags(["prog", "--help"], flag_values)
    assert e.value.code == 0 and "--helpfull" in capsys.readouterr().out
    with pytest.raises(flags.Error):
        launch.parse_flags(["prog", "--n=x"], flag_values)


def test_the_one_line_stays_last_when_writes_are_left_unawaited(tmp_path):
    """A failed checkpoint write leaves orbax's async write coroutines unawaited; their
    RuntimeWarning at interpreter exit must not print after the error line (seen in CI)."""
    script = tmp_path / "unawaited.py"
    script.write_text(
        "import launch\n"
        "KEEP = []\n"
        "async def write_fragment():\n"
        "    pass\n"
        "def fn(argv):\n"
        "    KEEP.append(write_fragment())  # alive until exit, as orbax leaves its writes\n"
        "    raise OSError('No space left on device')\n"
        "launch.one_line_errors((OSError,), fn, [])\n")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=120, env=dict(os.environ, PYTHONPATH=repo))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: No space left on device  (RL_TPU_DEBUG=1 shows the traceback)"], result.stderr
