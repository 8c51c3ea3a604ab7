"""LoRA against full fine-tuning for RL, on the quickstart's `largest` task (docs/lora.md).

LoRA is for a model someone else pretrained; here the stand-in is the quickstart's tiny model
after its full SFT warm start (300 steps), built once. RL then starts from it, the same 60
GRPO steps for every method, each at its own learning rate:

    python -m launch.train --config configs/quickstart.py:sft_only --workdir /tmp/lora/base \\
        --config.sft.steps=300
    python -m launch.train --config configs/lora_largest.py:r8,lr2 \\
        --workdir /tmp/lora/r8_lr2_seed0 --config.model.path=/tmp/lora/base/final_hf
    python benchmarks/lora_quality.py --root /tmp/lora   # the whole grid, table and figure

Methods: `full` (every weight, Adam over all of them) and `r1`, `r8`, `r32` (adapters of that
rank on all seven projections, alpha 32, so the update's scale is 32 / r as in PEFT; the base,
embeddings and head frozen). Learning rates `lr1`-`lr4`: full 2.5e-4 / 5e-4 / 1e-3 / 2e-3
(the quickstart uses 5e-4), LoRA 3e-4 / 1e-3 / 3e-3 / 1e-2 (LoRA's best rate is commonly
several times full's).
`seed<N>` picks the seed (RL's sampling and the adapters' init; the base is the same).
`smoke` runs any of them in seconds on the tiny random model (no base needed); `smoke` alone
runs `r8` (LoRA is what this file is about), `full,smoke` full fine-tuning.

Smoke runs (seconds on a CPU; `--list_variants` after the config prints every variant):
    python -m launch.train --config configs/lora_largest.py:smoke \\
        --workdir /tmp/lora_smoke  # r8
    python -m launch.train --config configs/lora_largest.py:full,smoke \\
        --workdir /tmp/lora_full_smoke
"""

from rl_tpu.recipes.config import base_config, largest_task, shrink_for_smoke
from rl_tpu.recipes.variants import parse_variant

METHODS = ("full", "r1", "r8", "r32")
LEARNING_RATES = {"full": (2.5e-4, 5e-4, 1e-3, 2e-3), "lora": (3e-4, 1e-3, 3e-3, 1e-2)}
ALPHA = 32.0


# One line for each variant name (`--list_variants`; rl_tpu/recipes/variants.py).
VARIANT_HELP = {
    "full": "full fine-tuning (Adam over every weight)",
    "r1": "LoRA adapters of rank 1 on all seven projections",
    "r8": "LoRA adapters of rank 8 on all seven projections",
    "r32": "LoRA adapters of rank 32 on all seven projections",
    "lr1": "full 2.5e-4, LoRA 3e-4",
    "lr2": "full 5e-4, LoRA 1e-3",
    "lr3": "full 1e-3, LoRA 3e-3",
    "lr4": "full 2e-3, LoRA 1e-2",
}


def get_config(arg: str = ""):
    chosen, smoke = parse_variant(arg, {"method": METHODS, "lr": ("lr2", "lr1", "lr3", "lr4")},
                                  numbered={"seed": 0})
    method = chosen["method"]
    if smoke and not set(arg.replace(" ", "").split(",")) & set(METHODS):
        method = "r8"  # a bare smoke shows LoRA working; `full` is the experiments' default
    c = largest_task(base_config("grpo"))
    c.seed = chosen["seed"]
    c.eval.num_tasks = 500
    c.sft.steps = 0  # the base (model.path) is already fine-tuned on the demonstrations
    rates = LEARNING_RATES["full" if method == "full" else "lora"]
    c.optim.lr = rates[int(chosen["lr"][2:]) - 1]
    if method != "full":
        c.model.lora.rank = int(method[1:])
        c.model.lora.alpha = ALPHA
        c.model.lora.targets = "all"
    if smoke:
        shrink_for_smoke(c, warm_start_steps=4, eval_tasks=16)
    return c
