"""Load on `launch.serve_rollout` (and SGLang's CPU server beside it): generated tokens/s with
1, 8, 64... concurrent clients, or calls of B prompts.

  python benchmarks/rollout_server.py --clients 1,8,64 --seconds 20
  python benchmarks/rollout_server.py --model_path $(python -m launch.get_model \
      smollm2-135m-instruct) --servers rl_tpu,sglang --batches 1,8,32 --prompt_tokens 64 \
      --min_new 128 --max_new 128 -- --max_batch=32

Starts the server (a random-weight model of --shape unless --model_path) in a subprocess, then for
each client count runs that many threads, each sending single-prompt `/generate` requests back
to back (a prompt of --prompt_tokens ids, max_new_tokens drawn from [--min_new, --max_new],
ignore_eos, temperature 1), first for a warm-up round (compiles), then for --seconds. Prints a
markdown row per client count: requests, errors, generated tokens/s, requests/s and the
latency percentiles, and the CPU the load generator itself used (on a small machine it
competes with the server for the same cores). `--repo DIR` serves from another checkout (e.g. `git worktree add
/tmp/before <commit>`) to compare before and after on the same machine.

--batches B1,B2,...: instead of clients, one client sends calls of B prompts in one `/generate`
request (input_ids [B, prompt_tokens], max_new_tokens --max_new, ignore_eos, --temperature),
as a trainer's rollout does and as benchmarks/sampler.py times the embedded sampler:
--warmup_calls untimed calls, then --calls timed ones, every call with prompts of its own
(seeded by batch and call, the same on every server); tok/s is B x new tokens over the median
call. --servers rl_tpu,sglang runs the same requests against each server in turn, each in its
own processes and alone on the machine: rl_tpu's `launch.serve_rollout` (its flags after --)
and real SGLang 0.5.23 on CPU (tests/rollout/sglang_server.py's venv, stand-in sgl_kernel and
CPU flags, fp32, --skip-tokenizer-init; --sglang_flags adds flags), SGLang's torch with
OMP_NUM_THREADS = the cores and OMP_WAIT_POLICY=PASSIVE, as the PyTorch side of every
head-to-head here (benchmarks/side_process.py). Every row has the 1-minute load average read
after it.
"""

from __future__ import annotations

import argparse
import json
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
    log = tempfile.TemporaryFile()  # not a pipe: a chatty server would fill it and block
    proc = subprocess.Popen([sys.executable, "-m", "launch.serve_rollout", "--model_path",
                             model_path, "--port", str(port), "--skip_tokenizer_init", *extra],
                            cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 900  # a real model's warm-up compiles for minutes on a CPU
    while time.time() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise SystemExit(f"the server exited: {log.read().decode()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not answer /health within 900 s")


def start_sglang(model_path: str, extra: list[str]):
    """Real SGLang on CPU (tests/rollout/sglang_server.py) with fair threads; the server."""
    sys.path.insert(0, os.path.join(HERE, "tests", "rollout"))
    from sglang_server import start_sglang_server

    sys.path.insert(0, HERE)
    from benchmarks import side_process

    env = {k: v for k, v in side_process.side_env("torch").items()
           if k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    return start_sglang_server(model_path, "--skip-tokenizer-init", *extra, env=env)


def run_calls(url: str, batch: int, args, calls: int, first: int) -> list[float]:
    """Seconds of each of `calls` /generate calls of `batch` prompts (call k's prompts seeded
    by (batch, first + k)), each checked for batch x max_new generated tokens."""
    times = []
    with httpx.Client(timeout=3600) as http:
        for k in range(first, first + calls):
            rng = np.random.RandomState([batch, k])
            ids = rng.randint(3, args.vocab, (batch, args.prompt_tokens)).tolist()
            body = {"input_ids": ids, "sampling_params": {
                "max_new_tokens": args.max_new, "temperature": args.temperature,
                "ignore_eos": True}}
            start = time.perf_counter()
            reply = http.post(url + "/generate", json=body)
            seconds = time.perf_counter() - start
            reply.raise_for_status()
            out = reply.json()
            out = out if isinstance(out, list) else [out]
            got = [o["meta_info"]["completion_tokens"] for o in out]
            if got != [args.max_new] * batch:
                raise SystemExit(f"a call of {batch} prompts generated {got} tokens, not "
                                 f"{args.max_new} each")
            times.append(seconds)
    return times


def run_clients(url: str, clients: int, seconds: float, args, seed: int) -> dict:
    """`clients` threads sending requests back to back for `seconds`."""
    tokens, latencies, errors = [0] * clients, [[] for _ in range(clients)], [0] * clients
    stop_at = time.perf_counter() + seconds

    def client(i: int):
        rng = random.Random(seed * 1000 + i)
        with httpx.Client(timeout=600) as http:
            while time.perf_counter() < stop_at:
                body = {"input_ids": [rng.randrange(3, args.vocab)
                                      for _ in range(args.prompt_tokens)],
                        "sampling_params": {"max_new_tokens": rng.randint(args.min_new,
                                                                          args.max_new),
                                            "temperature": args.temperature,
                                            "ignore_eos": True}}
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
    parser.add_argument("--batches", default="", help="calls of B prompts instead of clients")
    parser.add_argument("--warmup_calls", type=int, default=1)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--prompt_tokens", type=int, default=16)
    parser.add_argument("--min_new", type=int, default=32)
    parser.add_argument("--max_new", type=int, default=128)
    parser.add_argument("--model_path", default="")
    parser.add_argument("--shape", default="rl_step", help="benchmarks/common.py SHAPES "
                        "entry of the random model (rl_step: 3.7M params)")
    parser.add_argument("--servers", default="rl_tpu", help="rl_tpu, sglang or both, in turn")
    parser.add_argument("--sglang_flags", default="", help="more SGLang flags, space-separated")
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
    with open(os.path.join(model_path, "config.json")) as f:
        args.vocab = json.load(f)["vocab_size"]
    for name in args.servers.split(","):
        if name == "sglang":
            server = start_sglang(model_path, args.sglang_flags.split())
            url, stop, label = server.url, server.stop, "SGLang 0.5.23 (CPU, torch_native)"
        elif name == "rl_tpu":
            proc, url = start_server(os.path.abspath(args.repo), model_path, args.server_flags)
            label = args.label or ("rl_tpu launch.serve_rollout " + " ".join(args.server_flags))

            def stop(proc=proc):
                proc.terminate()
                proc.wait(timeout=30)
        else:
            raise SystemExit(f"--servers: {name!r} is neither rl_tpu nor sglang")
        try:
            if args.batches:
                batch_rows(url, label, args)
            else:
                client_rows(url, label, args)
        finally:
            stop()


def batch_rows(url: str, label: str, args) -> None:
    print("| server | batch | prompt | new tokens | median call s | generated tok/s | "
          "calls | load average |")
    print("|---|---|---|---|---|---|---|---|")
    for b in [int(x) for x in args.batches.split(",")]:
        run_calls(url, b, args, args.warmup_calls, first=0)  # compiles its shapes
        times = run_calls(url, b, args, args.calls, first=args.warmup_calls)
        med = float(np.median(times))
        print(f"| {label} | {b} | {args.prompt_tokens} | {args.max_new} | {med:.2f} | "
              f"{b * args.max_new / med:,.1f} | {args.warmup_calls} + {args.calls} | "
              f"{os.getloadavg()[0]:.1f} |", flush=True)


def client_rows(url: str, label: str, args) -> None:
    print("| server | clients | requests | errors | generated tok/s | req/s | p50 s | p95 s "
          "| client CPU (cores) | load average |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in [int(c) for c in args.clients.split(",")]:
        run_clients(url, n, args.warmup_seconds, args, seed=1)  # compiles its shapes
        r = run_clients(url, n, args.seconds, args, seed=2)
        print(f"| {label} | {n} | {r['requests']} | {r['errors']} | "
              f"{r['tok_s']:,.0f} | {r['req_s']:.2f} | {r['p50']:.2f} | {r['p95']:.2f} | "
              f"{r['client_cpu']:.2f} | {os.getloadavg()[0]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
