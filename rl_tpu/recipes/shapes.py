"""The rows of one RL step's batch, as the trainer builds it and launch.compile_check compiles it.

Shape letters: B rows (trajectories), G samples a task (train.samples_per_task), S self-play's
solver samples a proposal (selfplay.solver_samples).

One host's step is `tasks_per_step // hosts` task slots:
  fresh     G rows a slot (recipes/rl.py `_play`); self-play's slot is G proposals, each with S
            solver rows, or S loss-free fillers when the proposal is invalid: G (1 + S) rows,
            whatever share of proposals is valid (recipes/selfplay.py, which checks it)
  replayed  with train.replay, `ReplayBuffer.mix` adds ceil(fraction / (1 - fraction) x fresh
            groups) groups from the buffer, at most its capacity (fewer while it fills: the
            steady state is the largest batch, the one that must fit)
  padding   up to this host's share of the learner's row multiple (`Trainer._row_multiple`,
            `trajectories_to_batch`)
and the global batch is every host's rows. launch.compile_check (rl_tpu/aot.py) compiles the
learner at `step_rows`; tests/recipes/test_shapes.py checks the trainer's pieces give the same.
Where the learner's and the sampler's devices are is placement.split_devices.
"""

from __future__ import annotations

import math

import ml_collections


def rows_per_task(config: ml_collections.ConfigDict) -> int:
    """Trajectories one task slot adds to a step: G; self-play's G (1 + S)."""
    g = config.train.samples_per_task
    if config.recipe == "selfplay":
        return g * (1 + config.selfplay.solver_samples)
    return g


def groups_per_task(config: ml_collections.ConfigDict) -> int:
    """The most groups (`trajectory.groups_of`) one task slot adds: 1; self-play's proposal
    group and a solver group for each of its G proposals, when all are valid."""
    if config.recipe == "selfplay":
        return 1 + config.train.samples_per_task
    return 1


def replay_groups(config: ml_collections.ConfigDict, fresh_groups: int) -> int:
    """The most groups `ReplayBuffer.mix` replays beside `fresh_groups` fresh ones on one host:
    what it wants (the same float arithmetic), at most the buffer's capacity; 0 without
    replay."""
    r = config.train.replay
    if not r.capacity:
        return 0
    want = math.ceil(r.fraction / (1.0 - r.fraction) * fresh_groups)
    return min(want, r.capacity)


def host_rows(config: ml_collections.ConfigDict, hosts: int) -> int:
    """The most trajectories one of `hosts` hosts batches in a step (before padding): its
    fresh rows plus its replayed groups' (each at most a task slot's rows: G, and for
    self-play with replay an upper bound, its groups differing in size)."""
    tasks = config.train.tasks_per_step
    if tasks % hosts:  # as data.tasks.TaskStream refuses it
        raise ValueError(f"train.tasks_per_step={tasks} does not divide among {hosts} hosts; "
                         f"use a multiple of {hosts}")
    slots = tasks // hosts
    replayed = replay_groups(config, slots * groups_per_task(config))
    return (slots + replayed) * rows_per_task(config)


def host_row_multiple(row_multiple: int, hosts: int) -> int:
    """One host's share of the learner's global row multiple: every host pads its rows to it,
    so the global rows (hosts x a multiple of it) are a multiple of `row_multiple`."""
    return row_multiple // math.gcd(row_multiple, hosts)


def step_rows(config: ml_collections.ConfigDict, row_multiple: int, hosts: int) -> int:
    """The global rows B of one step's batch at its largest: each host's `host_rows` padded to
    its share of the learner's `row_multiple` (`Learner.row_multiple()`), times `hosts`."""
    m = host_row_multiple(row_multiple, hosts)
    return hosts * -(-host_rows(config, hosts) // m) * m
