"""Pairwise preference losses on sequence log-probabilities: DPO, IPO, INPO.

Shape letter: B preference pairs. Every `*_logps` argument is [B]: the log-probability of the
whole response given the prompt, i.e. the SUM of its token log-probs over the response tokens
(not a per-token mean). A caller who wants length-normalised variants passes per-token means
instead; the formulas below do not care where the numbers come from.

Each loss returns `(loss, metrics)`: `loss` a scalar mean over the B pairs, `metrics` a dict of
scalars (no gradient through them):
  reward_accuracy   share of pairs whose implicit reward ranks chosen above rejected
  chosen_reward     mean implicit reward of the chosen responses
  rejected_reward   mean implicit reward of the rejected responses
  reward_margin     mean of (chosen_reward - rejected_reward)
The implicit reward is the log-ratio each loss pushes on, scaled to reward units (each docstring
says which). PREFERENCE_LOSSES maps "dpo", "ipo", "inpo" to the functions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rl_tpu.rl.registry import Registry

Array = jax.Array

PREFERENCE_LOSSES: Registry = Registry("preference loss")


def _f32(*xs: Array) -> tuple[Array, ...]:
    # Sequence log-probs are sums of many terms; keep the arithmetic in f32 even for bf16 input.
    return tuple(jnp.asarray(x, jnp.float32) for x in xs)


def _metrics(chosen_reward: Array, rejected_reward: Array) -> dict[str, Array]:
    chosen_reward, rejected_reward = jax.lax.stop_gradient((chosen_reward, rejected_reward))
    return {
        "reward_accuracy": jnp.mean((chosen_reward > rejected_reward).astype(jnp.float32)),
        "chosen_reward": jnp.mean(chosen_reward),
        "rejected_reward": jnp.mean(rejected_reward),
        "reward_margin": jnp.mean(chosen_reward - rejected_reward),
    }


@PREFERENCE_LOSSES.register("dpo")
def dpo_loss(chosen_logps: Array, rejected_logps: Array, ref_chosen_logps: Array,
             ref_rejected_logps: Array, beta: float,
             label_smoothing: float = 0.0) -> tuple[Array, dict[str, Array]]:
    """Sigmoid DPO (Rafailov et al. 2023), with conservative-DPO label smoothing.

    All inputs [B]. With the log-ratio margin
      h = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l)),
    the per-pair loss is
      -(1 - eps) * log sigmoid(beta * h) - eps * log sigmoid(-beta * h),   eps = label_smoothing,
    i.e. the Bradley-Terry likelihood of the label when a share eps of labels is assumed
    flipped; eps = 0 is plain DPO. Implicit reward: beta * (log pi(y) - log pi_ref(y)).
    """
    pc, pr, rc, rr = _f32(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
    chosen_reward = beta * (pc - rc)
    rejected_reward = beta * (pr - rr)
    logits = chosen_reward - rejected_reward  # = beta * h
    losses = (-(1.0 - label_smoothing) * jax.nn.log_sigmoid(logits)
              - label_smoothing * jax.nn.log_sigmoid(-logits))
    return jnp.mean(losses), _metrics(chosen_reward, rejected_reward)


@PREFERENCE_LOSSES.register("ipo")
def ipo_loss(chosen_logps: Array, rejected_logps: Array, ref_chosen_logps: Array,
             ref_rejected_logps: Array, beta: float) -> tuple[Array, dict[str, Array]]:
    """IPO (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
    Preferences"): least squares of the log-ratio margin onto a fixed target.

    All inputs [B]. With h as in `dpo_loss` (computed from whole-sequence log-probs, as in the
    paper, where pi(y) is the probability of the full response), the per-pair loss is
      (h - 1 / (2 * beta))^2,
    beta being the paper's regularisation strength tau (larger beta, smaller target margin,
    closer to pi_ref). Unlike DPO the margin is regressed to a finite target, so it cannot grow
    without bound on deterministic preferences. Implicit reward: beta * (log pi - log pi_ref),
    whose margin the loss drives to 1/2.
    """
    pc, pr, rc, rr = _f32(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
    h = (pc - rc) - (pr - rr)
    losses = jnp.square(h - 1.0 / (2.0 * beta))
    return jnp.mean(losses), _metrics(beta * (pc - rc), beta * (pr - rr))


@PREFERENCE_LOSSES.register("inpo")
def inpo_loss(chosen_logps: Array, rejected_logps: Array, prev_chosen_logps: Array,
              prev_rejected_logps: Array, ref_chosen_logps: Array, ref_rejected_logps: Array,
              eta: float, tau: float) -> tuple[Array, dict[str, Array]]:
    """INPO (Zhang et al. 2024, "Iterative Nash Policy Optimization", arXiv 2407.00617).

    All inputs [B]: the policy being trained (pi), the previous iteration's policy pi_t (which
    sampled the pairs; `prev_*`, no gradient) and the reference pi_ref (`ref_*`).

    The paper runs online mirror descent on the preference game: with step size `eta` and KL
    strength `tau` toward pi_ref, the next iterate is
      pi_{t+1}(y)  proportional to  pi_t(y)^(1 - eta*tau) * pi_ref(y)^(eta*tau)
                                     * exp(eta * P(y beats pi_t)).
    Taking the log-ratio of two responses y, y' cancels the normaliser:
      h_t(pi, y, y') := log pi(y)/pi(y') - eta*tau * log pi_ref(y)/pi_ref(y')
                        - (1 - eta*tau) * log pi_t(y)/pi_t(y')
                      = eta * (P(y beats pi_t) - P(y' beats pi_t))     at pi = pi_{t+1}.
    The win rates are unknown, but for y, y' ~ pi_t that pi_{t+1} is the least-squares fit of
    h_t(pi, y, y') to eta * (1[y beats y'] - 1/2) (the IPO argument: the best antisymmetric fit
    f(y) - f(y') of a 0/1 label gives f(y) = eta * P(y beats pi_t) + const). On a labelled pair
    (y_w beat y_l) that target is eta/2, so the loss implemented is
      mean_B (h_t(pi, y_w, y_l) - eta / 2)^2
    with
      h_t = (logp_w - logp_l) - eta*tau * (ref_w - ref_l) - (1 - eta*tau) * (prev_w - prev_l).

    Limits, as checks: tau = 0 is IPO against pi_t with beta = 1/eta; eta*tau = 1 is IPO against
    pi_ref with beta = 1/eta. eta*tau should lie in [0, 1] (a geometric mixture of pi_t and
    pi_ref); eta is a step size (large, ~1/beta), not a DPO-style beta.
    Implicit reward: (log pi - eta*tau * log pi_ref - (1 - eta*tau) * log pi_t) / eta, whose
    margin the loss drives to 1/2 (the same units as the DPO/IPO rewards with beta = 1/eta).
    """
    if isinstance(eta, (int, float)) and isinstance(tau, (int, float)):
        if eta <= 0 or not 0.0 <= eta * tau <= 1.0:
            raise ValueError(f"inpo_loss needs eta > 0 and 0 <= eta*tau <= 1; got eta={eta}, "
                             f"tau={tau} (eta*tau={eta * tau}). eta is the mirror-descent step "
                             "size (about 1/beta), tau the KL strength toward the reference")
    pc, pr, tc, tr, rc, rr = _f32(chosen_logps, rejected_logps, prev_chosen_logps,
                                  prev_rejected_logps, ref_chosen_logps, ref_rejected_logps)
    w_ref = eta * tau
    w_prev = 1.0 - w_ref
    # Per-response anchored log-prob; h_t is its chosen-minus-rejected difference.
    anchored_c = pc - w_ref * rc - w_prev * tc
    anchored_r = pr - w_ref * rr - w_prev * tr
    h = anchored_c - anchored_r
    losses = jnp.square(h - eta / 2.0)
    return jnp.mean(losses), _metrics(anchored_c / eta, anchored_r / eta)
