"""Training tasks as a grain pipeline: every step's tasks, split among hosts, resumable exactly.

    stream = TaskStream(env.tasks(), "train", tasks_per_step=64, seed=0)
    for step in range(num_steps):
        for group_id, task in stream.next():      # this host's share of the step's 64 tasks
            ...                                   # G samples of `task`, all with `group_id`
        checkpoint["tasks"] = stream.get_state()  # JSON; stream.set_state(...) resumes exactly

The global stream is one sequence of source indices, position p = step * tasks_per_step + j:

- bounded source (`size(split)` is an int): `MapDataset.range(size).shuffle(seed).repeat()`.
  grain's shuffle is a seeded index permutation (no buffer, nothing read ahead), and behind
  `repeat` it is re-seeded every epoch (`seed + epoch`), so each epoch visits every index once,
  in a new order, and position p maps to its index by arithmetic alone;
- unbounded source (`size` None, procedural): `MapDataset.range(2**62)`, i.e. p itself;
  such sources are reproducible per index already, and a shuffle would add nothing.

grain then cuts the stream into this host's steps: `batch(tasks_per_step // process_count)`
makes host-sized chunks (chunk c = step * process_count + host), `slice(host::process_count)`
keeps this host's chunk of every step, and `to_iter_dataset()` gives an iterator whose
checkpointable state is the next element, i.e. the next step. So host h gets the contiguous
positions [h * k, (h + 1) * k) of each step (k = tasks_per_step // process_count), all hosts
together get exactly the step's tasks, and each position is a group id unique over hosts and
steps. Because the state is the global step, a run can resume on a different number of hosts.

`eval_tasks` is the fixed counterpart for evaluation: the first `num` tasks of a split, split
among hosts, the same at every evaluation.
"""

from __future__ import annotations

import logging
from typing import Optional

from rl_tpu.core.env import Task, TaskSource

log = logging.getLogger(__name__)

_STATE_VERSION = 1
_MAX_SEED = 2**32  # grain's shuffle takes 32-bit seeds


def _hosts(process_index: Optional[int], process_count: Optional[int]) -> tuple[int, int]:
    """(index, count) of this host, from jax unless given (jax imported only then)."""
    if process_index is None or process_count is None:
        import jax

        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} is not a host of "
                         f"process_count={process_count}; need 0 <= index < count")
    return int(process_index), int(process_count)


def _bounded_size(source: TaskSource, split: str) -> Optional[int]:
    source.check_split(split)
    size = source.size(split)
    if size is not None and size <= 0:
        raise ValueError(f"split {split!r} of {type(source).__name__} has no tasks; "
                         "choose a split that has some, or add tasks to it")
    return size


_ENDLESS = 2**62  # stream positions: more than any run reads


class TaskStream:
    """This host's share of each training step's tasks, from a TaskSource split, forever."""

    def __init__(self, source: TaskSource, split: str = "train", *, tasks_per_step: int,
                 seed: int = 0, shuffle: bool = True, process_index: Optional[int] = None,
                 process_count: Optional[int] = None, prefetch_steps: int = 0):
        """`tasks_per_step` counts all hosts' tasks. `prefetch_steps` > 0 has grain load that
        many steps' tasks ahead in as many threads (for slow sources; the source's `get` must
        then be thread-safe); 0 loads each step when `next` asks for it."""
        import grain

        self.process_index, self.process_count = _hosts(process_index, process_count)
        if not isinstance(tasks_per_step, int) or tasks_per_step < 1:
            raise ValueError(f"tasks_per_step must be a positive int, got {tasks_per_step!r}")
        if tasks_per_step % self.process_count:
            raise ValueError(f"tasks_per_step={tasks_per_step} does not divide among "
                             f"{self.process_count} hosts; use a multiple of {self.process_count}")
        if not 0 <= seed < _MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**32) (grain's shuffle seed), got {seed}")
        if prefetch_steps < 0:
            raise ValueError(f"prefetch_steps must be >= 0, got {prefetch_steps}")
        self.source, self.split = source, split
        self.tasks_per_step, self.seed, self.shuffle = tasks_per_step, int(seed), bool(shuffle)
        self.size = _bounded_size(source, split)
        self.per_host = tasks_per_step // self.process_count

        # Streams are endless for any practical purpose: 2**62 positions. Not grain's own
        # endless length (sys.maxsize, for range(sys.maxsize) or repeat()): its batches of
        # one task (one task a host) overflow grain's slice of them.
        if self.size is None:
            indices = grain.MapDataset.range(_ENDLESS)
        else:
            indices = grain.MapDataset.range(self.size)
            if self.shuffle:
                indices = indices.shuffle(seed=self.seed)
            # after shuffle: each epoch re-seeded, see module doc
            indices = indices.repeat(num_epochs=max(1, _ENDLESS // self.size))
        steps = (indices
                 .map_with_index(lambda position, index: (position, index))
                 .batch(self.per_host, batch_fn=list)
                 .slice(slice(self.process_index, None, self.process_count))
                 .map(self._load))
        # Threads only on request: a TaskSource is not promised to be thread-safe.
        read = grain.ReadOptions(num_threads=prefetch_steps, prefetch_buffer_size=prefetch_steps)
        self._iterator = iter(steps.to_iter_dataset(read))

    def _load(self, chunk: list[tuple[int, int]]) -> list[tuple[int, Task]]:
        return [(int(position), self.source.get(self.split, int(index)))
                for position, index in chunk]

    @property
    def step(self) -> int:
        """The step the next `next()` returns."""
        return int(self._iterator.get_state()["next_index"])

    def next(self) -> list[tuple[int, Task]]:
        """This host's tasks of the next step, each with its global stream position (the
        group id: unique over hosts and steps)."""
        return next(self._iterator)

    def get_state(self) -> dict:
        """JSON-serialisable position, with what it is only valid for."""
        return {"version": _STATE_VERSION, "step": self.step, "split": self.split,
                "tasks_per_step": self.tasks_per_step, "seed": self.seed,
                "shuffle": self.shuffle, "size": self.size}

    def set_state(self, state: dict) -> None:
        """Resumes exactly: the next `next()` is what the uninterrupted stream would give.
        A state from a stream over other data or settings is an error, not a silent reshuffle."""
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise ValueError(f"not a TaskStream state (version {_STATE_VERSION}): {state!r}")
        mine = self.get_state()
        changed = {k: (state.get(k), mine[k]) for k in
                   ("split", "tasks_per_step", "seed", "shuffle", "size")
                   if state.get(k) != mine[k]}
        if changed:
            detail = ", ".join(f"{k}: saved {old!r}, now {new!r}"
                               for k, (old, new) in changed.items())
            raise ValueError(f"the saved task stream state does not fit this stream ({detail}); "
                             "resume with the settings and data it was saved with")
        step = state["step"]
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"state step must be a non-negative int, got {step!r}")
        # grain's iterator state is its next element: here, the next step.
        self._iterator.set_state({"next_index": step})


def eval_tasks(source: TaskSource, split: str = "eval", num: Optional[int] = None, *,
               process_index: Optional[int] = None,
               process_count: Optional[int] = None) -> list[tuple[int, Task]]:
    """The first `num` tasks of the split (all of a bounded split when None), this host's
    contiguous share (shares differ by at most one task), each with its index in the split.
    A bounded split smaller than `num` gives all it has, with a warning."""
    process_index, process_count = _hosts(process_index, process_count)
    source.check_split(split)
    size = source.size(split)
    if num is None:
        if size is None:
            raise ValueError(f"split {split!r} is unbounded (procedural); pass num= the number "
                             "of eval tasks")
        num = size
    if not isinstance(num, int) or num < 0:
        raise ValueError(f"num must be a non-negative int, got {num!r}")
    if size is not None and size < num:
        log.warning("eval split %r has %d tasks, fewer than the %d asked for; using all %d",
                    split, size, num, size)
        num = size
    # Host h gets [h * num // P, (h + 1) * num // P): contiguous, sizes within one of each other.
    start = process_index * num // process_count
    stop = (process_index + 1) * num // process_count
    return [(i, source.get(split, i)) for i in range(start, stop)]
