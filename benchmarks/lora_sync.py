"""Weight sync to a real SGLang server for a LoRA policy: full weights vs the adapters alone.

  python benchmarks/lora_sync.py --shape small --rank 8 --repeats 5

Starts SGLang 0.5.23 on CPU (tests/rollout/sglang_server.py; LoRA on with the torch_native
backend and the pin_memory shim tests/rollout/test_sglang_lora.py explains) serving a random
model of --shape (benchmarks/common.py SHAPES), then times `SGLangEngine.update_weights`:

  * adapter: `model_config.lora` set, random rank --rank adapters on every projection sent
    alone: a PEFT dir written to weights_dir/adapter_<version> and `/load_lora_adapter`;
  * full: no lora in the config, the merged params (W + scale A B, computed beforehand):
    an HF export and `/update_weights_from_disk`, as a LoRA policy without adapter sync
    would need. Run after the adapter syncs, since it replaces the served base.

Each mode runs --repeats syncs (a new version each) after one untimed; prints a markdown row
per mode: bytes written per sync (the files), the median and range of the whole sync, the
median of writing the files alone (the rest is the server loading them), and the 1-minute
load average when the row was measured (the machine is shared: compare rows of one run).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "rollout"))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import SHAPES, print_table  # noqa: E402
from rl_tpu.models import hf, lora, peft_format, tiny  # noqa: E402
from rl_tpu.rollout.sglang import SGLangEngine  # noqa: E402
from rl_tpu.rollout.weight_sync import dir_bytes  # noqa: E402


def write_model(shape: str, out: str) -> None:
    dims = {k: v for k, v in SHAPES[shape].items() if k not in ("arch", "vocab_size")}
    tiny.write_tiny_model(out, SHAPES[shape]["arch"], vocab_size=SHAPES[shape]["vocab_size"],
                          init_scale=0.1, **dims)


def timed_syncs(engine: SGLangEngine, weights, prefix: str, repeats: int) -> list[float]:
    """Seconds of each of `repeats` syncs, after one untimed (first contact, caches)."""
    engine.update_weights(weights[0], f"{prefix}-warm")
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        engine.update_weights(weights[(i + 1) % len(weights)], f"{prefix}-{i}")
        times.append(time.perf_counter() - start)
    return times


def median_write_s(write, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        write()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def row(mode: str, shape: str, rank: int, nbytes: int, times: list[float],
        write_s: float) -> list:
    ms = [1e3 * t for t in times]
    return [mode, shape, rank, f"{nbytes:,}", f"{np.median(ms):.0f}",
            f"{min(ms):.0f}-{max(ms):.0f}", f"{1e3 * write_s:.0f}", f"{os.getloadavg()[0]:.2f}"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="small", choices=sorted(SHAPES))
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from sglang_server import lora_flags, lora_server_env, start_sglang_server
    from test_sglang_lora import random_adapters

    with tempfile.TemporaryDirectory(prefix="rl_tpu_lora_sync_") as tmp:
        model_dir = os.path.join(tmp, "model")
        write_model(args.shape, model_dir)
        cfg, params = hf.load(model_dir)
        lora_cfg = cfg.replace(lora=lora.LoraConfig(rank=args.rank, alpha=2.0 * args.rank))
        adapters = [random_adapters(lora_cfg, seed, scale=0.01) for seed in range(2)]
        merged = [jax.jit(lambda a: lora.merge(lora.with_adapters(params, a), lora_cfg.lora))(a)
                  for a in adapters]
        env = lora_server_env(os.path.join(tmp, "env"))
        rows = []
        with start_sglang_server(model_dir, *lora_flags(args.rank), env=env) as server:
            common = dict(request_timeout_s=600, logprob_convention="full")
            with SGLangEngine([server.url], model_config=lora_cfg, keep_adapters=2,
                              weights_dir=os.path.join(tmp, "adapter"), **common) as engine:
                engine.wait_healthy(timeout=120)
                times = timed_syncs(engine, adapters, "lora", args.repeats)
                nbytes = engine.last_sync_bytes
                write = median_write_s(lambda: peft_format.save_adapter(
                    os.path.join(tmp, "scratch_adapter"), lora_cfg,
                    lora.with_adapters(params, adapters[0])), args.repeats)
                last = engine.weight_sync.adapter_path(f"lora-{args.repeats - 1}")
                assert nbytes == dir_bytes(last), "the bytes counted are the files written"
                rows.append(row("adapter", args.shape, args.rank, nbytes, times, write))
            with SGLangEngine([server.url], model_config=cfg,
                              weights_dir=os.path.join(tmp, "full"), **common) as engine:
                engine.wait_healthy(timeout=120)
                times = timed_syncs(engine, merged, "full", args.repeats)
                nbytes = engine.last_sync_bytes
                write = median_write_s(lambda: hf.save(os.path.join(tmp, "scratch_full"), cfg,
                                                       merged[0]), args.repeats)
                rows.append(row("full", args.shape, "-", nbytes, times, write))
        print(f"\n{cfg.num_params():,} params; adapters of rank {args.rank} on "
              f"{list(lora_cfg.lora.targets)}: {lora.adapter_count(adapters[0]):,} params")
        print_table(["sync", "shape", "rank", "bytes/sync", "median ms", "range ms", "write ms",
                     "load avg"], rows)
        full_row, adapter_row = rows[1], rows[0]
        ratio = int(full_row[3].replace(",", "")) / int(adapter_row[3].replace(",", ""))
        speed = float(full_row[4]) / float(adapter_row[4])
        print(f"\nadapter sync: {ratio:.0f}x fewer bytes, {speed:.1f}x faster (median)")


if __name__ == "__main__":
    main()
