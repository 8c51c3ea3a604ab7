"""Env server load: steps/s with 1, 16 and 256 episodes in flight at once, and the errors seen.

Starts `python -m launch.serve_env --env <env>` in a subprocess (from `--root`, so an older
checkout's server can be measured with this same load) and drives it from one asyncio loop
over httpx: each of the N concurrent episodes creates an instance, then plays episodes on it
(AgentGym's `/reset {"id", "data_idx"}`, then up to `--horizon` `/step`s of a random action
the observation lists) until the row's time is up, and closes it. An episode is one
connection's worth of work at a time, as with `RemoteEnv`: a request waits for the previous
one's reply. Every reply is checked: a non-200 status, an `{"error"}` body or a transport
error counts as an error.

    python benchmarks/env_server.py                      # babyai, 1/16/256 episodes, 15 s each
    python benchmarks/env_server.py --root /tmp/old      # the same load on another checkout
    python benchmarks/env_server.py --root /tmp/old,. --repeats 2   # both, taking turns

Rows: steps/s (steps only; the resets between episodes are counted apart), step latency
median and 99th percentile, errors, and the CPU the server and the load generator used (in
cores): steps per server CPU-second is what a server costs per step, whatever else runs on
the machine. Load generator and server share the machine's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import subprocess
import sys
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_LISTED = re.compile(r"Available actions: (\[.*\])")


def start_server(root: str, env_name: str, max_instances: int, extra: list[str]
                 ) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.serve_env", "--env", env_name, "--port", "0",
         "--max_instances", str(max_instances), *extra],
        cwd=root, stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=root))
    line = proc.stdout.readline()
    if " at http://" not in line:
        proc.kill()
        raise SystemExit(f"env server for {env_name} did not start (got {line!r})")
    return proc, line.strip().rsplit(" at ", 1)[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pick_action(observation: str, rng: random.Random) -> str:
    """A random action among those BabyAI lists (AgentGym's wording); "inventory" otherwise
    (TextCraft's always-valid command), so any env gets a stream of well-formed steps."""
    listed = _LISTED.search(observation)
    if listed:
        return rng.choice([a for a in json.loads(listed.group(1)) if "check" not in a])
    return "inventory"


class Stats:
    def __init__(self):
        self.steps = self.resets = 0
        self.errors: list[str] = []
        self.latencies: list[float] = []


async def call(client: httpx.AsyncClient, stats: Stats, path: str, body: dict):
    """One POST; None (and an error counted) unless it is a 200 without an `error` key."""
    try:
        response = await client.post(path, json=body)
        payload = response.json()
    except (httpx.HTTPError, ValueError) as e:
        stats.errors.append(f"{path}: {type(e).__name__}: {e}")
        return None
    if response.status_code != 200 or (isinstance(payload, dict) and "error" in payload):
        stats.errors.append(f"{path}: HTTP {response.status_code}: {str(payload)[:200]}")
        return None
    return payload


async def episodes(client: httpx.AsyncClient, stats: Stats, worker: int, horizon: int,
                   ready: asyncio.Event, started: list[int], concurrency: int,
                   counting: list[bool], deadline: list[float]) -> None:
    rng = random.Random(worker)
    created = await call(client, stats, "/create", {})
    if created is None:
        return
    env_id, episode = created["id"], 0
    while not counting[0] or time.perf_counter() < deadline[0]:
        # One level per worker (its grid cached by the env), a new seed each episode: the
        # load is the server's and the steps', not minigrid building levels.
        item = worker % 40 + 40 * (episode % 100)
        episode += 1
        reply = await call(client, stats, "/reset", {"id": env_id, "data_idx": item})
        if reply is None:
            return
        if episode == 1:
            started[0] += 1
            if started[0] == concurrency:
                ready.set()
        stats.resets += counting[0]
        observation = reply["observation"]
        for _ in range(horizon):
            if counting[0] and time.perf_counter() >= deadline[0]:
                break
            start = time.perf_counter()
            reply = await call(client, stats, "/step",
                               {"id": env_id, "action": pick_action(observation, rng)})
            if reply is None:
                return
            if counting[0]:
                stats.steps += 1
                stats.latencies.append(time.perf_counter() - start)
            observation = reply["observation"]
            if reply["done"]:
                break
    await call(client, stats, "/close", {"id": env_id})


async def measure(url: str, server_pid: int, concurrency: int, seconds: float, warmup: float,
                  horizon: int) -> dict:
    stats = Stats()
    # One client (one keep-alive connection) per episode, as RemoteEnv has: one pool of 256
    # connections costs httpx more CPU per request than the server spends (measured: the
    # load generator, not the server, was then the bottleneck).
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(
            httpx.AsyncClient(base_url=url, timeout=120, limits=limits))
            for _ in range(concurrency)]
        # Counting starts `warmup` seconds after every episode has started (256 creates and
        # first resets take a while), and lasts `seconds`.
        ready, started, counting, deadline = asyncio.Event(), [0], [False], [0.0]
        tasks = [asyncio.create_task(episodes(clients[w], stats, w, horizon, ready, started,
                                              concurrency, counting, deadline))
                 for w in range(concurrency)]
        await ready.wait()
        await asyncio.sleep(warmup)
        start = time.perf_counter()
        cpu = (cpu_seconds(os.getpid()), cpu_seconds(server_pid))
        deadline[0] = start + seconds
        counting[0] = True
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
        client_cpu = cpu_seconds(os.getpid()) - cpu[0]
        server_cpu = cpu_seconds(server_pid) - cpu[1]
    lat = sorted(stats.latencies) or [float("nan")]
    return {"concurrency": concurrency, "steps": stats.steps, "resets": stats.resets,
            "seconds": elapsed, "steps_per_s": stats.steps / elapsed,
            "p50_ms": 1e3 * lat[len(lat) // 2], "p99_ms": 1e3 * lat[int(len(lat) * 0.99)],
            "errors": len(stats.errors), "first_error": stats.errors[0] if stats.errors else "",
            "server_cpu": server_cpu / elapsed, "client_cpu": client_cpu / elapsed}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--env", default="babyai")
    parser.add_argument("--root", default=ROOT, help="checkout whose launch.serve_env to run; "
                        "several, comma-separated, are measured in turns, row by row")
    parser.add_argument("--concurrency", default="1,16,256")
    parser.add_argument("--seconds", type=float, default=15.0, help="measured time per row")
    parser.add_argument("--warmup", type=float, default=3.0, help="unmeasured seconds per row "
                        "after every episode has started")
    parser.add_argument("--repeats", type=int, default=1, help="rows per server and level")
    parser.add_argument("--horizon", type=int, default=20, help="steps before a reset "
                        "(AgentGym-RL's BabyAI turn limit)")
    parser.add_argument("--server_args", default="", help="more flags for launch.serve_env, "
                        "e.g. '--threads 4'")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    roots = [os.path.abspath(r) for r in args.root.split(",")]
    servers = []
    rows = []
    try:
        for root in roots:
            servers.append(start_server(root, args.env, max(levels) + 8,
                                        args.server_args.split()))
        # Servers take turns row by row, so a machine whose load changes (a shared one) weighs
        # on each alike; the steps per server CPU-second do not depend on that load at all.
        for concurrency in levels:
            for _ in range(args.repeats):
                for root, (proc, url) in zip(roots, servers):
                    row = asyncio.run(measure(url, proc.pid, concurrency, args.seconds,
                                              args.warmup, args.horizon))
                    rows.append(dict(row, root=root))
    finally:
        for proc, _ in servers:
            proc.terminate()
            proc.wait()
    print(f"env {args.env} {args.server_args}")
    print("| server | episodes in flight | steps/s | step p50 ms | step p99 ms | steps | resets "
          "| errors | server CPU | steps per server CPU-s | load CPU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        per_cpu = r["steps_per_s"] / r["server_cpu"] if r["server_cpu"] else float("nan")
        print(f"| {r['root']} | {r['concurrency']} | {r['steps_per_s']:.0f} | {r['p50_ms']:.1f} "
              f"| {r['p99_ms']:.1f} | {r['steps']} | {r['resets']} | {r['errors']} | "
              f"{r['server_cpu']:.2f} | {per_cpu:.0f} | {r['client_cpu']:.2f} |")
    for r in rows:
        if r["errors"]:
            print(f"first error, {r['root']} at {r['concurrency']}: {r['first_error']}")


if __name__ == "__main__":
    main()
