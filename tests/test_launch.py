"""The launchers' shared start: one-line errors, name overrides that rebuild their block,
and launchers that refuse to overwrite or create what the user did not ask for."""

import os
import subprocess
import sys

import pytest
from absl import flags
from ml_collections import config_flags

import launch
from rl_tpu.models import tiny
from rl_tpu.recipes import algorithms, components, evaluate

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
}


def start(module, *args, env=None):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO, **(env or {}))
    env.pop("XLA_FLAGS", None)
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def mistakes(tmp_path_factory):
    root = tmp_path_factory.mktemp("mistakes")
    runs = {}
    for name, (module, args, _) in MISTAKES.items():
        config = [] if "--config" in args else ["--config", "configs/quickstart.py:smoke"]
        runs[name] = (root / name, start(module, *config, *args,
                                         "--workdir", str(root / name / TYPO)))
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
    return {name: (workdir, *proc.communicate(timeout=300), proc.returncode)
            for name, (workdir, proc) in runs.items()}


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
    env = components.make_env_factory(c)()
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
