"""Reward-model losses: Bradley-Terry on pairs (with margin and centring), cross-entropy for a
K-class verifier head, and host-side calibration of a pairwise model.

Shape letters: P pairs (or examples, for the K-class head), K classes. `chosen_rewards` and
`rejected_rewards` are [P] scalar rewards r_c, r_r read from the reward model's head (one
number per reply). Every jnp function keeps its arithmetic in float32 whatever the input dtype
(a bf16 head's rewards differ by less than bf16 resolves near a large common offset) and
returns `(loss, metrics)`: `loss` a scalar, `metrics` a dict of scalars with no gradient.

Padding pairs: every loss takes `weights` [P] (a bool mask or non-negative floats; None is all
ones). Loss and metrics are weighted means sum(w * x) / sum(w), so a zero-weight pair changes
nothing, and `metrics["pairs"]` is sum(w), for a caller that averages metrics over batches.
A batch whose weights are all zero gives loss 0 and metrics 0 (not NaN).

Host-side numpy: `calibration`, the expected calibration error of the pairwise probability
sigmoid(r_c - r_r) with the per-bin counts of a reliability table; `select_pseudo_labels`,
SSRM's choice of confident pseudo-labelled pairs from an unlabelled pool.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def _f32(x) -> Array:
    return jnp.asarray(x, jnp.float32)


def _check_pairs(name: str, *arrays) -> int:
    """The common length P of 1-D arrays (shapes are static, so this works under jit too)."""
    shapes = [jnp.shape(a) for a in arrays]
    if any(len(s) != 1 for s in shapes) or len(set(shapes)) != 1:
        raise ValueError(f"{name} needs 1-D arrays of one length [P] (one number per pair); "
                         f"got shapes {shapes}")
    return shapes[0][0]


def _concrete(x) -> np.ndarray | None:
    """x as numpy when its value is known (eager call), None under jit tracing."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _pair_weights(name: str, weights, p: int) -> Array:
    if weights is None:
        return jnp.ones((p,), jnp.float32)
    if jnp.shape(weights) != (p,):
        raise ValueError(f"{name}: weights must be [P]={p} (one per pair, 0 for padding); "
                         f"got shape {jnp.shape(weights)}")
    value = _concrete(weights)
    if value is not None and not (np.all(np.isfinite(value)) and np.all(value >= 0)):
        raise ValueError(f"{name}: weights must be finite and >= 0 (a mask or pair weights); "
                         f"got {value}")
    return _f32(weights)


def _weighted_mean(x: Array, w: Array, total: Array) -> Array:
    # total == 0 (an all-padding batch): 0 rather than 0/0.
    return jnp.sum(w * x) / jnp.where(total > 0, total, 1.0)


def pairwise_accuracy(chosen_rewards: Array, rejected_rewards: Array) -> Array:
    """[P] per-pair credit for ranking chosen above rejected: 1 when r_c > r_r, 0 when r_c < r_r
    and 1/2 on an exact tie (a model that scores both replies alike has guessed, not ranked: a
    constant model gets 0.5, the chance level, instead of 0 or 1)."""
    rc, rr = _f32(chosen_rewards), _f32(rejected_rewards)
    return jnp.where(rc > rr, 1.0, jnp.where(rc == rr, 0.5, 0.0))


def bradley_terry_loss(chosen_rewards: Array, rejected_rewards: Array, *, margin=None,
                       weights=None, centring: float = 0.0) -> tuple[Array, dict[str, Array]]:
    """Bradley-Terry reward-model loss, with an optional per-pair margin and reward centring.

    chosen_rewards, rejected_rewards: [P]. margin: None, a float, or [P] (Llama 2's reward model
    uses a margin m >= 0 that grows with how strongly annotators preferred the chosen reply: the
    model must rank it ahead by at least about m before the loss flattens). Per pair
      bt(p) = -log sigmoid(r_c - r_r - m) = softplus(-(r_c - r_r - m)),
    computed through log_sigmoid, so a margin of -100 or +100 neither overflows nor rounds to
    log(0).

    centring: coefficient c of the auxiliary term
      c * (r_c + r_r)^2
    (Eisenstein et al. 2023, "Helping or Herding?"). The BT likelihood sees only differences,
    so adding a constant to every reward leaves it unchanged and rewards drift; the term pins the
    pair's sum, hence the mean reward, near 0, which makes rewards from separate runs or
    ensemble members comparable. It is added to the loss and reported alone as centring_loss.

    Returns (loss, metrics), loss = mean_w bt + c * mean_w (r_c + r_r)^2 over the weighted pairs.
    Metrics (weighted means over the pairs):
      bt_loss          mean_w bt                 centring_loss  c * mean_w (r_c + r_r)^2
      accuracy         pairwise_accuracy (r_c > r_r; ties count 1/2; the margin plays no part)
      reward_margin    mean_w (r_c - r_r)        chosen_reward, rejected_reward  mean_w r_c, r_r
      reward_mean      mean_w (r_c + r_r) / 2    pairs          sum(w)
    """
    p = _check_pairs("bradley_terry_loss", chosen_rewards, rejected_rewards)
    w = _pair_weights("bradley_terry_loss", weights, p)
    rc, rr = _f32(chosen_rewards), _f32(rejected_rewards)
    m = jnp.zeros((p,), jnp.float32) if margin is None else _f32(margin)
    if jnp.ndim(m) == 0:
        m = jnp.broadcast_to(m, (p,))
    if jnp.shape(m) != (p,):
        raise ValueError(f"bradley_terry_loss: margin must be a scalar or [P]={p}; got shape "
                         f"{jnp.shape(m)}")
    if isinstance(centring, (int, float)) and centring < 0:
        raise ValueError(f"bradley_terry_loss: centring must be >= 0 (a penalty), got {centring}")
    total = jnp.sum(w)
    bt = -jax.nn.log_sigmoid(rc - rr - m)
    bt_loss = _weighted_mean(bt, w, total)
    centring_loss = centring * _weighted_mean(jnp.square(rc + rr), w, total)
    rc_, rr_ = jax.lax.stop_gradient((rc, rr))
    metrics = {
        "bt_loss": jax.lax.stop_gradient(bt_loss),
        "centring_loss": jax.lax.stop_gradient(centring_loss),
        "accuracy": _weighted_mean(pairwise_accuracy(rc_, rr_), w, total),
        "reward_margin": _weighted_mean(rc_ - rr_, w, total),
        "chosen_reward": _weighted_mean(rc_, w, total),
        "rejected_reward": _weighted_mean(rr_, w, total),
        "reward_mean": _weighted_mean((rc_ + rr_) / 2.0, w, total),
        "pairs": total,
    }
    return bt_loss + centring_loss, metrics


def classification_loss(logits: Array, labels: Array, *,
                        weights=None) -> tuple[Array, dict[str, Array]]:
    """Pointwise cross-entropy for a K-class head (a verifier whose labels are e.g.
    0 = incorrect, 1 = correct, or graded 0..K-1).

    logits: [P, K], labels: int [P] in [0, K). Per example
      ce = logsumexp(logits) - logits[label]  = -log softmax(logits)[label].
    Returns (loss, metrics), loss = mean_w ce. Metrics (weighted means):
      ce_loss          mean_w ce
      accuracy         mean_w 1[argmax logits == label] (a tie in the logits goes to the lowest
                       class index, jnp.argmax's rule)
      label_prob       mean_w softmax(logits)[label], the probability the head gives the truth
      examples         sum(w)
    Labels are range-checked when their values are known (an eager call); under jit a label
    outside [0, K) would silently select nothing, so check the data before.
    """
    if jnp.ndim(logits) != 2 or jnp.shape(logits)[1] < 2:
        raise ValueError(f"classification_loss needs logits [P, K] with K >= 2 classes; got "
                         f"shape {jnp.shape(logits)}")
    p, k = jnp.shape(logits)
    if jnp.shape(labels) != (p,):
        raise ValueError(f"classification_loss: labels must be [P]={p} (one class index per "
                         f"example); got shape {jnp.shape(labels)}")
    if not jnp.issubdtype(jnp.result_type(labels), jnp.integer):
        raise ValueError(f"classification_loss: labels must be integer class indices; got dtype "
                         f"{jnp.result_type(labels)}")
    value = _concrete(labels)
    if value is not None and not np.all((value >= 0) & (value < k)):
        bad = np.flatnonzero((value < 0) | (value >= k))
        raise ValueError(f"classification_loss: labels must lie in [0, {k}); example(s) "
                         f"{bad.tolist()} have {value[bad].tolist()}")
    w = _pair_weights("classification_loss", weights, p)
    x = _f32(logits)
    log_probs = jax.nn.log_softmax(x, axis=-1)
    label_log_prob = jnp.take_along_axis(log_probs, jnp.asarray(labels)[:, None], axis=-1)[:, 0]
    total = jnp.sum(w)
    loss = _weighted_mean(-label_log_prob, w, total)
    lp = jax.lax.stop_gradient(label_log_prob)
    correct = (jnp.argmax(jax.lax.stop_gradient(x), axis=-1) == labels).astype(jnp.float32)
    metrics = {
        "ce_loss": jax.lax.stop_gradient(loss),
        "accuracy": _weighted_mean(correct, w, total),
        "label_prob": _weighted_mean(jnp.exp(lp), w, total),
        "examples": total,
    }
    return loss, metrics


# ----------------------------------------------------------------------------- calibration


@dataclasses.dataclass(frozen=True)
class Calibration:
    """A reliability table of a pairwise model. Bin b covers confidences [edges[b], edges[b+1])
    (the last bin also holds 1.0); confidence and accuracy are each bin's weighted means, NaN in
    an empty bin. ece = sum_b (count_b / total) * |accuracy_b - confidence_b|."""
    ece: float
    edges: np.ndarray       # [B + 1], 0.5 .. 1.0
    counts: np.ndarray      # [B] weight of the pairs in each bin (the pair count when unweighted)
    confidence: np.ndarray  # [B]
    accuracy: np.ndarray    # [B]

    def rows(self) -> list[str]:
        """The table as text lines, one per bin, for a log or a report."""
        out = ["confidence bin   pairs  mean conf  accuracy"]
        for b in range(len(self.counts)):
            out.append(f"[{self.edges[b]:.3f}, {self.edges[b + 1]:.3f})  {self.counts[b]:6g}"
                       f"  {self.confidence[b]:9.4f}  {self.accuracy[b]:8.4f}")
        return out


def calibration(chosen_rewards, rejected_rewards, num_bins: int = 10,
                weights=None) -> Calibration:
    """Expected calibration error of p = sigmoid(r_c - r_r), the model's probability that the
    chosen reply is preferred (host-side numpy, float64).

    The model predicts "chosen" when p > 1/2 and "rejected" when p < 1/2, with confidence
    max(p, 1 - p) in [1/2, 1]; the prediction is right when it says "chosen", and an exact tie
    (p = 1/2) counts half, as in pairwise_accuracy. Since confidence never falls below 1/2 the
    num_bins equal-width bins split [1/2, 1] (binning [0, 1] would leave half the bins empty
    by construction). A confidence exactly on an inner edge goes to the upper bin.
    """
    rc = np.asarray(chosen_rewards, np.float64)
    rr = np.asarray(rejected_rewards, np.float64)
    if rc.ndim != 1 or rc.shape != rr.shape:
        raise ValueError(f"calibration needs two 1-D arrays of one length [P]; got shapes "
                         f"{rc.shape} and {rr.shape}")
    if not isinstance(num_bins, (int, np.integer)) or num_bins < 1:
        raise ValueError(f"calibration: num_bins must be a positive integer, got {num_bins!r}")
    w = np.ones_like(rc) if weights is None else np.asarray(weights, np.float64)
    if w.shape != rc.shape or not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError(f"calibration: weights must be [P]={rc.shape[0]} finite values >= 0")
    diff = rc - rr
    if not np.all(np.isfinite(diff[w > 0])):
        raise ValueError("calibration: rewards must be finite (a NaN or inf reward has no "
                         "probability)")
    diff = np.where(w > 0, diff, 0.0)
    # |d| form: exp(-|d|) <= 1 never overflows, so p is exact-ish for any finite d.
    conf = 1.0 / (1.0 + np.exp(-np.abs(diff)))  # = max(p, 1 - p)
    correct = np.where(diff > 0, 1.0, np.where(diff == 0, 0.5, 0.0))
    edges = np.linspace(0.5, 1.0, num_bins + 1)
    bins = np.clip(np.searchsorted(edges, conf, side="right") - 1, 0, num_bins - 1)
    counts = np.bincount(bins, weights=w, minlength=num_bins)
    conf_sum = np.bincount(bins, weights=w * conf, minlength=num_bins)
    acc_sum = np.bincount(bins, weights=w * correct, minlength=num_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_conf = np.where(counts > 0, conf_sum / counts, np.nan)
        mean_acc = np.where(counts > 0, acc_sum / counts, np.nan)
    total = counts.sum()
    # An empty bin contributes |acc_sum - conf_sum| = 0: no NaN reaches the sum.
    ece = float(np.abs(acc_sum - conf_sum).sum() / total) if total > 0 else 0.0
    return Calibration(ece=ece, edges=edges, counts=counts, confidence=mean_conf,
                       accuracy=mean_acc)


# ----------------------------------------------------------------------------- SSRM
# SSRM (semi-supervised reward modelling). One round: the current reward model scores both
# replies (a, b) of every unlabelled pair; the higher-scored reply becomes the pseudo-chosen
# one; the pairs the model is confident about are kept and added to the labelled pairs for the
# next round of Bradley-Terry training. Under the Bradley-Terry model sigmoid(r_a - r_b) is the
# probability that a beats b, so the probability of the pseudo-label being right is
#   confidence = sigmoid(|r_a - r_b|)  in [1/2, 1].
# select_pseudo_labels is the selection step only: host-side numpy, deterministic (no
# sampling; ties in confidence are broken by pool order).


class PseudoLabels(NamedTuple):
    """Per pair of the pool (all [N]):
      chosen_index    0 when a is pseudo-chosen, 1 when b is (the column of a [N, 2] array of
                      replies stacked as (a, b))
      rejected_index  1 - chosen_index
      kept            bool: the pair passed the selection
      confidence      sigmoid(|r_a - r_b|)
    and `summary`, a dict of floats:
      pool, kept, kept_fraction, ties (pairs scored exactly equal: never kept),
      mean_confidence (over the kept pairs; NaN when none is kept),
      pseudo_label_accuracy (only with `true_chosen_index`: the share of kept pairs whose
      pseudo-label matches the truth; NaN when none is kept)."""
    chosen_index: np.ndarray
    rejected_index: np.ndarray
    kept: np.ndarray
    confidence: np.ndarray
    summary: dict


def _pool_scores(name: str, x, n: int | None = None) -> np.ndarray:
    a = np.asarray(x, np.float64)
    if a.ndim != 1 or (n is not None and a.shape[0] != n):
        want = "[N]" if n is None else f"[N]={n} (one per pair)"
        raise ValueError(f"select_pseudo_labels: {name} must be 1-D {want}; got shape {a.shape}")
    bad = np.flatnonzero(~np.isfinite(a))
    if bad.size:
        raise ValueError(f"select_pseudo_labels: {name} is not finite at pair(s) "
                         f"{bad[:10].tolist()}; score every pair before selecting")
    return a


def select_pseudo_labels(score_a, score_b, *, threshold: float | None = None,
                         top_fraction: float | None = None,
                         true_chosen_index=None) -> PseudoLabels:
    """Pseudo-labels and the kept set of an unlabelled pool scored by the current RM.

    score_a, score_b: [N] the RM's rewards of each pair's two replies.
    threshold: keep pairs with confidence >= threshold (equality keeps), in [1/2, 1].
    top_fraction: keep the floor(top_fraction * N) most confident pairs (equal confidences:
      the earlier pair first), in [0, 1].
    At least one of the two; given both, a pair must pass both. A pair whose scores are equal
    has no pseudo-label (a is reported as chosen, but it is never kept, whatever the
    threshold: its label would be a coin flip).
    true_chosen_index: optional [N] of 0/1 (which side humans preferred, same convention as
    chosen_index), for measuring the pseudo-labels on a pool whose labels were held back.
    """
    if threshold is None and top_fraction is None:
        raise ValueError("select_pseudo_labels needs threshold (keep confidence >= threshold) "
                         "or top_fraction (keep the most confident share), or both")
    if threshold is not None and not 0.5 <= threshold <= 1.0:
        raise ValueError(f"select_pseudo_labels: threshold must be in [0.5, 1] (confidence "
                         f"sigmoid(|r_a - r_b|) is never below 0.5); got {threshold}")
    if top_fraction is not None and not 0.0 <= top_fraction <= 1.0:
        raise ValueError(f"select_pseudo_labels: top_fraction must be in [0, 1], got "
                         f"{top_fraction}")
    a = _pool_scores("score_a", score_a)
    n = a.shape[0]
    b = _pool_scores("score_b", score_b, n)
    diff = a - b
    chosen = np.where(diff >= 0, 0, 1).astype(np.int64)  # a tie reports a (never kept)
    # exp(-|d|) <= 1: no overflow for any finite difference.
    confidence = 1.0 / (1.0 + np.exp(-np.abs(diff)))
    ties = diff == 0
    kept = ~ties
    if threshold is not None:
        kept &= confidence >= threshold
    if top_fraction is not None:
        k = math.floor(top_fraction * n + 1e-9)  # 0.3 * 10 is 2.9999999999999996 in floats
        # Stable sort on -confidence: equal confidences keep pool order, so the result does
        # not depend on the sort algorithm.
        order = np.argsort(-confidence, kind="stable")
        in_top = np.zeros(n, bool)
        in_top[order[:k]] = True
        kept &= in_top
    count = int(kept.sum())
    summary = {
        "pool": float(n),
        "kept": float(count),
        "kept_fraction": count / n if n else 0.0,
        "ties": float(ties.sum()),
        "mean_confidence": float(confidence[kept].mean()) if count else math.nan,
    }
    if true_chosen_index is not None:
        truth = np.asarray(true_chosen_index)
        if truth.shape != (n,) or not np.all((truth == 0) | (truth == 1)):
            raise ValueError(f"select_pseudo_labels: true_chosen_index must be [N]={n} of 0 "
                             f"(a preferred) or 1 (b preferred); got shape {truth.shape}")
        summary["pseudo_label_accuracy"] = (float((chosen[kept] == truth[kept]).mean())
                                            if count else math.nan)
    return PseudoLabels(chosen_index=chosen, rejected_index=1 - chosen, kept=kept,
                        confidence=confidence, summary=summary)
