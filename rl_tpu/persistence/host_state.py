"""Host-side state saved beside a checkpoint (the producer's, the replay buffer's), as data.

A checkpoint step's sharded arrays are orbax's (checkpoint.py); what lives only on one
host's Python side (the task stream's position, played-but-not-trained `Trajectory` lists,
`(position, Task)` tuples, chunk metrics, replay groups) is written here, one file per process
per step: `<checkpoint dir>/host/<step>.process<i>.hoststate`.

Format: no pickle. A workdir file must never be able to run code when read (a checkpoint is
copied between machines and users), and a pickle of `Trajectory` also breaks whenever a class
moves. The file is

    b"rl_tpu host state 1\\n" b"sha256 <64 hex digits of the payload>\\n" <payload>

and the payload is a numpy .npz (a zip of .npy files, read with allow_pickle=False): member
"structure" holds the JSON text of the tree, in which each array stands as {"$array": k} and
is member "a<k>", so arrays keep their dtype and bytes exactly and the rest stays readable by
any JSON tool. (flax.serialization's msgpack was the other candidate: it has no int dict keys,
tuples or dataclasses either, so it would need the same tagging, and is opaque to read.)

What a tree may hold, and how it is written (anything else is refused, naming where it is):

    None, bool, int, float (NaN and inf too), str    as JSON
    list                                             a JSON list
    dict with str keys (none starting with "$")      a JSON object
    any other dict (int keys...)                     {"$dict": [[key, value], ...]}
    tuple                                            {"$tuple": [...]}
    numpy array (not dtype object), bytes            {"$array": k}, {"$bytes": k}
    numpy scalar (np.float32(1.0)...)                {"$scalar": k}: a 0-d array
    a registered dataclass (Trajectory, Task...)     {"$dataclass": name, "fields": {...}}

Only dataclasses named in the registry are rebuilt on read (`register` adds one): a file names
a class, it never makes the reader import one.

The checksum covers the whole payload: a file cut short by a full disk or with one flipped
byte fails to read (`HostStateCorruptError`), and the Checkpointer then treats that step as
damaged and resumes from the one before it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import re
from typing import Any, Optional

import numpy as np

from rl_tpu.core.env import StepResult, Task
from rl_tpu.core.trajectory import Trajectory

MAGIC = b"rl_tpu host state 1\n"
SUFFIX = ".hoststate"
PICKLE_SUFFIX = ".pkl"  # what rl_tpu wrote before this format: refused, never read
_TAG = "$"

_REGISTRY: dict[str, type] = {}


class HostStateError(ValueError):
    """A host state that cannot be written or read as it is (a type the format does not hold,
    a file of another format)."""


class HostStateCorruptError(HostStateError):
    """A host-state file whose bytes do not match their checksum, or that is cut short."""


class PickledHostStateError(HostStateError):
    """A checkpoint directory holding host state pickled by an earlier rl_tpu."""


# ---------------------------------------------------------------------------------------------
# Registry of the dataclasses a host state may hold
# ---------------------------------------------------------------------------------------------

def register(cls: type) -> type:
    """Lets instances of dataclass `cls` be written and rebuilt (every field an init field)."""
    if not dataclasses.is_dataclass(cls) or not isinstance(cls, type):
        raise TypeError(f"{cls!r} is not a dataclass class; only dataclasses can be registered")
    if any(not f.init for f in dataclasses.fields(cls)):
        raise TypeError(f"{cls.__qualname__} has fields outside __init__; it cannot be rebuilt "
                        "from its fields")
    _REGISTRY[_class_name(cls)] = cls
    return cls


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# The names the built-in classes were written under before they moved to rl_tpu/core: a
# checkpoint saved then still resumes (tests/persistence/data/before_core.hoststate).
FORMER_NAMES = {"rl_tpu.agent.trajectory.Trajectory": "rl_tpu.core.trajectory.Trajectory",
                "rl_tpu.envs.base.Task": "rl_tpu.core.env.Task",
                "rl_tpu.envs.base.StepResult": "rl_tpu.core.env.StepResult"}


def _registry() -> dict[str, type]:
    if not _REGISTRY:
        for cls in (Trajectory, Task, StepResult):
            register(cls)
    return _REGISTRY


# ---------------------------------------------------------------------------------------------
# Tree <-> (JSON structure, arrays)
# ---------------------------------------------------------------------------------------------

def _encode(value: Any, arrays: list, where: str) -> Any:
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if isinstance(value, np.generic):  # before float: np.float64 is a float subclass
        arrays.append(np.asarray(value))
        _check_array(arrays[-1], where)
        return {"$scalar": len(arrays) - 1}
    if kind is np.ndarray:
        _check_array(value, where)
        arrays.append(value)
        return {"$array": len(arrays) - 1}
    if kind is bytes:
        arrays.append(np.frombuffer(value, np.uint8))
        return {"$bytes": len(arrays) - 1}
    if kind is list:
        return [_encode(v, arrays, f"{where}[{i}]") for i, v in enumerate(value)]
    if kind is tuple:
        return {"$tuple": [_encode(v, arrays, f"{where}[{i}]") for i, v in enumerate(value)]}
    if kind is dict:
        if all(type(k) is str and not k.startswith(_TAG) for k in value):
            return {k: _encode(v, arrays, f"{where}[{k!r}]") for k, v in value.items()}
        return {"$dict": [[_encode(k, arrays, f"{where} key {k!r}"),
                           _encode(v, arrays, f"{where}[{k!r}]")] for k, v in value.items()]}
    if dataclasses.is_dataclass(value) and _registry().get(_class_name(kind)) is kind:
        return {"$dataclass": _class_name(kind),
                "fields": {f.name: _encode(getattr(value, f.name), arrays, f"{where}.{f.name}")
                           for f in dataclasses.fields(value)}}
    raise HostStateError(
        f"host state at {where} is a {kind.__module__}.{kind.__qualname__}, which the host-state "
        "format does not hold (None, bool, int, float, str, list, tuple, dict, bytes, numpy "
        f"arrays and scalars, and the registered dataclasses {sorted(_registry())}). Convert "
        "it to one of these, or register its dataclass with rl_tpu.persistence.host_state.register")


def _check_array(array: np.ndarray, where: str) -> None:
    if array.dtype.hasobject:
        raise HostStateError(f"host state at {where} is a numpy array of dtype "
                             f"{array.dtype}, which holds Python objects; store numbers, or "
                             "a list of the objects")


def _decode(node: Any, arrays: dict, what: str) -> Any:
    if isinstance(node, list):
        return [_decode(v, arrays, what) for v in node]
    if not isinstance(node, dict):
        return node
    tags = [k for k in node if k.startswith(_TAG)]
    if not tags:
        return {k: _decode(v, arrays, what) for k, v in node.items()}
    tag = tags[0]
    if tag in ("$array", "$scalar", "$bytes"):
        key = f"a{node[tag]}"
        if key not in arrays:
            raise HostStateCorruptError(f"{what}: its structure names array {key}, which the "
                                        "file does not hold")
        array = arrays[key]
        return array.tobytes() if tag == "$bytes" else array[()] if tag == "$scalar" else array
    if tag == "$tuple":
        return tuple(_decode(v, arrays, what) for v in node[tag])
    if tag == "$dict":
        return {_decode(k, arrays, what): _decode(v, arrays, what) for k, v in node[tag]}
    if tag == "$dataclass":
        cls = _registry().get(FORMER_NAMES.get(node[tag], node[tag]))
        if cls is None:
            raise HostStateError(f"{what} holds a {node[tag]}, which is not a registered "
                                 "host-state dataclass; read it with the rl_tpu version that "
                                 "wrote it")
        return cls(**{k: _decode(v, arrays, what) for k, v in node["fields"].items()})
    raise HostStateCorruptError(f"{what}: unknown tag {tag!r} in its structure")


def encode(tree: Any) -> bytes:
    """`tree` as the bytes of one host-state file (header, checksum, payload)."""
    arrays: list[np.ndarray] = []
    structure = _encode(tree, arrays, "the root")
    text = json.dumps(structure, allow_nan=True, separators=(",", ":")).encode()
    buffer = io.BytesIO()
    np.savez(buffer, structure=np.frombuffer(text, np.uint8),
             **{f"a{i}": a for i, a in enumerate(arrays)})
    payload = buffer.getvalue()
    return MAGIC + b"sha256 " + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload


def decode(data: bytes, what: str = "host state") -> Any:
    """The tree of `encode`'s bytes; HostStateCorruptError when they fail their checksum."""
    if not data.startswith(MAGIC):
        raise HostStateError(f"{what} is not an rl_tpu host-state file (it does not start with "
                             f"{MAGIC!r})")
    header_end = data.find(b"\n", len(MAGIC))
    header = data[len(MAGIC):header_end]
    match = re.fullmatch(rb"sha256 ([0-9a-f]{64})", header)
    if header_end < 0 or match is None:
        raise HostStateCorruptError(f"{what}: its checksum line is damaged")
    payload = data[header_end + 1:]
    if hashlib.sha256(payload).hexdigest().encode() != match.group(1):
        raise HostStateCorruptError(f"{what} fails its sha256 checksum: the file was damaged "
                                    f"(cut short or changed; {len(payload)} payload bytes)")
    with np.load(io.BytesIO(payload), allow_pickle=False) as npz:
        arrays = {name: npz[name] for name in npz.files}
    structure = json.loads(arrays.pop("structure").tobytes().decode())
    return _decode(structure, arrays, what)


# ---------------------------------------------------------------------------------------------
# Files: one per process per step
# ---------------------------------------------------------------------------------------------

def path(directory: str, step: int, process: int) -> str:
    return os.path.join(directory, f"{int(step)}.process{int(process)}{SUFFIX}")


def write(file_path: str, tree: Any) -> None:
    """Writes `tree` to `file_path` atomically: a kill leaves the old file or the new one."""
    data = encode(tree)
    os.makedirs(os.path.dirname(file_path) or ".", exist_ok=True)
    with open(file_path + ".tmp", "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(file_path + ".tmp", file_path)


def read(file_path: str) -> Any:
    with open(file_path, "rb") as f:
        data = f.read()
    return decode(data, f"host state {file_path}")


def saved_steps(directory: str, process: int) -> list[int]:
    """Steps with a host-state file of `process` in `directory`, oldest first."""
    pattern = re.compile(rf"(\d+)\.process{int(process)}{re.escape(SUFFIX)}")
    if not os.path.isdir(directory):
        return []
    return sorted(int(m.group(1)) for m in map(pattern.fullmatch, os.listdir(directory)) if m)


def refuse_pickles(directory: str) -> None:
    """Raises PickledHostStateError if `directory` holds host state an earlier rl_tpu pickled.

    Such a file is never unpickled: unpickling runs whatever code the file names."""
    pickled = _pickled_files(directory)
    if pickled:
        raise PickledHostStateError(
            f"{directory} holds host state pickled by an earlier rl_tpu ({', '.join(pickled[:3])}"
            f"{', ...' if len(pickled) > 3 else ''}); this version never unpickles a workdir "
            "file. Start a new --workdir, or finish this run with the rl_tpu version that wrote "
            "it")


def _pickled_files(directory: str) -> list[str]:
    if not os.path.isdir(directory):
        return []
    return sorted(name for name in os.listdir(directory)
                  if re.fullmatch(rf"\d+\.process\d+{re.escape(PICKLE_SUFFIX)}", name))


def prune(directory: str, process: int, keep: set[int], below: int) -> None:
    """Deletes `process`'s host-state files of steps under `below` that are not in `keep`
    (their checkpoints were deleted by retention or never completed)."""
    for step in saved_steps(directory, process):
        if step < below and step not in keep:
            os.remove(path(directory, step, process))


def read_if_saved(directory: str, step: int, process: int) -> Optional[Any]:
    """The host state of `step`, or None when `process` saved none in `directory` at all (a
    checkpoint from before host state existed). One missing while other steps have theirs
    is damage: HostStateCorruptError."""
    file_path = path(directory, step, process)
    if os.path.exists(file_path):
        return read(file_path)
    if saved_steps(directory, process):
        raise HostStateCorruptError(f"host state {file_path} is missing, while the host states "
                                    f"of steps {saved_steps(directory, process)} are there")
    return None
