"""GRPO on an agent program: an existing agent, written only against the `openai` client,
trained as it is (rl_tpu/agent/program.py, docs/tools.md).

    python -m launch.train --config configs/agent_program.py --workdir /tmp/agent_program

The program (`env.kwargs.program`, "module:function") is called once an episode as
`program(base_url, task) -> reward`; every `chat.completions.create` it makes goes to a
recording endpoint that answers with the policy and records the call token-exactly. Here it
is `rl_tpu.envs.agent_programs:arithmetic_agent`: two chained questions in one conversation
(a + b, then that times c), half the reward for each right answer. `env.max_turns` caps a
program's calls an episode and `env.max_new_tokens` each reply. Point `program` and `tasks`
at your own agent and its tasks (or `env.dataset_dir` at a JSONL dataset), and `model.path`
at a real chat model; the tiny random model here only shows the pipeline running. `smoke`
runs 2 steps in seconds.

Smoke runs (seconds on a CPU; `--list_variants` after the config prints every variant):
    python -m launch.train --config configs/agent_program.py:smoke \\
        --workdir /tmp/agent_program_smoke
"""

from rl_tpu.recipes.config import base_config, set_env, shrink_for_smoke
from rl_tpu.recipes.variants import parse_variant


def get_config(arg: str = ""):
    _, smoke = parse_variant(arg, {})
    c = base_config("grpo")
    set_env(c, "agent_program", program="rl_tpu.envs.agent_programs:arithmetic_agent",
            tasks="rl_tpu.envs.agent_programs:arithmetic_tasks", timeout_s=300.0)
    c.env.max_turns = 2  # the program's calls an episode (it makes two)
    c.env.max_new_tokens = 8  # a number
    c.env.max_context_tokens = 256
    c.train.length_buckets = (128, 256)
    # a tiny random model a CPU trains (float32, no remat); model.path = a chat model's dir
    c.model.tiny_hidden, c.model.tiny_layers = 64, 2
    c.model.dtype, c.model.remat, c.model.scan_layers = "float32", "none", False
    c.mesh.data, c.mesh.fsdp = -1, 1
    c.optim.lr = 5e-4
    c.train.steps = 50
    c.train.tasks_per_step = 8
    c.train.samples_per_task = 4
    c.eval.num_tasks = 32
    c.eval.every = 10
    c.checkpoint.every = 25
    if smoke:
        shrink_for_smoke(c, eval_tasks=2)
    return c
