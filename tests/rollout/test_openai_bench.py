"""Acceptance: SGLang's own benchmark client (`python -m sglang.bench_serving` from SGLang's
venv, unchanged) against `python -m launch.serve_rollout` on a tiny model, as a new user
would run it, over the native API (--backend sglang) and OpenAI's (sglang-oai, sglang-oai-chat):
every request succeeds, and the stream streams (mean time to first token well under half of
the mean end-to-end latency; a server that sent its text at the end would make them equal)."""

import json
import os
import subprocess

import pytest

from rl_tpu.models import tiny
from sglang_server import ensure_sglang_venv, start_rollout_server  # noqa: E402 (on sys.path)

pytestmark = [pytest.mark.slow, pytest.mark.sglang_venv]

NUM_PROMPTS = 16
OUTPUT_LEN = 256


@pytest.fixture(scope="module")
def rollout_server(tmp_path_factory):
    model = str(tmp_path_factory.mktemp("bench") / "tiny")
    # a tiny model, but not the tiniest: with D=64 a 96-token reply decodes in 10 ms, below
    # the HTTP round trip, and no stream could show; at D=256 x 4 layers decoding dominates
    tiny.write_tiny_model(model, "qwen2", vocab_size=512, seed=0, hidden_size=256,
                          intermediate_size=768, num_layers=4)
    # --warmup: every program compiled before the server listens, so no request's time to
    # first token is a compile
    with start_rollout_server(model, "--warmup", "--max_batch", "8", "--max_context_tokens",
                              "512", timeout=600) as server:
        yield server


def bench_serving(server, backend: str, out_dir) -> dict:
    """One bench_serving run; its result record (the JSON line it writes)."""
    python = ensure_sglang_venv()
    out = os.path.join(str(out_dir), f"{backend}.jsonl")
    cmd = [python, "-m", "sglang.bench_serving", "--backend", backend,
           "--base-url", server.url, "--dataset-name", "random-ids",
           "--num-prompts", str(NUM_PROMPTS), "--random-input-len", "64",
           "--random-output-len", str(OUTPUT_LEN), "--random-range-ratio", "1.0",
           "--max-concurrency", "4", "--seed", "0", "--disable-tqdm", "--output-file", out]
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "XLA_FLAGS", "JAX_PLATFORMS") and not k.startswith("PYTEST")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    report = f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}\nserver: {server.log_tail(2000)}"
    assert run.returncode == 0, report
    with open(out) as f:
        return json.loads(f.read().splitlines()[-1])


@pytest.mark.parametrize("backend", ["sglang", "sglang-oai", "sglang-oai-chat"])
def test_sglang_bench_serving_runs_unchanged_and_sees_a_stream(rollout_server, backend,
                                                              tmp_path):
    result = bench_serving(rollout_server, backend, tmp_path)
    assert result["completed"] == NUM_PROMPTS, result
    # random-ids with ignore_eos: every request decodes all its tokens
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN, result
    assert 0 < result["mean_ttft_ms"] < 0.5 * result["mean_e2e_latency_ms"], result
