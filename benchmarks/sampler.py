"""Generated tokens/s of the embedded JAX sampler beside transformers' `generate` (torch CPU).

  python benchmarks/sampler.py --shape peer --batches 1,8,32,128 --new_tokens 64 --temperature 1
  python benchmarks/sampler.py --shape small --batches 1,8,32 --new_tokens 64,128
  python benchmarks/sampler.py --shape tiny --batches 1,8,32 --draw_vocab 151936 --notorch
  python benchmarks/sampler.py --shape qwen2.5-0.5b --dtype bfloat16 --batches 64,256 \
      --new_tokens 256 --temperature 1 --notorch            # on an accelerator (gpu.sh)
  python benchmarks/sampler.py --model_path $(python -m launch.get_model smollm2-135m-instruct) \
      --batches 1,8,32 --prompt_len 64 --new_tokens 128 --temperature 1   # a real model

Both sides decode from the same random-weight HF directory (the first JAX process writes it),
or from --model_path's (a real model's; its config gives the vocab), greedily unless
--temperature > 0 (then plain sampling: no top-p / top-k), prompts of --prompt_len random
ids, every row generating exactly `new_tokens` (EOS does not stop a row on either side). Each
side runs in a process of its own (benchmarks/side_process.py says why), in --rounds
interleaved rounds (jax, torch, torch, jax, ...). In each process every (batch, new tokens)
runs --warmup_calls untimed calls (JAX's first compiles its bucket) and --calls timed ones;
tok/s is batch x new tokens over the median call, of all rounds' timed calls. "tok per
CPU-s" divides the same tokens by the median call's CPU time (the process's, all threads): on
a shared machine, where wall time depends on what else runs, it says what work each side
spends on them (JAX's pool threads may spin a little while waiting; PyTorch's, passive, not).

Every call gets a batch of prompts of its own (seeded by round, batch and call; call k gets
the same prompts on both sides), so nothing one call computed helps the next: the JAX sampler
keeps a prefix cache, and prompts repeated call after call would let its timed calls reuse
their K/V while transformers prefills each in full. The table's "JAX prompt K/V reused" column
shows the share of prompt tokens the timed calls took from that cache. --reuse_prompts sends
one prompt batch per batch size on every call (the measurement before 2026-12-05), with the
cache doing what it would do for them.

--draw_vocab V adds a table of one sampling step alone (`sample_next` on random [B, V] logits,
plain and top-p 0.9): what a draw costs at a real vocab, apart from the model.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Only numpy and the side-process helper at the top: a PyTorch child must not load JAX.
import numpy as np  # noqa: E402
from absl import flags  # noqa: E402

from benchmarks import side_process  # noqa: E402
from benchmarks.side_process import median  # noqa: E402

flags.DEFINE_string("shape", "small", "A CPU-sized shape (benchmarks/common.py SHAPES: tiny, "
                    "small, rl_step, peer), or a model preset (qwen2.5-0.5b...: random params, "
                    "JAX only, for an accelerator).")
flags.DEFINE_string("model_path", "", "A real model's HF directory (both sides load it; "
                    "overrides --shape).")
flags.DEFINE_string("batches", "1,8,32", "Batch sizes.")
flags.DEFINE_string("new_tokens", "64,128", "New tokens per row.")
flags.DEFINE_integer("prompt_len", 32, "Prompt tokens per row.")
flags.DEFINE_bool("torch", True, "Also time transformers' generate.")
flags.DEFINE_string("dtype", "float32", "JAX params and compute dtype.")
flags.DEFINE_float("temperature", 0.0, "0 = greedy; above 0, sample at this temperature.")
flags.DEFINE_integer("warmup_calls", 1, "Untimed calls per (batch, new tokens) and process.")
flags.DEFINE_integer("calls", 3, "Timed calls per (batch, new tokens) and process.")
flags.DEFINE_integer("rounds", 0, "Processes per side, interleaved with the other side's "
                     "(0: 2 with --torch, 1 without).")
flags.DEFINE_bool("reuse_prompts", False, "Send the same prompts on every call (the old "
                  "measurement: JAX's prefix cache then serves the timed calls' prompts).")
flags.DEFINE_integer("draw_vocab", 0, "Also time one sampling step at this vocab (0 = off).")
flags.DEFINE_enum("side", "", ["", "jax", "torch"], "Internal: run one side's process.")
flags.DEFINE_string("spec", "", "Internal: the side process's JSON spec.")
flags.DEFINE_string("result", "", "Internal: where the side process writes its result.")


def call_prompts(spec: dict, rnd: int, batch: int, call: int) -> np.ndarray:
    """The [batch, prompt_len] prompt ids of one call: its own unless reuse_prompts."""
    seed = [batch] if spec["reuse_prompts"] else [rnd, batch, call]
    return np.random.RandomState(seed).randint(3, spec["vocab_size"],
                                               (batch, spec["prompt_len"]))


def each_call(spec: dict, run_call) -> tuple[dict, dict]:
    """Runs `run_call(prompts [B, P], new, call index) -> seconds` for every (new tokens,
    batch): warm-up calls, then timed ones; ({"new,batch": [timed seconds]}, the same of the
    process's CPU seconds in each timed call, all its threads together)."""
    times, cpu = {}, {}
    for new in spec["new_tokens"]:
        for batch in spec["batches"]:
            key, walls, cpus = f"{new},{batch}", [], []
            for k in range(spec["warmup_calls"] + spec["calls"]):
                start = time.process_time()
                walls.append(run_call(call_prompts(spec, spec["round"], batch, k), new, k))
                cpus.append(time.process_time() - start)
            times[key], cpu[key] = walls[spec["warmup_calls"]:], cpus[spec["warmup_calls"]:]
    return times, cpu


def write_model(shape: str, out: str):
    from benchmarks.common import SHAPES
    from rl_tpu.models import tiny

    dims = {k: v for k, v in SHAPES[shape].items() if k not in ("arch", "vocab_size")}
    tiny.write_tiny_model(out, SHAPES[shape]["arch"], vocab_size=SHAPES[shape]["vocab_size"],
                          init_scale=0.1, **dims)


def run_jax(spec: dict) -> dict:
    from benchmarks.common import model_config
    from rl_tpu.core.engine import GenerateRequest, SamplingParams
    from rl_tpu.models import hf, tiny
    from rl_tpu.rollout.sampler import JaxSampler

    if spec["model_dir"]:
        if not os.path.exists(spec["model_dir"]):
            write_model(spec["shape"], spec["model_dir"])
        cfg, params = hf.load(spec["model_dir"], dtype=spec["dtype"])
    else:  # a real model's shape: random weights in memory (no tokenizer, no torch twin)
        cfg = model_config(spec["shape"], dtype=spec["dtype"], param_dtype=spec["dtype"])
        params = tiny.random_params(cfg, scale=0.1)
    sampler = JaxSampler(cfg, params, max_batch=max(spec["batches"]))
    reuse = {"prompt_tokens": 0, "reused_tokens": 0, "compiled_programs": 0}

    def run_call(prompts, new, k) -> float:
        requests = [GenerateRequest(p, SamplingParams(
            max_new_tokens=new, temperature=spec["temperature"], ignore_eos=True,
            seed=1000 * k + i)) for i, p in enumerate(prompts.tolist())]
        before = sampler.stats()
        start = time.perf_counter()
        results = sampler.generate(requests)
        seconds = time.perf_counter() - start
        assert all(len(r.output_ids) == new for r in results)
        if k >= spec["warmup_calls"]:
            after = sampler.stats()
            for name in reuse:
                reuse[name] += after[name] - before[name]
        return seconds

    times, cpu = each_call(spec, run_call)
    return dict(times=times, cpu=cpu, params=cfg.num_params(),
                reuse_fraction=reuse["reused_tokens"] / max(reuse["prompt_tokens"], 1),
                compiled_in_timed_calls=reuse["compiled_programs"])


def run_torch(spec: dict) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(side_process.cores())
    transformers.utils.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32).eval()
    # No EOS: every row runs to max_new_tokens, as the JAX side's ignore_eos (which still
    # samples EOS, where min_new_tokens would mask it).
    model.generation_config.eos_token_id = None
    sampling = (dict(do_sample=True, temperature=spec["temperature"], top_k=0, top_p=1.0)
                if spec["temperature"] > 0 else dict(do_sample=False, top_k=None, top_p=None,
                                                     temperature=None))

    def run_call(prompts, new, k) -> float:
        ids = torch.from_numpy(prompts).long()
        torch.manual_seed(k)
        with torch.no_grad():
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                 pad_token_id=0, **sampling)
            seconds = time.perf_counter() - start
        assert out.shape[1] == ids.shape[1] + new, out.shape
        return seconds

    times, cpu = each_call(spec, run_call)
    return dict(times=times, cpu=cpu, torch_version=torch.__version__)


def parent_main(f) -> None:
    from benchmarks.common import SHAPES, model_config

    if f.model_path:
        from rl_tpu.models import hf
        cfg = hf.read_config(f.model_path)
        f.shape = os.path.basename(os.path.dirname(os.path.abspath(f.model_path))) or "model"
    else:
        cfg = model_config(f.shape)  # an unknown shape fails here, before any process starts
    # a preset has no HF directory to load
    with_torch = f.torch and (f.shape in SHAPES or bool(f.model_path))
    if f.warmup_calls < 1 or f.calls < 1:
        raise SystemExit("--warmup_calls and --calls must be at least 1 (JAX's first call "
                         "compiles, and a median needs a timed call)")
    # With reused prompts the second call is the first to hit the prefix cache, and the
    # prefill from cached K/V compiles then: two warm-up calls keep it out of the timed ones.
    warmup_calls = max(f.warmup_calls, 2) if f.reuse_prompts else f.warmup_calls
    batches = [int(b) for b in f.batches.split(",")]
    new_tokens = [int(n) for n in f.new_tokens.split(",")]
    rounds = f.rounds or (2 if with_torch else 1)
    sides = ("jax", "torch") if with_torch else ("jax",)
    tmp = tempfile.mkdtemp(prefix="sampler_bench_")
    spec = dict(shape=f.shape, dtype=f.dtype, temperature=f.temperature, batches=batches,
                new_tokens=new_tokens, prompt_len=f.prompt_len, vocab_size=cfg.vocab_size,
                warmup_calls=warmup_calls, calls=f.calls, reuse_prompts=f.reuse_prompts,
                model_dir=f.model_path or (os.path.join(tmp, f.shape) if f.shape in SHAPES
                                           else ""))
    jax_env = {} if os.environ.get("JAX_COMPILATION_CACHE_DIR") else {
        "JAX_COMPILATION_CACHE_DIR": os.path.join(tmp, "jax_cache")}
    print(side_process.thread_note() if with_torch else "JAX with its default threads",
          flush=True)
    results = {side: [] for side in sides}
    try:
        for r, side in side_process.round_order(rounds, sides):
            results[side].append(side_process.run_side(
                os.path.abspath(__file__), side, dict(spec, round=r),
                extra_env=jax_env if side == "jax" else None))
            print(f"round {r} {side} done, load {side_process.load_range(results[side][-1:])}",
                  file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n{warmup_calls} warm-up + {f.calls} timed calls per (batch, new tokens) and "
          f"process, {rounds} process(es) per side; prompts "
          f"{'reused on every call' if f.reuse_prompts else 'fresh on every call'}")
    print_rows(f, results, batches, new_tokens)
    if f.draw_vocab:
        time_draws(batches, f.draw_vocab)


def print_rows(f, results: dict, batches: list[int], new_tokens: list[int]):
    def tok_s(side, new, batch, what="times"):
        if side not in results:
            return float("nan")
        calls = [x for r in results[side] for x in r[what][f"{new},{batch}"]]
        return batch * new / median(calls)

    jax_rs = results["jax"]
    compiled = sum(r["compiled_in_timed_calls"] for r in jax_rs)
    if compiled:
        print(f"note: the JAX sampler compiled {compiled} program(s) during timed calls; "
              "more --warmup_calls would keep compiles out of the timing")
    reused = np.mean([r["reuse_fraction"] for r in jax_rs])
    load = side_process.load_range([r for rs in results.values() for r in rs])
    rows = []
    for new in new_tokens:
        for batch in batches:
            jax_tps, torch_tps = tok_s("jax", new, batch), tok_s("torch", new, batch)
            jax_cpu, torch_cpu = tok_s("jax", new, batch, "cpu"), tok_s("torch", new, batch,
                                                                       "cpu")
            rows.append([f.shape, f"{jax_rs[0]['params'] / 1e6:.2f}M", f.temperature, batch,
                         f.prompt_len, new, "reused" if f.reuse_prompts else "fresh",
                         f"{reused:.0%}", f"{jax_tps:,.0f}",
                         f"{torch_tps:,.0f}" if "torch" in results else "-",
                         f"{jax_tps / torch_tps:.2f}x" if "torch" in results else "-",
                         f"{jax_cpu:,.0f} / {torch_cpu:,.0f}" if "torch" in results
                         else f"{jax_cpu:,.0f}", load])
    side_process.print_table(
        ["shape", "params", "temperature", "batch", "prompt", "new tokens", "prompts",
         "JAX prompt K/V reused", "rl_tpu JAX tok/s", "transformers tok/s",
         "rl_tpu / transformers", "tok per CPU-s (JAX / torch)", "load"], rows)


def time_draws(batches, vocab: int):
    import jax
    import jax.numpy as jnp

    from benchmarks.common import median_ms
    from rl_tpu.rollout.decoding import sample_next

    draw = jax.jit(sample_next)
    rows = []
    for b in batches:
        logits = jnp.asarray(np.random.RandomState(0).randn(b, vocab).astype(np.float32) * 3)
        keys = jax.vmap(jax.random.key)(jnp.arange(b))
        times = [median_ms(lambda: draw(logits, jnp.ones(b), jnp.full(b, top_p),
                                        jnp.full(b, -1, jnp.int32), keys), 10)
                 for top_p in (1.0, 0.9)]
        rows.append([b, vocab] + [f"{t:.2f}" for t in times])
    side_process.print_table(["batch", "vocab", "draw ms (plain)", "draw ms (top-p 0.9)"], rows)


if __name__ == "__main__":
    side_process.run(parent_main, run_jax, run_torch)
