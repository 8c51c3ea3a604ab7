"""Code RL on a laptop CPU: a tiny model learns to write small Python functions past its warm
start, its programs run against hidden tests in the sandbox (rl_tpu/sandbox).

    python -m launch.train --config configs/code_grpo.py --workdir /tmp/code_rl
    python -m launch.train --config configs/code_grpo.py:sft_only --workdir /tmp/code_sft
    python -m launch.eval --config configs/code_grpo.py:humaneval --workdir /tmp/code_rl

The `code` env's `functions` tasks (rl_tpu/envs/code_tasks.py): "Write f(x): multiply x by 3,
then add 7. Example: f(2) == 13." -> `def f(x):\\n    return x * 3 + 7`, 4 hidden tests, reward
the fraction passed. The eval split holds functions (kind and constants) never seen in
training. A tiny model (its tokenizer learns the env's text) is warm-started by SFT on a
teacher that writes the right function 30% of the time and otherwise stops one step short
(`return x * 3`, `return x`), then GRPO.

Variants:
  rl         (default) the warm start, then 60 GRPO steps of 16 tasks x 8 samples
  sft_only   the control: no RL, the same seed, SFT on the teacher for longer instead
  repair     the `code_repair` env: a failing program gets its first failing test back and
             the model has a second try (2 turns), reward the last program's fraction
  tir        the `tir` env: "Compute 4817 * 2963 - 512.", a ```python block runs in the
             sandbox and its output comes back, then <answer>N</answer> (2 turns); the
             teacher uses the tool 30% of the time, else answers from a slip
  humaneval  the eval of HumanEval's 164 problems (launch.eval): greedy, the prompt and the
             reply in a 2048-token context; a tiny model scores 0, what it measures is the
             pipeline (every problem's program through the sandbox) and its wall time
`smoke` shrinks any of them to seconds. `sandbox` names the sandbox: bubblewrap (default) or
unsafe_no_isolation (plain subprocesses, for a machine without user namespaces).

Smoke runs (seconds on a CPU; `--list_variants` after the config prints every variant):
    python -m launch.train --config configs/code_grpo.py:smoke --workdir /tmp/code_smoke
    python -m launch.train --config configs/code_grpo.py:repair,smoke \\
        --workdir /tmp/code_repair_smoke
    python -m launch.train --config configs/code_grpo.py:tir,smoke --workdir /tmp/code_tir_smoke
    python -m launch.eval --config configs/code_grpo.py:humaneval,smoke \\
        --model_path /tmp/code_smoke/final_hf
"""

from rl_tpu.recipes.config import base_config, set_env, shrink_for_smoke, tiny_model_warm_start
from rl_tpu.recipes.variants import parse_variant


# One line for each variant name (`--list_variants`; rl_tpu/recipes/variants.py).
VARIANT_HELP = {
    "rl": "the warm start, then 60 GRPO steps of 16 tasks x 8 samples",
    "sft_only": "the control: no RL, longer SFT on the teacher",
    "repair": "the code_repair env: a second try after the first failing test",
    "tir": "the tir env: a python block runs in the sandbox, then the answer",
    "humaneval": "HumanEval's 164 problems as the eval (launch.eval only)",
    "bubblewrap": "programs run in the bubblewrap sandbox",
    "unsafe_no_isolation": "plain subprocesses with rlimits only (unsafe)",
}


def get_config(arg: str = ""):
    chosen, smoke = parse_variant(arg, {"variant": ("rl", "sft_only", "repair", "tir", "humaneval"),
                                        "sandbox": ("bubblewrap", "unsafe_no_isolation")})
    c = base_config("grpo")
    c.seed = 0
    set_env(c, "code", tasks="functions", sandbox=chosen["sandbox"], eval_size=300)
    tiny_model_warm_start(c, context_tokens=128, sft_steps=300, num_demos=4000,
                          teacher_skill=0.3, corpus_tasks=400)
    c.env.max_new_tokens = 24
    c.train.steps = 60
    c.train.tasks_per_step = 16
    c.train.samples_per_task = 8
    c.eval.num_tasks = 300
    if chosen["variant"] == "sft_only":
        c.train.steps = 0
        c.sft.steps = 600
    if chosen["variant"] == "repair":
        set_env(c, "code_repair", tasks="functions", max_attempts=2,
                sandbox=chosen["sandbox"], eval_size=300)
        c.env.max_turns = c.eval.max_turns = 2
        # two programs and a failure (a syntax error's feedback runs to ~150 tokens)
        c.env.max_context_tokens = c.sft.max_length = 384
        c.train.length_buckets = (192, 384)
    if chosen["variant"] == "tir":
        set_env(c, "tir", sandbox=chosen["sandbox"], eval_size=300)
        c.env.max_turns = c.eval.max_turns = 2
        c.env.max_new_tokens = 32
        c.env.max_context_tokens = c.sft.max_length = 192
        c.train.length_buckets = (96, 192)
    if chosen["variant"] == "humaneval":
        c.env.kwargs.tasks = "humaneval"
        c.env.max_context_tokens = 2048  # the longest prompt is ~900 tiny-tokenizer tokens
        c.train.length_buckets = (1024, 2048)
        c.env.max_new_tokens = 128
        c.eval.num_tasks = 164
        c.model.tiny_corpus_tasks = 0  # HumanEval has no train split to learn text from
    if smoke:
        shrink_for_smoke(c, warm_start_steps=4, eval_tasks=8)
        c.env.max_turns = c.eval.max_turns = 2 if chosen["variant"] in ("repair", "tir") else 1
        c.env.max_new_tokens = 24 if chosen["variant"] not in ("humaneval", "tir") else 32
        c.sft.num_demos = 64
    return c
