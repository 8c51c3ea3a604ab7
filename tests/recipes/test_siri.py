"""SIRI's budget reaches the loop: Dr.GRPO's normaliser follows it as an array (one compile for
every budget, the loss as worked by hand), the Trainer logs it, the teacher is verbose."""

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_tpu import parallel
from rl_tpu.models import tiny
from rl_tpu.models.transformer import Transformer
from rl_tpu.rl.losses import PolicyLossConfig, aggregate, policy_loss
from rl_tpu.train.learner import Learner, UpdateConfig
from rl_tpu.train.state import OptimConfig, create_state, make_optimizer

X = jnp.array([[1., 2., 3.], [4., 5., 6.]])
M = jnp.array([[1, 1, 0], [1, 0, 0]], bool)


def test_fixed_normalizer_takes_a_scalar_or_a_row_array():
    # row sums 1 + 2 = 3 and 4; one normaliser 4: (3 + 4) / (B=2 * 4) = 0.875
    np.testing.assert_allclose(aggregate(X, M, "fixed_normalizer", 4), 0.875, rtol=1e-6)
    np.testing.assert_allclose(aggregate(X, M, "fixed_normalizer", jnp.float32(4)), 0.875,
                               rtol=1e-6)
    # per row [2, 4]: (3 / 2 + 4 / 4) / 2 = 1.25
    np.testing.assert_allclose(aggregate(X, M, "fixed_normalizer", jnp.array([2., 4.])), 1.25,
                               rtol=1e-6)


def test_policy_loss_normalizer_overrides_the_static_one_under_jit():
    cfg = PolicyLossConfig(aggregation="fixed_normalizer", fixed_normalizer=64)
    lp = jnp.zeros((2, 3))
    adv = jnp.array([1.0, -2.0])

    @jax.jit
    def loss(normalizer):
        return policy_loss(lp, lp, adv, M, cfg, normalizer=normalizer)[0]

    # ratio 1 on every token: per-token loss -A; row sums -1 * 2 = -2 and +2 * 1 = 2
    # per row [2, 4]: (-2 / 2 + 2 / 4) / 2 = -0.25; one L = 8: (-2 + 2) / 16 = 0
    np.testing.assert_allclose(loss(jnp.array([2., 4.])), -0.25, rtol=1e-6)
    np.testing.assert_allclose(loss(jnp.array([8., 8.])), 0.0, atol=1e-7)
    assert loss._cache_size() == 1
    # without the array the static one: (-2 + 2) / (2 * 64) = 0
    np.testing.assert_allclose(policy_loss(lp, lp, adv, M, cfg)[0], 0.0, atol=1e-7)


def _learner():
    cfg = tiny.tiny_config("qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                           num_layers=1, head_dim=8)
    mesh = parallel.make_mesh({"data": -1})
    params = tiny.random_params(cfg, seed=0, mesh=mesh, scale=0.2)
    policy = create_state(params, make_optimizer(OptimConfig(lr=1e-3)))
    loss_cfg = PolicyLossConfig(aggregation="fixed_normalizer", fixed_normalizer=8)
    return Learner(Transformer(cfg, mesh=mesh), policy, mesh, loss_cfg, UpdateConfig())


def _batch(budget):
    b, t = 8, 8  # 8 rows: the test mesh has 8 CPU devices
    mask = np.zeros((b, t), bool)
    mask[0, 2:6] = True   # 4 policy tokens
    mask[1, 2:4] = True   # 2
    mask[2, 2:8] = True   # 6
    #      rows 3-7: none (padding rows)
    adv = np.array([1.0, -2.0, 0.5, 3.0, 1.0, 1.0, 1.0, 1.0], np.float32)
    return {"tokens": np.arange(b * t, dtype=np.int32).reshape(b, t) % 64,
            "positions": np.tile(np.arange(t, dtype=np.int32), (b, 1)),
            "segment_ids": np.ones((b, t), np.int32), "loss_mask": mask,
            "advantages": np.repeat(adv[:, None], t, axis=1),
            "length_normalizer": np.full(b, budget, np.float32)}


def test_learner_update_compiles_once_across_budgets_and_divides_by_each():
    learner = _learner()
    # First (only) minibatch of an update: the params are the proximal ones, ratio 1, so the
    # per-token loss is -A. Row sums of -A: -1*4 = -4, 2*2 = 4, -0.5*6 = -3, 0 for the five
    # rows with no tokens: total -3; pg_loss = -3 / (B=8 * L) -> L=8: -3/64 = -0.046875,
    # L=2: -3/16 = -0.1875, L=5: -3/40 = -0.075.
    for budget, expected in ((8, -0.046875), (2, -0.1875), (5, -0.075)):
        batch = learner.score(parallel.host_to_global(_batch(budget), learner.mesh))
        metrics = learner.update(batch, step=1)
        np.testing.assert_allclose(metrics["train/pg_loss"], expected, rtol=1e-5)
    assert learner.program("policy_update", 8, 8)._cache_size() == 1  # one compile, 3 budgets


def test_arithmetic_teacher_is_verbose_imperfect_and_self_consistent():
    from rl_tpu.envs.reasoning import TEACHER_FILLER, arithmetic_teacher_reply
    from rl_tpu.core.env import Task

    task = Task("arithmetic/train/0", {"question": "Calculate 6 + 9.", "answer": "15",
                                        "metadata": {"expression": "6 + 9"}})
    rng = random.Random(0)
    replies = [arithmetic_teacher_reply(task, rng, 0.5) for _ in range(400)]
    right = [r for r in replies if r.endswith("<answer>15</answer>")]
    assert 160 < len(right) < 240  # skill 0.5 of 400 = 200, +-2 sigma (10 each)
    assert all("6 + 9 = 15." in r for r in right)
    wrong = {r.rsplit("<answer>", 1)[1][:-len("</answer>")] for r in replies if r not in right}
    assert wrong == {"13", "14", "16", "17"}  # off by 1 or 2
    fillers = [sum(r.count(f) for f in TEACHER_FILLER) for r in replies]
    assert set(fillers) == {0, 1, 2, 3}  # removable verbosity of every length


def test_the_steps_teacher_works_a_sum_as_running_totals_and_slips_once():
    from rl_tpu.core.env import Task, make
    from rl_tpu.envs.reasoning import TEACHER_FILLER

    task = Task("arithmetic/train/0", {"question": "Calculate 6 + 9 + 8 + 4.", "answer": "27",
                                        "metadata": {"expression": "6 + 9 + 8 + 4"}})
    env = make("arithmetic", teacher="steps", isolate=False)
    rng = random.Random(0)
    replies = [env.teacher_reply(task, rng, 0.5) for _ in range(400)]
    strip = lambda r: " ".join(s + "." for s in r.split(". ")  # noqa: E731
                               if s.rstrip(".") + "." not in TEACHER_FILLER).rstrip(".")
    right = [r for r in replies if r.endswith("<answer>27</answer>")]
    assert 160 < len(right) < 240
    assert {strip(r) for r in right} == {
        "6 + 9 = 15. 15 + 8 = 23. 23 + 4 = 27. <answer>27</answer>"}
    for reply in set(replies) - set(right):  # one step off by 1 or 2, carried on after it
        steps = [s for s in strip(reply).split(". ") if "=" in s]
        sums = [(int(a), int(b), int(c.rstrip("."))) for a, _, b, _, c in
                (s.split() for s in steps)]
        slips = [c - a - b for a, b, c in sums if c != a + b]
        assert len(slips) == 1 and slips[0] in (-2, -1, 1, 2)
        assert all(sums[i + 1][0] == sums[i][2] for i in range(len(sums) - 1))
        assert reply.endswith(f"<answer>{sums[-1][2]}</answer>")
    with pytest.raises(ValueError, match="teacher='chatty'"):
        make("arithmetic", teacher="chatty")


@pytest.mark.slow
def test_trainer_logs_the_budget_and_compiles_the_update_once(tmp_path, monkeypatch):
    from rl_tpu.metrics import read_metrics
    from rl_tpu.recipes import rl
    from tests.recipes.test_rl import config

    cache_sizes = []
    update = rl.Trainer.update

    def counting_update(self, batch, step):
        out = update(self, batch, step)
        cache_sizes.append(sum(fn._cache_size() for (phase, _), fn in
                               self.learner._programs.items() if phase == "policy_update"))
        return out

    monkeypatch.setattr(rl.Trainer, "update", counting_update)
    c = config("siri_arithmetic")  # smoke: stair, period 2, short first
    c.train.steps = 3
    rl.run(c, str(tmp_path))
    records = [r for r in read_metrics(str(tmp_path)) if "train/max_new_tokens" in r]
    # 0-based steps 0, 1, 2 of a short-first stair with P = 2: 32, 64, 32
    assert [r["train/max_new_tokens"] for r in records] == [32, 64, 32]
    assert all(r["rollout/response_length"] <= r["train/max_new_tokens"] for r in records)
    assert cache_sizes == [1, 1, 1]


@pytest.mark.slow
def test_free_running_rows_are_normalised_by_the_budget_they_were_sampled_with(
        tmp_path, monkeypatch):
    """Free-running with partial rollouts: a chunk's episodes may end chunks later and train a
    step or more after the chunk that sampled them, under a budget the stair has moved since
    (32, 64, 32, 64 by step). Each row's Dr.GRPO normaliser is the budget its trajectory was
    sampled with (recorded by the agent loop), which is one the chunk plans handed out."""
    from rl_tpu.recipes import rl
    from tests.recipes.test_rl import config

    handed_out, seen = set(), []
    episode_args, batch = rl.Trainer.episode_args, rl.Trainer.batch

    def recording_args(self, tasks, chunk, round_index):
        args = episode_args(self, tasks, chunk, round_index)
        handed_out.add(args["max_new_tokens_per_turn"])
        return args

    def recording_batch(self, trajectories, step):
        out = batch(self, trajectories, step)
        normaliser = np.asarray(out["length_normalizer"])
        seen.append((normaliser[:len(trajectories)],
                     [t.info["max_new_tokens_per_turn"] for t in trajectories]))
        return out

    monkeypatch.setattr(rl.Trainer, "episode_args", recording_args)
    monkeypatch.setattr(rl.Trainer, "batch", recording_batch)
    c = config("siri_arithmetic")  # smoke: Dr.GRPO, a stair of period 2 from 32 tokens
    c.train.steps = 4
    c.rollout.max_staleness = 1
    c.rollout.partial_token_budget = 24  # fewer tokens than one reply: episodes span chunks
    c.eval.every = 4
    rl.run(c, str(tmp_path))
    assert handed_out == {32, 64} and len(seen) == 4
    for normaliser, budgets in seen:
        np.testing.assert_array_equal(normaliser, budgets)
        assert set(budgets) <= handed_out
