"""DAPO on math word problems with rollouts from external SGLang servers.

    python -m sglang.launch_server --model-path /models/Qwen2.5-1.5B-Instruct --port 30000 &
    python -m launch.train --config configs/math_sglang.py \\
        --config.model.path=/models/Qwen2.5-1.5B-Instruct \\
        --config.env.kwargs.path=/data/math/train.jsonl \\
        --rollout_urls=http://127.0.0.1:30000 --workdir /tmp/math_sglang

The trainer exports each update as an HF directory and asks every server to load it
(`/update_weights_from_disk`); the weight version is the step. Answers are checked with
math-verify. `get_config("smoke")`: a tiny random model served by `launch.serve_rollout`
(rl_tpu's own SGLang-compatible server) or real SGLang, single-turn arithmetic from
reasoning-gym, two steps; the tests pass the server's url with --rollout_urls.
"""

from rl_tpu.recipes.config import base_config, set_env, shrink_for_smoke


def get_config(arg: str = ""):
    c = base_config("dapo")
    c.rollout.engine = "sglang"
    set_env(c, "math")  # env.kwargs.path: the JSONL of problems (question + answer per line)
    c.env.max_turns = 1
    c.env.max_new_tokens = 2048
    c.env.max_context_tokens = 3072
    c.algo.overlong_buffer = 512
    c.train.length_buckets = (1024, 2048, 4096)
    c.train.steps = 200
    c.train.tasks_per_step = 64
    c.train.samples_per_task = 8
    c.train.minibatches = 4
    c.optim.lr = 1e-6
    c.model.dtype = "bfloat16"
    c.model.remat = "dots"
    c.eval.every = 20
    c.eval.num_tasks = 200
    if arg == "smoke":
        shrink_for_smoke(c)
        set_env(c, "arithmetic")
        c.algo.overlong_buffer = 4
        c.env.max_context_tokens = 512
        c.train.length_buckets = (256, 512)
    elif arg:
        raise ValueError(f"unknown variant {arg!r}; use '' or 'smoke'")
    return c
