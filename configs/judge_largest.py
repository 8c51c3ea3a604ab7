"""Training an LLM judge by RL: a tiny model learns to say which of two replies to the
quickstart's question is right, paid by the known preference.

    python -m launch.train --config configs/judge_largest.py --workdir /tmp/judge_largest
    python -m launch.train --config configs/judge_largest.py:smoke --workdir /tmp/judge_smoke

The `judge_pairwise` env (rl_tpu/envs/judge.py) with its generated pairs: the `largest`
question ("Which number is largest? 3 7 2 5 1"), its answer against a smaller number of the
list, shown as replies A and B in a seeded random order; the reply is a verdict [[A]] or [[B]]
(rl_tpu/rewards/judge.py), paid 1 when it picks the answer, 0 otherwise or when it is no
verdict. A tiny model (its tokenizer learns the judge prompts' text) is first fine-tuned on a
teacher right half the time and otherwise position-biased (it says [[A]]): 0.75 accurate, a
policy that leans on "A". Then 40 GRPO steps of 32 tasks x 8 samples. The eval reports
`eval/success` (the judge's greedy accuracy on 200 held-out pairs) and
`eval/format_valid_rate` (replies that were a verdict) every 5 steps; `eval/violation_rate`
is 1 - accuracy among the verdicts. `seedN` picks the run's seed; `smoke` shrinks it.

Smoke runs (seconds on a CPU; `--list_variants` after the config prints every variant):
    python -m launch.train --config configs/judge_largest.py:smoke --workdir /tmp/judge_smoke
"""

from rl_tpu.recipes.config import base_config, set_env, shrink_for_smoke, tiny_model_warm_start
from rl_tpu.recipes.variants import parse_variant


def get_config(arg: str = ""):
    chosen, smoke = parse_variant(arg, {}, numbered={"seed": 0})
    c = base_config("grpo")
    c.seed = chosen["seed"]
    set_env(c, "judge_pairwise")
    # the tokenizer learns the prompts' words; the teacher is right half the time, else "[[A]]"
    tiny_model_warm_start(c, context_tokens=256, sft_steps=200, num_demos=2000,
                          teacher_skill=0.5, corpus_tasks=200)
    c.env.max_new_tokens = 8
    c.train.steps = 40
    c.eval.every = 5
    c.eval.num_tasks = 200
    if smoke:
        shrink_for_smoke(c, warm_start_steps=4, eval_tasks=8)
        c.model.tiny_corpus_tasks = 20
        c.train.tasks_per_step = c.train.samples_per_task = 4
    return c
