"""Throughput of the jitted `policy_step`: tokens/s, seconds per step, MFU and peak RSS, as
table rows; with --torch, PyTorch's same update beside it, measured the same way.

  python benchmarks/train_step.py --shape tiny --batch 8 --seq_len 256
  python benchmarks/train_step.py --shape qwen2.5-0.5b --batch 16 --seq_len 1024 \
      --dtype bfloat16 --remat dots --micro_batches 2        # on an accelerator
  python benchmarks/train_step.py --loss bapo --micro_batches 2  # + BAPO's scoring pass
  python benchmarks/train_step.py --shape peer --batch 8 --lengths 96,384,1536 --torch
  python benchmarks/train_step.py --model_path $(python -m launch.get_model \
      smollm2-135m-instruct) --batch 8 --seq_len 512 --torch [--lora_rank 16]  # a real model

Random weights at the named shape (benchmarks/common.py), a policy loss (--loss) over a random
batch with a realistic loss mask (a quarter prompt, the rest response). With --loss bapo and
--micro_batches > 1 the step also runs one forward-only scoring pass for the whole-batch clip
bounds, which the table's s/step includes.

Each side runs in a process of its own (benchmarks/side_process.py says why), in --rounds
interleaved rounds per length (jax, torch, torch, jax, ...). Every process starts from the same
weights (the first JAX process saves its initial params as an HF directory, which each PyTorch
process loads) and the same batch (written once by this parent), runs --warmup_steps untimed
steps (JAX's first one compiles) and then --steps timed ones; each side's s/step is the median
of all its timed steps over the rounds. Peak RSS is each side's largest process's
ru_maxrss. The PyTorch update is transformers' model of the shape (fp32, its default
attention) with the forward, the log-softmax gather of the taken tokens, the entropy, the
clipped token-mean PPO loss, the backward, the gradient clip and AdamW: what the JAX step does.
Both first losses are printed and must agree (the run fails when they do not).

--model_path: a real model's HF directory instead of random weights, which both sides load.
--lora_rank r: LoRA on every projection (q, k, v, o, gate, up, down; alpha 2r, no dropout,
PEFT's init, so B = 0 and the first losses still agree), the base frozen, AdamW and the
gradient clip over the adapters alone: rl_tpu's `model.lora` adapters against PEFT's
`get_peft_model` on the transformers model. --torch_logprobs rows computes PyTorch's
log-probs and entropy a row at a time (as TRL does), so it never holds a log_softmax of the
whole [B, T, V] beside the logits: the same numbers, a lower peak at a real vocab. The comparison table has each side's first step
in round 0 (JAX: compiles from nothing) and in the later rounds (JAX: programs loaded from the
persistent compilation cache the first round filled), and the warm steps' median.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Only numpy and the side-process helper at the top: a PyTorch child must not load JAX (its
# memory would count in torch's peak RSS and its thread pool would compete for the cores).
import numpy as np  # noqa: E402
from absl import flags  # noqa: E402

from benchmarks import side_process  # noqa: E402
from benchmarks.side_process import median  # noqa: E402

flags.DEFINE_string("shape", "tiny", "Model shape (benchmarks/common.py SHAPES) or preset.")
flags.DEFINE_string("model_path", "", "A real model's HF directory (both sides load it; "
                    "overrides --shape).")
flags.DEFINE_integer("lora_rank", 0, "LoRA rank on every projection (0: full fine-tuning).")
flags.DEFINE_enum("torch_logprobs", "full", ["full", "rows"], "PyTorch's log-probs: a "
                  "log_softmax over the whole [B, T, V] (full), or a logsumexp a row at a time "
                  "(rows: TRL's selective_log_softmax, no second [B, T, V] tensor).")
flags.DEFINE_integer("batch", 8, "Sequences per step (global).")
flags.DEFINE_integer("seq_len", 256, "Tokens per sequence (when --lengths is not given).")
flags.DEFINE_string("lengths", "", "Comma-separated sequence lengths, one row each "
                    "(e.g. 96,384,1536); overrides --seq_len.")
flags.DEFINE_integer("micro_batches", 1, "Gradient accumulation steps.")
flags.DEFINE_enum("loss", "ppo", ["ppo", "gspo", "bapo"], "Policy loss kind.")
flags.DEFINE_integer("warmup_steps", 1, "Untimed steps per process (JAX's first compiles).")
flags.DEFINE_integer("steps", 3, "Timed steps per process; the median over all rounds is "
                     "reported.")
flags.DEFINE_integer("rounds", 0, "Processes per side and length, interleaved with the other "
                     "side's (0: 3 with --torch, 1 without).")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Params and compute dtype.")
flags.DEFINE_enum("remat", "none", ["none", "full", "dots"], "Rematerialisation policy.")
flags.DEFINE_bool("scan_layers", True, "Scan over layers (one compiled layer).")
flags.DEFINE_integer("logprob_chunk", 256, "Positions per logits chunk.")
flags.DEFINE_integer("attention_block", -1, "Attention's query block (model.attention_block; "
                     "0 = one block, -1 = the model's default).")
flags.DEFINE_string("mesh", "fsdp=-1", "Mesh axes, e.g. 'fsdp=4,tensor=2'.")
flags.DEFINE_float("peak_tflops", 0.0, "Peak TFLOP/s per device for MFU (auto on GPU/TPU).")
flags.DEFINE_bool("torch", False, "Also time PyTorch's equivalent update (transformers).")
flags.DEFINE_enum("side", "", ["", "jax", "torch"], "Internal: run one side's process.")
flags.DEFINE_string("spec", "", "Internal: the side process's JSON spec.")
flags.DEFINE_string("result", "", "Internal: where the side process writes its result.")

LOSS_AGREEMENT = 1e-4  # |jax - torch| first loss, fp32: the same model computes the same loss


def parse_mesh(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in (part.split("=") for part in text.split(",") if part)}


def loss_config(kind: str):
    from rl_tpu.rl.losses import PolicyLossConfig

    if kind == "gspo":
        return PolicyLossConfig(kind="gspo", clip_low=3e-4, clip_high=4e-4)
    return PolicyLossConfig(kind=kind, clip_high=0.28)


def make_batch(vocab_size: int, b: int, t: int) -> dict[str, np.ndarray]:
    rng = np.random.RandomState(0)
    mask = np.zeros((b, t), bool)
    mask[:, t // 4:] = True  # a quarter prompt, the rest response
    return dict(tokens=rng.randint(0, vocab_size, (b, t)).astype(np.int32), loss_mask=mask,
                old_logprobs=np.full((b, t), -2.0, np.float32),
                behaviour_logprobs=np.full((b, t), -2.0, np.float32),
                advantages=rng.randn(b).astype(np.float32))


def timed_steps(one_step, warmup: int, steps: int) -> tuple[float, float, list[float]]:
    """(first step's loss, first step's seconds, the timed steps' seconds): `one_step()` runs
    a step to completion and returns its loss."""
    first_loss, first_s = None, 0.0
    for i in range(warmup):
        start = time.perf_counter()
        loss = one_step()
        if i == 0:
            first_loss, first_s = loss, time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        one_step()
        times.append(time.perf_counter() - start)
    return first_loss, first_s, times


def run_jax(spec: dict) -> dict:
    import jax

    from benchmarks.common import model_config, peak_flops_per_device, train_flops_per_token
    from rl_tpu import parallel
    from rl_tpu.models import hf
    from rl_tpu.models.transformer import Transformer
    from rl_tpu.train import steps
    from rl_tpu.train.state import OptimConfig, create_state, make_optimizer

    block = spec.get("attention_block", -1)
    options = dict(remat=spec["remat"], scan_layers=spec["scan_layers"],
                   **({} if block < 0 else {"attention_block": block}))
    mesh = parallel.make_mesh(parse_mesh(spec["mesh"]))
    if spec.get("model_path"):
        cfg, params = hf.load(spec["model_path"], mesh=mesh, dtype=spec["dtype"], **options)
    else:
        cfg = model_config(spec["shape"], dtype=spec["dtype"], param_dtype=spec["dtype"],
                           **options)
        params = parallel.init_params(Transformer(cfg, mesh=mesh, rules=parallel.DEFAULT_RULES),
                                      mesh, parallel.DEFAULT_RULES, jax.random.key(0),
                                      np.zeros((1, 1), np.int32))
    if spec.get("save_weights_to"):  # before the first step, which donates (deletes) params
        hf.save(spec["save_weights_to"], cfg, jax.device_get(params))
    trainable = None
    if spec.get("lora_rank"):  # fresh adapters (B = 0) on the frozen base
        from rl_tpu.models import lora
        from rl_tpu.recipes.policy_io import with_fresh_adapters

        r = spec["lora_rank"]
        cfg = cfg.replace(lora=lora.LoraConfig(rank=r, alpha=2.0 * r))
        params = with_fresh_adapters(Transformer(cfg, mesh=mesh), params, mesh, 0)
        trainable = frozenset(lora.ADAPTER_KEYS)
    model = Transformer(cfg, mesh=mesh, rules=parallel.DEFAULT_RULES)
    state = create_state(params, make_optimizer(OptimConfig(lr=1e-6)), trainable)
    step = steps.compile_step(
        steps.make_policy_step(model, loss_config(spec["loss"]),
                               steps.StepConfig(micro_batches=spec["micro_batches"],
                                                logprob_chunk=spec["logprob_chunk"])),
        state, mesh)
    with np.load(spec["batch_path"]) as npz:
        batch = parallel.host_to_global({k: npz[k] for k in npz.files}, mesh)

    def one_step() -> float:
        nonlocal state
        state, metrics = step(state, batch)
        return float(jax.block_until_ready(metrics)["loss"])

    first_loss, first_s, times = timed_steps(one_step, spec["warmup_steps"], spec["steps"])
    out = dict(first_loss=first_loss, first_s=first_s, times=times,
               params=cfg.num_params(), peak_rss_mib=side_process.peak_rss_mib(),
               device=f"{jax.device_count()}x {jax.devices()[0].device_kind}")
    # Once per length, after the peak RSS is read: on CPU it measures a large matmul, seconds
    # of work and memory that are not the update's.
    if spec.get("mfu"):
        peak, source = peak_flops_per_device(spec["peak_tflops"])
        out.update(peak_flops=peak * jax.device_count(), peak_source=source,
                   flops_per_token=train_flops_per_token(cfg, spec["seq_len"]))
    return out


def run_torch(spec: dict) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(side_process.cores())
    transformers.utils.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(spec["weights_dir"], dtype=torch.float32).train()
    if spec.get("lora_rank"):  # PEFT's adapters on every projection, the base frozen
        from peft import LoraConfig, get_peft_model

        r = spec["lora_rank"]
        model = get_peft_model(model, LoraConfig(
            r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=[
                "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-6, weight_decay=0.0)
    with np.load(spec["batch_path"]) as npz:
        tokens = torch.from_numpy(npz["tokens"]).long()
        mask = torch.from_numpy(npz["loss_mask"][:, 1:]).float()  # token t+1 from position t
        old = torch.from_numpy(npz["old_logprobs"][:, 1:])
        adv = torch.from_numpy(npz["advantages"])[:, None]
    low, high = 1 - spec["clip_low"], 1 + spec["clip_high"]

    def log_probs(logits):  # (log p of the taken tokens [B, T-1], entropy [B, T-1])
        if spec.get("torch_logprobs") == "rows":  # TRL's selective_log_softmax, a row a time
            taken = torch.stack([row.gather(-1, t[:, None])[:, 0] - torch.logsumexp(row, -1)
                                 for row, t in zip(logits, tokens[:, 1:])])
            with torch.no_grad():
                entropy = torch.stack([torch.logsumexp(row, -1) - (torch.softmax(row, -1)
                                                                   * row).sum(-1)
                                       for row in logits])
            return taken, entropy
        logp = torch.log_softmax(logits, -1)
        with torch.no_grad():
            entropy = -(logp.exp() * logp).sum(-1)
        return logp.gather(-1, tokens[:, 1:, None])[..., 0], entropy

    def one_step() -> float:
        logits = model(tokens).logits[:, :-1].float()  # [B, T-1, V]
        taken, entropy = log_probs(logits)
        float((entropy * mask).sum() / mask.sum())  # a metric, as the JAX step reports it
        ratio = torch.exp(taken - old)
        per_token = -torch.minimum(ratio * adv, ratio.clamp(low, high) * adv)
        loss = (per_token * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        return loss.item()

    first_loss, first_s, times = timed_steps(one_step, spec["warmup_steps"], spec["steps"])
    return dict(first_loss=first_loss, first_s=first_s, times=times,
                threads=torch.get_num_threads(), torch_version=torch.__version__)


def parent_main(f) -> None:
    from benchmarks.common import model_config

    if f.model_path:
        from rl_tpu.models import hf
        cfg = hf.read_config(f.model_path)
        f.shape = os.path.basename(os.path.dirname(os.path.abspath(f.model_path))) or "model"
    else:
        cfg = model_config(f.shape)  # an unknown shape fails here, before any process starts
    if f.torch and (f.loss != "ppo" or f.micro_batches != 1):
        raise SystemExit("--torch compares the ppo loss with --micro_batches 1 (the PyTorch "
                         f"update implements only that); got --loss {f.loss} --micro_batches "
                         f"{f.micro_batches}")
    if f.warmup_steps < 1 or f.steps < 1:
        raise SystemExit("--warmup_steps and --steps must be at least 1 (the first step "
                         "compiles, and a median needs a timed step)")
    lengths = [int(x) for x in f.lengths.split(",")] if f.lengths else [f.seq_len]
    rounds = f.rounds or (3 if f.torch else 1)
    sides = ("jax", "torch") if f.torch else ("jax",)
    tmp = tempfile.mkdtemp(prefix="train_step_bench_")
    # Rounds after the first load their compiled step from here instead of compiling again
    # (the timed steps run the same program either way); a cache the caller set is kept.
    jax_env = {} if os.environ.get("JAX_COMPILATION_CACHE_DIR") else {
        "JAX_COMPILATION_CACHE_DIR": os.path.join(tmp, "jax_cache")}
    print(side_process.thread_note() if f.torch else "JAX with its default threads", flush=True)
    try:
        rows, compare, failures = run_lengths(f, cfg, lengths, rounds, sides, tmp, jax_env)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    side_process.print_table(
        ["shape", "params", "device", "mesh", "dtype", "B x T", "loss", "micro", "remat",
         "first step s", "s/step", "tokens/s", "model TFLOP/s", "MFU", "peak RSS MiB",
         "load"], rows)
    if f.torch:
        print(f"\n{f.warmup_steps} warm-up + {f.steps} timed steps per process, {rounds} "
              "processes per side and length; s/step is the median of every timed step")
        side_process.print_table(["B x T", "update", "first step s (round 0)",
                                  "first step s (later rounds)", "s/step (warm)", "tokens/s",
                                  "first loss", "peak RSS MiB", "rl_tpu / torch", "load"],
                                 [row for pair in compare for row in pair])
    if failures:
        raise SystemExit("the two updates' first losses differ, so they are not the same "
                         "computation: " + "; ".join(failures))


def run_lengths(f, cfg, lengths, rounds, sides, tmp, jax_env):
    """Every length's processes, in interleaved rounds: (JAX rows, comparison row pairs,
    first-loss disagreements)."""
    lc = loss_config(f.loss)
    script = os.path.abspath(__file__)
    weights_dir = f.model_path or os.path.join(tmp, "hf")
    rows, compare, failures = [], [], []
    for t in lengths:
        batch_path = os.path.join(tmp, f"batch_{t}.npz")
        np.savez(batch_path, **make_batch(cfg.vocab_size, f.batch, t))
        results = {side: [] for side in sides}
        for r, side in side_process.round_order(rounds, sides):
            spec = dict(shape=f.shape, model_path=f.model_path, lora_rank=f.lora_rank,
                        torch_logprobs=f.torch_logprobs,
                        dtype=f.dtype, remat=f.remat, scan_layers=f.scan_layers,
                        attention_block=f.attention_block,
                        mesh=f.mesh, loss=f.loss, micro_batches=f.micro_batches,
                        logprob_chunk=f.logprob_chunk, peak_tflops=f.peak_tflops, seq_len=t,
                        batch_path=batch_path, weights_dir=weights_dir,
                        warmup_steps=f.warmup_steps, steps=f.steps,
                        clip_low=lc.clip_low, clip_high=lc.clip_high, mfu=r == 0,
                        save_weights_to=(weights_dir if f.torch and side == "jax"
                                         and not os.path.exists(weights_dir) else ""))
            results[side].append(side_process.run_side(
                script, side, spec, extra_env=jax_env if side == "jax" else None))
            print(f"{f.batch} x {t} round {r} {side}: median step "
                  f"{median(results[side][-1]['times']):.3f} s, load "
                  f"{side_process.load_range(results[side][-1:])}", file=sys.stderr, flush=True)
        rows.append(jax_row(f, cfg, t, results["jax"]))
        if f.torch:
            compare.append(compare_rows(f.batch, t, results, f.lora_rank))
            # Every process starts from the same weights and batch, so every first loss agrees.
            losses = [r["first_loss"] for rs in results.values() for r in rs]
            if max(losses) - min(losses) > LOSS_AGREEMENT:
                failures.append(f"{f.batch} x {t}: first losses jax "
                                f"{[r['first_loss'] for r in results['jax']]} vs torch "
                                f"{[r['first_loss'] for r in results['torch']]}")
    return rows, compare, failures


def jax_row(f, cfg, t: int, results: list[dict]) -> list:
    step_s = median([x for r in results for x in r["times"]])
    tokens_per_s = f.batch * t / step_s
    first = results[0]
    flops = first["flops_per_token"] * tokens_per_s
    mfu = f"{flops / first['peak_flops']:.1%} (of {first['peak_source']})"
    return [f.shape, f"{first['params'] / 1e6:.2f}M", first["device"], f.mesh, f.dtype,
            f"{f.batch} x {t}", f.loss, f.micro_batches, f.remat, f"{first['first_s']:.1f}",
            f"{step_s:.3f}", f"{tokens_per_s:,.0f}", f"{flops / 1e12:.3f}", mfu,
            f"{max(r['peak_rss_mib'] for r in results):,.0f}", side_process.load_range(results)]


def compare_rows(b: int, t: int, results: dict, lora_rank: int = 0) -> list[list]:
    step_s = {side: median([x for r in rs for x in r["times"]]) for side, rs in results.items()}
    torch_version = results["torch"][0]["torch_version"]
    kind = f"LoRA r{lora_rank}" if lora_rank else "full"
    label = {"jax": f"rl_tpu (JAX), {kind}",
             "torch": f"PyTorch {torch_version} (transformers{', PEFT' if lora_rank else ''}), "
                      f"{kind}"}

    def later(rs):
        return f"{median([r['first_s'] for r in rs[1:]]):.2f}" if len(rs) > 1 else "-"

    return [[f"{b} x {t}", label[side], f"{rs[0]['first_s']:.2f}", later(rs),
             f"{step_s[side]:.3f}", f"{b * t / step_s[side]:,.0f}",
             f"{rs[0]['first_loss']:.6f}", f"{max(r['peak_rss_mib'] for r in rs):,.0f}",
             f"{step_s['torch'] / step_s['jax']:.2f}x" if side == "jax" else "",
             side_process.load_range(rs)]
            for side, rs in results.items()]


if __name__ == "__main__":
    side_process.run(parent_main, run_jax, run_torch)
