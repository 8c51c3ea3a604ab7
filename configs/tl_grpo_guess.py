"""TL-GRPO against trajectory GRPO on an iterative optimisation task, on a laptop CPU.

    python -m launch.train --config configs/tl_grpo_guess.py:tl_grpo --workdir /tmp/tl/tl_grpo
    python -m launch.train --config configs/tl_grpo_guess.py:grpo --workdir /tmp/tl/grpo

TL-GRPO's setting (circuit sizing) is a search where every turn proposes a solution to the same
problem and the episode is worth its best turn. `guess` is that in miniature: find a number in
0-63 from "higher" / "lower", each turn scored by its closeness, the episode by its best turn
(`env.reward_reduce = "max"`), 8 turns (halving needs 7). A tiny model after an SFT warm start
on a teacher that halves the interval 30% of the time and guesses inside it otherwise.

  tl_grpo  each task is played once up to a fork turn drawn from 0..4, then forked into 8
           branches that share its history; the branches' rewards (their own turns' best) are
           normalised in their group, the turns before the fork carry no loss
  grpo     8 whole episodes a task, normalised in their group

At equal steps TL-GRPO plays fewer env steps (the trunk once, not 8 times): compare on the
tokens sampled too (`benchmarks/compare_runs.py --x tokens`). `,seedN` picks the seed;
`smoke` shrinks either.
Eval: greedy success (found within 8 turns) and the best turn's closeness (`eval/reward`) on
200 held-out numbers, every 5 steps.

Smoke runs (seconds on a CPU; `--list_variants` after the config prints every variant):
    python -m launch.train --config configs/tl_grpo_guess.py:tl_grpo,smoke \\
        --workdir /tmp/tl_guess_smoke
    python -m launch.train --config configs/tl_grpo_guess.py:grpo,smoke \\
        --workdir /tmp/grpo_guess_smoke
"""

from rl_tpu.recipes.config import (base_config, multi_turn_agent, shrink_for_smoke,
                                   tiny_model_warm_start)
from rl_tpu.recipes.variants import parse_variant

TURNS = 8


# One line for each variant name (`--list_variants`; rl_tpu/recipes/variants.py).
VARIANT_HELP = {
    "tl_grpo": "one trunk a task, forked into 8 branches normalised together",
    "grpo": "8 whole episodes a task (the control)",
}


def get_config(arg: str = ""):
    chosen, smoke = parse_variant(arg, {"algo": ("tl_grpo", "grpo")}, numbered={"seed": 0})
    c = multi_turn_agent(base_config(chosen["algo"]), "guess", turns=TURNS, max_new_tokens=4,
                         max_context_tokens=384)
    c.seed = chosen["seed"]
    c.env.reward_reduce = "max"  # the best turn's closeness
    c.model.attention_impl = "xla"  # a tiny CPU model: rows of any bucket, no 128-token blocks
    tiny_model_warm_start(c, context_tokens=384, sft_steps=300, num_demos=4000,
                          teacher_skill=0.3, corpus_tasks=50)
    c.eval.max_turns = TURNS
    c.eval.num_tasks = 200
    c.eval.every = 5
    c.train.steps = 40
    c.train.tasks_per_step = 16
    c.train.samples_per_task = 8
    c.train.minibatches = 1
    c.train.length_buckets = (192, 384)
    c.schedules.horizon_turns = ()
    if chosen["algo"] == "tl_grpo":
        c.algo.branch_turn = 4
        c.algo.branch_sample = "uniform"
    if smoke:
        shrink_for_smoke(c, warm_start_steps=2, context_tokens=384)
        c.model.tiny_corpus_tasks = 8
        c.sft.num_demos = 8
        c.sft.batch_size = 8
        if chosen["algo"] == "tl_grpo":
            c.algo.branch_turn = 1
            c.algo.branch_sample = "fixed"
    return c
