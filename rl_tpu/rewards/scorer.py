"""A reward model scoring token sequences on this host's own devices.

The RL loop scores its rollouts where it plays them: on the producer thread of each host (a
free-running producer plays beside the learner), so the scorer holds its own copy of the
reward model on a mesh of local devices and runs no cross-host collective, as the embedded
sampler does. The reward recipe scores its held-out pairs with the same class.

Batches are cut from the sequences sorted by length: each batch pads to a power-of-two length
(at least MIN_LENGTH) and holds as many rows as `tokens_per_batch` allows at that length
(a power of two, at most `max_rows`, at least one a device); a batch of fewer rows pads to
the next power of two of its rows, so the shapes compiled are a few a length bucket whatever
the mix of lengths.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from rl_tpu import parallel
from rl_tpu.models import reward_model
from rl_tpu.models.transformer import ModelConfig
from rl_tpu.rollout.prefix_cache import next_power_of_two

log = logging.getLogger(__name__)

MIN_LENGTH = 16


def padded_length(n: int) -> int:
    """The length a batch whose longest sequence has `n` tokens pads to."""
    return next_power_of_two(int(n), MIN_LENGTH)


class RewardScorer:
    """score(sequences) -> [N, C] float32: each token sequence's scores at its last token."""

    def __init__(self, cfg: ModelConfig, head: reward_model.RewardHead, params, mesh, *,
                 tokens_per_batch: int = 16384, max_rows: int = 64):
        if tokens_per_batch < MIN_LENGTH or max_rows < 1:
            raise ValueError(f"RewardScorer: tokens_per_batch={tokens_per_batch} must be >= "
                             f"{MIN_LENGTH} and max_rows={max_rows} >= 1")
        self.cfg, self.head, self.mesh = cfg, head, mesh
        mesh_devices = set(mesh.devices.flat)
        if any(set(leaf.sharding.device_set) != mesh_devices
               for leaf in jax.tree.leaves(params)):  # a copy on the scorer's own devices
            params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
        self.params = params
        self.tokens_per_batch, self.max_rows = tokens_per_batch, max_rows
        self.devices = mesh.devices.size
        model = reward_model.RewardModel(cfg, head.num_labels, mesh, parallel.DEFAULT_RULES)
        batch_sharding = NamedSharding(mesh, parallel.batch_spec(1))

        def scores(params, tokens, lengths):
            t = tokens.shape[1]
            segments = (jnp.arange(t)[None, :] < lengths[:, None]).astype(jnp.int32)
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), tokens.shape)
            per_token = model.apply({"params": params}, tokens, positions, segments)
            return reward_model.sequence_scores(per_token, lengths=lengths)

        self._batch_sharding = batch_sharding
        self._scores = jax.jit(scores, in_shardings=(None, batch_sharding, batch_sharding),
                               out_shardings=batch_sharding)

    @classmethod
    def from_dir(cls, path: str, devices: Optional[Sequence[jax.Device]] = None,
                 dtype: str = "float32", **kwargs) -> "RewardScorer":
        """The reward model of an HF *ForSequenceClassification dir, on `devices` (default:
        this host's own), data-parallel over them."""
        mesh = parallel.make_mesh({"data": -1}, devices=list(devices or jax.local_devices()))
        cfg, head, params = reward_model.load(path, mesh=mesh, dtype=dtype)
        log.info("reward model %s: %d label(s), on %d device(s)", path, head.num_labels,
                 mesh.devices.size)
        return cls(cfg, head, params, mesh, **kwargs)

    def rows_for(self, length: int) -> int:
        """Rows of a batch padded to `length`: a power of two that fits the token budget,
        a multiple of the devices (one row each at the least)."""
        rows = max(1, min(self.max_rows, self.tokens_per_batch // length))
        rows = 1 << (rows.bit_length() - 1)  # down to a power of two
        return max(rows, self.devices) if rows % self.devices else rows

    def padded_rows(self, rows: int, length: int) -> int:
        """Rows a batch of `rows` sequences at `length` is padded to: the next power of two
        (a multiple of the devices), at most `rows_for(length)`. A few rows (a reward
        server's lone request, a bucket's last rows) then cost their own tokens, not a full
        batch's (up to max_rows x as many), for one program a row count."""
        padded = next_power_of_two(rows, self.devices)
        padded = -(-padded // self.devices) * self.devices
        return min(padded, self.rows_for(length))

    def score(self, sequences: Sequence[Sequence[int]]) -> np.ndarray:
        """[N, C] scores of `sequences` (lists of token ids, none empty), in their order."""
        lengths = np.asarray([len(s) for s in sequences], np.int32)
        out = np.zeros((len(sequences), self.head.num_labels), np.float32)
        if not len(sequences):
            return out
        if lengths.min() < 1:
            raise ValueError(f"RewardScorer.score: sequence {int(lengths.argmin())} is empty; "
                             "a reward model scores a sequence's last token")
        if lengths.max() > self.cfg.max_position_embeddings:
            raise ValueError(f"RewardScorer.score: a sequence of {int(lengths.max())} tokens is "
                             f"longer than the reward model's {self.cfg.max_position_embeddings} "
                             "positions")
        order = np.argsort(lengths, kind="stable")
        start = 0
        while start < len(order):
            # the batch's length is that of its longest (last, sorted) row: shrink the rows
            # until the budget holds them at that length
            rows = self.max_rows
            while True:
                end = min(start + rows, len(order))
                length = padded_length(lengths[order[end - 1]])
                fitting = self.rows_for(length)
                if fitting >= rows or fitting >= end - start:
                    break
                rows = fitting
            chosen = order[start:end]
            size = self.padded_rows(len(chosen), length)
            tokens = np.zeros((size, length), np.int32)
            row_lengths = np.ones((size,), np.int32)  # pad rows: one token, discarded
            for i, index in enumerate(chosen):
                tokens[i, :lengths[index]] = sequences[index]
                row_lengths[i] = lengths[index]
            # placed first: jit takes no numpy input for a sharded argument once there are
            # several processes (the mesh is this host's alone: its devices take it whole)
            tokens, row_lengths = jax.device_put((tokens, row_lengths), self._batch_sharding)
            scores = self._scores(self.params, tokens, row_lengths)
            out[chosen] = np.asarray(jax.device_get(scores))[:len(chosen)]
            start = end
        return out
