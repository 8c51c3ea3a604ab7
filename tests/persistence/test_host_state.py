"""Host state's data format on real files: a round trip of real Trajectory / Task objects,
the checksum, and the refusal of what the format does not hold."""

import dataclasses
import hashlib
import io
import json
import math
import os

import numpy as np
import pytest

from rl_tpu.persistence import host_state
from rl_tpu.core.env import StepResult, Task
from rl_tpu.core.trajectory import Trajectory


def make_trajectory(group_id=7):
    # prompt ids 1, 2 (turn -1), then turn 0: sampled ids 3, 4 and an observation id 5
    return Trajectory(
        tokens=np.array([1, 2, 3, 4, 5], np.int32),
        loss_mask=np.array([False, False, True, True, False]),
        behaviour_logprobs=np.array([0.0, 0.0, -0.5, -1.25, 0.0], np.float32),
        turn_ids=np.array([-1, -1, 0, 0, 0], np.int32),
        rewards=[0.5], reward=0.5, success=True, num_turns=1, weight_versions=[3],
        task_id="countdown/train/7", group_id=group_id, finish="stop",
        messages=[{"role": "user", "content": "make 10"}, {"role": "assistant", "content": "5+5"}],
        info={"task": (group_id, Task("countdown/train/7", {"numbers": (5, 5), "target": 10})),
              "env_step_s": np.float32(0.25), "error": None, "step_infos": [{"valid": True}]})


def producer_state():
    """What AsyncProducer.state (deterministic) and ReplayBuffer.state give, in miniature."""
    traj = make_trajectory()
    return {"producer": {"mode": "deterministic", "next_chunk": 5,
                         "stream": {"version": 1, "step": 4, "split": "train", "size": None},
                         "chunks": {3: [traj, make_trajectory(8)], 4: []},
                         "chunk_metrics": {3: {"rollout/staleness_mean": 1.5,
                                               "rollout/nan": float("nan")}, 4: {}},
                         "pending": [(12, Task("countdown/train/12"))]},
            "replay": [[traj]]}


def test_round_trip_of_trajectories_and_tasks_keeps_types_and_values(tmp_path):
    path = str(tmp_path / "4.process0.hoststate")
    host_state.write(path, producer_state())
    got = host_state.read(path)

    producer = got["producer"]
    assert sorted(producer["chunks"]) == [3, 4]  # int keys stay ints
    assert producer["chunks"][4] == [] and producer["next_chunk"] == 5
    assert producer["stream"] == {"version": 1, "step": 4, "split": "train", "size": None}
    assert producer["chunk_metrics"][3]["rollout/staleness_mean"] == 1.5
    assert math.isnan(producer["chunk_metrics"][3]["rollout/nan"])
    (position, task), = producer["pending"]
    assert (position, task) == (12, Task("countdown/train/12"))
    assert type(producer["pending"][0]) is tuple and task.data == {}

    traj = producer["chunks"][3][0]
    assert type(traj) is Trajectory
    assert traj.tokens.dtype == np.int32 and traj.tokens.tolist() == [1, 2, 3, 4, 5]
    assert traj.loss_mask.dtype == np.bool_
    assert traj.loss_mask.tolist() == [False, False, True, True, False]
    assert traj.behaviour_logprobs.dtype == np.float32
    assert traj.behaviour_logprobs.tolist() == [0.0, 0.0, -0.5, -1.25, 0.0]
    # turn 0's version 3 on its two sampled ids, -1 elsewhere (computed when first made)
    assert traj.token_versions.tolist() == [-1, -1, 3, 3, -1]
    assert (traj.rewards, traj.reward, traj.success, traj.num_turns) == ([0.5], 0.5, True, 1)
    assert (traj.weight_versions, traj.task_id, traj.group_id, traj.finish) == (
        [3], "countdown/train/7", 7, "stop")
    assert traj.messages[1] == {"role": "assistant", "content": "5+5"}
    assert traj.oldest_version == 3
    info = traj.info
    assert info["task"] == (7, Task("countdown/train/7"))
    assert info["task"][1].data == {"numbers": (5, 5), "target": 10}
    assert type(info["env_step_s"]) is np.float32 and info["env_step_s"] == 0.25
    assert info["error"] is None and info["step_infos"] == [{"valid": True}]
    assert producer["chunks"][3][1].group_id == 8
    assert got["replay"][0][0].task_id == "countdown/train/7"


def test_dicts_with_tag_like_keys_bytes_and_nested_tuples_round_trip():
    tree = {"$array": 1, (1, "a"): b"\x00\xff", "x": ((), (1.0, -0.0)), 2.5: [True, None]}
    got = host_state.decode(host_state.encode(tree))
    assert got == tree and list(got) == list(tree)  # order kept too
    assert math.copysign(1.0, got["x"][1][1]) == -1.0


def test_a_flipped_byte_fails_the_checksum(tmp_path):
    path = tmp_path / "4.process0.hoststate"
    host_state.write(str(path), producer_state())
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, in the payload
    path.write_bytes(bytes(data))
    with pytest.raises(host_state.HostStateCorruptError,
                       match=r"4\.process0\.hoststate fails its sha256 checksum"):
        host_state.read(str(path))


def test_a_file_cut_short_fails_the_checksum(tmp_path):
    path = tmp_path / "4.process0.hoststate"
    host_state.write(str(path), producer_state())
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(host_state.HostStateCorruptError, match="checksum"):
        host_state.read(str(path))


def test_a_pickle_is_not_a_host_state_file(tmp_path):
    import pickle
    data = pickle.dumps({"producer": {}})
    with pytest.raises(host_state.HostStateError, match="not an rl_tpu host-state file"):
        host_state.decode(data)


@dataclasses.dataclass
class Unregistered:
    x: int = 1


@pytest.mark.parametrize("value,what", [
    (object(), "builtins.object"),
    ({1, 2}, "builtins.set"),
    (Unregistered(), "Unregistered"),
    (np.array([None, 1], dtype=object), "dtype object"),
])
def test_a_type_the_format_does_not_hold_is_refused_naming_where(value, what):
    tree = {"producer": {"chunks": {3: [make_trajectory()]}, "extra": [1, value]}}
    with pytest.raises(host_state.HostStateError, match=what) as err:
        host_state.encode(tree)
    assert "['producer']['extra'][1]" in str(err.value)


def test_an_unregistered_dataclass_in_a_file_is_not_rebuilt():
    # A well-formed file (right checksum) naming a class outside the registry: never imported.
    structure = json.dumps({"t": {"$dataclass": "subprocess.Popen", "fields": {"args": "ls"}}})
    buffer = io.BytesIO()
    np.savez(buffer, structure=np.frombuffer(structure.encode(), np.uint8))
    payload = buffer.getvalue()
    forged = (host_state.MAGIC + b"sha256 " + hashlib.sha256(payload).hexdigest().encode()
              + b"\n" + payload)
    with pytest.raises(host_state.HostStateError,
                       match="subprocess.Popen, which is not a registered host-state dataclass"):
        host_state.decode(forged)


# Written by rl_tpu before the contracts moved to rl_tpu/core (commit 826fa83), when Trajectory
# was rl_tpu.agent.trajectory's and Task, StepResult rl_tpu.envs.base's: the names in the file.
BEFORE_CORE = os.path.join(os.path.dirname(__file__), "data", "before_core.hoststate")


def test_a_file_written_before_the_move_to_core_reads_back():
    with open(BEFORE_CORE, "rb") as f:
        assert b"rl_tpu.agent.trajectory.Trajectory" in f.read()  # zip members are stored
    tree = host_state.read(BEFORE_CORE)
    (trajectory,) = tree["pending"]
    assert type(trajectory) is Trajectory
    np.testing.assert_array_equal(trajectory.tokens, np.array([1, 2, 3, 4], np.int32))
    np.testing.assert_array_equal(trajectory.behaviour_logprobs,
                                  np.array([0, 0, -0.5, -0.25], np.float32))
    assert (trajectory.task_id, trajectory.group_id, trajectory.weight_versions) == ("t1", 3, [7])
    assert tree["tasks"] == [(5, Task("t1", {"question": "2 + 2?", "answer": "4"}))]
    assert tree["tasks"][0][1].data == {"question": "2 + 2?", "answer": "4"}
    assert tree["last_step"] == StepResult("done", 1.0, True, {"success": True})


def test_saved_steps_prune_and_missing_but_expected(tmp_path):
    directory = str(tmp_path)
    for step in (2, 4, 6):
        host_state.write(host_state.path(directory, step, 0), {"step": step})
    host_state.write(host_state.path(directory, 4, 1), {"step": 4})
    assert host_state.saved_steps(directory, 0) == [2, 4, 6]
    host_state.prune(directory, 0, keep={4}, below=6)  # 2 is gone, 6 is not below 6
    assert host_state.saved_steps(directory, 0) == [4, 6]
    assert host_state.saved_steps(directory, 1) == [4]  # another process's files untouched
    assert host_state.read_if_saved(directory, 6, 0) == {"step": 6}
    with pytest.raises(host_state.HostStateCorruptError, match=r"2\.process0.* is missing"):
        host_state.read_if_saved(directory, 2, 0)
    assert host_state.read_if_saved(str(tmp_path / "none"), 2, 0) is None  # none ever saved
