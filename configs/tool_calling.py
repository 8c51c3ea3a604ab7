"""Function calling on a laptop CPU: a tiny model learns to call a calculator and use its result.

    python -m launch.train --config configs/tool_calling.py --workdir /tmp/tool_calling

The `tool_calling` env (rl_tpu/envs/tool_calling.py) plays `arithmetic` (a sum or product of
two numbers of 1 or 2 digits, the larger more than a tiny model works out in its head) with
one tool, `calculator`. Its schema reaches the prompt through the chat template (`tools=`);
the model calls it by writing `<tool_call>{"name": "calculator", "arguments": {"expression":
...}}</tool_call>` (the tiny tokenizer's template writes calls as Qwen2.5's do), the result
comes back as a role "tool" message, and the next reply's `<answer>` is scored (1 if exact).
The setting is `config.calculator_task`:

1. SFT warm start on a teacher that calls the calculator half the time and answers from its
   head otherwise (always off by 1 or 2 there): imitation copies that habit.
2. GRPO with the exact reward: a call and a copied result pay, a guess does not.
`get_config("sft_only")` is the control: the same budget spent on more SFT instead of RL.
`smoke` runs the same pipeline in seconds.

Smoke runs (seconds on a CPU; `--list_variants` after the config prints every variant):
    python -m launch.train --config configs/tool_calling.py:smoke \\
        --workdir /tmp/tool_calling_smoke
    python -m launch.train --config configs/tool_calling.py:sft_only,smoke \\
        --workdir /tmp/tool_sft_smoke
"""

from rl_tpu.recipes.config import base_config, calculator_task, shrink_for_smoke
from rl_tpu.recipes.variants import parse_variant


# One line for each variant name (`--list_variants`; rl_tpu/recipes/variants.py).
VARIANT_HELP = {
    "rl": "SFT warm start, then GRPO with the exact reward",
    "sft_only": "the control: the same budget spent on more SFT instead of RL",
}


def get_config(arg: str = ""):
    chosen, smoke = parse_variant(arg, {"variant": ("rl", "sft_only")})
    c = calculator_task(base_config("grpo"))
    c.seed = 0
    if chosen["variant"] == "sft_only":
        c.train.steps = 0
        c.sft.steps = 800
    if smoke:
        shrink_for_smoke(c, warm_start_steps=4, eval_tasks=4)
        c.sft.num_demos = 32
    return c
