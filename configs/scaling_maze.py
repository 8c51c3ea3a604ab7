"""ScalingInter-RL's claim on a task that needs long horizons: fixed short horizons plateau,
fixed long ones destabilise, a horizon that grows in stages does better than both.

    python -m launch.train --config configs/scaling_maze.py:staged --workdir /tmp/maze_staged
    python -m launch.train --config configs/scaling_maze.py:long,seed1 --workdir /tmp/maze_long

    python benchmarks/testbed_grid.py --config configs/scaling_maze.py --root /tmp/smaze \\
        --runs short long staged --seeds 0,1 --x env_steps \\
        --panels eval/success,rollout/turns,train/horizon

The `maze` env (rl_tpu/envs/maze.py): walk a 6 x 6 grid with walls to a goal, one direction a
turn; each task's shortest path is 2-14 moves, reward 1 on reaching the goal. A tiny model is
first fine-tuned on a teacher that takes a shortest-path move half the time and a greedy one
(which bumps into walls) otherwise; then 40 GRPO steps of 16 tasks x 4 samples whose turn
limit H is
  short   6 turns throughout: the tasks whose paths fit, no room for a detour
  long    16 turns throughout, from the first step
  staged  ScalingInter-RL: 6, then 11 from step 14, then 16 from step 27
Eval: greedy success on 200 held-out tasks at 16 turns, at step 0 and every 5. The runs play
different numbers of env steps a step: compare_runs.py's `--x env_steps` sets them side by side
at equal interaction (the paper's budget). `seedN` picks the RL seed (the warm start is the
base's); `smoke` shrinks any of them.

`hidden` (with any horizon: `hidden,staged,seed1`) is the partially observed maze: the goal
is named only once the agent stands next to it (`hidden_goal=True, sight=1`), so every
episode is a search, and searching well needs the episode's history, not just the last
observation. Paths are 2-12 moves; the teacher searches (a step toward the nearest cell it has
not stood on) half the time and moves at random otherwise. In the full-view maze a move learned
in 6-turn episodes is the right move at turn 12 too; here a short horizon never pays for the
later turns of a search, which is what the paper's plateau needs. Its grid, from its own base:
    python benchmarks/testbed_grid.py --config configs/scaling_maze.py --root /tmp/hmaze \
        --base_variant hidden --runs hidden,short hidden,long hidden,staged --seeds 0,1 \
        --x env_steps --panels eval/success,rollout/turns,train/horizon

Smoke runs (seconds on a CPU; `--list_variants` after the config prints every variant):
    python -m launch.train --config configs/scaling_maze.py:staged,smoke \\
        --workdir /tmp/maze_smoke
    python -m launch.train --config configs/scaling_maze.py:hidden,staged,smoke \\
        --workdir /tmp/hmaze_smoke
"""

from rl_tpu.recipes.config import base_config, set_env, shrink_for_smoke, tiny_model_warm_start
from rl_tpu.recipes.variants import parse_variant

LONG = 16
SHORT = 6
STAGES = (6, 11, 16)


# One line for each variant name (`--list_variants`; rl_tpu/recipes/variants.py).
VARIANT_HELP = {
    "short": "6 turns throughout",
    "long": "16 turns throughout",
    "staged": "ScalingInter-RL: 6, then 11 from step 14, then 16 from step 27",
    "full": "the goal is in view from the start",
    "hidden": "the goal is named only next to it: every episode is a search",
}


def get_config(arg: str = ""):
    chosen, smoke = parse_variant(arg, {"horizon": ("short", "long", "staged"),
                                        "view": ("full", "hidden")}, numbered={"seed": 0})
    horizon = chosen["horizon"]
    c = base_config("grpo")
    c.seed = chosen["seed"]
    view = (dict(max_steps=12, hidden_goal=True, sight=1) if chosen["view"] == "hidden"
            else dict(max_steps=14))
    set_env(c, "maze", size=6, wall_density=0.2, min_steps=2, **view)
    tiny_model_warm_start(c, context_tokens=1024, sft_steps=300, num_demos=3000,
                          teacher_skill=0.5, corpus_tasks=200, sft_batch_size=32)
    c.sft.group_by_length = 8  # demos run from 2 turns to 16
    c.train.length_buckets = (256, 512, 768, 1024)
    c.env.max_new_tokens = 4
    c.env.max_turns = SHORT if horizon == "short" else LONG
    c.schedules.horizon_turns = STAGES if horizon == "staged" else ()
    c.schedules.horizon_every = 14
    c.eval.max_turns = LONG
    c.eval.every = 5
    c.eval.num_tasks = 200
    c.train.steps = 40
    c.train.tasks_per_step = 16
    c.train.samples_per_task = 4
    c.rollout.max_batch = 64
    if smoke:
        shrink_for_smoke(c, warm_start_steps=4, eval_tasks=4, context_tokens=512)
        c.model.tiny_corpus_tasks = 20
        c.sft.num_demos, c.sft.batch_size = 16, 8
    return c
