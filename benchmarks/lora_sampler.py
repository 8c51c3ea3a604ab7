"""The embedded sampler with a LoRA policy: merged kernels against the low-rank path in
decode, beside the same model without adapters (rollout/adapter_weights.py), and a serving
sampler holding several adapters at once (rollout/adapter_slots.py).

    python benchmarks/lora_sampler.py --shape peer --rank 8 --batches 8,32,128
    python benchmarks/lora_sampler.py --shape qwen2.5-0.5b --dtype bfloat16 --rank 16 \\
        --batches 64,256 --new_tokens 256          # on an accelerator

For each mode (`plain`: no adapters, a full weight copy per update; `merge`: adapters copied
and merged into the sampler's own kernels; `lowrank`: adapters copied, applied in prefill and
decode; `slots`: --slots adapters loaded by name as rl_tpu's rollout server holds them, each
batch's rows spread over them, an update = unloading one and loading a PEFT dir) in a process
of its own, rounds interleaved (plain, merge, lowrank, lowrank, merge,
...): generated tokens/s at each batch (fresh prompts every call, temperature 1, every row
exactly --new_tokens; median of --calls timed calls after one warm-up call), the seconds of a
weight update (median of 5, after one), the bytes it copies, and the sampler's weight bytes.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

flags.DEFINE_string("shape", "peer", "benchmarks/common.py SHAPES name or a model preset.")
flags.DEFINE_string("dtype", "float32", "params and compute dtype (the base's).")
flags.DEFINE_integer("rank", 8, "LoRA rank (all seven projections).")
flags.DEFINE_string("batches", "8,32,128", "rows per generate call.")
flags.DEFINE_integer("new_tokens", 64, "tokens generated per row.")
flags.DEFINE_integer("prompt_len", 32, "prompt ids per row.")
flags.DEFINE_integer("calls", 3, "timed calls per batch.")
flags.DEFINE_integer("rounds", 2, "processes per mode, interleaved.")
flags.DEFINE_integer("slots", 4, "Adapters the `slots` mode holds, rows spread over them.")
flags.DEFINE_string("modes", "plain,merge,lowrank,slots", "Modes compared.")
flags.DEFINE_string("mode", "", "Internal: run one mode (plain | merge | lowrank | slots).")
flags.DEFINE_string("result", "", "Internal: where the mode's process writes its result.")
FLAGS = flags.FLAGS


def run_mode(mode: str) -> dict:
    import flax.linen as nn
    import jax
    import numpy as np

    from benchmarks.common import model_config
    from rl_tpu.core.engine import GenerateRequest, SamplingParams
    from rl_tpu.models import lora, tiny
    from rl_tpu.models.transformer import Transformer
    from rl_tpu.rollout.sampler import JaxSampler

    cfg = model_config(FLAGS.shape, dtype=FLAGS.dtype, param_dtype=FLAGS.dtype)
    params = tiny.random_params(cfg, scale=0.1)
    if mode != "plain":  # the sampler runs the adapters as their LoraConfig says
        sampler_mode = mode if mode in lora.SAMPLER_MODES else "merge"
        cfg = cfg.replace(lora=lora.LoraConfig(rank=FLAGS.rank, alpha=2.0 * FLAGS.rank,
                                               sampler=sampler_mode))
        tokens = np.zeros((1, 1), np.int32)
        adapters = lora.adapters(nn.meta.unbox(Transformer(cfg).init(jax.random.key(0),
                                                                     tokens))["params"])
        # B != 0: the adapters change the model, as trained ones do
        adapters = jax.tree_util.tree_map_with_path(
            lambda kp, x: 0.01 * jax.random.normal(jax.random.key(1), x.shape)
            if kp[-1].key == "lora_b" else x, adapters)
        params = lora.with_adapters(params, adapters)
    batches = [int(b) for b in FLAGS.batches.split(",")]
    if mode == "slots":
        sampler, adapter_dir, names = _slots_sampler(cfg, params, max(batches))
        rows_slots = [sampler.adapter_slots.acquire(name) for name in names]
    else:
        sampler = JaxSampler(cfg, params, max_batch=max(batches))
        rows_slots = [0]
    held = sampler.stats()["weight_bytes"]

    tokens_per_s = {}
    for b in batches:
        times = []
        for k in range(1 + FLAGS.calls):
            prompts = np.random.RandomState([b, k, os.getpid()]).randint(
                3, cfg.vocab_size, (b, FLAGS.prompt_len))
            requests = [GenerateRequest(p, SamplingParams(
                max_new_tokens=FLAGS.new_tokens, temperature=1.0, ignore_eos=True, seed=i),
                lora_slot=rows_slots[i % len(rows_slots)])
                for i, p in enumerate(prompts.tolist())]
            start = time.perf_counter()
            sampler.generate(requests)
            times.append(time.perf_counter() - start)
        tokens_per_s[b] = b * FLAGS.new_tokens / statistics.median(times[1:])

    update = params if mode == "plain" else lora.adapters(params)
    seconds = []
    if mode == "slots":
        for slot in rows_slots:
            sampler.adapter_slots.release(slot)
    for k in range(6):
        start = time.perf_counter()
        if mode == "slots":  # the oldest out, a new version in (weight_sync's order reversed)
            sampler.adapter_slots.unload(names[k])
            names.append(f"new{k}")
            sampler.load_adapter(names[-1], adapter_dir)
        else:
            sampler.update_weights(update, str(k))
        jax.block_until_ready(sampler.weights()[0])
        seconds.append(time.perf_counter() - start)
    moved = (sum(os.path.getsize(os.path.join(adapter_dir, f)) for f in os.listdir(adapter_dir))
             if mode == "slots" else sampler.stats()["last_sync_bytes"])
    return dict(tokens_per_s=tokens_per_s, update_s=statistics.median(seconds[1:]),
                update_bytes=moved, held_bytes=held, load=os.getloadavg()[0])


def _slots_sampler(cfg, params, max_batch: int):
    """(a serving sampler holding FLAGS.slots copies of these adapters by name, the PEFT dir
    they were loaded from, their names)."""
    from rl_tpu.models import lora, peft_format
    from rl_tpu.rollout.adapter_slots import slot_config
    from rl_tpu.rollout.sampler import JaxSampler

    adapter_dir = tempfile.mkdtemp(prefix="lora_sampler_")
    peft_format.save_adapter(adapter_dir, cfg, params)
    sampler = JaxSampler(slot_config(cfg.replace(lora=None), FLAGS.rank, FLAGS.slots),
                         lora.without_adapters(params), max_batch=max_batch)
    names = [f"v{k}" for k in range(FLAGS.slots)]
    for name in names:
        sampler.load_adapter(name, adapter_dir)
    return sampler, adapter_dir, names


def main(argv):
    del argv
    if FLAGS.mode:
        with open(FLAGS.result, "w") as f:
            json.dump(run_mode(FLAGS.mode), f)
        return
    modes = tuple(FLAGS.modes.split(","))
    results = {m: [] for m in modes}
    for r in range(FLAGS.rounds):
        for mode in modes if r % 2 == 0 else tuple(reversed(modes)):
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                args = [a for a in sys.argv[1:] if not a.startswith(("--mode", "--result"))]
                subprocess.run([sys.executable, __file__, *args, f"--mode={mode}",
                                f"--result={out.name}"], check=True)
                results[mode].append(json.load(open(out.name)))
    batches = [int(b) for b in FLAGS.batches.split(",")]
    print(f"shape {FLAGS.shape}, {FLAGS.dtype}, rank {FLAGS.rank}, {FLAGS.new_tokens} new "
          f"tokens, {FLAGS.rounds} rounds")
    print("| mode | " + " | ".join(f"tok/s at {b}" for b in batches)
          + " | update s | update MB | sampler weights MB | load |")
    print("|---|" + "---|" * len(batches) + "---|---|---|---|")
    for mode, runs in results.items():
        med = lambda f: statistics.median(f(x) for x in runs)  # noqa: E731
        cells = [f"{med(lambda x: x['tokens_per_s'][str(b)]):,.0f}" for b in batches]
        print(f"| {mode} | " + " | ".join(cells)
              + f" | {med(lambda x: x['update_s']):.4f} | {runs[0]['update_bytes'] / 2**20:.2f}"
              f" | {runs[0]['held_bytes'] / 2**20:.1f} | "
              f"{min(x['load'] for x in runs):.1f}-{max(x['load'] for x in runs):.1f} |")


if __name__ == "__main__":
    app.run(main)
