#!/usr/bin/env bash
# The GPU numbers of benchmarks/README.md, on a machine with one NVIDIA GPU, in under 10 minutes:
#   1. update-step MFU at Qwen2.5-0.5B and 1.5B shapes, bf16, random weights;
#   2. decode tokens/s of the embedded sampler at batch 64 and 256 (0.5B, temperature 1);
#   3. one GRPO step end to end (sample, score, update) at the rl_step shape;
#   4. the rollout server's tokens/s at 1, 8 and 64 concurrent clients (continuous batching).
# Needs jax with CUDA (pip install -U "jax[cuda12]") beside `pip install -e .`; prints markdown
# rows to paste into benchmarks/README.md under the date and the device.
#
#   bash benchmarks/gpu.sh 2>&1 | tee /tmp/gpu_bench.txt
set -euo pipefail
cd "$(dirname "$0")/.."
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}"
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-/tmp/rl_tpu_gpu_bench_cache}"

echo "## $(date -u +%Y-%m-%d), $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader)"
python -c "import jax; d = jax.devices()[0]; assert d.platform == 'gpu', d; print(d.device_kind)"

step() { echo; echo "### $*"; timeout 150 "$@" 2>&1 | grep '^|' || echo "(failed: $*)"; }

# 1. The update: policy step (forward, log-probs, clipped loss, backward, AdamW) in bf16.
step python benchmarks/train_step.py --shape qwen2.5-0.5b --batch 16 --seq_len 1024 \
    --dtype bfloat16 --remat dots --steps 5
step python benchmarks/train_step.py --shape qwen2.5-1.5b --batch 8 --seq_len 1024 \
    --dtype bfloat16 --remat dots --steps 5
# 2. Decode: 128-token prompts, 256 new tokens a row, plain sampling at temperature 1.
step python benchmarks/sampler.py --shape qwen2.5-0.5b --dtype bfloat16 --batches 64,256 \
    --prompt_len 128 --new_tokens 256 --temperature 1 --notorch
# 3. One RL step end to end, by phase (the first step compiles; the steady row is the median).
step python benchmarks/rl_step.py --steps 3
# 4. launch.serve_rollout on the GPU (the benchmark starts it with JAX_PLATFORMS as given here):
#    8 clients should get well over 3x one client's tokens/s, a decode step of 8 rows costing
#    about one row's on an accelerator.
JAX_PLATFORMS=cuda step python benchmarks/rollout_server.py --shape small --warmup_seconds 12 \
    --seconds 10 --clients 1,8,64
