"""Two-role self-play on arithmetic: one tiny model proposes problems and solves them.

    python -m launch.train --config configs/selfplay_arithmetic.py --workdir /tmp/selfplay

The `selfplay_arithmetic` env (rl_tpu/envs/selfplay.py) and recipe (rl_tpu/recipes/
selfplay.py): a proposer writes an expression of up to 4 integers in [0, 20] joined by
+ - *; a solver computes it. A tiny model (its tokenizer learns the env's text) is warm-started
on a teacher that proposes random 2-3 term problems and solves half of them, then 40 GRPO
steps, each of 16 proposer slots x 4 proposals, every valid proposal tried 4 times by the
solver. The proposer is paid most when the solver succeeds half the time on its problem
(selfplay.target_success = 0.5). W/curves.png draws the proposer's difficulty
(selfplay/proposal_terms), the solver's success on proposals and the held-out eval; the
figures are in docs/loops.md. `smoke` runs the same game in seconds.

Variants (the proposer's reward, recipes/selfplay.py): `peak` (the default: highest at 50%
solver success), `learnability` (4 p (1 - p)), `band` (1 for solver success in [0.2, 0.8]);
and `solver_only`, the control: plain GRPO on random problems of 2-3 terms (the env's solve
tasks) from the same warm start, no proposer, compared at equal solver tokens
(selfplay/solver_tokens against rollout/played_tokens). `,seedN` picks the seed.

`small` (with any of them: `small,band,seed1`) is the testbed size: two integers in [0, 9]
(+ - *), where the warm-started solver is neither at zero nor done, so a proposer has
problems of every difficulty to choose from. At the full size the warm start solves 4% of
held-out problems and no variant moves it (docs/loops.md). The grid, from one base:
    python benchmarks/testbed_grid.py --config configs/selfplay_arithmetic.py --root /tmp/sp \
        --base_variant small --runs small,peak small,learnability small,band \
        small,solver_only --seeds 0,1 --x solver_tokens \
        --panels eval/success,selfplay/solver_success,selfplay/proposal_abs_value

Smoke runs (seconds on a CPU; `--list_variants` after the config prints every variant):
    python -m launch.train --config configs/selfplay_arithmetic.py:smoke \\
        --workdir /tmp/selfplay_smoke
    python -m launch.train --config configs/selfplay_arithmetic.py:small,band,smoke \\
        --workdir /tmp/sp_band_smoke
    python -m launch.train --config configs/selfplay_arithmetic.py:solver_only,smoke \\
        --workdir /tmp/sp_solver_smoke
"""

from rl_tpu.recipes.config import base_config, set_env, shrink_for_smoke, tiny_model_warm_start
from rl_tpu.recipes.variants import parse_variant


REWARDS = ("peak", "learnability", "band", "solver_only")


# One line for each variant name (`--list_variants`; rl_tpu/recipes/variants.py).
VARIANT_HELP = {
    "peak": "proposer paid most at 50% solver success",
    "learnability": "proposer paid 4 p (1 - p)",
    "band": "proposer paid 1 for solver success in [0.2, 0.8]",
    "solver_only": "the control: plain GRPO on random problems, no proposer",
    "full": "up to 4 integers in [0, 20]",
    "small": "the testbed size: two integers in [0, 9]",
}


def get_config(arg: str = ""):
    chosen, smoke = parse_variant(arg, {"reward": REWARDS, "size": ("full", "small")},
                                  numbered={"seed": 0})
    small = chosen["size"] == "small"
    c = base_config("grpo")
    c.seed = chosen["seed"]
    solver_only = chosen["reward"] == "solver_only"
    c.recipe = "rl" if solver_only else "selfplay"
    if not solver_only:
        c.selfplay.proposer_reward = chosen["reward"]
    set_env(c, "selfplay_arithmetic", max_terms=2 if small else 4,
            max_number=9 if small else 20, train_roles="solve" if solver_only else "both")
    tiny_model_warm_start(c, context_tokens=256, sft_steps=300, num_demos=4000,
                          teacher_skill=0.5, corpus_tasks=200)
    c.env.max_new_tokens = 12
    c.train.steps = 40
    c.train.tasks_per_step = 16
    c.train.samples_per_task = 4
    c.eval.num_tasks = 300
    if smoke:
        shrink_for_smoke(c, warm_start_steps=30, eval_tasks=8)
        c.model.tiny_corpus_tasks = 20
        c.env.max_new_tokens = 12  # a proposal of four numbers
        c.selfplay.solver_samples = 2
    return c
