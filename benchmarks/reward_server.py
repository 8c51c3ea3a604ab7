"""Load on `launch.serve_reward`: sequences scored/s and latency with 1, 8 and 64 clients.

  python benchmarks/reward_server.py --clients 1,8,64 --seconds 8 --repeats 3

Starts the server in a subprocess of its own (a random reward model of --shape, a `score`
head on a random trunk, unless --model_path) and, for each client count, runs that many
threads, each sending `POST /score` requests of --sequences_per_request random token
sequences (lengths drawn from [--min_len, --max_len]) back to back: a warm-up round first
(its programs compiled, its connections open), then --repeats rounds of --seconds. A row is
the median over the rounds of: sequences scored/s, the requests' p50 and p95 latency, and
the sequences per device call the server made (its /load: how far the scoring thread
coalesced the clients' requests); errors (a non-200, a reply without one row a sequence, a
transport error) are summed over the rounds and must be 0. The 1-minute load average is read
beside each row: the server and the load generator share the machine's cores.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import numpy as np

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_model(shape: str) -> str:
    """A random reward model of `shape` (benchmarks/common.py) in a fresh directory."""
    sys.path.insert(0, HERE)
    from benchmarks.common import model_config
    from rl_tpu.models import reward_model as rm
    from rl_tpu.models import tiny

    cfg = model_config(shape, max_position_embeddings=2048)
    params = rm.reward_params_from(tiny.random_params(cfg, seed=0), cfg, 1, stddev=0.02)
    path = tempfile.mkdtemp(prefix="rl_tpu_bench_reward_")
    rm.save(path, cfg, params, rm.RewardHead(1, 0))
    return path


def start_server(repo: str, model_path: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, PYTHONPATH=repo, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    proc = subprocess.Popen([sys.executable, "-m", "launch.serve_reward", "--model_path",
                             model_path, "--port", "0", "--skip_tokenizer_init", *extra],
                            cwd=repo, env=env, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:  # the warm-up line, then the one naming the url
        if " at http://" in line:
            return proc, line.strip().rsplit(" at ", 1)[1]
    proc.wait()
    raise SystemExit(f"the reward server exited ({proc.returncode}) before listening")


def run_clients(url: str, clients: int, seconds: float, args, seed: int) -> dict:
    """`clients` threads sending /score requests back to back for `seconds`."""
    scored, latencies, errors = [0] * clients, [[] for _ in range(clients)], [0] * clients
    stop_at = time.perf_counter() + seconds

    def client(i: int):
        rng = random.Random(seed * 1000 + i)
        with httpx.Client(timeout=600) as http:
            while time.perf_counter() < stop_at:
                seqs = [[rng.randrange(3, args.vocab) for _ in range(
                    rng.randint(args.min_len, args.max_len))]
                        for _ in range(args.sequences_per_request)]
                start = time.perf_counter()
                try:
                    reply = http.post(url + "/score", json={"input_ids": seqs})
                    rows = reply.json()["scores"] if reply.status_code == 200 else None
                    if rows is None or len(rows) != len(seqs):
                        errors[i] += 1
                        continue
                    scored[i] += len(rows)
                    latencies[i].append(time.perf_counter() - start)
                except (httpx.HTTPError, KeyError, ValueError):
                    errors[i] += 1

    before = httpx.get(url + "/load").json()
    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start  # includes the requests in flight at the deadline
    after = httpx.get(url + "/load").json()
    batches = max(after["batches"] - before["batches"], 1)
    lat = np.array([x for per in latencies for x in per] or [float("nan")])
    return dict(seq_s=sum(scored) / wall, p50=float(np.percentile(lat, 50)),
                p95=float(np.percentile(lat, 95)), errors=sum(errors),
                per_call=(after["sequences_scored"] - before["sequences_scored"]) / batches)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", default="1,8,64")
    parser.add_argument("--seconds", type=float, default=8)
    parser.add_argument("--warmup_seconds", type=float, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sequences_per_request", type=int, default=1)
    parser.add_argument("--min_len", type=int, default=32)
    parser.add_argument("--max_len", type=int, default=256)
    parser.add_argument("--model_path", default="")
    parser.add_argument("--shape", default="rl_step", help="benchmarks/common.py SHAPES entry "
                        "of the random reward model's trunk (rl_step: 3.7M params)")
    parser.add_argument("--repo", default=HERE, help="checkout whose launch.serve_reward runs")
    parser.add_argument("server_flags", nargs="*", help="after --: flags for the server")
    args = parser.parse_args()
    model_path = args.model_path or write_model(args.shape)
    proc, url = start_server(os.path.abspath(args.repo), model_path, args.server_flags)
    try:
        args.vocab = httpx.get(url + "/get_model_info").json()["vocab_size"]
        print("| clients | sequences/s | p50 s | p95 s | sequences a device call | errors "
              "| load average |")
        print("|---|---|---|---|---|---|---|")
        for n in [int(c) for c in args.clients.split(",")]:
            run_clients(url, n, args.warmup_seconds, args, seed=0)
            rounds = [run_clients(url, n, args.seconds, args, seed=r + 1)
                      for r in range(args.repeats)]
            med = {k: float(np.median([r[k] for r in rounds]))
                   for k in ("seq_s", "p50", "p95", "per_call")}
            print(f"| {n} | {med['seq_s']:,.0f} | {med['p50']:.3f} | {med['p95']:.3f} | "
                  f"{med['per_call']:.1f} | {sum(r['errors'] for r in rounds)} | "
                  f"{os.getloadavg()[0]:.1f} |", flush=True)
    finally:
        proc.terminate()  # SIGTERM: uvicorn finishes what is in flight, then exits
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
