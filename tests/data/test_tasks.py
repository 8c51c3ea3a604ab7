"""TaskStream / eval_tasks: determinism, host shares, unique group ids, exact resume, epochs."""

import json
import logging

import pytest

from rl_tpu.core.env import Task, TaskSource
from rl_tpu.data.tasks import TaskStream, eval_tasks


class ListSource(TaskSource):
    """`size` tasks per split (None: unbounded), task i of a split is "<split>/<i>"."""

    def __init__(self, size):
        self._size = size
        self.calls = 0

    def size(self, split):
        self.check_split(split)
        return self._size

    def get(self, split, index):
        self.calls += 1
        if self._size is not None and not 0 <= index < self._size:
            raise IndexError(index)
        return Task(f"{split}/{index}", {"index": index})


def indices(batch):
    return [task.data["index"] for _, task in batch]


def positions(batch):
    return [position for position, _ in batch]


def take(stream, steps):
    return [stream.next() for _ in range(steps)]


def single(source, **kwargs):
    kwargs.setdefault("tasks_per_step", 4)
    return TaskStream(source, process_index=0, process_count=1, **kwargs)


@pytest.mark.parametrize("size", [10, None])
def test_positions_are_the_global_stream(size):
    batches = take(single(ListSource(size), tasks_per_step=4), 6)
    # step s holds positions 4s .. 4s+3: unique over steps, so usable as group ids.
    assert [positions(b) for b in batches] == [list(range(4 * s, 4 * s + 4)) for s in range(6)]
    assert all(task.task_id == f"train/{task.data['index']}" for b in batches for _, task in b)


def test_unbounded_source_yields_positions_as_indices():
    batches = take(single(ListSource(None), tasks_per_step=3, seed=5), 4)
    assert [indices(b) for b in batches] == [positions(b) for b in batches]


def test_deterministic_by_seed():
    def run(seed):
        return [indices(b) for b in take(single(ListSource(50), seed=seed), 10)]

    assert run(1) == run(1)
    assert run(1) != run(2)  # fixed seeds: a deterministic fact, not a probabilistic check


def test_epoch_visits_every_index_once_and_reshuffles():
    size, per_step = 7, 3  # steps straddle epoch boundaries
    stream = single(ListSource(size), tasks_per_step=per_step, seed=3)
    flat = [i for b in take(stream, 7) for i in indices(b)]  # 21 positions = 3 epochs
    epochs = [flat[e * size:(e + 1) * size] for e in range(3)]
    assert all(sorted(epoch) == list(range(size)) for epoch in epochs)
    assert epochs[0] != list(range(size))  # shuffled ...
    assert epochs[0] != epochs[1]  # ... differently each epoch


def test_no_shuffle_is_file_order_repeated():
    stream = single(ListSource(5), tasks_per_step=2, shuffle=False)
    assert [i for b in take(stream, 5) for i in indices(b)] == [0, 1, 2, 3, 4] * 2


@pytest.mark.parametrize("size", [13, None])
@pytest.mark.parametrize("hosts", [2, 4])
def test_hosts_together_get_the_single_host_step(size, hosts):
    whole = take(single(ListSource(size), tasks_per_step=8, seed=7), 5)
    shares = [take(TaskStream(ListSource(size), tasks_per_step=8, seed=7, process_index=h,
                              process_count=hosts), 5) for h in range(hosts)]
    for step in range(5):
        union = [item for h in range(hosts) for item in shares[h][step]]
        assert positions(union) == positions(whole[step])
        assert indices(union) == indices(whole[step])
        assert all(len(shares[h][step]) == 8 // hosts for h in range(hosts))


@pytest.mark.parametrize("size", [None, 3])
def test_one_task_a_host(size):
    """Self-play's and TL-GRPO's smokes: 2 tasks a step on 2 hosts, from a procedural source
    or a bounded one (grain's slice of sys.maxsize batches of one overflowed)."""
    shares = [take(TaskStream(ListSource(size), tasks_per_step=2, process_index=h,
                              process_count=2, shuffle=False), 3) for h in range(2)]
    assert [positions(shares[0][s]) + positions(shares[1][s]) for s in range(3)] == \
        [[0, 1], [2, 3], [4, 5]]
    if size:  # positions go on, indices wrap around the split
        assert [indices(shares[h][2]) for h in range(2)] == [[1], [2]]


def test_group_ids_unique_over_hosts_and_steps():
    ids = [p for h in range(2)
           for b in take(TaskStream(ListSource(3), tasks_per_step=6, process_index=h,
                                    process_count=2), 10)
           for p in positions(b)]
    assert len(ids) == len(set(ids)) == 60  # 20 epochs of a 3-task split, ids still unique


@pytest.mark.parametrize("size", [11, None])
def test_resume_equals_uninterrupted(size):
    uninterrupted = take(single(ListSource(size), seed=9), 8)
    first = single(ListSource(size), seed=9)
    take(first, 3)
    state = json.loads(json.dumps(first.get_state()))  # survives a JSON checkpoint
    assert state["step"] == 3
    resumed = single(ListSource(size), seed=9)
    resumed.set_state(state)
    rest = take(resumed, 5)
    assert [positions(b) for b in rest] == [positions(b) for b in uninterrupted[3:]]
    assert [indices(b) for b in rest] == [indices(b) for b in uninterrupted[3:]]


def test_resume_on_another_number_of_hosts():
    one = single(ListSource(20), tasks_per_step=4, seed=2)
    take(one, 4)
    state = one.get_state()
    expected = one.next()
    shares = []
    for h in range(2):
        stream = TaskStream(ListSource(20), tasks_per_step=4, seed=2, process_index=h,
                            process_count=2)
        stream.set_state(state)
        shares += stream.next()
    assert shares == expected


def test_resume_can_go_back():
    stream = single(ListSource(6), seed=4)
    start, first = stream.get_state(), stream.next()
    take(stream, 3)
    stream.set_state(start)
    assert stream.next() == first


def test_state_of_another_stream_is_refused():
    state = single(ListSource(10), seed=1).get_state()
    with pytest.raises(ValueError, match="seed: saved 1, now 2"):
        single(ListSource(10), seed=2).set_state(state)
    with pytest.raises(ValueError, match="size: saved 10, now 12"):
        single(ListSource(12), seed=1).set_state(state)
    with pytest.raises(ValueError, match="not a TaskStream state"):
        single(ListSource(10), seed=1).set_state({"step": 3})


def test_prefetch_gives_the_same_stream():
    plain = take(single(ListSource(30), seed=6), 6)
    stream = single(ListSource(30), seed=6, prefetch_steps=3)
    take(stream, 2)
    state = stream.get_state()  # the state counts consumed steps, not prefetched ones
    assert state["step"] == 2
    ahead = single(ListSource(30), seed=6, prefetch_steps=3)
    ahead.set_state(state)
    assert take(ahead, 4) == plain[2:]


def test_loads_only_what_is_asked_for():
    source = ListSource(1000)
    stream = TaskStream(source, tasks_per_step=8, process_index=1, process_count=4)
    take(stream, 3)
    assert source.calls == 3 * 2  # this host's 2 tasks a step, nothing read ahead


def test_bad_arguments():
    with pytest.raises(ValueError, match="does not divide among 3 hosts; use a multiple of 3"):
        TaskStream(ListSource(10), tasks_per_step=4, process_index=0, process_count=3)
    with pytest.raises(ValueError, match="positive int"):
        single(ListSource(10), tasks_per_step=0)
    with pytest.raises(ValueError, match="not a host"):
        TaskStream(ListSource(10), tasks_per_step=4, process_index=2, process_count=2)
    with pytest.raises(ValueError, match="has no tasks"):
        single(ListSource(0))
    with pytest.raises(ValueError, match="unknown split"):
        single(ListSource(10), split="test")
    with pytest.raises(ValueError, match="seed"):
        single(ListSource(10), seed=-1)


def test_hosts_default_to_jax():
    stream = TaskStream(ListSource(10), tasks_per_step=4)  # one process here
    assert (stream.process_index, stream.process_count) == (0, 1)
    assert len(stream.next()) == 4


def test_eval_tasks_hosts_share_the_first_num():
    whole = eval_tasks(ListSource(100), "eval", 10, process_index=0, process_count=1)
    assert [i for i, _ in whole] == list(range(10))
    assert [t.task_id for _, t in whole] == [f"eval/{i}" for i in range(10)]
    shares = [eval_tasks(ListSource(100), "eval", 10, process_index=h, process_count=3)
              for h in range(3)]
    assert [len(s) for s in shares] == [3, 3, 4]
    assert [item for s in shares for item in s] == whole
    assert eval_tasks(ListSource(None), num=5, process_index=0, process_count=1) == whole[:5]


def test_eval_tasks_small_split_and_unbounded(caplog):
    with caplog.at_level(logging.WARNING):
        got = eval_tasks(ListSource(4), "eval", 10, process_index=0, process_count=1)
    assert len(got) == 4 and "fewer than the 10 asked for" in caplog.text
    assert len(eval_tasks(ListSource(6), process_index=0, process_count=1)) == 6  # num=None: all
    with pytest.raises(ValueError, match="unbounded"):
        eval_tasks(ListSource(None), process_index=0, process_count=1)
