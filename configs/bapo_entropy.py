"""BAPO's claim where it can show: a task with several right answers, off-policy enough for the
clip to bind, with the mechanism logged.

    python -m launch.train --config configs/bapo_entropy.py:bapo,s8 --workdir /tmp/bapo_e/bapo_s8
    python benchmarks/bapo_entropy.py --root /tmp/bapo_e        # the grid, table and figure

BAPO (Xi et al. 2025) says that under off-policy data a fixed clip lets negative-advantage
tokens dominate the policy gradient while the upper bound cuts off low-probability positive
tokens, so entropy collapses; its adaptive bounds keep the positive share at rho0 and the
entropy up. `configs/bapo_offpolicy.py` found nothing either way on `largest`, a task with one
right answer, where collapsing onto it is what the reward asks for. Here the task is `evens`
(name any even number of six digits, 2-6 right answers a task): a policy can stay spread over
the right answers or collapse onto one, and the eval measures both (`eval.pass_k = 8`: pass@8,
mean@8 = pass@1 at temperature 1, distinct@8 = distinct right answers in 8 samples; greedy
success), with the loss's mechanism numbers logged every step (`algo.mechanism_metrics`:
the positive and negative tokens' gradient weight, the clip rate by advantage sign and by
behaviour-probability bucket, BAPO's bounds; `train/entropy`).

Losses (every ratio against the behaviour policy, token-mean aggregation, as
configs/bapo_offpolicy.py):
  bapo         adaptive bounds (rho0 0.4, c_low in [0.6, 0.9], c_high in [1.2, 3.0])
  clip         PPO clip [0.8, 1.2]
  clip_higher  DAPO clip-higher [0.8, 1.28]
Settings:
  s0           on-policy, one update a step (the control)
  s4, s8       an asynchronous producer in lock-step: step s trains on rollouts of version
               s - 1 - k (staleness exactly 4 or 8), 2 epochs x 4 minibatches a step, so even
               the first mini-update is off-policy and the last is far
Variants are comma-separated (`clip,s8`, `bapo,s4,seed1`); `smoke` shrinks any of them. Two
CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=2) let the sampler and the
learner overlap; one device runs the same numbers, only slower.

Smoke runs (seconds on a CPU; `--list_variants` after the config prints every variant):
    python -m launch.train --config configs/bapo_entropy.py:bapo,smoke \\
        --workdir /tmp/bapo_e_smoke
    python -m launch.train --config configs/bapo_entropy.py:clip,s0,smoke \\
        --workdir /tmp/bapo_e_clip_smoke
"""

from rl_tpu.recipes.config import base_config, set_env, shrink_for_smoke, tiny_model_warm_start
from rl_tpu.recipes.variants import parse_variant

LOSSES = ("bapo", "clip", "clip_higher")
SETTINGS = ("s0", "s4", "s8")


# One line for each variant name (`--list_variants`; rl_tpu/recipes/variants.py).
VARIANT_HELP = {
    "bapo": "BAPO's adaptive bounds (rho0 0.4, c_low in [0.6, 0.9], c_high in [1.2, 3.0])",
    "clip": "PPO clip [0.8, 1.2]",
    "clip_higher": "DAPO clip-higher [0.8, 1.28]",
    "s0": "on-policy, one update a step (the control)",
    "s4": "an asynchronous producer in lock-step: staleness exactly 4",
    "s8": "an asynchronous producer in lock-step: staleness exactly 8",
}


def get_config(arg: str = ""):
    chosen, smoke = parse_variant(arg, {"loss": LOSSES, "setting": SETTINGS}, {"setting": "s8"},
                                  numbered={"seed": 0})
    loss, setting = chosen["loss"], chosen["setting"]

    c = base_config("bapo" if loss == "bapo" else "grpo")
    set_env(c, "evens")
    tiny_model_warm_start(c, context_tokens=96, sft_steps=300, num_demos=4000,
                          teacher_skill=0.3)
    c.seed = chosen["seed"]
    c.env.max_new_tokens = 4
    c.train.steps = 60
    c.rollout.temperature = 1.0
    c.algo.ratio_against = "behaviour"
    c.algo.aggregation = "token_mean"
    c.algo.mechanism_metrics = True
    if loss == "clip_higher":
        c.algo.clip_high = 0.28
    c.eval.num_tasks = 200
    c.eval.pass_k = 8
    c.eval.every = 5

    if setting != "s0":
        c.rollout.max_staleness = int(setting[1:])
        c.rollout.deterministic = True
        c.train.epochs = 2
        c.train.minibatches = 4

    if smoke:
        shrink_for_smoke(c, warm_start_steps=4, eval_tasks=4)
        c.train.tasks_per_step = 4
        c.train.minibatches = min(c.train.minibatches, 2)
        c.rollout.max_staleness = min(c.rollout.max_staleness, 2)
        c.eval.pass_k = 2
        c.sft.num_demos = 64
    return c
