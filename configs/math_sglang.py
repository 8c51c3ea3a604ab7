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

Smoke runs (seconds on a CPU; `--list_variants` after the config prints every variant):
    python -m launch.make_tiny_model --out /tmp/math_smoke_model
    python -m launch.serve_rollout --model_path /tmp/math_smoke_model --port 30000 &
    python -m launch.train --config configs/math_sglang.py:smoke \\
        --config.model.path=/tmp/math_smoke_model --rollout_urls=http://127.0.0.1:30000 \\
        --workdir /tmp/math_smoke
"""

from rl_tpu.recipes.config import base_config, set_env, shrink_for_smoke, single_turn_reasoning
from rl_tpu.recipes.variants import parse_variant


def get_config(arg: str = ""):
    _, smoke = parse_variant(arg, {})
    # env.kwargs.path: the JSONL of problems (question + answer per line)
    c = single_turn_reasoning(base_config("dapo"), "math", max_new_tokens=2048,
                              max_context_tokens=3072)
    c.rollout.engine = "sglang"
    c.algo.overlong_buffer = 512
    if smoke:
        shrink_for_smoke(c, context_tokens=512)
        set_env(c, "arithmetic")
        c.algo.overlong_buffer = 4
    return c
