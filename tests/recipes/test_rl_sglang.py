"""`configs/math_sglang.py:smoke` trains against SGLang-compatible servers: real SGLang 0.5.23
on CPU and rl_tpu's own `launch.serve_rollout`, the weight version advancing every step."""

import importlib
import os
import sys

import pytest

from rl_tpu.metrics import read_metrics
from rl_tpu.recipes import policy_io, rl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "rollout"))
from sglang_server import REPO, start_rollout_server, start_sglang_server  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("rollout_servers")]


def _smoke_config():
    """configs/math_sglang.py:smoke with its tiny model (model.path unset: written on demand)."""
    sys.path.insert(0, REPO)
    try:
        config = importlib.import_module("configs.math_sglang").get_config("smoke")
    finally:
        sys.path.remove(REPO)
    config.model.path = ""
    return config


@pytest.mark.parametrize("backend", [pytest.param("sglang", marks=pytest.mark.sglang_venv),
                                     "jax"])
def test_math_sglang_smoke_trains_two_steps_with_weight_sync(tmp_path, backend):
    # The policy and the server start from the same HF dir, as a user's would.
    config = _smoke_config()
    model_dir = policy_io.model_path(config, str(tmp_path))
    config.model.path = model_dir
    start = start_sglang_server if backend == "sglang" else start_rollout_server
    server = start(model_dir)
    try:
        config.rollout.urls = server.url
        result = rl.run(config, str(tmp_path / "run"))
    finally:
        server.stop()
    records = [r for r in read_metrics(str(tmp_path / "run")) if "rollout/reward" in r]
    assert [r["step"] for r in records] == [1, 2]
    # step k samples with the weights of step k-1: version 0 (the start), then 1
    assert [r["rollout/weight_version"] for r in records] == [0, 1]
    assert all(r["train/skipped"] == 0 for r in records)
    assert "eval/success" in result


@pytest.mark.parametrize("deterministic", [True, False], ids=["lock_step", "free_running"])
def test_async_eval_on_shared_servers_measures_the_version_it_is_labelled_with(
        tmp_path, deterministic):
    """Asynchronous with SGLang-compatible servers, the eval shares the producer's servers,
    which lag the learner: the eval at step s must sample with version s (lock-step: loaded
    between two chunks, the producer's own put back after; free-running: once the publisher
    has loaded it), never the version the producer happens to hold."""
    config = _smoke_config()
    config.model.path = policy_io.model_path(config, str(tmp_path))
    config.train.steps, config.eval.every = 3, 1
    config.rollout.max_staleness, config.rollout.deterministic = 1, deterministic
    server = start_rollout_server(config.model.path)
    try:
        config.rollout.urls = server.url
        rl.run(config, str(tmp_path / "run"))
    finally:
        server.stop()
    records = read_metrics(str(tmp_path / "run"))
    evals = [(r["step"], r["eval/weight_version"]) for r in records if "eval/success" in r]
    assert evals == [(0, 0), (1, 1), (2, 2), (3, 3)]
    rollouts = [(r["step"], r["rollout/weight_version"]) for r in records
                if "rollout/reward" in r]
    if deterministic:  # step s trains on version max(0, s - 2): the eval's swap undone
        assert rollouts == [(1, 0), (2, 0), (3, 1)]
