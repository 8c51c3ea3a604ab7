"""The RL algorithms as pure functions of arrays: losses, advantages, importance weights.

The public names (each imported from its module on first use; rl_tpu/lazy_api.py):

    PolicyLossConfig, policy_loss  the clipped policy-gradient loss (PPO, GRPO, DAPO, GSPO,
                                   CISPO, ...) chosen by its config, and its metrics
    POLICY_LOSSES, KL_ESTIMATORS,  the registries of policy losses, KL estimators (k1, k2,
    AGGREGATIONS                   k3, ...) and token aggregations (token-, sequence-mean)
    kl_penalty                     the KL of the policy to the reference, per token
    compute_advantages, ADVANTAGES the advantage estimators (grpo, dr_grpo, rloo, gae, ...)
                                   and their registry
    behaviour_weights              importance weights against the policy that played the
                                   rollouts (off-policy and asynchronous runs)
    BapoConfig, adapt_clip_bounds  BAPO's adaptive clipping bounds
    PREFERENCE_LOSSES, dpo_loss    the preference losses (DPO, IPO, ...) on chosen/rejected
                                   pairs, and DPO's
    bradley_terry_loss             a reward model's pairwise loss
    masked_mean, Metric            the masked mean the losses use; a statistic that knows
                                   how to combine with its other parts (micro-batches, hosts)
    Registry                       a name -> function table that names its choices in errors
"""

from rl_tpu.lazy_api import lazy_api, public_names

_HOMES = {
    ".losses": ("PolicyLossConfig", "policy_loss", "POLICY_LOSSES", "KL_ESTIMATORS",
                "AGGREGATIONS", "kl_penalty"),
    ".advantages": ("compute_advantages", "ADVANTAGES"),
    ".importance": ("behaviour_weights",),
    ".bapo": ("BapoConfig", "adapt_clip_bounds"),
    ".preference": ("PREFERENCE_LOSSES", "dpo_loss"),
    ".reward_losses": ("bradley_terry_loss",),
    ".masked": ("masked_mean", "Metric"),
    ".registry": ("Registry",),
}
__all__ = public_names(_HOMES)
__getattr__, __dir__ = lazy_api(__name__, _HOMES)
