"""Rollout routing replay (R3) on a mixture of experts, on a laptop CPU: does it matter that
the update routes tokens through the experts the sampler chose?

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m launch.train \\
        --config configs/moe_replay.py:replay --workdir /tmp/moe_replay

The quickstart's task (name the largest of five numbers) and warm start (SFT on a teacher that
is right 30% of the time) on a tiny Qwen3-MoE (2 layers, 8 experts, top 2, every layer
sparse: `model.tiny_arch=qwen3_moe`), then GRPO with the ratio against the behaviour policy on
rollouts that are exactly 2 versions old (an asynchronous producer in lock-step) and sampled
in bfloat16 while the learner computes in float32: the settings in which a learner's router
and a sampler's disagree. One of:
  replay  algo.routing_replay=rollout: the update's and the score pass's forwards use the
          experts the sampler chose for every token (R3, arXiv 2510.11370)
  none    the learner's routers choose for themselves (the control)
and one of:
  s2      staleness exactly 2 (the default)
  s0      on-policy: the learner's weights are the sampler's, so what differs is numerics
          (bfloat16 against float32, a decode step against a whole-sequence forward)
Both log train/routing_mismatch (the share of token-layer routings, on the policy's tokens,
where the learner's own top-k differs from the sampler's), train/logprob_gap_* (proximal
against behaviour log-probs), train/router_aux_loss and the entropy. Variants are
comma-separated with a seed suffix (`replay,seed1`); `smoke` shrinks any of them. The
comparison and what it shows are in docs/models.md.

Smoke runs (seconds on a CPU; `--list_variants` after the config prints every variant):
    python -m launch.train --config configs/moe_replay.py:replay,smoke \\
        --workdir /tmp/moe_replay_smoke
    python -m launch.train --config configs/moe_replay.py:none,smoke \\
        --workdir /tmp/moe_none_smoke
"""

from rl_tpu.recipes.config import base_config, largest_task, shrink_for_smoke
from rl_tpu.recipes.variants import parse_variant

# One line for each variant name (`--list_variants`; rl_tpu/recipes/variants.py).
VARIANT_HELP = {
    "replay": "the update replays the sampler's experts (algo.routing_replay=rollout)",
    "none": "the learner's routers choose (the control)",
    "s2": "rollouts exactly 2 versions old (an asynchronous producer in lock-step)",
    "s0": "on-policy: only numerics (bf16 sampling, decode against a whole forward) differ",
}


def get_config(arg: str = ""):
    chosen, smoke = parse_variant(arg, {"routing": ("replay", "none"), "staleness": ("s2", "s0")},
                                  numbered={"seed": 0})
    c = largest_task(base_config("grpo"))
    c.seed = chosen["seed"]
    c.model.tiny_arch = "qwen3_moe"
    c.model.sampler_dtype = "bfloat16"
    c.algo.routing_replay = "rollout" if chosen["routing"] == "replay" else "none"
    c.algo.log_routing_mismatch = True
    c.algo.ratio_against = "behaviour"
    c.algo.aggregation = "token_mean"
    if chosen["staleness"] == "s2":
        c.rollout.max_staleness = 2
        c.rollout.deterministic = True
    c.eval.num_tasks = 200
    if smoke:
        shrink_for_smoke(c, warm_start_steps=4, eval_tasks=8)
        c.model.sampler_dtype = "bfloat16"  # the smoke keeps the path it shrinks
        c.train.tasks_per_step = 4
        c.sft.num_demos = 64
    return c
