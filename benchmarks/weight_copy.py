"""What the sampler's own copy of the weights costs, beside the train step it follows.

  python benchmarks/weight_copy.py --shapes tiny,small --copy_dtypes float32,bfloat16

The embedded sampler never samples with the trainer's arrays (a compiled step donates them):
`JaxSampler.update_weights` copies the params on device into the sampler's shardings,
unstacking scanned layers and optionally casting (rl_tpu/rollout/sampler.py). This times that
copy against one SFT step (batch x seq_len tokens, AdamW, scanned layers) of the same model,
and prints markdown table rows: params bytes, copy ms, step ms, and the copy's share.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from benchmarks.common import median_ms, model_config, print_table  # noqa: E402
from rl_tpu import parallel  # noqa: E402
from rl_tpu.models.transformer import Transformer  # noqa: E402
from rl_tpu.rollout.sampler import JaxSampler  # noqa: E402
from rl_tpu.train import steps  # noqa: E402
from rl_tpu.train.state import OptimConfig, create_state, make_optimizer  # noqa: E402

flags.DEFINE_string("shapes", "tiny,small", "Model shapes (benchmarks/common.py SHAPES).")
flags.DEFINE_string("copy_dtypes", "float32,bfloat16", "Dtypes the sampler copies into.")
flags.DEFINE_integer("batch", 8, "Sequences per SFT step.")
flags.DEFINE_integer("seq_len", 128, "Tokens per sequence.")
flags.DEFINE_integer("repeats", 10, "Timed calls of each (median reported).")
flags.DEFINE_string("mesh", "fsdp=-1", "Trainer mesh axes, e.g. 'fsdp=4,tensor=2'.")


def parse_mesh(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in (part.split("=") for part in text.split(",") if part)}


def measure(shape: str, copy_dtypes: list[str], f) -> list[list]:
    cfg = model_config(shape, scan_layers=True)
    mesh = parallel.make_mesh(parse_mesh(f.mesh))
    model = Transformer(cfg, mesh=mesh, rules=parallel.DEFAULT_RULES)
    params = parallel.init_params(model, mesh, parallel.DEFAULT_RULES, jax.random.key(0),
                                  np.zeros((1, 1), np.int32))
    state = create_state(params, make_optimizer(OptimConfig(lr=1e-6)))
    step = steps.compile_step(steps.make_sft_step(model), state, mesh)
    rng = np.random.RandomState(0)
    batch = parallel.host_to_global(dict(
        tokens=rng.randint(0, cfg.vocab_size, (f.batch, f.seq_len)).astype(np.int32),
        loss_mask=np.ones((f.batch, f.seq_len), bool)), mesh)
    holder = {"state": state}

    def train_step():
        holder["state"], metrics = step(holder["state"], batch)
        return metrics

    step_ms = median_ms(train_step, f.repeats)
    params_bytes = sum(x.nbytes for x in jax.tree.leaves(holder["state"].params))
    rows = []
    for dtype in copy_dtypes:
        sampler = JaxSampler(cfg, holder["state"].params,
                             dtype=None if dtype == cfg.param_dtype else dtype)

        def copy():
            sampler.update_weights(holder["state"].params, "bench")
            return sampler.weights()[0]

        copy_ms = median_ms(copy, f.repeats)
        rows.append([shape, f"{cfg.num_params() / 1e6:.1f}M", f"{params_bytes / 2**20:.2f} MiB",
                     f"{cfg.param_dtype} -> {dtype}", f"{copy_ms:.2f}",
                     f"{f.batch} x {f.seq_len}", f"{step_ms:.1f}", f"{copy_ms / step_ms:.1%}"])
    return rows


def main(argv):
    del argv
    f = flags.FLAGS
    rows = []
    for shape in f.shapes.split(","):
        rows += measure(shape, f.copy_dtypes.split(","), f)
    device = f"{jax.device_count()}x {jax.devices()[0].device_kind}"
    print(f"device: {device}, trainer mesh {f.mesh}, sampler on one device")
    print_table(["shape", "params", "params bytes", "copy", "copy ms", "SFT B x T",
                 "SFT step ms", "copy / step"], rows)


if __name__ == "__main__":
    app.run(main)
