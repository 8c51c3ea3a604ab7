"""Load on `launch.serve_rollout`: generated tokens/s with 1, 8, 64... concurrent clients.

  python benchmarks/rollout_server.py --clients 1,8,64 --seconds 20

Starts the server (a random-weight model of --shape unless --model_path) in a subprocess, then for
each client count runs that many threads, each sending single-prompt `/generate` requests back
to back (a prompt of --prompt_tokens ids, max_new_tokens drawn from [--min_new, --max_new],
ignore_eos, temperature 1), first for a warm-up round (compiles), then for --seconds. Prints a
markdown row per client count: requests, errors, generated tokens/s, requests/s and the
latency percentiles, and the CPU the load generator itself used (on a small machine it
competes with the server for the same cores). `--repo DIR` serves from another checkout (e.g. `git worktree add
/tmp/before <commit>`) to compare before and after on the same machine.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import numpy as np

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(repo: str, model_path: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=repo, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    proc = subprocess.Popen([sys.executable, "-m", "launch.serve_rollout", "--model_path",
                             model_path, "--port", str(port), "--skip_tokenizer_init", *extra],
                            cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not answer /health within 300 s")


def run_clients(url: str, clients: int, seconds: float, args, seed: int) -> dict:
    """`clients` threads sending requests back to back for `seconds`."""
    tokens, latencies, errors = [0] * clients, [[] for _ in range(clients)], [0] * clients
    stop_at = time.perf_counter() + seconds

    def client(i: int):
        rng = random.Random(seed * 1000 + i)
        with httpx.Client(timeout=600) as http:
            while time.perf_counter() < stop_at:
                body = {"input_ids": [rng.randrange(3, 300) for _ in range(args.prompt_tokens)],
                        "sampling_params": {"max_new_tokens": rng.randint(args.min_new,
                                                                          args.max_new),
                                            "temperature": 1.0, "ignore_eos": True}}
                start = time.perf_counter()
                try:
                    reply = http.post(url + "/generate", json=body)
                    reply.raise_for_status()
                    tokens[i] += reply.json()["meta_info"]["completion_tokens"]
                    latencies[i].append(time.perf_counter() - start)
                except (httpx.HTTPError, KeyError, ValueError):
                    errors[i] += 1

    start, cpu = time.perf_counter(), time.process_time()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start  # includes the requests in flight at the deadline
    client_cpu = (time.process_time() - cpu) / wall  # the load generator's share of the cores
    lat = np.array([x for per in latencies for x in per] or [float("nan")])
    return dict(clients=clients, requests=int(sum(len(x) for x in latencies)),
                errors=sum(errors), tok_s=sum(tokens) / wall,
                req_s=sum(len(x) for x in latencies) / wall, p50=float(np.percentile(lat, 50)),
                p95=float(np.percentile(lat, 95)), client_cpu=client_cpu)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", default="1,8,64")
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--warmup_seconds", type=float, default=8)
    parser.add_argument("--prompt_tokens", type=int, default=16)
    parser.add_argument("--min_new", type=int, default=32)
    parser.add_argument("--max_new", type=int, default=128)
    parser.add_argument("--model_path", default="")
    parser.add_argument("--shape", default="rl_step", help="benchmarks/common.py SHAPES "
                        "entry of the random model (rl_step: 3.7M params)")
    parser.add_argument("--repo", default=HERE, help="checkout whose launch.serve_rollout runs")
    parser.add_argument("--label", default="", help="first column of the rows")
    parser.add_argument("server_flags", nargs="*", help="after --: flags for the server")
    args = parser.parse_args()
    model_path = args.model_path
    if not model_path:
        sys.path.insert(0, HERE)
        from benchmarks.common import SHAPES
        from rl_tpu.models import tiny
        model_path = tempfile.mkdtemp(prefix="rl_tpu_bench_model_")
        shape = {k: v for k, v in SHAPES[args.shape].items() if k != "arch"}
        tiny.write_tiny_model(model_path, "qwen2", seed=0, overwrite=True, **shape)
    proc, url = start_server(os.path.abspath(args.repo), model_path, args.server_flags)
    try:
        print("| server | clients | requests | errors | generated tok/s | req/s | p50 s | p95 s "
              "| client CPU (cores) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for n in [int(c) for c in args.clients.split(",")]:
            run_clients(url, n, args.warmup_seconds, args, seed=1)  # compiles its shapes
            r = run_clients(url, n, args.seconds, args, seed=2)
            print(f"| {args.label or args.repo} | {n} | {r['requests']} | {r['errors']} | "
                  f"{r['tok_s']:,.0f} | {r['req_s']:.2f} | {r['p50']:.2f} | {r['p95']:.2f} | "
                  f"{r['client_cpu']:.2f} |",
                  flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
