"""Reward models: the policy's transformer trunk with a sequence-classification head.

Shape letters: B batch, T length, D model width, C labels (num_labels), K scored positions.

The layout is transformers' `*ForSequenceClassification` (Llama, Qwen2, Qwen3): the decoder
under `model.`, no lm_head, and a bias-free `score` Linear [C, D] applied to every token's
final-normed hidden state. Params are `{'trunk': <Transformer params>, 'score': {'kernel'
[D, C]}}`, so a reward model loads from (`load`) and exports to (`save`) such a directory, or
starts from a policy checkpoint (`reward_params_from`).

Reading a reward off the per-token scores:
  * outcome reward: `sequence_scores`, the score of the last non-pad token, as transformers
    pools it;
  * process reward: `scores_at`, the scores at chosen tokens (the end of each step or turn).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from rl_tpu import parallel
from rl_tpu.models import hf
from rl_tpu.models.transformer import ModelConfig, Transformer

SCORE = "score.weight"  # transformers' head tensor, [C, D]
# SGLang's Qwen2 / Qwen3 classification heads are nn.Linear with a bias (transformers' have
# none); a checkpoint without one leaves SGLang's at its random init, shifting every score by a
# constant. `save` writes a zero one for those families, which transformers ignores.
SCORE_BIAS = "score.bias"
SGLANG_BIASED = ("qwen2", "qwen3")


class RewardModel(nn.Module):
    """__call__(tokens [B, T], positions, segment_ids) -> scores [B, T, C] float32, one
    score per label at every token (padding included: pool with `sequence_scores` or
    `scores_at`)."""

    cfg: ModelConfig
    num_labels: int = 1
    mesh: Any = None
    rules: Any = None

    @nn.compact
    def __call__(self, tokens, positions=None, segment_ids=None):
        if self.num_labels < 1:
            raise ValueError(f"num_labels={self.num_labels}; a reward model needs at least 1")
        hidden = Transformer(self.cfg, self.mesh, self.rules, name="trunk")(
            tokens, positions, segment_ids, return_hidden=True)  # [B, T, D]
        score = nn.Dense(
            self.num_labels, use_bias=False, dtype=jnp.float32,
            param_dtype=self.cfg.params_dtype, name="score",
            kernel_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed", None)))
        # fp32 (transformers: the model dtype), as the critic's head: a bf16 score would round
        # rewards that differ in their third significant digit to one value.
        return score(hidden.astype(jnp.float32))


def sequence_scores(scores, tokens=None, pad_token_id: Optional[int] = None, *, lengths=None):
    """scores [B, T, C] -> [B, C], each row's score at its last token.

    With `tokens` [B, T] and `pad_token_id`, transformers' rule (GenericForSequenceClassification
    .forward, transformers 5.x): the rightmost token that is not `pad_token_id`, found as
    argmax(arange(T) * (tokens != pad)). It holds for right and left padding alike; a pad id
    inside the text is skipped over like padding, and a row of pads only (or whose only
    non-pad is token 0) gives index 0. Without `pad_token_id`, as transformers: the last
    token, and only for a batch of one row (it cannot tell padding from text).

    With `lengths` [B] instead (right-padded rows, the rollout's layout): index lengths - 1,
    which does not depend on the pad id (that may be the eos id a response ends with);
    length 0 gives index 0.
    """
    b, t = scores.shape[:2]
    if (tokens is None) == (lengths is None):
        raise ValueError("sequence_scores: give tokens (with pad_token_id) or lengths, "
                         "exactly one of them")
    if lengths is not None:
        if tuple(jnp.shape(lengths)) != (b,):
            raise ValueError(f"sequence_scores: lengths of shape {tuple(jnp.shape(lengths))} "
                             f"for {b} rows; give one length a row")
        last = jnp.maximum(jnp.asarray(lengths) - 1, 0)
    elif pad_token_id is None:
        if b != 1:
            raise ValueError(f"sequence_scores: {b} rows and no pad_token_id, so no row's end "
                             "can be found (transformers refuses this too); pass the "
                             "pad_token_id of the reward model's config, or lengths")
        last = jnp.full((1,), t - 1)
    else:
        if tuple(tokens.shape) != (b, t):
            raise ValueError(f"sequence_scores: tokens {tuple(tokens.shape)} do not match "
                             f"scores {tuple(scores.shape)}")
        non_pad = (jnp.asarray(tokens) != pad_token_id).astype(jnp.int32)
        last = jnp.argmax(jnp.arange(t, dtype=jnp.int32) * non_pad, axis=-1)
    return jnp.take_along_axis(scores, last[:, None, None].astype(jnp.int32), axis=1)[:, 0]


def scores_at(scores, positions):
    """Process rewards: scores [B, T, C] at `positions` [B, K] (e.g. each step's or turn's last
    token) -> (values [B, K, C], mask [B, K] bool).

    Rows with fewer than K positions pad theirs with -1 (any negative): mask False and value 0
    there. A position >= T is an error when positions are concrete; under jit (no check
    possible) it is masked out like padding, never clipped onto another token's score.
    """
    t = scores.shape[1]
    if not isinstance(positions, jax.core.Tracer):
        concrete = np.asarray(positions)
        if concrete.ndim != 2 or concrete.shape[0] != scores.shape[0]:
            raise ValueError(f"scores_at: positions {concrete.shape} must be [B, K] with "
                             f"B={scores.shape[0]} rows")
        past = sorted(set(concrete[concrete >= t].tolist()))
        if past:
            raise ValueError(f"scores_at: positions {past} are past the last token ({t - 1})")
    positions = jnp.asarray(positions)
    mask = (positions >= 0) & (positions < t)
    index = jnp.where(mask, positions, 0).astype(jnp.int32)
    values = jnp.take_along_axis(scores, index[:, :, None], axis=1)
    return jnp.where(mask[:, :, None], values, 0.0), mask


def reward_params_from(policy_params, cfg: ModelConfig, num_labels: int = 1,
                       stddev: float = 0.0, seed: int = 0) -> dict:
    """Reward-model params whose trunk is a copy of the policy's (without its LM head) and
    whose score head is zero (stddev=0) or normal(stddev).

    Zero by default: a linear head needs no random start to learn (its gradient, hidden x
    dL/dscore, is not zero at W = 0), and a zero head scores every response 0 at first, so
    a Bradley-Terry loss starts at exactly log 2 with no arbitrary preference, the same for
    any seed. The trunk's gradient goes through W, so it is zero on the first step only;
    stddev=0.02 is transformers' own init (initializer_range) for a trunk gradient at once.
    """
    if num_labels < 1:
        raise ValueError(f"num_labels={num_labels}; a reward model needs at least 1")
    dtype = cfg.params_dtype
    trunk = {name: p for name, p in policy_params.items() if name != "lm_head"}
    shape = (cfg.hidden_size, num_labels)
    kernel = (jnp.zeros(shape, dtype) if stddev == 0 else
              (stddev * jax.random.normal(jax.random.key(seed), shape)).astype(dtype))
    return {"trunk": jax.tree.map(jnp.copy, trunk), "score": {"kernel": kernel}}


# ----------------------------------------------------------------------------- HF directories


@dataclasses.dataclass(frozen=True)
class RewardHead:
    """What config.json says of the head: C labels, their names, and the pad id that
    `sequence_scores` pools by."""

    num_labels: int = 1
    pad_token_id: Optional[int] = None
    labels: tuple[str, ...] = ()  # id2label in id order; () = transformers' LABEL_i

    def __post_init__(self):
        if self.num_labels < 1:
            raise ValueError(f"num_labels={self.num_labels}; a reward model needs at least 1")
        if self.labels and len(self.labels) != self.num_labels:
            raise ValueError(f"{len(self.labels)} labels {list(self.labels)} for "
                             f"num_labels={self.num_labels}")

    @classmethod
    def from_hf(cls, hf_config: dict, source: str = "config.json") -> "RewardHead":
        """num_labels from `num_labels` or `id2label` (transformers writes only the latter;
        with neither, its default of 2), checked to agree; `pad_token_id` as written."""
        id2label = hf_config.get("id2label") or {}
        try:
            labels = tuple(str(id2label[k]) for k in sorted(id2label, key=int))
        except (TypeError, ValueError):
            raise hf.CheckpointError(f"{source}: id2label {id2label!r} is not a map of "
                                     "integer ids to names") from None
        if labels and sorted(int(k) for k in id2label) != list(range(len(labels))):
            raise hf.CheckpointError(f"{source}: id2label ids {sorted(id2label, key=int)} are "
                                     f"not 0..{len(labels) - 1}")
        num = hf_config.get("num_labels", len(labels) or 2)
        if labels and num != len(labels):
            raise hf.CheckpointError(f"{source}: num_labels={num} but id2label has "
                                     f"{len(labels)} labels; make them agree")
        pad = hf_config.get("pad_token_id")
        if isinstance(pad, list):  # some configs list several; transformers would fail on it
            raise hf.CheckpointError(f"{source}: pad_token_id={pad}; a reward model pools by "
                                     "one pad id")
        try:
            return cls(int(num), None if pad is None else int(pad), labels)
        except (TypeError, ValueError) as err:
            raise hf.CheckpointError(f"{source}: {err}") from None

    def hf_fields(self) -> dict:
        labels = self.labels or tuple(f"LABEL_{i}" for i in range(self.num_labels))
        return {"id2label": dict(enumerate(labels)), "pad_token_id": self.pad_token_id,
                "label2id": {label: i for i, label in enumerate(labels)}}


def check_reward_dir(path: str) -> tuple[ModelConfig, RewardHead]:
    """`hf.check_model_dir` for a reward model: config.json of a *ForSequenceClassification
    model, safetensors holding its trunk and `score.weight` [C, D]; reads no tensor data."""
    return _read_checked(path)[:2]


def _read_checked(path: str, **config_overrides):
    if not os.path.isdir(path):
        raise hf.CheckpointError(f"{path}: no such model directory")
    cfg = hf.read_config(path, head=hf.SEQUENCE_CLASSIFICATION, **config_overrides)
    head = RewardHead.from_hf(hf.read_hf_config(path), os.path.join(path, "config.json"))
    files = hf.SafetensorsDir(path)
    shapes = {SCORE: (head.num_labels, cfg.hidden_size)}
    if SCORE_BIAS in files.entries:  # SGLang's head has one: accepted when it is zero
        shapes[SCORE_BIAS] = (head.num_labels,)
    hf.check_tensors(files, cfg, path, hf.SEQUENCE_CLASSIFICATION, shapes)
    if SCORE_BIAS in files.entries:
        bias = np.asarray(files.read(SCORE_BIAS), np.float32)
        if np.any(bias != 0):
            raise hf.CheckpointError(
                f"{path}: {SCORE_BIAS} is {bias.tolist()[:4]}..., but a sequence classifier's "
                "score head has no bias (transformers' has none; rl_tpu writes a zero one for "
                "SGLang only): a checkpoint with a trained bias is not one rl_tpu can score")
    return cfg, head, files


def load(path: str, mesh=None, dtype="float32", rules=parallel.DEFAULT_RULES,
         **config_overrides):
    """Reads a transformers *ForSequenceClassification dir into (ModelConfig, RewardHead,
    params), each param in its mesh sharding; `dtype` and `config_overrides` as `hf.load`.
    A causal-LM dir is a CheckpointError (start from it with `reward_params_from`)."""
    dtype = hf.dtype_name(dtype, "reward_model.load(dtype)")
    config_overrides["param_dtype"] = hf.dtype_name(
        config_overrides.get("param_dtype", dtype), "reward_model.load(param_dtype)")
    cfg, head, files = _read_checked(path, dtype=dtype, **config_overrides)
    if mesh is None:
        mesh = parallel.make_mesh({}, devices=jax.devices()[:1])
    model = RewardModel(cfg, head.num_labels)
    abstract, names = parallel.logical_axes_of(model, np.zeros((1, 1), np.int32))
    shardings = parallel.param_shardings(abstract, names, mesh, rules)
    trunk = hf.read_params(files, cfg, abstract["trunk"], shardings["trunk"],
                           hf.SEQUENCE_CLASSIFICATION)
    kernel = np.asarray(files.read(SCORE)).T.astype(cfg.params_dtype)  # [D, C]: small
    score = jax.make_array_from_callback(kernel.shape, shardings["score"]["kernel"],
                                         lambda index: kernel[index])
    return cfg, head, {"trunk": trunk, "score": {"kernel": score}}


def save(path: str, cfg: ModelConfig, params, head: RewardHead, tokenizer=None,
         dtype: Optional[str] = None, max_shard_bytes: int = 4 << 30):
    """Writes a dir that transformers' AutoModelForSequenceClassification loads (and `load`
    reads back): the trunk as `hf.save` writes it, without an lm_head, plus `score.weight`
    [C, D], the head's config fields, and for Qwen2 / Qwen3 a zero `score.bias` [C] so that
    SGLang (`--is-embedding`), whose head has a bias, scores it as transformers does
    (transformers ignores the tensor). As `hf.save`, every process must call it."""
    kernel = params["score"]["kernel"]
    if tuple(kernel.shape) != (cfg.hidden_size, head.num_labels):
        raise ValueError(f"score kernel {tuple(kernel.shape)} is not [D, C] = "
                         f"{[cfg.hidden_size, head.num_labels]} (hidden_size, num_labels)")
    # Gathered here, by every process (collective), before process 0 alone writes; C order,
    # as safetensors writes a transposed (Fortran-order) array's memory as if it were C.
    score = np.ascontiguousarray(parallel.gather_to_host(kernel).T)
    tensors = {SCORE: score}
    if cfg.arch in SGLANG_BIASED:
        tensors[SCORE_BIAS] = np.zeros((head.num_labels,), score.dtype)
    hf.save(path, cfg, params["trunk"], tokenizer, dtype, max_shard_bytes,
            head=hf.SEQUENCE_CLASSIFICATION, head_tensors=tensors, hf_fields=head.hf_fields())
