"""Reward over-optimisation on the quickstart's task: RL against a weak proxy reward model at
three KL coefficients, the env's exact reward as the gold one (Gao et al. 2023's curves).

    python -m launch.train --config configs/reward_model_largest.py:proxy --workdir /tmp/rm_proxy
    for kl in kl0 kl0.05 kl0.5; do
      python -m launch.train --config configs/overoptimisation_largest.py:$kl \\
          --config.reward.model_path=/tmp/rm_proxy/reward_model_hf --workdir /tmp/oo_$kl
    done
    python -m launch.overoptimisation --runs kl0=/tmp/oo_kl0 --runs kl0.05=/tmp/oo_kl0.05 \\
        --runs kl0.5=/tmp/oo_kl0.5 --out docs/figures/overoptimisation_largest.png

GRPO from the SFT warm start, 120 steps of 32 tasks x 8 samples, paid by the proxy alone
(reward.model_weight 1, rule weight 0); the KL to the warm start is kept and logged every step
(algo.log_kl) and, at kl0.05 and kl0.5, penalised (algo.kl_coef, k3). rollout/reward_rule is
the env's verdict on the same rollouts: the gold curve. The figures are in docs/rewards.md.
`smoke` shrinks any of them (it needs --config.reward.model_path too).

Smoke runs (seconds on a CPU; `--list_variants` after the config prints every variant):
    python -m launch.train --config configs/reward_model_largest.py:proxy,smoke \\
        --workdir /tmp/rm_proxy_smoke
    python -m launch.train --config configs/overoptimisation_largest.py:kl0.05,smoke \\
        --config.reward.model_path=/tmp/rm_proxy_smoke/reward_model_hf --workdir /tmp/oo_smoke
"""

from rl_tpu.recipes.config import base_config, largest_task, shrink_for_smoke
from rl_tpu.recipes.variants import parse_variant

KL_COEF = {"kl0": 0.0, "kl0.05": 0.05, "kl0.5": 0.5}


# One line for each variant name (`--list_variants`; rl_tpu/recipes/variants.py).
VARIANT_HELP = {
    "kl0": "no KL penalty (the KL is still logged)",
    "kl0.05": "KL penalty 0.05 (k3)",
    "kl0.5": "KL penalty 0.5 (k3)",
}


def get_config(arg: str = ""):
    chosen, smoke = parse_variant(arg, {"kl": tuple(KL_COEF)})
    c = largest_task(base_config("grpo"))
    c.train.steps = 120
    c.eval.num_tasks = 200
    c.reward.model_path = "/tmp/rm_proxy/reward_model_hf"  # reward_model_largest.py:proxy's
    c.reward.model_weight = 1.0
    c.reward.rule_weight = 0.0
    c.algo.log_kl = True
    c.algo.kl_coef = KL_COEF[chosen["kl"]]
    if smoke:
        shrink_for_smoke(c, warm_start_steps=4, eval_tasks=8)
        c.sft.num_demos = 64
    return c
