"""A multi-turn agent that learns on a CPU: AgentGym's BabyAI, a tiny model, GRPO over episodes.

    python -m launch.train --config configs/babyai_cpu.py --workdir /tmp/babyai_cpu
    python -m launch.train --config configs/babyai_cpu.py:fixed --workdir /tmp/babyai_fixed
    python -m launch.train --config configs/babyai_cpu.py:scaling --workdir /tmp/babyai_scaling

1. A tiny random Qwen2 whose tokenizer has also learned BabyAI's words (model.tiny_corpus_tasks).
2. SFT warm start (600 steps, batches of like-length demos, 6,000 demos so that each is seen
   about 1.6 times: with 1,500 it memorised them and misquoted the goal in 44 of 100
   held-out episodes' thoughts) on episodes of an imperfect scripted teacher (rl_tpu/envs/babyai_teacher.py) over AgentGym's macro actions: an episode's
   teacher is careless with probability 0.7 and then acts on the NEAREST object whatever the
   mission names, solving about 56% of held-out tasks at 4 turns.
3. GRPO over whole multi-turn episodes (AgentGym's observations, actions and scores; the
   trajectory's reward is AgentGym's final score, 1 - 0.9 * moves / max_steps on success),
   on the single-room levels the teacher knows (EASY_LEVELS: go to / pick up / open).
Eval: greedy success on 100 held-out tasks at a fixed 4-turn horizon, at step 0 and every 5.

Variants: '' = `fixed` (4 turns throughout), `scaling` (ScalingInter-RL: 2, 3, then 4 turns,
a stage every 14 of the 40 steps), `smoke` (2 steps, a tiny budget), and `,seed1`-style suffixes for the
seed (e.g. `scaling,seed1`). The teacher's success and the warm start's are logged at step 0.

Smoke runs (seconds on a CPU; `--list_variants` after the config prints every variant):
    python -m launch.train --config configs/babyai_cpu.py:smoke --workdir /tmp/babyai_cpu_smoke
    python -m launch.train --config configs/babyai_cpu.py:scaling,smoke \\
        --workdir /tmp/babyai_scaling_smoke
"""

from rl_tpu.envs.babyai_teacher import EASY_LEVELS
from rl_tpu.recipes.config import (base_config, multi_turn_agent, shrink_for_smoke,
                                   tiny_model_warm_start)
from rl_tpu.recipes.variants import parse_variant

HORIZON = 4
STAGES = (2, 3, 4)


# One line for each variant name (`--list_variants`; rl_tpu/recipes/variants.py).
VARIANT_HELP = {
    "fixed": "4 turns throughout",
    "scaling": "ScalingInter-RL: 2, 3, then 4 turns, a stage every 14 of the 40 steps",
}


def get_config(arg: str = ""):
    chosen, smoke = parse_variant(arg, {"horizon": ("fixed", "scaling")}, numbered={"seed": 0})
    c = multi_turn_agent(base_config("grpo"), "babyai_agentgym", turns=HORIZON,
                         max_new_tokens=24, max_context_tokens=1792)
    c.seed = chosen["seed"]
    c.env.kwargs.levels = EASY_LEVELS
    c.env.kwargs.eval_size = 400
    c.env.reward_reduce = "last"  # AgentGym's score is a running sum: its last value
    tiny_model_warm_start(c, context_tokens=1792, sft_steps=600, sft_batch_size=16,
                          num_demos=6000, teacher_skill=0.3, corpus_tasks=200)
    c.model.tiny_vocab = 1024
    # SFT batches of like-length demos: episodes run from ~400 tokens (one turn) to the limit
    c.sft.group_by_length = 8
    c.eval.max_turns = HORIZON
    c.eval.every = 5
    c.train.steps = 40
    c.train.tasks_per_step = 8
    c.train.minibatches = 1
    # Dense attention holds [rows, heads, T, T] logits: 16-row micro-batches and 64-row
    # sampler batches keep a 1792-token episode inside a few GB; fine buckets pad each
    # batch to little more than its own length.
    c.train.micro_batches = 4
    c.rollout.max_batch = 64
    c.train.length_buckets = (512, 768, 1024, 1280, 1536, 1792)
    c.checkpoint.every = 10
    if chosen["horizon"] == "scaling":
        c.schedules.horizon_turns = STAGES
        c.schedules.horizon_every = 14
    else:
        c.schedules.horizon_turns = ()
    if smoke:
        # the multi-turn teacher's demos and SFT stay on the smoke's path
        shrink_for_smoke(c, warm_start_steps=2, context_tokens=2048)
        c.model.tiny_corpus_tasks = 8
        c.rollout.max_batch = 16
        c.sft.num_demos = 8
        c.sft.batch_size = 8  # a multiple of any data-parallel size up to 8 devices
    return c
