"""Host-side batch assembly: pad to a few bucketed lengths so a run compiles a few times.

Every distinct `[B, T]` shape is a new XLA compilation. Responses vary in length step to step,
so `T` is rounded up to the next of a short list of buckets (e.g. 256, 512, 1024, 2048): a run
compiles each step once per bucket it meets, then never again.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

# Pad values per key: tokens pad with 0 (masked anyway), segment_ids with 0 (= padding).
PAD_VALUES = {"tokens": 0, "segment_ids": 0, "loss_mask": False}


def bucket_length(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= length; an error (not a silent truncation) past the largest."""
    for bucket in sorted(buckets):
        if length <= bucket:
            return bucket
    raise ValueError(f"sequence length {length} exceeds the largest length bucket "
                     f"{max(buckets)}; add a bucket or lower the generation budget")


def pad_to_bucket(batch: Mapping[str, np.ndarray], buckets: Sequence[int]) -> dict[str, np.ndarray]:
    """Right-pads every [B, T] array of `batch` to the bucket of T; [B] arrays pass through.

    Adds `positions` (0..T-1) and `segment_ids` (1 on real tokens, 0 on padding) when the
    batch does not carry its own (packed batches do).
    """
    if "tokens" not in batch:
        raise ValueError(f"batch needs 'tokens'; it has {sorted(batch)}")
    b, t = np.shape(batch["tokens"])
    length = bucket_length(t, buckets)
    out = {}
    for key, value in batch.items():
        value = np.asarray(value)
        if value.ndim >= 2 and value.shape[:2] == (b, t):
            pad = [(0, 0), (0, length - t)] + [(0, 0)] * (value.ndim - 2)
            value = np.pad(value, pad, constant_values=PAD_VALUES.get(key, 0))
        out[key] = value
    if "positions" not in out:
        out["positions"] = np.broadcast_to(np.arange(length, dtype=np.int32), (b, length)).copy()
    if "segment_ids" not in out:
        segment = np.zeros((b, length), np.int32)
        segment[:, :t] = 1
        out["segment_ids"] = segment
    return out
