"""RLoop against plain RL at the same number of sampled tokens, on the quickstart's task.

    python -m launch.train --config configs/rloop_largest.py --workdir /tmp/rloop
    python -m launch.train --config configs/rloop_largest.py:plain_rl --workdir /tmp/plain_rl

Both start from the quickstart's SFT warm start (P_0; rl_tpu/recipes/config.py:
largest_task) and sample the same RL rollouts: 60 GRPO steps of 32 tasks x 8 samples.
  (default)   RLoop (rl_tpu/recipes/rloop.py): 3 rounds, each a 20-step RL run from P_r
              whose correct samples (each distinct one once) fine-tune P_r itself, the
              round's STARTING policy, for 100 steps at lr 1e-3 into P_{r+1}
  alternate   RL and SFT alternating: the same, but the fine-tune continues from the RL
              run's final policy (loop.rft_from = "end")
  plain_rl    the control: one 60-step RL run (the quickstart's RL, 60 steps)
Greedy success on 500 held-out tasks: W/metrics.jsonl's eval/success (RLoop: one line a
round; each round's RL run has its own curve in W/round_R/rl). `smoke` shrinks any variant.
The figures are in docs/loops.md.

Smoke runs (seconds on a CPU; `--list_variants` after the config prints every variant):
    python -m launch.train --config configs/rloop_largest.py:smoke --workdir /tmp/rloop_smoke
    python -m launch.train --config configs/rloop_largest.py:plain_rl,smoke \\
        --workdir /tmp/plain_rl_smoke
"""

from rl_tpu.recipes.config import base_config, largest_task, shrink_for_smoke
from rl_tpu.recipes.variants import parse_variant

VARIANTS = ("rloop", "alternate", "plain_rl")


# One line for each variant name (`--list_variants`; rl_tpu/recipes/variants.py).
VARIANT_HELP = {
    "rloop": "3 rounds: RL, then fine-tune the round's starting policy",
    "alternate": "RL and SFT alternating (the fine-tune continues from RL's end)",
    "plain_rl": "the control: one 60-step RL run",
}


def get_config(arg: str = ""):
    chosen, smoke = parse_variant(arg, {"variant": VARIANTS})
    variant = chosen["variant"]
    c = largest_task(base_config("grpo"))
    c.eval.num_tasks = 500
    # 3 rounds of a 20-step RL run whose successes (loop.reward_threshold 1) fine-tune for
    # loop.sft_steps = 100 steps at loop.sft_lr = 1e-3
    c.recipe = "rloop"
    c.train.steps = 20
    c.loop.rft_from = "end" if variant == "alternate" else "start"
    if variant == "plain_rl":
        c.recipe = "rl"
        c.train.steps = 60
    if smoke:
        shrink_for_smoke(c, warm_start_steps=30, eval_tasks=8)
        c.train.tasks_per_step = c.train.samples_per_task = 4
    return c
