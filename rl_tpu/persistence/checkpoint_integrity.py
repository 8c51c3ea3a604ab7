"""The bits of a checkpoint's arrays, checked: one checksum per array, computed where its
shards are, the same whatever the sharding (checkpoint.py saves it beside each step
and verifies it on restore).

Tensorstore checks its index but not the array bytes, so a flipped bit in a data file would
restore silently; a checksum turns that into a read error.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

FORMAT = 1


class CheckpointCorruptError(RuntimeError):
    """A checkpoint was read but its arrays do not match the checksums saved with them."""


def _key_name(entry) -> str:
    for attr in ("name", "key", "idx"):  # GetAttrKey, DictKey, SequenceKey
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def path_name(path) -> str:
    """'opt_state/1/0/mu/w': the same string orbax's nested-dict layout implies."""
    return "/".join(_key_name(e) for e in path)


def flat(tree) -> dict[str, Any]:
    """Every leaf of `tree` by its path name."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    named = {path_name(path): leaf for path, leaf in leaves}
    if len(named) != len(leaves):
        raise ValueError("two leaves of the state have the same path name; rename one of them")
    return named


def check_savable(state) -> None:
    for name, leaf in flat(state).items():
        if not isinstance(leaf, (jax.Array, np.ndarray)):
            raise TypeError(f"state leaf {name!r} is a {type(leaf).__name__}; every leaf must be "
                            "a jax.Array or numpy array (wrap Python numbers in jnp.asarray)")
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            raise TypeError(f"state leaf {name!r} is a typed PRNG key; store "
                            "jax.random.key_data(key) (uint32) and wrap it again after restore")


def _checkable(dtype) -> bool:
    """Dtypes whose elements are whole bytes with a plain bit pattern (not int4, complex)."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return True
    if jnp.issubdtype(dtype, jnp.integer):
        bits = jnp.iinfo(dtype).bits
    elif jnp.issubdtype(dtype, jnp.floating):
        bits = jnp.finfo(dtype).bits
    else:
        return False
    return bits == 8 * dtype.itemsize and dtype.itemsize in (1, 2, 4, 8)


def _words(x: jax.Array) -> Optional[jax.Array]:
    """The array's bits as uint32 words, or None for a dtype without a plain bit pattern."""
    if not _checkable(x.dtype):
        return None
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = np.dtype(x.dtype).itemsize
    if size == 4 or size == 8:  # 8-byte elements become a trailing pair of words
        return lax.bitcast_convert_type(x, jnp.uint32)
    small = {1: jnp.uint8, 2: jnp.uint16}[size]
    return lax.bitcast_convert_type(x, small).astype(jnp.uint32)


def _checksum(x: jax.Array):
    """sum_i words[i] * (2i + 1) mod 2**32, i the row-major element index.

    The odd weights make any single changed word change the sum, and the position weight
    catches swapped chunks. Elementwise work plus one modular sum, so it runs where the shards
    are, and the result does not depend on the sharding (addition mod 2**32 is exact in any
    order): a state restored onto another mesh gets the same checksum.
    """
    words = _words(x)
    if words is None:
        return jnp.zeros((), jnp.uint32)
    # Row-major index from one iota per dim (no reshape, which could force a gather of the
    # shards); uint32 arithmetic wraps, which only reuses weights past 2**32 elements.
    index = jnp.zeros(words.shape, jnp.uint32)
    stride = 1
    for dim in reversed(range(words.ndim)):
        iota = lax.broadcasted_iota(jnp.uint32, words.shape, dim)
        index = index + iota * np.uint32(stride % 2**32)
        stride *= words.shape[dim]
    return jnp.sum(words * (index * np.uint32(2) + np.uint32(1)), dtype=jnp.uint32)


@jax.jit
def _checksums(leaves):
    return [_checksum(x) for x in leaves]


def compile_record(state) -> None:
    """Compiles the checksum program for a state of `state`'s shapes and shardings, before
    the first save needs it (jit's cache keeps it): a run compiles nothing after its first
    step, its first checkpoint included. Nothing runs; only the leaves' metadata is read."""
    def shape_of(x):  # an uncommitted array (or numpy) goes where jit puts it: no sharding
        committed = isinstance(x, jax.Array) and x.committed
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if committed else None)

    abstract = [shape_of(x) for x in flat(state).values()]
    _checksums.lower(abstract).compile()


def record(state) -> dict:
    leaves = flat(state)
    sums = jax.device_get(_checksums(list(leaves.values())))
    arrays = {}
    for (name, leaf), total in zip(leaves.items(), sums):
        checkable = _checkable(leaf.dtype)
        arrays[name] = {"dtype": str(np.dtype(leaf.dtype)), "shape": list(leaf.shape),
                        "checksum": int(total) if checkable else None}
    return {"format": FORMAT, "arrays": arrays}


def verify(restored, record: dict, what: str) -> None:
    leaves = flat(restored)
    saved = record.get("arrays", {})
    # Only leaves restored in the dtype they were saved in have comparable bits.
    names = [n for n, x in leaves.items() if n in saved and saved[n]["checksum"] is not None
             and saved[n]["dtype"] == str(np.dtype(x.dtype))]
    sums = jax.device_get(_checksums([leaves[n] for n in names]))
    bad = [n for n, total in zip(names, sums) if int(total) != saved[n]["checksum"]]
    if bad:
        raise CheckpointCorruptError(
            f"{what}: the bytes of {len(bad)} array(s) differ from their saved checksums "
            f"({', '.join(bad[:5])}{', ...' if len(bad) > 5 else ''}): the files were damaged")
