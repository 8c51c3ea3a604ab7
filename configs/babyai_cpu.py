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
"""

from rl_tpu.envs.babyai_teacher import EASY_LEVELS
from rl_tpu.recipes.config import base_config, multi_turn_agent, shrink_for_smoke

HORIZON = 4
STAGES = (2, 3, 4)


def get_config(arg: str = ""):
    parts = [p for p in arg.split(",") if p]
    seed = 0
    for p in list(parts):
        if p.startswith("seed") and p[4:].isdigit():
            seed = int(p[4:])
            parts.remove(p)
    if len(parts) > 1 or parts[:1] not in ([], ["fixed"], ["scaling"], ["smoke"]):
        raise ValueError(f"unknown variant {arg!r}; use '', 'fixed', 'scaling' or 'smoke', "
                         "optionally with ',seed<N>'")
    c = multi_turn_agent(base_config("grpo"), "babyai_agentgym", turns=HORIZON,
                         max_new_tokens=24, max_context_tokens=1792)
    c.seed = seed
    c.env.kwargs.levels = EASY_LEVELS
    c.env.kwargs.eval_size = 400
    c.env.reward_reduce = "last"  # AgentGym's score is a running sum: its last value
    c.eval.max_turns = HORIZON
    c.eval.num_tasks = 100
    c.eval.every = 5
    # A tiny model: bf16 and remat are for real sizes, float32 is exact and fast on a CPU.
    c.model.dtype = "float32"
    c.model.remat = "none"
    c.model.scan_layers = False
    c.mesh.data, c.mesh.fsdp = -1, 1
    c.model.tiny_hidden = 64
    c.model.tiny_layers = 2
    c.model.tiny_vocab = 1024
    c.model.tiny_corpus_tasks = 200
    c.train.steps = 40
    c.train.tasks_per_step = 8
    c.train.samples_per_task = 8
    c.train.minibatches = 1
    # Dense attention holds [rows, heads, T, T] logits: 16-row micro-batches and 64-row
    # sampler batches keep a 1792-token episode inside a few GB.
    c.train.micro_batches = 4
    c.rollout.max_batch = 64
    # Episodes run from ~400 tokens (one turn) to the context limit: fine buckets, and SFT
    # batches of like-length demos, pad each batch to little more than its own length.
    c.train.length_buckets = (512, 768, 1024, 1280, 1536, 1792)
    c.optim.lr = 5e-4
    c.optim.grad_clip = 1.0
    c.sft.steps = 600
    c.sft.batch_size = 16
    c.sft.lr = 3e-3
    c.sft.num_demos = 6000
    c.sft.teacher_skill = 0.3
    c.sft.max_length = 1792
    c.sft.group_by_length = 8
    c.checkpoint.every = 10
    if parts == ["scaling"]:
        c.schedules.horizon_turns = STAGES
        c.schedules.horizon_every = 14
    else:
        c.schedules.horizon_turns = ()
    if parts == ["smoke"]:
        shrink_for_smoke(c)
        c.model.tiny_corpus_tasks = 8
        c.eval.max_turns = 2
        c.env.max_context_tokens = 2048
        c.train.length_buckets = (1024, 2048)
        c.train.micro_batches = 1
        c.rollout.max_batch = 16
        c.sft.steps = 2  # the multi-turn teacher's demos and SFT stay on the smoke's path
        c.sft.num_demos = 8
        c.sft.batch_size = 8  # a multiple of any data-parallel size up to 8 devices
        c.sft.max_length = 2048
    return c
