"""Generated tokens/s of the embedded JAX sampler beside transformers' `generate` (torch CPU).

  python benchmarks/sampler.py --shape small --batches 1,8,32 --new_tokens 64,128

Both sides decode greedily from the same random-weight HF directory, prompts of 32 tokens,
every row generating exactly `new_tokens` (eos ignored). JAX is timed after its one compile
per shape bucket; torch needs none.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from benchmarks.common import SHAPES, print_table  # noqa: E402
from rl_tpu.models import hf, tiny  # noqa: E402
from rl_tpu.rollout.engine import GenerateRequest, SamplingParams  # noqa: E402
from rl_tpu.rollout.sampler import JaxSampler  # noqa: E402

flags.DEFINE_enum("shape", "small", ["tiny", "small"], "Model shape (CPU-sized ones).")
flags.DEFINE_string("batches", "1,8,32", "Batch sizes.")
flags.DEFINE_string("new_tokens", "64,128", "New tokens per row.")
flags.DEFINE_integer("prompt_len", 32, "Prompt tokens per row.")
flags.DEFINE_bool("torch", True, "Also time transformers' generate.")
flags.DEFINE_string("dtype", "float32", "JAX params and compute dtype.")


def write_model(shape: str, out: str):
    dims = {k: v for k, v in SHAPES[shape].items() if k not in ("arch", "vocab_size")}
    tiny.write_tiny_model(out, SHAPES[shape]["arch"], vocab_size=SHAPES[shape]["vocab_size"],
                          init_scale=0.1, **dims)


def time_jax(sampler, prompts, new):
    requests = [GenerateRequest(p, SamplingParams(max_new_tokens=new, temperature=0.0,
                                                  ignore_eos=True)) for p in prompts]
    sampler.generate(requests)  # compile this bucket
    start = time.perf_counter()
    out = sampler.generate(requests)
    seconds = time.perf_counter() - start
    assert all(len(r.output_ids) == new for r in out)
    return len(prompts) * new / seconds


def time_torch(model, prompts, new):
    import torch

    ids = torch.tensor(prompts)
    with torch.no_grad():
        model.generate(ids[:, :4], max_new_tokens=2, do_sample=False)  # warm-up
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0)
        seconds = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + new
    return len(prompts) * new / seconds


def main(argv):
    del argv
    f = flags.FLAGS
    path = os.path.join(tempfile.mkdtemp(), f.shape)
    write_model(f.shape, path)
    cfg, params = hf.load(path, dtype=f.dtype)
    sampler = JaxSampler(cfg, params, max_batch=max(int(b) for b in f.batches.split(",")))
    torch_model = None
    if f.torch:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(os.cpu_count() or 1)
        torch_model = AutoModelForCausalLM.from_pretrained(path).eval()
    rng = np.random.RandomState(0)
    rows = []
    for new in (int(n) for n in f.new_tokens.split(",")):
        for batch in (int(b) for b in f.batches.split(",")):
            prompts = rng.randint(3, cfg.vocab_size, (batch, f.prompt_len)).tolist()
            jax_tps = time_jax(sampler, prompts, new)
            torch_tps = time_torch(torch_model, prompts, new) if torch_model else float("nan")
            rows.append([f.shape, f"{cfg.num_params() / 1e6:.1f}M", batch, f.prompt_len, new,
                         f"{jax_tps:,.0f}", f"{torch_tps:,.0f}", f"{jax_tps / torch_tps:.1f}x"])
    print_table(["shape", "params", "batch", "prompt", "new tokens", "rl_tpu JAX tok/s",
                 "transformers tok/s", "speed-up"], rows)


if __name__ == "__main__":
    app.run(main)
