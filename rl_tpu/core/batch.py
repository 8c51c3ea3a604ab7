"""The rollout batch: every array an RL step moves from the host to the learner, declared once.

Shape letters: B rows, T length bucket, M turn slots (TL-GRPO's branch turns), S a mixture of
experts' sparse layers, K its experts per token.

`FIELDS` says, for each array, its dtype, its shape kind (per token [B, T], per row [B] or per
turn slot [B, M]) and which learner program reads it. Everything else reads that table: the
fields of `RolloutBatch`, the dtypes `trajectories_to_batch` makes, the arrays the policy and
value updates take (`update_fields`), the ShapeDtypeStructs the learner compiles ahead and aot
measures (`abstract_batch`), and the checks on a batch that arrives (`RolloutBatch.check`).
Adding a per-token array is one line in `FIELDS`, one in `RolloutBatch`, and its producer and
consumer.

`RolloutBatch` is a registered pytree dataclass. An absent field is None, an empty pytree
node, so jit sees only the arrays a batch carries; as with the dict it replaces, a batch with
a field more or less is another jit cache entry (the field set of one run is fixed).

It can be read like a mapping of its present fields (`batch["tokens"]`, `batch.get(...)`,
`"ref_logprobs" in batch`, `dict(batch)`): the step functions of rl_tpu/train/steps.py and
the losses and advantage estimators of rl_tpu/rl/ are shared with SFT, DPO and reward-model
batches (dicts of other names) and pick their inputs by name, so they stay generic over any
mapping of arrays rather than know this type.

The log-prob convention is decided where the batch is assembled (recipes/algorithms.py,
`batch_fields`): behaviour log-probs enter a batch only when they are of the full
distribution; a consumer that needs them asks for the field (`check(required=...)`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Iterable, Iterator, Optional

import jax
import numpy as np

# shape kinds: [B, T], [B], [B, M], [B, T, S, K]
TOKEN, ROW, TURN, ROUTING = "token", "row", "turn", "routing"
POLICY, VALUE = "policy", "value"  # the update programs that read a field
ROLLOUT, RECIPE, LEARNER = "rollout", "recipe", "learner"  # who makes a field
MODEL_INPUTS = ("tokens", "positions", "segment_ids")  # what a forward pass reads
# what a mixture of experts' forward also reads under routing replay (Transformer's
# `routing_replay`: the experts the sampler chose, -1 where it recorded none)
ROUTING_INPUT = "routed_experts"


@dataclasses.dataclass(frozen=True)
class FieldSpec:
    """One batch array: dtype, shape kind, which updates read it, whether a batch must carry
    it (`required`) or a program needs it whenever it runs (`always`), and who makes it:
    trajectories_to_batch (ROLLOUT), the recipe from the trajectories (RECIPE), or the
    learner on device (LEARNER). Any field can be an advantage estimator's input: an
    estimator reads the fields its arguments are named after (rl/advantages.py)."""

    dtype: Any
    kind: str = TOKEN
    read_by: tuple[str, ...] = ()  # POLICY and/or VALUE: the update programs that take it
    always: tuple[str, ...] = ()  # of read_by: the programs that cannot run without it
    required: bool = False  # every batch carries it
    doc: str = ""
    made_by: str = ROLLOUT


_F32, _I32, _BOOL = np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.bool_)
_BOTH = (POLICY, VALUE)

FIELDS: dict[str, FieldSpec] = {
    # made by train/rollout_batch.trajectories_to_batch
    "tokens": FieldSpec(_I32, TOKEN, _BOTH, _BOTH, True, "token ids, right-padded"),
    "positions": FieldSpec(_I32, TOKEN, _BOTH, _BOTH, True, "0..T-1"),
    "segment_ids": FieldSpec(_I32, TOKEN, _BOTH, _BOTH, True, "1 on real tokens, 0 on padding"),
    "loss_mask": FieldSpec(_BOOL, TOKEN, _BOTH, _BOTH, True, "the policy's own tokens"),
    "behaviour_logprobs": FieldSpec(_F32, TOKEN, (POLICY,), (), False,
                                    "the engine's log-probs (full distribution only)"),
    "turn_ids": FieldSpec(_I32, TOKEN, doc="the turn of each token, -1 on padding"),
    "token_versions": FieldSpec(_I32, TOKEN, doc="the weight version that sampled it, or -1"),
    "token_rewards": FieldSpec(_F32, TOKEN, doc="turn k's reward on its last policy token"),
    "rewards": FieldSpec(_F32, ROW, doc="the episode's final reward"),
    "group_ids": FieldSpec(_I32, ROW, doc="the task's global stream index; -1: no group"),
    "valid": FieldSpec(_BOOL, ROW, doc="a scored row (not padding, error or filler)"),
    "routed_experts": FieldSpec(_I32, ROUTING, (POLICY,), doc=(
        "a mixture of experts' experts the sampler chose per token and sparse layer (-1: not "
        "recorded); only with algo.routing_replay or algo.log_routing_mismatch")),
    # added by the recipes (algorithms.batch_arrays, the Dr.GRPO budget)
    "turn_rewards": FieldSpec(_F32, TURN, doc="TL-GRPO: each branch slot's reward",
                              made_by=RECIPE),
    "turn_group_ids": FieldSpec(_I32, TURN, doc="TL-GRPO: each branch slot's group",
                                made_by=RECIPE),
    "length_normalizer": FieldSpec(_F32, ROW, (POLICY,), doc="Dr.GRPO's per-row divisor",
                                   made_by=RECIPE),
    # added by the learner (score, advantages)
    "old_logprobs": FieldSpec(_F32, TOKEN, (POLICY,), (POLICY,), doc="proximal log-probs",
                              made_by=LEARNER),
    "ref_logprobs": FieldSpec(_F32, TOKEN, (POLICY,), doc="the KL reference's log-probs",
                              made_by=LEARNER),
    "values": FieldSpec(_F32, TOKEN, (VALUE,), (VALUE,), doc="the critic's estimates",
                        made_by=LEARNER),
    "advantages": FieldSpec(_F32, TOKEN, (POLICY,), (POLICY,), doc="the estimator's A",
                            made_by=LEARNER),
    "returns": FieldSpec(_F32, TOKEN, (VALUE,), (VALUE,), doc="the value step's targets",
                         made_by=LEARNER),
}


@dataclasses.dataclass(frozen=True, eq=False)
class RolloutBatch(Mapping):
    """The arrays of one RL batch (numpy on the host, global jax arrays on the learner, or
    ShapeDtypeStructs); None where absent. See FIELDS for each one's dtype and shape."""

    tokens: Any = None
    positions: Any = None
    segment_ids: Any = None
    loss_mask: Any = None
    behaviour_logprobs: Any = None
    turn_ids: Any = None
    token_versions: Any = None
    token_rewards: Any = None
    rewards: Any = None
    group_ids: Any = None
    valid: Any = None
    routed_experts: Any = None
    turn_rewards: Any = None
    turn_group_ids: Any = None
    length_normalizer: Any = None
    old_logprobs: Any = None
    ref_logprobs: Any = None
    values: Any = None
    advantages: Any = None
    returns: Any = None

    # -- read access by name (see the module docstring) ---------------------------------

    def __getitem__(self, name: str):
        value = getattr(self, name, None) if name in FIELDS else None
        if value is None:
            raise KeyError(f"the batch has no {name!r}; it has {list(self)}")
        return value

    def __iter__(self) -> Iterator[str]:
        return (name for name in FIELDS if getattr(self, name) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, name) -> bool:
        return name in FIELDS and getattr(self, name) is not None

    def __repr__(self) -> str:
        shapes = {k: getattr(v, "shape", v) for k, v in self.items()}
        return f"RolloutBatch({shapes})"

    # -- building ------------------------------------------------------------------------

    @classmethod
    def of(cls, arrays: Mapping[str, Any]) -> "RolloutBatch":
        """A batch of `arrays` by name (a RolloutBatch is returned as it is); a name that is
        not a field is a ValueError naming it."""
        if isinstance(arrays, cls):
            return arrays
        unknown = sorted(set(arrays) - set(FIELDS))
        if unknown:
            raise ValueError(f"{unknown} are not rollout batch fields; declare a new array in "
                             f"rl_tpu/core/batch.py FIELDS (the fields: {list(FIELDS)})")
        return cls(**arrays)

    def replace(self, **arrays) -> "RolloutBatch":
        """This batch with `arrays` added or replaced (None removes one)."""
        return dataclasses.replace(self, **arrays)

    def only(self, names: Iterable[str]) -> "RolloutBatch":
        """The same batch carrying `names` alone (each must be present)."""
        names = list(names)
        return RolloutBatch(**{k: self[k] for k in names})

    # -- checking ------------------------------------------------------------------------

    def check(self, required: Iterable[str] = (), why: str = "") -> "RolloutBatch":
        """This batch, after checking it against FIELDS: the required fields (the table's and
        `required`, which `why` explains) are present, each present field has its dtype and
        shape kind, and all agree on B (and T, M). A ValueError names the first field that
        does not. Host-side (eager); the compiled programs trust what passed."""
        missing = [k for k in dict.fromkeys([*REQUIRED, *required]) if k not in self]
        if missing:
            raise ValueError(f"the rollout batch lacks {missing}"
                             f"{f' ({why})' if why else ''}; it has {list(self)}")
        dims: dict[str, tuple[str, int]] = {}  # letter -> (the field that set it, its size)
        for name, x in self.items():
            spec = FIELDS[name]
            if np.dtype(x.dtype) != spec.dtype:
                raise ValueError(f"rollout batch field {name!r} is {np.dtype(x.dtype)}; it "
                                 f"must be {spec.dtype} ({spec.doc})")
            letters = SHAPE_LETTERS[spec.kind]
            if len(x.shape) != len(letters):
                raise ValueError(f"rollout batch field {name!r} has shape {tuple(x.shape)}; it "
                                 f"must be [{', '.join(letters)}] ({spec.kind} array)")
            for letter, size in zip(letters, x.shape):
                first, want = dims.setdefault(letter, (name, size))
                if size != want:
                    raise ValueError(f"rollout batch field {name!r} has {letter}={size} but "
                                     f"{first!r} has {letter}={want} (shape {tuple(x.shape)})")
        return self


jax.tree_util.register_dataclass(RolloutBatch, data_fields=list(FIELDS), meta_fields=[])

SHAPE_LETTERS = {TOKEN: ("B", "T"), ROW: ("B",), TURN: ("B", "M"),
                 ROUTING: ("B", "T", "S", "K")}
REQUIRED = tuple(name for name, spec in FIELDS.items() if spec.required)
assert [f.name for f in dataclasses.fields(RolloutBatch)] == list(FIELDS), \
    "RolloutBatch's fields and FIELDS must list the same arrays in the same order"


def shape_of(name: str) -> str:
    """A field's shape in letters, e.g. "[B, T]" (for messages)."""
    return f"[{', '.join(SHAPE_LETTERS[FIELDS[name].kind])}]"


def update_fields(program: str, present: Iterable[str] = ()) -> list[str]:
    """The fields `program` (POLICY or VALUE) takes from a batch that carries `present`: those
    it always reads, and those it reads when there."""
    present = set(present)
    return [name for name, spec in FIELDS.items() if program in spec.read_by
            and (program in spec.always or name in present)]


def abstract_batch(rows: int, length: int, sharding, names: Iterable[str],
                   turns: Optional[int] = None,
                   routing: Optional[tuple[int, int]] = None) -> RolloutBatch:
    """ShapeDtypeStructs of a batch carrying `names`, in FIELDS' dtypes and shapes ([rows,
    length], [rows], [rows, turns], or [rows, length, *routing] with routing = (sparse
    layers, top-k)), sharded by `sharding`: what a program is lowered against when nothing
    is to run."""
    sizes = {"B": rows, "T": length, "M": turns, "S": None, "K": None}
    if routing is not None:
        sizes["S"], sizes["K"] = routing

    def one(name: str):
        letters = SHAPE_LETTERS[FIELDS[name].kind]
        if any(sizes[k] is None for k in letters):
            raise ValueError(f"an abstract {name!r} needs the number of turn slots (turns=) "
                             "or of sparse layers and experts a token (routing=)")
        return jax.ShapeDtypeStruct(tuple(sizes[k] for k in letters), FIELDS[name].dtype,
                                    sharding=sharding)

    return RolloutBatch.of({name: one(name) for name in names})
