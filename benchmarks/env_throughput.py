"""Env steps per second, in-process and through the env server, for babyai and textcraft.

Random *valid* actions (well-formed commands; some still fail in the game, e.g. crafting
without the ingredients, which is the normal mix an agent produces). Episodes reset when done
or after `--horizon` steps; resets are included in the time. Three rows per env:

- in-process: `rl_tpu.core.env.make(env)` stepped directly;
- server, 1 client: one `RemoteEnv` against `python -m launch.serve_env` in a subprocess
  (loopback HTTP, one keep-alive connection): the per-request overhead;
- server, N clients: N threads, each with its own `RemoteEnv`, against the same server.

    python benchmarks/env_throughput.py
    python benchmarks/env_throughput.py --envs textcraft --steps 5000 --clients 8
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rl_tpu.core import env as env_lib  # noqa: E402
from rl_tpu.env_serving.remote import RemoteEnv  # noqa: E402


def random_actions(env_name: str, observation: str, rng: random.Random):
    """An endless stream of well-formed actions for the episode that `observation` starts;
    `send(observation)` gives the next one for the env's latest observation."""
    if env_name == "babyai":  # AgentGym's BabyAI lists the actions each observation allows
        while True:
            listed = re.search(r"Available actions: (\[.*\])", observation)
            observation = (yield "Action: " + rng.choice(
                json.loads(listed.group(1)) if listed else ["turn left"])) or observation
    # TextCraft: the listed crafting commands, "get" for their ingredients, and "inventory".
    crafts = [line for line in observation.splitlines() if line.startswith("craft ")]
    ingredients = sorted({part.split(" ", 1)[1] for line in crafts
                          for part in line.split(" using ", 1)[1].split(", ")})
    while True:
        roll = rng.random()
        if roll < 0.1:
            yield "Action: inventory"
        elif roll < 0.55 and ingredients:
            yield f"Action: get {rng.randint(1, 4)} {rng.choice(ingredients)}"
        else:
            yield "Action: " + rng.choice(crafts)


def run_steps(env: env_lib.Env, env_name: str, steps: int, horizon: int, seed: int) -> int:
    """Steps `env` `steps` times over eval tasks; returns the number of episodes started."""
    rng = random.Random(seed)
    tasks = env.tasks()
    size = tasks.size("eval")
    episodes, taken = 0, 0
    while taken < steps:
        observation = env.reset(tasks.get("eval", (seed * 7919 + episodes) % size))
        episodes += 1
        stream = random_actions(env_name, observation, rng)
        action = next(stream)
        for _ in range(min(horizon, steps - taken)):
            taken += 1
            result = env.step(action)
            if result.done:
                break
            action = stream.send(result.observation)
    return episodes


def start_server(env_name: str, max_instances: int):
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.serve_env", "--env", env_name, "--port", "0",
         "--max_instances", str(max_instances)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if " at http://" not in line:
        proc.kill()
        raise RuntimeError(f"env server for {env_name} did not start (got {line!r})")
    return proc, line.strip().rsplit(" at ", 1)[1]


def measure(make_env, env_name: str, steps: int, horizon: int, clients: int = 1):
    """(steps/s, episodes) over `clients` threads each taking `steps // clients` steps."""
    envs = [make_env() for _ in range(clients)]
    # Warm up (first reset imports/builds level generators, first request connects).
    for env in envs:
        run_steps(env, env_name, 5, horizon, seed=99)
    per_client = steps // clients
    episodes = [0] * clients

    def work(i):
        episodes[i] = run_steps(envs[i], env_name, per_client, horizon, seed=i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    for env in envs:
        env.close()
    return per_client * clients / elapsed, sum(episodes), elapsed


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--envs", default="babyai,textcraft")
    parser.add_argument("--steps", type=int, default=4000, help="steps per row")
    parser.add_argument("--horizon", type=int, default=30, help="steps before a forced reset")
    parser.add_argument("--clients", type=int, default=4, help="threads in the N-client row")
    args = parser.parse_args()

    rows = []
    for env_name in args.envs.split(","):
        rows.append((env_name, "in-process", 1,
                     *measure(lambda: env_lib.make(env_name), env_name, args.steps, args.horizon)))
        proc, url = start_server(env_name, max_instances=args.clients + 4)
        try:
            remote = lambda: RemoteEnv(url, env_name, timeout=30)  # noqa: E731
            for clients in (1, args.clients):
                rows.append((env_name, "server", clients,
                             *measure(remote, env_name, args.steps, args.horizon, clients)))
        finally:
            proc.terminate()
            proc.wait()

    header = f"{'env':<10} {'mode':<11} {'clients':>7} {'steps/s':>9} {'episodes':>8} {'seconds':>8}"
    print(header)
    print("-" * len(header))
    for env_name, mode, clients, rate, episodes, elapsed in rows:
        print(f"{env_name:<10} {mode:<11} {clients:>7} {rate:>9.0f} {episodes:>8} {elapsed:>8.2f}")


if __name__ == "__main__":
    main()
