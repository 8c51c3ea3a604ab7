"""rl_tpu's GRPO step beside its peers' (TRL's GRPOTrainer, Tunix's GRPOLearner), each in its
own environment and process, on the same random Qwen2, prompts, reward and batch.

    python benchmarks/peers.py --install        # venvs for TRL and Tunix (minutes, once)
    python benchmarks/peers.py                  # 3 interleaved rounds of every installed side
    python benchmarks/peers.py --rounds 1 --steps 2 --sides rl_tpu,trl

Every side: the same HF model dir (a random 3.67M-param Qwen2 that rl_tpu writes, so all load
the same weights), the same prompts (fresh random ones of exactly `--prompt` ids each step,
texts whose tokenization is exactly those ids, so the text-prompt trainers see them too), the
rule reward "fraction of even ids in the completion", GRPO with `--prompts` x `--samples`
completions of exactly `--completion` tokens, one policy update per step (one epoch, one
minibatch), lr 1e-6. The child scripts live in benchmarks/peers/; each prints one
`PEER_RESULT {json}` line with its first step (cold: compilation included) and the medians of
its steady steps, split into sample and update where the side exposes the split.

Rounds interleave the sides (rl_tpu, trl, tunix, rl_tpu warm cache, then again), so a load
change on a shared machine hits all of them alike. Threads: the torch side runs with
OMP_WAIT_POLICY=PASSIVE and torch.set_num_threads(all cores); the JAX sides with JAX's
defaults. rl_tpu's first step is measured with the persistent compilation cache off, and again
("rl_tpu warm cache") with a cache dir that a run before the rounds filled.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CHILDREN = os.path.join(ROOT, "benchmarks", "peers")
PEERS_HOME = os.path.expanduser(os.environ.get("RL_TPU_PEERS_HOME", "~/.cache/rl_tpu/peers"))
# What each peer venv installs. Torch comes as its CPU build (the CPU wheel index; a machine
# that cannot reach it takes a CPU wheel its pip already finds, e.g. in a local wheel dir).
PEER_PACKAGES = {"trl": ["trl==1.16.0", "torch"], "tunix": ["google-tunix==0.1.7"]}
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# The shape the issue measured: 4 layers, D 256, 4 heads of 64 on 2 kv heads, F 768, V 2048,
# tied embeddings, fp32 (benchmarks/common.py's "peer" shape where that exists).
PEER_SHAPE = dict(arch="qwen2", vocab_size=2048, hidden_size=256, intermediate_size=768,
                  num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, qkv_bias=True,
                  tie_word_embeddings=True)
SIDES = ("rl_tpu", "trl", "tunix", "rl_tpu_warm")


def venv_python(name: str) -> str:
    return os.path.join(PEERS_HOME, name, "bin", "python")


def install(names: list[str]) -> None:
    """python -m venv + pip install of each peer; the log goes to PEERS_HOME/<name>.install.log."""
    os.makedirs(PEERS_HOME, exist_ok=True)
    for name in names:
        venv = os.path.join(PEERS_HOME, name)
        log_path = os.path.join(PEERS_HOME, f"{name}.install.log")
        print(f"installing {name} into {venv} (log: {log_path})", flush=True)
        packages = list(PEER_PACKAGES[name])
        extra = []
        if "torch" in packages:
            packages[packages.index("torch")] = cpu_torch_requirement()
            # --retries 0: a machine without that index goes on to its other sources at once
            extra = ["--extra-index-url", TORCH_CPU_INDEX, "--retries", "0", "--timeout", "20"]
        with open(log_path, "w") as log:
            if not os.path.exists(venv_python(name)):
                subprocess.run([sys.executable, "-m", "venv", venv], check=True, stdout=log,
                               stderr=subprocess.STDOUT)
            result = subprocess.run([venv_python(name), "-m", "pip", "install", *extra,
                                     *packages], stdout=log, stderr=subprocess.STDOUT)
        if result.returncode:
            raise SystemExit(f"pip install {' '.join(packages)} into {venv} failed "
                             f"(exit {result.returncode}); see {log_path}")
        print(f"  {name}: {installed_version(name)}", flush=True)


def cpu_torch_requirement() -> str:
    """A torch pin that resolves to a CPU build: this interpreter's torch version when it is
    one (its wheel is findable here), else any torch from the CPU index."""
    try:
        import torch
    except ImportError:
        return "torch"
    return f"torch=={torch.__version__}" if "+cpu" in torch.__version__ else "torch"


def installed_version(name: str) -> str:
    package = {"trl": "trl", "tunix": "google-tunix"}[name]
    out = subprocess.run([venv_python(name), "-c", "from importlib.metadata import version; "
                          f"print(version({package!r}))"], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else f"not importable: {out.stderr[-200:]}"


def peer_shape() -> dict:
    try:
        from benchmarks.common import SHAPES
    except ImportError:
        return PEER_SHAPE
    return SHAPES.get("peer", PEER_SHAPE)


def write_model(path: str, seed: int) -> str:
    """The shared random model as an HF dir (config, safetensors, tokenizer), written once per
    seed; std 0.02 matrices (a training init)."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    from rl_tpu.models import tiny

    shape = {k: v for k, v in peer_shape().items() if k not in ("arch", "vocab_size")}
    tiny.write_tiny_model(path, "qwen2", vocab_size=peer_shape()["vocab_size"], seed=seed,
                          init_scale=0.04, overwrite=True, **shape)
    return path


def exact_prompts(tokenizer, n: int, length: int, rng, first_id: int = 3) -> list[dict]:
    """`n` random prompts of exactly `length` ids whose text tokenizes back to those ids: random
    ids (past the special ones) are decoded and re-encoded until the ids are a fixed point (a
    byte-level BPE merges random neighbours anew, so raw random ids rarely round-trip)."""
    prompts = []
    while len(prompts) < n:
        ids = [int(x) for x in rng.integers(first_id, len(tokenizer), length + 8)][:length]
        for _ in range(8):
            again = tokenizer(tokenizer.decode(ids), add_special_tokens=False)["input_ids"]
            if again == ids:
                prompts.append({"text": tokenizer.decode(ids), "ids": ids})
                break
            ids = (again + [int(x) for x in rng.integers(first_id, len(tokenizer), length)])
            ids = ids[:length]
    return prompts


def write_prompts(model_dir: str, path: str, steps: int, n: int, length: int, seed: int):
    import numpy as np
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        json.dump({"steps": [exact_prompts(tokenizer, n, length, rng) for _ in range(steps)]}, f)


def child_command(side: str, args, model_dir: str, prompts_file: str, cache_dir: str,
                  steps: int) -> tuple[list[str], dict]:
    common = ["--model_dir", model_dir, "--prompts_file", prompts_file, "--steps", str(steps),
              "--samples", str(args.samples), "--completion", str(args.completion),
              "--lr", str(args.lr)]
    env = dict(os.environ)
    if side in ("rl_tpu", "rl_tpu_warm"):
        cmd = [sys.executable, os.path.join(CHILDREN, "rl_tpu_grpo.py"), *common]
        if side == "rl_tpu_warm":
            cmd += ["--cache_dir", cache_dir]
        return cmd, env
    if side == "trl":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
        return [venv_python("trl"), os.path.join(CHILDREN, "trl_grpo.py"), *common,
                "--threads", str(os.cpu_count())], env
    return [venv_python("tunix"), os.path.join(CHILDREN, "tunix_grpo.py"), *common], env


def run_child(side: str, cmd: list[str], env: dict, log_path: str, timeout: float,
              completion: int) -> dict:
    """Runs one child; its result dict, or {"error": ...} with the tail of its log."""
    load = os.getloadavg()[0]
    start = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=log, text=True,
                                  timeout=timeout, cwd=ROOT)
        except subprocess.TimeoutExpired:
            return {"side": side, "error": f"timed out after {timeout:.0f} s", "load": load}
    lines = [x for x in proc.stdout.splitlines() if x.startswith("PEER_RESULT ")]
    if proc.returncode or not lines:
        with open(log_path) as f:
            tail = f.read()[-600:]
        return {"side": side, "error": f"exit {proc.returncode}: {tail}", "load": load}
    result = json.loads(lines[-1][len("PEER_RESULT "):])
    result.update(side=side, load=load, wall_s=time.perf_counter() - start)
    if result.get("completion_tokens") not in (None, [completion, completion]):
        return {"side": side, "load": load, "error": f"completions of {result['completion_tokens']}"
                f" tokens (min, max), not all {completion}: the sides would not be comparable"}
    return result


def available_sides(wanted: list[str]) -> list[str]:
    sides = []
    for side in wanted:
        if side in ("trl", "tunix") and not os.path.exists(venv_python(side)):
            print(f"({side}: not installed under {PEERS_HOME}; `--install` sets it up)")
            continue
        sides.append(side)
    return sides


def fmt(x, digits=2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def span(xs) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    return fmt(xs[0]) if len(xs) == 1 or max(xs) - min(xs) < 0.005 else \
        f"{min(xs):.2f}-{max(xs):.2f}"


def summary_rows(results: list[dict]) -> list[list[str]]:
    """One row per side: first step over the rounds (range), medians of the steady numbers, the
    steady step's ratio rl_tpu / side (above 1: rl_tpu slower), the 1-min load at the starts."""
    by_side: dict[str, list[dict]] = {}
    for r in results:
        by_side.setdefault(r["side"], []).append(r)
    ok = lambda side: [r for r in by_side.get(side, []) if "error" not in r]  # noqa: E731
    median = lambda rs, k: (statistics.median(r[k] for r in rs)  # noqa: E731
                            if rs and all(r.get(k) is not None for r in rs) else None)
    ours = median(ok("rl_tpu"), "steady_s")
    rows = []
    for side, runs in by_side.items():
        good = ok(side)
        loads = span([r["load"] for r in runs])
        if not good:
            rows.append([label(side), "-", "failed", "-", "-", "-", "-", loads])
            continue
        steady = median(good, "steady_s")
        ratio = fmt(ours / steady) if ours and steady and side != "rl_tpu" else "-"
        rows.append([label(side), good[0]["version"], span([r["first_s"] for r in good]),
                     fmt(steady), fmt(median(good, "sample_s")), fmt(median(good, "update_s")),
                     ratio, loads])
    return rows


def label(side: str) -> str:
    return {"rl_tpu_warm": "rl_tpu (warm compilation cache)"}.get(side, side)


def print_table(header, rows):
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(str(x) for x in row) + " |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--install", action="store_true",
                        help=f"create the peer venvs under {PEERS_HOME} and exit")
    parser.add_argument("--sides", default=",".join(SIDES),
                        help=f"comma-separated, of {', '.join(SIDES)} (run in this order)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="steady steps after the first")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--completion", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per child run")
    parser.add_argument("--keep", default="", help="keep the child logs in this dir")
    args = parser.parse_args()
    wanted = [s for s in args.sides.split(",") if s]
    unknown = sorted(set(wanted) - set(SIDES))
    if unknown:
        raise SystemExit(f"unknown --sides {unknown}; choose from {list(SIDES)}")
    if args.install:
        install([s for s in ("trl", "tunix") if s in wanted] or ["trl", "tunix"])
        return
    if args.rounds < 1 or args.steps < 1:
        raise SystemExit("--rounds and --steps must be >= 1 (the steady median needs a step)")
    sides = available_sides(wanted)

    model_dir = write_model(os.path.join(PEERS_HOME, f"model-seed{args.seed}"), args.seed)
    work = args.keep or tempfile.mkdtemp(prefix="rl_tpu_peers_")
    os.makedirs(work, exist_ok=True)
    prompts_file = os.path.join(work, "prompts.json")
    write_prompts(model_dir, prompts_file, args.steps + 1, args.prompts, args.prompt, args.seed)
    cache_dir = os.path.join(work, "jax_cache")
    if "rl_tpu_warm" in sides:  # fill the cache: one first step, compiled and written
        cmd, env = child_command("rl_tpu_warm", args, model_dir, prompts_file, cache_dir, 0)
        fill = run_child("rl_tpu_warm", cmd, env, os.path.join(work, "fill_cache.log"),
                         args.timeout, args.completion)
        if "error" in fill:
            print(f"(filling the compilation cache failed: {fill['error']})")

    print(f"GRPO step, {args.prompts} prompts x {args.samples} samples, prompt {args.prompt}, "
          f"completion {args.completion}, {args.steps} steady steps after the first, "
          f"{args.rounds} round(s), {os.cpu_count()} CPU cores; model {model_dir}")
    results = []
    for round_ in range(1, args.rounds + 1):
        for side in sides:
            cmd, env = child_command(side, args, model_dir, prompts_file, cache_dir, args.steps)
            r = run_child(side, cmd, env, os.path.join(work, f"{side}.round{round_}.log"),
                          args.timeout, args.completion)
            r["round"] = round_
            results.append(r)
            print(f"  round {round_} {side}: " + (r["error"][:300] if "error" in r else
                  f"first {r['first_s']:.2f} s, steady {fmt(r['steady_s'])} s (sample "
                  f"{fmt(r['sample_s'])}, update {fmt(r['update_s'])}), load {r['load']:.2f}"),
                  flush=True)
    with open(os.path.join(work, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print()
    print_table(["side", "version", "first step s", "steady step s (median)", "sample s",
                 "update s", "rl_tpu / side (steady)", "load avg (1 min)"],
                summary_rows(results))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
