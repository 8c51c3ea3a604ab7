"""Generation demo: load an HF model directory, run a forward pass and greedy generation with
the embedded JAX sampler (KV cache, compiled decode loop); a check that a model loads and runs.

  python -m launch.get_model smollm2-135m-instruct --out /tmp/smollm2
  python -m launch.generate --model_path /tmp/smollm2 --prompt "What is 17 + 25?"
  python -m launch.make_tiny_model --arch qwen2 --out /tmp/tiny_qwen2   # random weights
  python -m launch.generate --model_path /tmp/tiny_qwen2

Replies stop at the model's end-of-turn id (config.json's eos_token_id, e.g. <|im_end|>);
--ignore_eos decodes all --max_new_tokens, as a speed test wants. The tokens/s line counts the
tokens generated and times the second call (the first compiles).
"""

import time

import jax
import numpy as np
from absl import app, flags

import launch
from rl_tpu import parallel
from rl_tpu.core.engine import GenerateRequest, SamplingParams
from rl_tpu.models import hf
from rl_tpu.models.tokenizer import load_tokenizer
from rl_tpu.models.transformer import Transformer
from rl_tpu.rollout.sampler import JaxSampler

flags.DEFINE_string("model_path", None, "HF model directory.", required=True)
flags.DEFINE_string("prompt", "What is 3 + 4?", "User message of the demo chat.")
flags.DEFINE_integer("batch", 8, "Copies of the prompt decoded together.")
flags.DEFINE_integer("max_new_tokens", 32, "Tokens to generate.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Params and compute dtype.")
flags.DEFINE_bool("ignore_eos", False, "Decode past the end-of-turn id (a speed test).")


def main(argv):
    del argv
    f = flags.FLAGS
    hf.check_model_dir(f.model_path)  # a broken dir in one line, before any compile
    parallel.maybe_initialize_distributed()
    mesh = parallel.make_mesh({"fsdp": -1})
    cfg, params = hf.load(f.model_path, mesh=mesh, dtype=f.dtype)
    tokenizer = load_tokenizer(f.model_path)
    model = Transformer(cfg)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": f.prompt}],
                                           add_generation_prompt=True)
    logits = jax.jit(lambda p, x: model.apply({"params": p}, x))(params, np.array([prompt]))
    print(f"forward: logits {logits.shape}, finite={bool(np.isfinite(np.asarray(logits)).all())}")
    sampler = JaxSampler(cfg, params, tokenizer=tokenizer,
                         mesh=parallel.sampler_mesh(jax.local_devices(), cfg.num_kv_heads))
    greedy = SamplingParams(max_new_tokens=f.max_new_tokens, temperature=0.0,
                            ignore_eos=f.ignore_eos)
    requests = [GenerateRequest(prompt, greedy)] * f.batch
    sampler.generate(requests)  # compile this shape bucket
    start = time.perf_counter()
    results = sampler.generate(requests)
    seconds = time.perf_counter() - start
    print(f"prompt: {tokenizer.decode(prompt)!r}")
    print(f"greedy: {tokenizer.decode(results[0].output_ids)!r} "
          f"(finish: {results[0].finish_reason})")
    generated = sum(len(r.output_ids) for r in results)
    print(f"decode: {generated / seconds:,.0f} tokens/s ({generated} tokens in {seconds:.2f} s: "
          f"batch {f.batch}, up to {f.max_new_tokens} new tokens, prefill included, "
          f"{jax.device_count()} devices)")


if __name__ == "__main__":
    app.run(lambda argv: launch.one_line_errors(launch.run_errors(), main, argv),
            flags_parser=launch.parse_flags)
