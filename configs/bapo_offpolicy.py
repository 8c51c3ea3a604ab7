"""BAPO in its own setting, off-policy data, against the clip baselines, on a laptop CPU.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m launch.train \\
        --config configs/bapo_offpolicy.py:bapo,s2 --workdir /tmp/bapo_s2 --config.seed=0

The quickstart's task (name the largest of five numbers) and warm start (SFT on a teacher that
is right 30% of the time), then GRPO advantages with one of three policy losses, every ratio
taken against the behaviour policy (r = pi_theta / pi_rollout, as BAPO defines it), token-mean
aggregation, 4 minibatches a step (each mini-update adapts BAPO's bounds on its own):
  bapo         adaptive bounds (rho0 0.4, c_low in [0.6, 0.9], c_high in [1.2, 3.0])
  clip         PPO clip [0.8, 1.2]
  clip_higher  DAPO clip-higher [0.8, 1.28]
and one of the off-policy settings:
  s0           on-policy (the control)
  s2, s4       an asynchronous producer in lock-step (`rollout.deterministic`): step s trains
               on rollouts of version s - 1 - k, i.e. staleness exactly k = 2 or 4 (the
               sampler and the learner each get one of the two CPU devices)
  replay       on-policy rollouts plus as many replayed groups of up to 4 versions old
  partial      partial rollouts: a free-running producer (at most 2 versions behind) whose
               chunks may spend half the tokens a chunk could generate; generations cut
               there are resumed under newer weights, so trajectories span versions (tokens
               more than 2 versions old carry no loss)
Variants are comma-separated: `bapo,s4`, `clip_higher,replay`; `smoke` shrinks any of them.
Without the XLA flag (one CPU device) every setting runs too: the asynchronous ones' sampler
and learner then share the device and take turns (s2 and s4, in lock-step, give the same
numbers as on two devices), only without the overlap.
The comparison, its figure and what it shows are in docs/off_policy.md.

Smoke runs (seconds on a CPU; `--list_variants` after the config prints every variant):
    python -m launch.train --config configs/bapo_offpolicy.py:bapo,smoke \\
        --workdir /tmp/bapo_smoke
    python -m launch.train --config configs/bapo_offpolicy.py:clip,replay,smoke \\
        --workdir /tmp/bapo_replay_smoke
    python -m launch.train --config configs/bapo_offpolicy.py:bapo,partial,smoke \\
        --workdir /tmp/bapo_partial_smoke
"""

from rl_tpu.recipes.config import base_config, largest_task, shrink_for_smoke
from rl_tpu.recipes.variants import parse_variant

LOSSES = ("bapo", "clip", "clip_higher")
SETTINGS = ("s0", "s2", "s4", "replay", "partial")


# One line for each variant name (`--list_variants`; rl_tpu/recipes/variants.py).
VARIANT_HELP = {
    "bapo": "BAPO's adaptive bounds (rho0 0.4, c_low in [0.6, 0.9], c_high in [1.2, 3.0])",
    "clip": "PPO clip [0.8, 1.2]",
    "clip_higher": "DAPO clip-higher [0.8, 1.28]",
    "s0": "on-policy (the control)",
    "s2": "an asynchronous producer in lock-step: staleness exactly 2",
    "s4": "an asynchronous producer in lock-step: staleness exactly 4",
    "replay": "on-policy rollouts plus as many replayed groups up to 4 versions old",
    "partial": "partial rollouts resumed under newer weights (at most 2 behind)",
}


def get_config(arg: str = ""):
    chosen, smoke = parse_variant(arg, {"loss": LOSSES, "setting": SETTINGS}, {"setting": "s2"})
    loss, setting = chosen["loss"], chosen["setting"]

    c = largest_task(base_config("bapo" if loss == "bapo" else "grpo"))
    c.algo.ratio_against = "behaviour"
    c.algo.aggregation = "token_mean"
    if loss == "clip_higher":
        c.algo.clip_high = 0.28
    c.train.minibatches = 4
    c.eval.num_tasks = 200

    if setting in ("s2", "s4"):
        c.rollout.max_staleness = int(setting[1])
        c.rollout.deterministic = True
    elif setting == "replay":
        c.train.replay.capacity = 4 * c.train.tasks_per_step
        c.train.replay.fraction = 0.5
        c.train.replay.max_staleness = 4
    elif setting == "partial":
        c.rollout.max_staleness = 2
        c.rollout.partial_token_budget = (c.train.tasks_per_step * c.train.samples_per_task
                                          * c.env.max_new_tokens // 2)
        c.rollout.mask_stale_tokens = True

    if smoke:
        shrink_for_smoke(c, warm_start_steps=4, eval_tasks=8)
        c.train.tasks_per_step = 4
        c.train.minibatches = 2
        c.train.replay.capacity = min(c.train.replay.capacity, 8)
        if setting == "partial":
            c.rollout.partial_token_budget = 8
        c.sft.num_demos = 64
    return c
