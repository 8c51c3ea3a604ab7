"""Throughput of the jitted `policy_step`: tokens/s, seconds per step and MFU, as table rows.

  python benchmarks/train_step.py --shape tiny --batch 8 --seq_len 256
  python benchmarks/train_step.py --shape qwen2.5-0.5b --batch 16 --seq_len 1024 \
      --dtype bfloat16 --remat dots --micro_batches 2        # on an accelerator
  python benchmarks/train_step.py --loss bapo --micro_batches 2  # + BAPO's scoring pass
  python benchmarks/train_step.py --shape rl_step --batch 32 --seq_len 96 --torch  # vs PyTorch

Random weights at the named shape (benchmarks/common.py), a policy loss (--loss) over a random
batch with a realistic loss mask, the step compiled once and timed over --steps calls. With
--loss bapo and --micro_batches > 1 the step also runs one forward-only scoring pass for the
whole-batch clip bounds, which the table's s/step includes.

--torch also times PyTorch's equivalent update on the same weights and batch, in the same
process, its steps alternating with the JAX ones so both see the same machine, each reporting
its median step (transformers' model of the shape, fp32, every CPU thread): the forward, the
log-softmax gather of the taken tokens, the entropy, the clipped token-mean loss, the
backward, the gradient clip and AdamW. Its row gives the ratio rl_tpu / torch in tokens/s, and both steps'
losses, which agree when the two models are the same.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from benchmarks.common import (model_config, peak_flops_per_device, print_table,  # noqa: E402
                               train_flops_per_token)
from rl_tpu import parallel  # noqa: E402
from rl_tpu.models.transformer import Transformer  # noqa: E402
from rl_tpu.rl.losses import PolicyLossConfig  # noqa: E402
from rl_tpu.train import steps  # noqa: E402
from rl_tpu.train.state import OptimConfig, create_state, make_optimizer  # noqa: E402

flags.DEFINE_string("shape", "tiny", "Model shape (benchmarks/common.py SHAPES).")
flags.DEFINE_integer("batch", 8, "Sequences per step (global).")
flags.DEFINE_integer("seq_len", 256, "Tokens per sequence.")
flags.DEFINE_integer("micro_batches", 1, "Gradient accumulation steps.")
flags.DEFINE_enum("loss", "ppo", ["ppo", "gspo", "bapo"], "Policy loss kind.")
flags.DEFINE_integer("steps", 10, "Timed steps (after one compile + warm-up step); the "
                     "median is reported.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Params and compute dtype.")
flags.DEFINE_enum("remat", "none", ["none", "full", "dots"], "Rematerialisation policy.")
flags.DEFINE_bool("scan_layers", True, "Scan over layers (one compiled layer).")
flags.DEFINE_integer("logprob_chunk", 256, "Positions per logits chunk.")
flags.DEFINE_string("mesh", "fsdp=-1", "Mesh axes, e.g. 'fsdp=4,tensor=2'.")
flags.DEFINE_float("peak_tflops", 0.0, "Peak TFLOP/s per device for MFU (auto on GPU/TPU).")
flags.DEFINE_bool("torch", False, "Also time PyTorch's equivalent update (transformers).")


def parse_mesh(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in (part.split("=") for part in text.split(",") if part)}


def _loss_config(kind: str) -> PolicyLossConfig:
    if kind == "gspo":
        return PolicyLossConfig(kind="gspo", clip_low=3e-4, clip_high=4e-4)
    return PolicyLossConfig(kind=kind, clip_high=0.28)


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def torch_update(cfg, params, batch: dict, loss_cfg: PolicyLossConfig):
    """PyTorch's PPO update of `params` on `batch`: a function of no arguments that runs one
    step and returns (loss, mean entropy)."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    from rl_tpu.models import hf

    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as path:
        hf.save(path, cfg, jax.device_get(params))
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    tokens = torch.from_numpy(batch["tokens"]).long()
    mask = torch.from_numpy(batch["loss_mask"][:, 1:]).float()  # token t+1 from position t
    old = torch.from_numpy(batch["old_logprobs"][:, 1:])
    adv = torch.from_numpy(batch["advantages"])[:, None]
    low, high = 1 - loss_cfg.clip_low, 1 + loss_cfg.clip_high

    def step():
        logits = model(tokens).logits[:, :-1].float()  # [B, T-1, V]
        logp = torch.log_softmax(logits, -1)
        taken = logp.gather(-1, tokens[:, 1:, None])[..., 0]
        with torch.no_grad():  # a metric, as the JAX step reports it
            entropy = -(logp.exp() * logp).sum(-1)
            mean_entropy = (entropy * mask).sum() / mask.sum()
        ratio = torch.exp(taken - old)
        per_token = -torch.minimum(ratio * adv, ratio.clamp(low, high) * adv)
        loss = (per_token * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return float(loss), float(mean_entropy)

    return step


def main(argv):
    del argv
    f = flags.FLAGS
    cfg = model_config(f.shape, dtype=f.dtype, param_dtype=f.dtype, remat=f.remat,
                       scan_layers=f.scan_layers)
    mesh = parallel.make_mesh(parse_mesh(f.mesh))
    model = Transformer(cfg, mesh=mesh, rules=parallel.DEFAULT_RULES)
    params = parallel.init_params(model, mesh, parallel.DEFAULT_RULES, jax.random.key(0),
                                  np.zeros((1, 1), np.int32))
    state = create_state(params, make_optimizer(OptimConfig(lr=1e-6)))
    step = steps.compile_step(
        steps.make_policy_step(model, _loss_config(f.loss),
                               steps.StepConfig(micro_batches=f.micro_batches,
                                                logprob_chunk=f.logprob_chunk)), state, mesh)

    rng = np.random.RandomState(0)
    b, t = f.batch, f.seq_len
    mask = np.zeros((b, t), bool)
    mask[:, t // 4:] = True  # a quarter prompt, the rest response
    host_batch = dict(
        tokens=rng.randint(0, cfg.vocab_size, (b, t)).astype(np.int32), loss_mask=mask,
        old_logprobs=np.full((b, t), -2.0, np.float32),
        behaviour_logprobs=np.full((b, t), -2.0, np.float32),
        advantages=rng.randn(b).astype(np.float32))
    batch = parallel.host_to_global(host_batch, mesh)
    torch_step = None
    if f.torch:  # built before the JAX step, which donates (and so deletes) these params
        torch_step = torch_update(cfg, state.params, host_batch, _loss_config(f.loss))
        torch_loss, _ = torch_step()  # warm-up

    start = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - start
    first_loss = float(metrics["loss"])

    def one_step():
        nonlocal state
        state, step_metrics = step(state, batch)
        jax.block_until_ready(step_metrics)

    # Steps alternate with PyTorch's so both see the same machine, and each reports its
    # median: a shared 2-core machine's stalls hit single steps, and a mean would carry them.
    jax_times, torch_times = [], []
    for _ in range(f.steps):
        jax_times.append(seconds(one_step))
        if torch_step is not None:
            torch_times.append(seconds(torch_step))
    step_s = float(np.median(jax_times))

    tokens_per_s = b * t / step_s
    peak, peak_source = peak_flops_per_device(f.peak_tflops)
    flops = train_flops_per_token(cfg, t) * tokens_per_s
    mfu = f"{flops / (peak * jax.device_count()):.1%} (of {peak_source})"
    device = f"{jax.device_count()}x {jax.devices()[0].device_kind}"
    print_table(["shape", "params", "device", "mesh", "dtype", "B x T", "loss", "micro",
                 "remat", "compile s", "s/step", "tokens/s", "model TFLOP/s", "MFU"],
                [[f.shape, f"{cfg.num_params() / 1e6:.1f}M", device, f.mesh, f.dtype,
                  f"{b} x {t}", f.loss, f.micro_batches, f.remat, f"{compile_s:.1f}",
                  f"{step_s:.3f}",
                  f"{tokens_per_s:,.0f}", f"{flops / 1e12:.3f}", mfu]])
    if torch_step is not None:
        torch_s = float(np.median(torch_times))
        print_table(["update", "s/step", "tokens/s", "first loss", "rl_tpu / torch"],
                    [["rl_tpu (JAX)", f"{step_s:.3f}", f"{tokens_per_s:,.0f}",
                      f"{first_loss:.6f}", f"{torch_s / step_s:.2f}x"],
                     ["PyTorch (transformers)", f"{torch_s:.3f}", f"{b * t / torch_s:,.0f}",
                      f"{torch_loss:.6f}", ""]])

if __name__ == "__main__":
    app.run(main)
