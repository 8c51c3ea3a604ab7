"""SIRI on a laptop CPU: a tiny model compresses a verbose teacher's arithmetic, against a
fixed-budget twin (same seed, same steps). Run them one after the other:

    nice -n 10 python -m launch.train --config configs/siri_arithmetic.py:siri \\
        --workdir /tmp/siri_arith_siri
    nice -n 10 python -m launch.train --config configs/siri_arithmetic.py:fixed \\
        --workdir /tmp/siri_arith_fixed
    python benchmarks/siri_report.py --runs siri=/tmp/siri_arith_siri \\
        --runs fixed=/tmp/siri_arith_fixed --period 20 --start short \\
        --out docs/figures/siri_arithmetic.png

The task: reasoning-gym's basic_arithmetic, one-digit sums ("Calculate 6 + 9."), scored by the
dataset's own checker. The SFT warm start imitates a teacher that pads each reply with 0-3
filler sentences ("Let me think about this.") before the worked sum and the answer tag, and
gets the sum right half the time (else off by 1 or 2). Its replies take 19-58 tokens.
Then Dr.GRPO (group-centred advantages, a constant length normaliser) with:
  siri     the budget in stairs of 10 steps: 32 tokens (compression: only replies with at
           most one filler sentence fit, a cut reply has no answer and scores 0), then 64
           (expansion), three cycles in 60 steps; Dr.GRPO's normaliser follows it
  fixed    64 tokens every step (the twin)
  cosine   as siri, the cosine form of the same cycle (stair is the headline run)
Eval: greedy, 200 held-out tasks at 64 tokens whatever the schedule, every 10 steps: at the
end of each compression and each expansion phase. `smoke` shrinks any of them to 2 steps.
docs/siri.md has the results.

`steps` (with any variant: `steps,siri`, `steps,fixed,seed1`) is the scratchpad testbed: sums
of 3-6 one-digit terms, which the teacher works as running totals after its filler
(`6 + 9 = 15. 15 + 8 = 23. ... <answer>..</answer>`), so the reply's useful part grows with the
terms (26-48 tokens without filler from 3 to 6 terms, up to 94 with it). L_max is 96 tokens;
the compression budget, 40, holds a 3- or 4-term scratchpad with its answer but not a 5- or
6-term one even without filler: a budget that binds on the reasoning, not only on padding (a
policy can still fit by adding several terms a step). Its 2-seed grid from one warm-started base:
    python benchmarks/testbed_grid.py --config configs/siri_arithmetic.py --root /tmp/ssteps \
        --base_variant steps --runs steps,siri steps,fixed --seeds 0,1 --x tokens \
        --panels eval/success,eval/tokens,rollout/response_length

Smoke runs (seconds on a CPU; `--list_variants` after the config prints every variant):
    python -m launch.train --config configs/siri_arithmetic.py:siri,smoke \\
        --workdir /tmp/siri_smoke
    python -m launch.train --config configs/siri_arithmetic.py:fixed,smoke \\
        --workdir /tmp/siri_fixed_smoke
    python -m launch.train --config configs/siri_arithmetic.py:steps,siri,smoke \\
        --workdir /tmp/siri_steps_smoke
"""

from rl_tpu.recipes.config import base_config, set_env, shrink_for_smoke, tiny_model_warm_start
from rl_tpu.recipes.variants import parse_variant

VARIANTS = ("siri", "fixed", "cosine")

# One-digit sums with no signs or brackets: a tiny model learns them from a few thousand
# demonstrations (there are only 100 distinct questions, so eval texts recur in training;
# the eval measures the policy's replies, not generalisation to unseen sums).
ARITHMETIC = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
              "operators": ("+",), "allow_parentheses": False, "allow_negation": False}


# A short system prompt (the reasoning envs' own is ~125 tokens): the rows fit in 128 tokens,
# which halves every forward pass on a CPU.
PROMPT = "Give the final answer inside <answer>...</answer>."


# The scratchpad testbed's sums: 3-6 one-digit terms, worked as running totals
STEPS_ARITHMETIC = dict(ARITHMETIC, min_terms=3, max_terms=6)


# One line for each variant name (`--list_variants`; rl_tpu/recipes/variants.py).
VARIANT_HELP = {
    "pair": "one-digit sums of two terms",
    "steps": "the scratchpad testbed: sums of 3-6 terms",
    "siri": "budget stairs of 10 steps: compression, then expansion",
    "fixed": "the same budget every step (the twin)",
    "cosine": "as siri, the cosine form of the cycle",
}


def get_config(arg: str = ""):
    chosen, smoke = parse_variant(arg, {"task": ("pair", "steps"), "variant": VARIANTS},
                                  numbered={"seed": 0})
    variant, steps = chosen["variant"], chosen["task"] == "steps"

    c = base_config("dr_grpo")
    c.seed = chosen["seed"]
    # in-process scoring: basic_arithmetic's checker compares strings, nothing to isolate
    set_env(c, "arithmetic", config=dict(STEPS_ARITHMETIC if steps else ARITHMETIC),
            isolate=False, system_prompt=PROMPT, teacher="steps" if steps else "worked")
    # rows of at most 128 tokens: prompt ~35 tokens + 64 (steps: 192, for 96)
    tiny_model_warm_start(c, context_tokens=192 if steps else 128, sft_steps=300 if steps else 200,
                          sft_batch_size=32, num_demos=4000, teacher_skill=0.5)
    # L_max: fits every teacher reply (at most 58 tokens + eos; steps: the longest sum's)
    c.env.max_new_tokens = 96 if steps else 64
    c.train.steps = 60
    c.train.tasks_per_step = 16
    c.eval.num_tasks = 200

    if variant in ("siri", "cosine"):
        c.schedules.budget = "stair" if variant == "siri" else "cosine"
        # the worked sum + answer (19) and one filler fit; steps: a short sum's scratchpad
        c.schedules.budget_min = 40 if steps else 32
        c.schedules.budget_period = 20
        c.schedules.budget_start = "short"  # compression first: steps 1-10 at 32 tokens

    if smoke:
        shrink_for_smoke(c, warm_start_steps=4, eval_tasks=4)
        c.env.max_new_tokens = 96 if steps else 64  # the schedule's range, as in the experiment
        c.schedules.budget_period = 2  # steps 1 and 2 at different budgets
        c.sft.num_demos = 32
    return c
