"""The one line every run prints once its model is loaded, saying what it is about to do:

    run: recipe rl, algorithm grpo, model W/init_model (qwen2, 139.8K params), LoRA rank 8
    (16.4K trainable), engine jax sampler, env largest, devices 1 x cpu on 1 host, warm start
    4 SFT steps on 256 teacher demos

(one line on screen). A config read wrong (LoRA silently off, the wrong env, a warm start
that will or will not run) shows here before the first step compiles, rather than in the
results. Printed on process 0 only, and logged; `say` prints the other plain facts of a start
(a resume) the same way, on every process, since each host's log should hold its own.
"""

from __future__ import annotations

import logging

import jax
import ml_collections
import numpy as np

from rl_tpu.models import lora

log = logging.getLogger(__name__)


def say(line: str, chief_only: bool = False) -> None:
    """A plain line of information on stdout (a log file when redirected) and in the log:
    not a warning, nothing is wrong."""
    log.info(line)
    if not chief_only or jax.process_index() == 0:
        print(line, flush=True)


def algorithm(config: ml_collections.ConfigDict) -> str:
    """What optimises the policy: the RL algorithm of the recipes built on the RL loop, else
    what the recipe itself does."""
    recipe = config.recipe
    if recipe in ("rl", "selfplay", "rloop"):
        return config.algo.name
    if recipe == "dpo":
        return config.dpo.loss
    if recipe == "reward_model":
        return "bradley-terry"
    if recipe == "expert_iteration":
        return "filtered sft"
    return recipe  # sft


def short_count(n: int) -> str:
    """1234 -> '1.2K', 5e8 -> '500.0M'."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def engine(config: ml_collections.ConfigDict) -> str:
    r = config.rollout
    if r.engine != "sglang":
        return "jax sampler"
    servers = [u for u in r.urls.split(",") if u.strip()]
    router = f" via router {r.router_url}" if r.router_url else ""
    return f"sglang ({len(servers)} server{'s' if len(servers) != 1 else ''}{router})"


def devices() -> str:
    found, hosts = jax.devices(), jax.process_count()
    return (f"{len(found)} x {found[0].device_kind} on {hosts} "
            f"host{'s' if hosts != 1 else ''}")


def describe(config: ml_collections.ConfigDict, model_path: str, model_cfg, params,
             warm_start: str) -> str:
    """The run's summary line (module docstring). `params`: the policy as it trains (with its
    adapters, under LoRA); `warm_start`: what the SFT warm start will do, in words."""
    adapters = lora.adapter_count(params) if lora.is_on(model_cfg) else 0
    total = int(sum(np.prod(x.shape) for x in jax.tree.leaves(params))) - adapters
    if lora.is_on(model_cfg):
        tuning = f"LoRA rank {model_cfg.lora.rank} ({short_count(adapters)} trainable)"
    else:
        tuning = "full fine-tuning (LoRA off: model.lora.rank=0)"
    return (f"run: recipe {config.recipe}, algorithm {algorithm(config)}, model {model_path} "
            f"({model_cfg.arch}, {short_count(total)} params), {tuning}, engine {engine(config)}, "
            f"env {config.env.name}, devices {devices()}, warm start {warm_start}")


def warm_start_plan(config: ml_collections.ConfigDict, done: str = "") -> str:
    """What the SFT warm start will do: `done` when the run is past it (a resume says where
    it goes on), else sft.steps steps on the teacher's demonstrations or a chat file, or
    'none'."""
    if done:
        return done
    s = config.sft
    if s.steps <= 0:
        return "none (sft.steps=0)"
    data = s.data_path if s.data_path else f"{s.num_demos} teacher demos"
    return f"{s.steps} SFT steps on {data}"


def announce(config: ml_collections.ConfigDict, model_path: str, model_cfg, params,
             warm_start: str) -> str:
    """Prints (process 0) and logs the run's summary line; returns it."""
    line = describe(config, model_path, model_cfg, params, warm_start)
    say(line, chief_only=True)
    return line
