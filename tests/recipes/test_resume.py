"""Resume checks the config: the record a checkpoint keeps, and what may differ on resume."""

import json
import logging

import ml_collections
import pytest

from rl_tpu.recipes.config import base_config
from rl_tpu.recipes.resume import RESUME_MAY_CHANGE, check_resume, config_record, may_change


def small_config():
    c = ml_collections.ConfigDict()
    c.seed = 3
    c.algo = ml_collections.ConfigDict({"name": "dapo", "clip_high": 0.28})
    c.train = ml_collections.ConfigDict({"steps": 10, "length_buckets": (64, 128)})
    c.env = ml_collections.ConfigDict({"kwargs": ml_collections.ConfigDict()})
    c.optim = ml_collections.ConfigDict({"schedule": "constant", "lr": 1e-6})
    c.eval = ml_collections.ConfigDict({"every": 5, "num_tasks": 16})
    c.checkpoint = ml_collections.ConfigDict({"every": 1, "keep": 3})
    c.lock()
    return c


def test_config_record_is_flat_sorted_and_json_round_trips():
    record = config_record(small_config())
    assert record == {"algo.clip_high": 0.28, "algo.name": "dapo", "checkpoint.every": 1,
                      "checkpoint.keep": 3, "env.kwargs": {}, "eval.every": 5,
                      "eval.num_tasks": 16, "optim.lr": 1e-6, "optim.schedule": "constant",
                      "seed": 3, "train.length_buckets": [64, 128], "train.steps": 10}
    assert list(record) == sorted(record)
    assert json.loads(json.dumps(record)) == record  # what a checkpoint's meta gives back
    assert config_record(small_config()) == record  # stable


def test_config_record_of_the_base_config_is_json():
    record = config_record(base_config("grpo"))
    assert record["algo.name"] == "grpo"
    assert record["train.length_buckets"] == [128, 256, 512, 1024, 2048]
    assert json.loads(json.dumps(record)) == record


def test_config_record_names_a_value_json_cannot_hold():
    c = ml_collections.ConfigDict({"env": {"kwargs": {"fn": object()}}})
    with pytest.raises(TypeError, match="'env.kwargs.fn' holds a object"):
        config_record(c)


def saved(c):
    return json.loads(json.dumps(config_record(c)))  # as read back from the checkpoint


def test_same_config_resumes():
    check_resume(saved(small_config()), small_config(), "/w")


def test_differing_clip_high_is_refused_naming_saved_and_new_values():
    c = small_config()
    c.algo.clip_high = 0.3
    with pytest.raises(ValueError) as err:
        check_resume(saved(small_config()), c, "/runs/a")
    message = str(err.value)
    assert "cannot resume the run in /runs/a" in message
    assert "algo.clip_high: saved 0.28, now 0.3" in message
    assert "original config and overrides" in message and "new --workdir" in message


def test_train_steps_and_eval_keys_may_change():
    c = small_config()
    c.train.steps = 20
    c.eval.every = 1
    c.eval.num_tasks = 4
    c.checkpoint.every = 5
    c.checkpoint.keep = 1
    check_resume(saved(small_config()), c, "/w")


def test_every_difference_is_named_in_one_message():
    old = saved(small_config())
    old["algo.removed_knob"] = 1  # a key the new config no longer has
    c = small_config()
    c.seed = 4
    c.train.length_buckets = (64, 256)
    c.eval.every = 1  # allowed: not named
    with c.unlocked():
        c.algo.new_knob = "x"
    with pytest.raises(ValueError) as err:
        check_resume(old, c, "/w")
    message = str(err.value)
    assert "in 4 key(s)" in message
    assert "seed: saved 3, now 4" in message
    assert "train.length_buckets: saved [64, 128], now [64, 256]" in message
    assert "algo.removed_knob: saved 1, now (no such key)" in message
    assert 'algo.new_knob: saved (no such key), now "x"' in message
    assert "eval.every" not in message.split("Keys that may change")[0]


def test_train_steps_may_not_change_when_the_lr_decays_over_them():
    old, new = small_config(), small_config()
    old.optim.schedule = new.optim.schedule = "cosine"
    new.train.steps = 20
    with pytest.raises(ValueError, match=r"train.steps: saved 10, now 20[\s\S]*"
                                         r"optim.schedule='cosine'"):
        check_resume(saved(old), new, "/w")


def test_bool_is_not_the_same_as_one():
    old = saved(small_config())
    old["seed"] = True
    with pytest.raises(ValueError, match="seed: saved true, now 3"):
        check_resume(old, small_config(), "/w")


def test_checkpoint_without_a_record_is_accepted_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="rl_tpu.recipes.resume"):
        check_resume(None, small_config(), "/runs/old")
    assert any("/runs/old" in r.getMessage() and "no config record" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("key,allowed", [
    ("train.steps", True), ("train.steps_per_epoch", False), ("train.tasks_per_step", False),
    ("eval.every", True), ("eval.pass_k", True), ("evaluation.x", False),
    ("log.plot", True), ("checkpoint.every", True), ("checkpoint.keep", True),
    ("algo.clip_high", False), ("optim.lr", False),
])
def test_may_change(key, allowed):
    assert may_change(key) is allowed


def test_every_allowed_key_exists_in_the_base_config():
    keys = set(config_record(base_config()))
    for prefix in RESUME_MAY_CHANGE:
        assert any(k == prefix or (prefix.endswith(".") and k.startswith(prefix))
                   for k in keys), prefix


def test_a_run_whose_params_turn_non_finite_stops_naming_the_step_and_exports_nothing(tmp_path):
    """The quickstart's smoke run (no SFT) with lr 1e20 and weight decay 1e20 after one
    warm-up step: step 1 trains at lr 0 and is checkpointed; step 2's decay term,
    lr x wd x w = 1e40 x w, overflows float32 (max 3.4e38) for every weight |w| > 3.4e-2, with finite loss and
    gradient (so it is no skipped update), and the run stops there, before its eval, sync or
    checkpoint, naming step 2 and checkpoint 1; no final_hf, no finished.json."""
    import importlib
    import os
    import sys

    from rl_tpu.recipes import rl
    from rl_tpu.train.learner import NonFiniteParamsError

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, repo)
    try:
        c = importlib.import_module("configs.quickstart").get_config("smoke")
    finally:
        sys.path.remove(repo)
    c.optim.lr, c.optim.weight_decay, c.optim.warmup_steps = 1e20, 1e20, 1
    c.train.steps, c.checkpoint.every, c.checkpoint.export_hf = 3, 1, True
    # No SFT warm-up: under the weight decay of 1e20 it leaves weights near 1e16, whose
    # overflowing activations make step 1's gradient NaN (a skipped update) on some XLA
    # builds, and the test is about step 2's finite update that overflows the params.
    c.sft.steps = 0
    with pytest.raises(NonFiniteParamsError, match=r"^step 2: the policy params hold NaN or inf "
                       r"after the update.*the last checkpoint, step 1, holds finite params"):
        rl.run(c, str(tmp_path))
    names = os.listdir(tmp_path)
    assert "final_hf" not in names and "final_hf.tmp" not in names
    assert rl.FINISHED_FILE not in names
    assert sorted(n for n in os.listdir(tmp_path / "checkpoints") if n.isdigit()) == ["1"]
