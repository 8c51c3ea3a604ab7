"""Online iterative DPO (and IPO, INPO) on the quickstart's task; offline DPO from a JSONL.

    python -m launch.train --config configs/dpo_largest.py --workdir /tmp/dpo
    python -m launch.train --config configs/dpo_largest.py:offline \\
        --config.dpo.data_path=pairs.jsonl --workdir /tmp/dpo_offline

The quickstart's setting (rl_tpu/recipes/config.py: largest_task): a tiny model and its SFT
warm start on a teacher right 30% of the time (P_0). Then 3 rounds (rl_tpu/recipes/dpo.py):
each samples 8 replies to 256 new training tasks from the current policy at temperature 1,
pairs the best reply of a task against its worst when their rewards differ, and makes four
passes over the pairs in DPO steps of 32 pairs at lr 2e-4 (beta 0.1) against a reference
refreshed to the round's starting policy. Variants: `ipo` (beta 0.1: a margin target of 5
nats), `inpo` (eta = 1 / beta = 10, tau 0.05 toward P_0), `offline` (60 steps on
dpo.data_path's pairs, reference P_0); `rm` (with any online one) ranks the replies by a
reward model (reward.model_path, default configs/reward_model_largest.py's) instead of the
env's exact reward, the online iterative RLHF recipe (docs/rewards.md); `smoke` shrinks any of
them. Greedy success on 500 held-out tasks after each round is
W/metrics.jsonl's eval/success at steps 0..3; the figures are in docs/loops.md.

Smoke runs (seconds on a CPU; `--list_variants` after the config prints every variant):
    python -m launch.train --config configs/dpo_largest.py:smoke --workdir /tmp/dpo_smoke
    python -m launch.train --config configs/dpo_largest.py:inpo,smoke --workdir /tmp/inpo_smoke
    python -m launch.train --config configs/reward_model_largest.py:smoke \\
        --workdir /tmp/rm_smoke
    python -m launch.train --config configs/dpo_largest.py:rm,smoke \\
        --config.reward.model_path=/tmp/rm_smoke/reward_model_hf --workdir /tmp/dpo_rm_smoke
    python -m launch.train --config configs/dpo_largest.py:offline,smoke \\
        --config.dpo.data_path=pairs.jsonl --workdir /tmp/dpo_offline_smoke  # your pairs
"""

from rl_tpu.recipes.config import base_config, largest_task, shrink_for_smoke
from rl_tpu.recipes.variants import parse_variant

VARIANTS = ("dpo", "ipo", "inpo", "offline")


# One line for each variant name (`--list_variants`; rl_tpu/recipes/variants.py).
VARIANT_HELP = {
    "dpo": "online iterative DPO (beta 0.1)",
    "ipo": "IPO (beta 0.1)",
    "inpo": "INPO (eta 10, tau 0.05 toward P_0)",
    "offline": "60 DPO steps on dpo.data_path's pairs, reference P_0",
    "rule": "replies ranked by the env's exact reward",
    "rm": "replies ranked by a reward model (reward.model_path)",
}


def get_config(arg: str = ""):
    chosen, smoke = parse_variant(arg, {"variant": VARIANTS, "reward": ("rule", "rm")})
    variant = chosen["variant"]
    c = largest_task(base_config("grpo"))
    c.recipe = "dpo"
    c.eval.num_tasks = 500
    # 3 rounds of 8 replies to 256 prompts (loop.*'s defaults); dpo.loss "dpo", beta 0.1
    c.loop.samples_per_task = 8
    c.dpo.steps = 60
    c.dpo.epochs = 4.0  # online: 4 passes over each round's pairs (offline: dpo.steps)
    c.dpo.lr = 2e-4
    c.checkpoint.every = 30
    if variant in ("ipo", "inpo"):
        c.dpo.loss = variant
    if variant == "inpo":
        c.dpo.inpo_tau = 0.05
    elif variant == "offline":
        c.loop.rounds = 1
        c.dpo.epochs = 0.0
    if chosen["reward"] == "rm":  # pairs ranked by reward_model_largest's model, not the env
        c.reward.model_path = "/tmp/rm_largest/reward_model_hf"
    if smoke:
        shrink_for_smoke(c, warm_start_steps=30, eval_tasks=8)
        c.dpo.steps = 3
        c.dpo.epochs = 0.0
        c.dpo.batch_size = 8
    return c
