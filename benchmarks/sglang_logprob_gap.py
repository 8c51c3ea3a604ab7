"""The train/inference log-prob gap on a real model: SGLang's reported log-prob of each token
it sampled against the trainer's recomputed log-prob of the same token, same weights, same
dtype on both sides.

  python benchmarks/sglang_logprob_gap.py                      # float32 and bfloat16
  python benchmarks/sglang_logprob_gap.py --dtypes bfloat16 --samples 8

For each --dtypes entry: SmolLM2-135M-Instruct in that dtype (tests/real_model.py, converted
once per machine from its GGUF on PyPI), served by a real SGLang 0.5.23 on CPU launched with
`--dtype <dtype>` (tests/rollout/sglang_server.py), samples --samples completions of
--max_new_tokens tokens (stopping at <|im_end|>) for each of a few chat prompts at
--temperature, untruncated (top-p 1, top-k all: full-distribution log-probs). The trainer side
loads the same HF dir with `hf.load(dtype=<dtype>)` (params and compute in that dtype, as
`model.dtype` sets it for training) and scores the prompt + completion ids with
`token_logprobs`, the function the learner's proximal pass and policy step call (fp32 logits
from the head, log-softmax in fp32).

Prints a markdown row per dtype: sampled tokens, mean and max |trainer - engine|, its 99th
percentile, the share of tokens above 0.1 nats (the default of `algo.logprob_gap_threshold`,
whose train/logprob_gap_frac is this column in a run), the signed mean (trainer - engine),
the mean |exp(gap) - 1| (the relative error of a token's probability), the mean engine
log-prob (how peaked the samples were) and the seconds SGLang took (start + sampling), then the
load average (the machine is shared).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "tests", "rollout"))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import print_table  # noqa: E402
from rl_tpu.core.engine import GenerateRequest, SamplingParams  # noqa: E402
from rl_tpu.models import hf  # noqa: E402
from rl_tpu.models.logprobs import token_logprobs  # noqa: E402
from rl_tpu.models.tokenizer import load_tokenizer  # noqa: E402
from rl_tpu.models.transformer import Transformer  # noqa: E402
from rl_tpu.rollout.sglang import SGLangEngine  # noqa: E402

QUESTIONS = ("What is 17 + 25? Answer with the number.",
             "Name three colours of the rainbow.",
             "Write one sentence about the sea.",
             "What is the capital of France?",
             "Count from one to five in words.",
             "Give a synonym for 'happy'.",
             "What do bees make?",
             "Is 91 a prime number? Explain briefly.")
THRESHOLD = 0.1  # nats: algo.logprob_gap_threshold's default


def sample(url: str, prompts: list[list[int]], args) -> list:
    """SGLang's samples of every prompt: `--samples` each, prompt-major, seeded."""
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              n=args.samples, seed=args.seed)
    with SGLangEngine([url], request_timeout_s=900) as engine:
        engine.wait_healthy(timeout=300)
        return engine.generate([GenerateRequest(p, sampling) for p in prompts])


def trainer_logprobs(model_dir: str, dtype: str, rows: list[tuple[list[int], list[int]]],
                     temperature: float) -> list[np.ndarray]:
    """The trainer's log-prob of each completion id, all rows in one right-padded batch
    (causal attention: the padding after a row changes nothing before it)."""
    cfg, params = hf.load(model_dir, dtype=dtype)
    model = Transformer(cfg)
    length = max(len(p) + len(c) for p, c in rows)
    tokens = np.zeros((len(rows), length), np.int32)
    for i, (prompt, completion) in enumerate(rows):
        tokens[i, :len(prompt) + len(completion)] = prompt + completion
    score = jax.jit(lambda p, t: token_logprobs(model, p, {"tokens": t},
                                                temperature=temperature, with_entropy=False)[0])
    lp = np.asarray(score(params, tokens))
    return [lp[i, len(p):len(p) + len(c)] for i, (p, c) in enumerate(rows)]


def measure(dtype: str, args) -> list:
    from real_model import smollm2_dir
    from sglang_server import start_sglang_server

    model_dir = smollm2_dir(dtype)
    tokenizer = load_tokenizer(model_dir)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                             add_generation_prompt=True)
               for q in QUESTIONS[:args.prompts]]
    started = time.perf_counter()
    # A later --dtype overrides the helper's own "--dtype float32" (which also starts the
    # server with one OpenMP thread and --sleep-on-idle: see start_sglang_server).
    with start_sglang_server(model_dir, "--dtype", dtype) as server:
        results = sample(server.url, prompts, args)
    sglang_s = time.perf_counter() - started
    rows = [(prompts[k // args.samples], list(r.output_ids)) for k, r in enumerate(results)]
    mine = trainer_logprobs(model_dir, dtype, rows, args.temperature)
    engine = np.concatenate([np.asarray(r.logprobs, np.float64) for r in results])
    trainer = np.concatenate(mine).astype(np.float64)
    gap = trainer - engine
    absolute = np.abs(gap)
    assert np.isfinite(gap).all(), "a non-finite log-prob on one side"
    return [dtype, len(results), len(gap), f"{absolute.mean():.2e}", f"{absolute.max():.2e}",
            f"{np.percentile(absolute, 99):.2e}", f"{(absolute > THRESHOLD).mean():.4f}",
            f"{gap.mean():+.2e}", f"{np.abs(np.expm1(gap)).mean():.2e}",
            f"{np.mean(engine):.3f}", f"{sglang_s:.0f}", f"{os.getloadavg()[0]:.2f}"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--prompts", type=int, default=8, choices=range(1, len(QUESTIONS) + 1))
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = [measure(dtype, args) for dtype in args.dtypes.split(",")]
    print(f"\nSmolLM2-135M-Instruct, SGLang 0.5.23 (CPU, torch_native) vs rl_tpu token_logprobs; "
          f"{args.prompts} prompts x {args.samples} samples, <= {args.max_new_tokens} new "
          f"tokens, temperature {args.temperature}")
    print_table(["dtype", "samples", "tokens", "mean abs gap", "max abs gap", "p99 abs gap",
                 f"share > {THRESHOLD}", "signed mean", "mean abs(ratio - 1)",
                 "mean engine logprob", "sglang s", "load avg"], rows)


if __name__ == "__main__":
    main()
