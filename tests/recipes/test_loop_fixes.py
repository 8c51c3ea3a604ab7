"""The RL loop's silent errors, each pinned by numbers worked out by hand: the lr schedule in
RL steps, DAPO's per-turn overlong shaping and loss-free fillers, GAE whitening and the
per-epoch minibatch shuffle, the fixed eval horizon, the proximal pass that can be skipped."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_tpu import parallel
from rl_tpu.recipes import algorithms, eval_suite, train_states
from rl_tpu.recipes.config import base_config, check
from rl_tpu.rl.advantages import compute_advantages
from rl_tpu.train import rollout_batch
from rl_tpu.train.state import step_schedule, learning_rate_schedule
from rl_tpu.core.trajectory import Trajectory


def traj(reward, group_id, turns=(4,), prompt=3):
    """A trajectory with `prompt` prompt ids, then per turn k its generated ids and 2
    observation ids (turn id k on both)."""
    mask, turn_ids = [False] * prompt, [-1] * prompt
    for k, n in enumerate(turns):
        mask += [True] * n + [False] * 2
        turn_ids += [k] * (n + 2)
    n_tokens = len(mask)
    return Trajectory(tokens=np.arange(n_tokens, dtype=np.int32), loss_mask=np.array(mask),
                      behaviour_logprobs=np.zeros(n_tokens, np.float32),
                      turn_ids=np.array(turn_ids, np.int32),
                      rewards=[reward / len(turns)] * len(turns), reward=reward,
                      success=reward > 0, num_turns=len(turns),
                      weight_versions=["0"] * len(turns), task_id="t", group_id=group_id,
                      finish="done", messages=[], info={})


# ----------------------------------------------------------------------------- lr schedule


def test_lr_schedule_counts_rl_steps_not_optimizer_updates():
    c = base_config("grpo")
    c.train.steps, c.train.minibatches, c.train.epochs = 10, 4, 2
    c.optim.schedule, c.optim.warmup_steps = "cosine", 2
    optim = train_states.rl_optim_config(c, 1e-3)
    assert optim.updates_per_step == 8 and optim.total_steps == 10
    per_update, per_step = learning_rate_schedule(optim), step_schedule(optim)
    # RL step k's 8 updates (counts 8k .. 8k+7) all use the lr of step k: warm-up 1e-3 * k/2,
    # then cosine over the 8 steps after it ends at step 10 (not at update 10 = step 1.25).
    for k in range(10):
        for count in range(8 * k, 8 * k + 8):
            np.testing.assert_allclose(per_update(count), per_step(k), rtol=1e-6)
    np.testing.assert_allclose(per_step(1), 5e-4, rtol=1e-6)
    np.testing.assert_allclose(per_step(6), 1e-3 * (0.9 * 0.5 + 0.1), rtol=1e-5)  # halfway
    # the critic's schedule is stretched the same way
    critic = train_states.rl_optim_config(c, c.algo.value_lr)
    assert critic.updates_per_step == 8


# ----------------------------------------------------------------------------- DAPO


def test_overlong_shaping_is_per_turn():
    algo = algorithms.algo_config("dapo")
    algo.overlong_buffer, algo.overlong_penalty = 4, 1.0
    # budget 10 a turn, buffer 4: a turn loses (len - 6) / 4, at most 1.
    # three turns of 5 tokens (15 in all): no turn is over 6 -> reward unchanged (the old
    # check on the episode's 15 tokens took the whole point).
    calm = traj(1.0, 0, turns=(5, 5, 5))
    # turns of 8, 2, 10 tokens: 0.5 + 0 + 1.0 = 1.5 off; each turn's own reward loses its part
    long = traj(1.5, 1, turns=(8, 2, 10))
    algorithms.shape_overlong([calm, long], algo, max_new_tokens=10)
    assert calm.reward == 1.0 and calm.rewards == [1 / 3] * 3
    assert long.reward == pytest.approx(0.0)
    assert long.rewards == pytest.approx([0.5 - 0.5, 0.5, 0.5 - 1.0])


def test_dapo_fillers_carry_no_loss_and_every_token_is_counted():
    algo = algorithms.algo_config("dapo")
    algo.max_refill_rounds = 1
    # 2 tasks wanted, G = 2. First round: group 0 informative, group 1 not. The refill round
    # plays groups 2 (not informative) and 3 (not): one informative group in all, so one
    # equal-reward group fills the batch, flagged to carry no loss.
    played = [traj(1, 0), traj(0, 0), traj(1, 1), traj(1, 1)]
    refill = [traj(0, 2), traj(0, 2), traj(1, 3), traj(1, 3)]
    chosen, metrics = algorithms.select_groups(played, 2, 2, algo, lambda r: refill,
                                               lambda flag: flag)
    assert [t.group_id for t in chosen] == [0, 0, 1, 1]
    assert [bool(t.info.get(rollout_batch.NO_LOSS)) for t in chosen] == [False] * 2 + [True] * 2
    assert metrics["rollout/played_tokens"] == 8 * 4  # refills included: 8 episodes x 4 ids
    assert metrics["rollout/refill_rounds"] == 1.0
    assert metrics["rollout/filler_group_frac"] == 0.5
    batch = rollout_batch.trajectories_to_batch(chosen, length_buckets=(16,))
    assert batch["loss_mask"][:2].sum() == 8 and batch["loss_mask"][2:].sum() == 0
    assert list(batch["group_ids"]) == [0, 0, -1, -1]
    # token mean: only the informative group's 8 tokens are in the denominator


# ----------------------------------------------------------------------------- PPO


def test_gae_advantages_are_whitened_for_ppo():
    algo = algorithms.algo_config("ppo")
    options = dict(algorithms.advantage_options(algo))
    assert options["whiten"] is True
    mask = jnp.array([[0, 1, 1, 1], [0, 1, 1, 0]], bool)
    rewards = jnp.array([[0, 0, 0, 1.0], [0, 0, 2.0, 0]])
    batch = {"token_rewards": rewards, "values": jnp.zeros((2, 4)), "loss_mask": mask}
    adv, ret = compute_advantages("gae", batch, **options)
    # gamma 1, lam 0.95, V = 0: raw A = [.9025 .95 1 | 1.9 2]; returns are the raw A.
    raw = np.array([0.9025, 0.95, 1.0, 1.9, 2.0])
    on = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(ret)[on], raw, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(adv)[on], (raw - raw.mean()) / raw.std(), rtol=1e-4)
    assert np.all(np.asarray(adv)[~on] == 0)


def test_minibatches_are_reshuffled_every_epoch():
    from jax.sharding import NamedSharding, PartitionSpec as P

    from rl_tpu.rl.masked import Metric
    from rl_tpu.train.learner import Learner, UpdateConfig
    from rl_tpu.train.state import OptimConfig, TrainState, make_optimizer

    mesh = parallel.make_mesh({"data": 1}, devices=jax.devices()[:1])
    tx = make_optimizer(OptimConfig())
    fresh = lambda: TrainState.create({"w": jnp.zeros(())}, tx)  # noqa: E731
    state = fresh()
    learner = Learner.__new__(Learner)  # only the update compiler: no model needed
    learner.cfg = UpdateConfig(epochs=3, minibatches=2)
    learner.mesh = mesh
    learner._batch_sharding = NamedSharding(mesh, parallel.batch_spec(1))
    learner._replicated = NamedSharding(mesh, P())

    def record_rows(state, minibatch):  # which rows this minibatch holds, as a bitmask
        return state, {"rows": Metric.of(jnp.sum(2.0 ** minibatch["tokens"][:, 0]), "last")}

    update = learner._compile_update(record_rows, state)
    batch = {"tokens": jnp.arange(8, dtype=jnp.int32)[:, None]}
    _, stacked = update(state, batch, jax.random.key(0))
    rows = [int(x) for x in np.asarray(stacked["rows"].value)]  # [E * N] = 6 minibatches
    epochs = [sorted(rows[i:i + 2]) for i in range(0, 6, 2)]
    assert all(sum(e) == 255 for e in epochs)  # each epoch covers all 8 rows once
    assert len({tuple(e) for e in epochs}) > 1  # ... split differently across epochs
    _, again = update(fresh(), batch, jax.random.key(0))  # the state was donated
    assert [int(x) for x in np.asarray(again["rows"].value)] == rows  # seeded


# ----------------------------------------------------------------------------- eval, proximal


def test_eval_horizon_is_fixed_at_the_final_stage():
    c = base_config("grpo")
    c.env.max_turns = 30
    c.schedules.horizon_turns = (10, 20, 30)
    assert eval_suite.eval_horizon(c) == 30
    c.schedules.horizon_turns = (5, 8)
    assert eval_suite.eval_horizon(c) == 8
    c.eval.max_turns = 12
    assert eval_suite.eval_horizon(c) == 12
    c.eval.max_turns, c.schedules.horizon_turns = 0, ()
    assert eval_suite.eval_horizon(c) == 30


def test_recompute_proximal_off_is_refused_for_stale_data_against_the_proximal():
    c = base_config("grpo")
    c.algo.recompute_proximal = False
    check(c)  # on-policy: fine
    c.rollout.max_staleness = 2
    with pytest.raises(ValueError, match="recompute_proximal"):
        check(c)
    c.algo.ratio_against = "behaviour"
    check(c)
    assert base_config("bapo").algo.ratio_against == "behaviour"
    assert base_config("ppo").algo.ratio_against == "proximal"


def test_across_hosts_on_one_process():
    assert parallel.across_hosts(3, "max") == 3
    assert parallel.across_hosts(True, "any") is True
    np.testing.assert_array_equal(parallel.across_hosts(np.array([1.0, 2.0]), "sum"), [1, 2])
    with pytest.raises(ValueError, match="reduce"):
        parallel.across_hosts(1, "mean")


def test_reshuffled_minibatches_stay_sharded_over_the_devices():
    """The permuted rows are re-sharded: each minibatch's step computes on its own rows per
    device, not on a copy of the whole batch everywhere (what an unconstrained gather gives)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from rl_tpu.rl.masked import Metric
    from rl_tpu.train.learner import Learner, UpdateConfig
    from rl_tpu.train.state import OptimConfig, TrainState, make_optimizer

    mesh = parallel.make_mesh({"data": 8}, devices=jax.devices()[:8])
    state = TrainState.create({"w": jnp.zeros(())}, make_optimizer(OptimConfig()))
    learner = Learner.__new__(Learner)
    learner.cfg = UpdateConfig(epochs=2, minibatches=2)
    learner.mesh = mesh
    learner._batch_sharding = NamedSharding(mesh, parallel.batch_spec(1))
    learner._replicated = NamedSharding(mesh, P())
    seen = []

    def step(state, minibatch):
        jax.debug.inspect_array_sharding(minibatch["tokens"], callback=seen.append)
        return state, {"n": Metric.of(jnp.sum(minibatch["tokens"]), "last")}

    update = learner._compile_update(step, jax.device_put(state, learner._replicated))
    batch = jax.device_put({"tokens": jnp.arange(32, dtype=jnp.int32)[:, None]},
                           learner._batch_sharding)
    update(jax.device_put(state, learner._replicated), batch, jax.random.key(0))
    assert seen and all(not s.is_fully_replicated for s in seen)
    assert all(s.shard_shape((16, 1)) == (2, 1) for s in seen)  # 16 rows over 8 devices
