"""A step's rows and the learner / sampler device split, as launch.compile_check plans them
(rl_tpu/aot.py `plan`) and as the trainer runs them (recipes/shapes.py, placement.split_devices):
by hand for the configs whose shapes differ from tasks x samples (replay, self-play,
asynchronous), for every shipped config against the shared functions, and the shared row
functions against the trainer's own pieces (the replay buffer, the batcher, self-play's game).
No model is built; TPU topologies come from libtpu (no TPU, nothing compiled)."""

import os

import numpy as np
import pytest
from test_config import load, shipped

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # as launch.compile_check sets it

from rl_tpu import aot  # noqa: E402
from rl_tpu.core.env import Task  # noqa: E402
from rl_tpu.recipes import env_factory, placement, shapes  # noqa: E402
from rl_tpu.offpolicy.replay import ReplayBuffer, ReplayConfig  # noqa: E402
from rl_tpu.train.rollout_batch import trajectories_to_batch  # noqa: E402
from rl_tpu.core.trajectory import Trajectory  # noqa: E402

pytest.importorskip("libtpu")


def _devices(topology):
    return aot.topology_devices(topology)[0]


def _plan(name, variant, topology, **overrides):
    config = load(name, variant)
    for key, value in overrides.items():
        block, field = key.split("__")
        config[block][field] = value
    return config, aot.plan(config, topology, devices=_devices(topology))


# ----------------------------------------------------------------------------- by hand


def test_replay_doubles_the_rows_compile_check_compiles():
    # v5p:2x2x4: 4 hosts of 4 chips, synchronous: the learner has all 16, a host's sampler
    # its 4. 32 tasks x 8 samples = 8 tasks (64 rows) a host; replay fraction 0.5 adds
    # ceil(0.5 / 0.5 x 8) = 8 groups (capacity 128): 64 more, 128 a host. Row multiple: 16
    # data-parallel x 4 minibatches = 64, a host's share 64 / gcd(64, 4) = 16: 4 x 128 = 512.
    config, p = _plan("bapo_offpolicy", "replay", "v5p:2x2x4")
    assert (config.train.tasks_per_step, config.train.samples_per_task) == (32, 8)
    assert (p.hosts, p.learner_chips, p.sampler_chips) == (4, 16, 4)
    assert p.row_multiple == 64 and p.rows == 512


def test_selfplay_compiles_proposer_and_solver_rows():
    # 16 task slots x 4 proposals x (1 + 4 solver rows each) = 320; a host's 80 rows are a
    # multiple of its share (16 data-parallel x 1 / gcd(16, 4) = 4)
    config, p = _plan("selfplay_arithmetic", "", "v5p:2x2x4")
    assert config.selfplay.solver_samples == 4
    assert p.row_multiple == 16 and p.rows == 16 * 4 * 5


def test_asynchronous_learner_and_sampler_split_each_hosts_chips():
    # max_staleness 2 with the embedded sampler: each host's first 2 chips sample, the other 2
    # of every host (8) form the learner's mesh (fsdp over all of them); 32 x 8 = 256 rows
    config, p = _plan("textcraft_bapo", "", "v5p:2x2x4")
    assert config.rollout.max_staleness == 2 and config.rollout.engine == "jax"
    assert (p.hosts, p.learner_chips, p.sampler_chips) == (4, 8, 2)
    assert [d.id for d in p.sampler_devices] == [0, 1]
    assert {d.process_index for d in p.learner_devices} == {0, 1, 2, 3}
    assert not {d.id for d in p.learner_devices} & {d.id for d in p.sampler_devices}
    assert dict(p.mesh.shape) == {"data": 1, "fsdp": 8, "expert": 1, "tensor": 1}
    assert p.rows == 256
    _, p = _plan("textcraft_bapo", "", "v5p:2x2x4", rollout__sampler_devices=1)
    assert (p.learner_chips, p.sampler_chips) == (12, 1)
    with pytest.raises(ValueError, match="sampler_devices=4.*1 <= rollout.sampler_devices < 4"):
        _plan("textcraft_bapo", "", "v5p:2x2x4", rollout__sampler_devices=4)


def test_synchronous_rows_pad_to_the_learners_row_multiple():
    # babyai_cpu on v5e:2x2 (one host of 4 chips, both the learner's and the sampler's): mesh
    # data 4 x 1 minibatch (a token budget picks the micro-batches): multiple 4, 8 x 8 rows
    config, p = _plan("babyai_cpu", "", "v5e:2x2")
    assert config.rollout.max_staleness == 0 and config.train.tokens_per_device
    assert (p.hosts, p.learner_chips, p.sampler_chips) == (1, 4, 4)
    assert p.row_multiple == 4 and p.rows == 8 * 8
    # 4 minibatches: multiple 16, and 5 tasks' 40 rows pad to 48
    _, p = _plan("babyai_cpu", "", "v5e:2x2", train__tasks_per_step=5, train__minibatches=4)
    assert (p.row_multiple, p.rows) == (16, 48)
    # four hosts (16 data-parallel x 4 = 64): a host's 1 task x 8 rows pads to its share
    # 64 / gcd(64, 4) = 16, so 4 x 16
    _, p = _plan("babyai_cpu", "", "v5p:2x2x4", train__tasks_per_step=4, train__minibatches=4)
    assert (p.row_multiple, p.rows) == (64, 64)
    with pytest.raises(ValueError, match="tasks_per_step=6 does not divide among 4 hosts"):
        _plan("babyai_cpu", "", "v5p:2x2x4", train__tasks_per_step=6)


# ----------------------------------------------------------------------------- every config


@pytest.mark.parametrize("name,variant", shipped())
def test_compile_check_plans_every_config_as_the_trainer_runs_it(name, variant):
    config = load(name, variant)
    topology = "v5p:2x2x4" if config.train.tasks_per_step % 4 == 0 else "v5e:2x2"
    devices = _devices(topology)
    p = aot.plan(config, topology, devices=devices)
    learner, sampler = placement.split_devices(config, devices, 0)  # the trainer's call
    assert p.learner_devices == learner and p.sampler_devices == sampler
    assert p.rows == shapes.step_rows(config, p.learner.row_multiple(), p.hosts)
    assert p.rows % p.row_multiple == 0
    assert p.rows >= config.train.tasks_per_step * shapes.rows_per_task(config)
    if config.rollout.max_staleness and config.rollout.engine == "jax":
        assert len(learner) + len(sampler) * p.hosts == len(devices)
        assert not {d.id for d in learner} & {d.id for d in sampler}
    else:
        assert learner == devices and len(sampler) <= 4


def test_the_trainer_splits_its_own_devices_by_the_same_function():
    # 8 fake CPU devices, one process: the default is jax.devices() and this host
    config = load("textcraft_bapo", "")
    import jax
    learner, sampler = placement.split_devices(config)
    assert [d.id for d in sampler] == [0, 1, 2, 3] and [d.id for d in learner] == [4, 5, 6, 7]
    assert placement.split_devices(config, jax.devices()) == (learner, sampler)


# ----------------------------------------------------------------------------- the trainer's pieces


def _traj(group, version, length=5):
    n = length
    return Trajectory(tokens=np.ones(n, np.int32), loss_mask=np.array([False] + [True] * (n - 1)),
                      behaviour_logprobs=np.zeros(n, np.float32),
                      turn_ids=np.array([-1] + [0] * (n - 1), np.int32), rewards=[1.0],
                      reward=1.0, success=True, num_turns=1, weight_versions=[version],
                      task_id=f"t{group}", group_id=group, finish="stop", messages=[], info={})


@pytest.mark.parametrize("capacity", [None, 2])
def test_the_replay_buffer_and_batcher_make_the_planned_rows(capacity):
    """ReplayBuffer.mix as the trainer builds and calls it, run to its steady state, and the
    batch trajectories_to_batch pads from it: the rows shapes.step_rows plans (one host)."""
    config = load("bapo_offpolicy", "replay,smoke")
    if capacity is not None:  # a buffer smaller than what mix wants
        config.train.replay.capacity = capacity
    r, t = config.train.replay, config.train
    replay = ReplayBuffer(ReplayConfig(capacity=r.capacity, fraction=r.fraction,
                                       max_staleness=r.max_staleness, seed=config.seed))
    multiple = 8  # e.g. 4 data-parallel x 2 minibatches
    g = t.samples_per_task
    for step in range(1, 8):
        fresh = [[_traj(step * 100 + i, step - 1) for _ in range(g)]
                 for i in range(t.tasks_per_step)]
        groups, _ = replay.mix(fresh, step - 1, step)
        rows = [traj for group in groups for traj in group]
        assert len(rows) <= shapes.host_rows(config, 1)
    assert len(rows) == shapes.host_rows(config, 1)  # steady state: the largest batch
    batch = trajectories_to_batch(rows, length_buckets=t.length_buckets,
                                  row_multiple=shapes.host_row_multiple(multiple, 1))
    assert len(batch["tokens"]) == shapes.step_rows(config, multiple, 1)
    # 4 fresh groups of 2: ceil(0.5 / 0.5 x 4) = 4 replayed, or the 2 a buffer of 2 holds
    assert shapes.host_rows(config, 1) == (4 + (4 if capacity is None else 2)) * g


def test_selfplay_plays_the_planned_rows_whatever_share_of_proposals_is_valid():
    """SelfPlayTrainer._play (the real game: env, agent loop, fillers) with a scripted engine
    whose proposals alternate valid and invalid: G (1 + S) rows a task slot."""
    from rl_tpu.models.tiny_tokenizer import build_tokenizer
    from rl_tpu.models.tokenizer import ChatTokenizer
    from rl_tpu.recipes.selfplay import SelfPlayTrainer
    from rl_tpu.rollout.scripted import ScriptedEngine

    config = load("selfplay_arithmetic", "smoke")
    proposals = iter(["3 + 4", "no problem here"] * 100)

    def policy(text, turn):
        return next(proposals) if "Write a new arithmetic problem." in text else "7"

    trainer = object.__new__(SelfPlayTrainer)  # the game needs no model, learner or mesh
    trainer.config, trainer.make_env = config, env_factory.make_env_factory(config)
    trainer.tokenizer = ChatTokenizer(build_tokenizer(512))
    trainer.engine = ScriptedEngine(trainer.tokenizer, policy)
    tasks = [(i, Task(f"propose/{i}", {"role": "propose"})) for i in range(3)]
    rows = trainer._play(tasks, 1, 0)
    g, s = config.train.samples_per_task, config.selfplay.solver_samples
    assert len(rows) == 3 * g * (1 + s) == 3 * shapes.rows_per_task(config)
    assert sum(t.info.get("role") == "solve" for t in rows) == 3 * s  # half the proposals
