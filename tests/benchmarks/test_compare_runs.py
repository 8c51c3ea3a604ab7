"""benchmarks/compare_runs.py's x axes, by hand: RL steps, tokens sampled so far, and env
steps played so far (ScalingInter-RL's horizons at equal interaction)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "benchmarks"))

import compare_runs  # noqa: E402

# a warm start's step (negative, skipped), the step-0 eval, then two steps: 64 episodes of 6
# turns (384 env steps), then 64 of 10 (640); eval after the second
RECORDS = [
    {"step": -10, "sft/loss": 1.0},
    {"step": 0, "eval/success": 0.2},
    {"step": 1, "rollout/env_steps": 384.0, "rollout/played_tokens": 1000.0,
     "rollout/turns": 6.0},
    {"step": 2, "rollout/env_steps": 640.0, "rollout/played_tokens": 1500.0,
     "rollout/turns": 10.0},
    {"step": 2, "eval/success": 0.5},
]


def test_each_x_axis_adds_up_its_own_counter():
    assert compare_runs.series(RECORDS, "eval/success") == ([0, 2], [0.2, 0.5])
    assert compare_runs.series(RECORDS, "eval/success", "env_steps") == ([0.0, 1024.0],
                                                                          [0.2, 0.5])
    assert compare_runs.series(RECORDS, "eval/success", "tokens") == ([0.0, 2500.0],
                                                                       [0.2, 0.5])
    assert compare_runs.series(RECORDS, "rollout/turns", "env_steps") == ([384.0, 1024.0],
                                                                           [6.0, 10.0])
