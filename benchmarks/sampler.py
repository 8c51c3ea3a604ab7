"""Generated tokens/s of the embedded JAX sampler beside transformers' `generate` (torch CPU).

  python benchmarks/sampler.py --shape small --batches 1,8,32 --new_tokens 64,128
  python benchmarks/sampler.py --shape tiny --batches 1,8,32 --new_tokens 64 --temperature 1
  python benchmarks/sampler.py --shape tiny --batches 1,8,32 --draw_vocab 151936 --notorch
  python benchmarks/sampler.py --shape qwen2.5-0.5b --dtype bfloat16 --batches 64,256 \
      --new_tokens 256 --temperature 1                     # on an accelerator (benchmarks/gpu.sh)

Both sides decode from the same random-weight HF directory, greedily unless --temperature > 0
(then plain sampling: no top-p / top-k), prompts of 32 tokens, every row generating exactly
`new_tokens` (eos ignored). JAX is timed after its one compile per shape bucket; torch needs
none.

--draw_vocab V adds a table of one sampling step alone (`sample_next` on random [B, V] logits,
plain and top-p 0.9): what a draw costs at a real vocab, apart from the model.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from benchmarks.common import SHAPES, median_ms, model_config, print_table  # noqa: E402
from rl_tpu.models import hf, tiny  # noqa: E402
from rl_tpu.rollout.engine import GenerateRequest, SamplingParams  # noqa: E402
from rl_tpu.rollout.sampler import JaxSampler  # noqa: E402

flags.DEFINE_string("shape", "small", "A CPU-sized shape (benchmarks/common.py SHAPES: tiny, "
                    "small, rl_step), or a model preset (qwen2.5-0.5b...: random params, JAX "
                    "only, for an accelerator).")
flags.DEFINE_string("batches", "1,8,32", "Batch sizes.")
flags.DEFINE_string("new_tokens", "64,128", "New tokens per row.")
flags.DEFINE_integer("prompt_len", 32, "Prompt tokens per row.")
flags.DEFINE_bool("torch", True, "Also time transformers' generate.")
flags.DEFINE_string("dtype", "float32", "JAX params and compute dtype.")
flags.DEFINE_float("temperature", 0.0, "0 = greedy; above 0, sample at this temperature.")
flags.DEFINE_integer("draw_vocab", 0, "Also time one sampling step at this vocab (0 = off).")


def write_model(shape: str, out: str):
    dims = {k: v for k, v in SHAPES[shape].items() if k not in ("arch", "vocab_size")}
    tiny.write_tiny_model(out, SHAPES[shape]["arch"], vocab_size=SHAPES[shape]["vocab_size"],
                          init_scale=0.1, **dims)


def time_jax(sampler, prompts, new, temperature):
    requests = [GenerateRequest(p, SamplingParams(max_new_tokens=new, temperature=temperature,
                                                  ignore_eos=True, seed=i))
                for i, p in enumerate(prompts)]
    assert all(len(r.output_ids) == new for r in sampler.generate(requests))  # compiles
    return len(prompts) * new / (median_ms(lambda: sampler.generate(requests), 3) / 1e3)


def time_torch(model, prompts, new, temperature):
    import torch

    ids = torch.tensor(prompts)
    with torch.no_grad():
        model.generate(ids[:, :4], max_new_tokens=2, do_sample=False)  # warm-up
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             min_new_tokens=new, pad_token_id=0,
                             **(dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
                                if temperature > 0 else dict(do_sample=False)))
        seconds = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + new
    return len(prompts) * new / seconds


def time_draws(batches, vocab: int):
    import jax
    import jax.numpy as jnp

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
    print_table(["batch", "vocab", "draw ms (plain)", "draw ms (top-p 0.9)"], rows)


def main(argv):
    del argv
    f = flags.FLAGS
    if f.shape in SHAPES:
        path = os.path.join(tempfile.mkdtemp(), f.shape)
        write_model(f.shape, path)
        cfg, params = hf.load(path, dtype=f.dtype)
    else:  # a real model's shape: random weights in memory (no tokenizer, no torch twin)
        cfg = model_config(f.shape, dtype=f.dtype, param_dtype=f.dtype)
        params, path = tiny.random_params(cfg, scale=0.1), None
    sampler = JaxSampler(cfg, params, max_batch=max(int(b) for b in f.batches.split(",")))
    torch_model = None
    if f.torch and path is not None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(os.cpu_count() or 1)
        torch_model = AutoModelForCausalLM.from_pretrained(path).eval()
    rng = np.random.RandomState(0)
    rows = []
    for new in (int(n) for n in f.new_tokens.split(",")):
        for batch in (int(b) for b in f.batches.split(",")):
            prompts = rng.randint(3, cfg.vocab_size, (batch, f.prompt_len)).tolist()
            jax_tps = time_jax(sampler, prompts, new, f.temperature)
            torch_tps = (time_torch(torch_model, prompts, new, f.temperature) if torch_model
                         else float("nan"))
            rows.append([f.shape, f"{cfg.num_params() / 1e6:.1f}M", f.temperature, batch,
                         f.prompt_len, new,
                         f"{jax_tps:,.0f}", f"{torch_tps:,.0f}", f"{jax_tps / torch_tps:.1f}x"])
    print_table(["shape", "params", "temperature", "batch", "prompt", "new tokens",
                 "rl_tpu JAX tok/s", "transformers tok/s", "speed-up"], rows)
    if f.draw_vocab:
        time_draws([int(b) for b in f.batches.split(",")], f.draw_vocab)


if __name__ == "__main__":
    app.run(main)
