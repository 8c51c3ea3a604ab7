"""Evaluate a policy on an env's eval split: from a run's workdir or from an HF directory.

    python -m launch.eval --config configs/quickstart.py --workdir /tmp/quickstart
    python -m launch.eval --config configs/quickstart.py --model_path /tmp/quickstart/final_hf

With a workdir, the policy is the latest checkpoint's (restored into the same state layout the
trainer saved); with `model_path`, that HF directory. Greedy success, pass@k
(`--config.eval.pass_k=k`), mean turns and generated tokens over `eval.num_tasks` tasks.

With a workdir, each eval is written to a file of its own, never overwritten:
W/evals/eval_step<k>.json for checkpoint step k (eval_step<k>_2.json for a second eval of the
same step, and so on), eval_<dir name>.json for an HF directory; W/eval.json is a copy of the
latest. `checkpoint_step` is the step of the checkpoint evaluated (-1: an HF directory);
`weight_version` the version of the weights that played the greedy episodes, which here is
that same step (0 for an HF directory): in a training run's eval it tells whether an
asynchronous sampler had caught up with the learner.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Optional

import jax
import ml_collections

from rl_tpu import parallel
from rl_tpu.data.tasks import eval_tasks
from rl_tpu.heartbeat import Heartbeat
from rl_tpu.metrics import atomic_write_text
from rl_tpu.recipes import (algorithms, engines, env_factory, eval_suite, input_checks,
                            placement, policy_io, train_states)
from rl_tpu.recipes.config import check

EVALS_DIR = eval_suite.EVALS_DIR
LATEST_FILE = "eval.json"  # W/eval.json: a copy of the latest


def _checkpoint_params(config, workdir: str, model_cfg, params, mesh):
    """The latest checkpoint's policy params, restored into the trainer's state layout."""
    # imported here for its cost (orbax): only an eval of a checkpoint needs it
    from rl_tpu.persistence.checkpoint import Checkpointer

    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"))
    if ckpt.latest_step() is None:
        raise FileNotFoundError(f"no checkpoint under {workdir}/checkpoints; train first or "
                                "pass --model_path to an HF directory")
    target = {"policy": train_states.new_state(
        params, train_states.rl_optim_config(config, config.optim.lr))}
    if algorithms.uses_critic(config.algo):
        target["critic"] = train_states.new_critic_state(config, target["policy"].params,
                                                         model_cfg, mesh)
    step, restored, _ = ckpt.restore({k: v.checkpoint_view() for k, v in target.items()})
    ckpt.close()
    return step, target["policy"].from_checkpoint(restored["policy"]).params


def _has_checkpoint(workdir: str) -> bool:
    """Whether <workdir>/checkpoints holds a step (orbax names a step's directory by its
    number); the Checkpointer opened later does the full check, but would create the directory."""
    directory = os.path.join(workdir, "checkpoints")
    return os.path.isdir(directory) and any(name.isdigit() for name in os.listdir(directory))


def run(config: ml_collections.ConfigDict, workdir: Optional[str] = None,
        model_path: Optional[str] = None, report: bool = False) -> dict[str, float]:
    """The eval's metrics (module docstring), written under `workdir` when given; `report`
    (launch.eval) prints them as a table (process 0), then where they were written."""
    check(config)
    if not workdir and not model_path:
        raise ValueError("give a workdir (its latest checkpoint) or a model_path (HF dir)")
    if not model_path and not _has_checkpoint(workdir):  # before anything is written there
        raise FileNotFoundError(f"no checkpoint in {workdir}: pass --model_path (an HF "
                                "directory) or the workdir of a training run")
    input_checks.check_inputs(config, model_path)  # before a compile or a write
    parallel.maybe_initialize_distributed()
    mesh = placement.make_mesh(config)
    path = model_path or policy_io.model_path(config, workdir)
    model_cfg, _, params, tokenizer = policy_io.load_policy(config, path, mesh)
    step = None
    if not model_path:
        step, params = _checkpoint_params(config, workdir, model_cfg, params, mesh)
    make_env = env_factory.make_env_factory(config)
    env_factory.check_call_format(make_env, tokenizer)
    source = env_factory.task_source(config, make_env)
    tasks = [t for _, t in eval_tasks(source, config.env.eval_split, config.eval.num_tasks)]
    # an HF export for SGLang servers goes under the workdir, else a fresh temporary dir
    sync_root = workdir or tempfile.mkdtemp(prefix="rl_tpu_eval_")
    engine = engines.make_engine(config, model_cfg, params, tokenizer, sync_root,
                                 version=str(step or 0))
    name = (f"eval_step{step}" if step is not None
            else f"eval_{os.path.basename(os.path.normpath(model_path))}")
    with Heartbeat(f"eval: {len(tasks)} tasks", every_s=config.log.every_s,
                   enabled=jax.process_index() == 0):
        result = eval_suite.evaluate_policy(
            config, engine, make_env, tasks, tokenizer, config.seed,
            replies_path=eval_suite.replies_file(workdir, name) if workdir else None)
    result = dict(result, checkpoint_step=-1 if step is None else step)
    if jax.process_index() != 0:
        return result
    if report:
        what = model_path or f"{workdir}, checkpoint step {step}"
        print(f"eval of {what} on {config.env.name} ({config.env.eval_split} split):\n"
              f"{table(result)}", flush=True)
    if workdir:
        path = write_eval(workdir, name, result)
        print(f"wrote {path} ({os.path.join(workdir, LATEST_FILE)}: a copy of the latest eval)",
              flush=True)
    return result


def write_eval(workdir: str, name: str, result: dict) -> str:
    """W/evals/<name>.json, or <name>_2.json, _3... when an earlier eval has that name (an
    eval is never overwritten), and W/eval.json as its copy; returns the new file's path."""
    directory = os.path.join(workdir, EVALS_DIR)
    os.makedirs(directory, exist_ok=True)
    path, n = os.path.join(directory, f"{name}.json"), 1
    while os.path.exists(path):
        n += 1
        path = os.path.join(directory, f"{name}_{n}.json")
    text = json.dumps(result, indent=1)
    atomic_write_text(path, text)
    atomic_write_text(os.path.join(workdir, LATEST_FILE), text)
    return path


# Metrics that count things: printed as integers, the others with 4 decimals
COUNTS = ("num_tasks", "env_errors", "weight_version", "checkpoint_step")
# What each metric of an eval means, for the table `launch.eval` prints (absent keys skipped;
# a metric not listed here is printed without a meaning).
MEANINGS = {
    "success": "greedy success rate (one deterministic episode a task)",
    "reward": "mean episode reward, greedy",
    "turns": "mean actions an episode",
    "tokens": "mean generated tokens an episode",
    "num_tasks": "held-out tasks played (eval.num_tasks)",
    "env_errors": "episodes the env failed on (not the policy's fault)",
    "format_failed": "greedy replies without the env's answer format (e.g. `Answer: N`)",
    "weight_version": "version of the weights that played (here: the checkpoint step)",
    "checkpoint_step": "checkpoint evaluated (-1: an HF directory, --model_path)",
}


def table(result: dict) -> str:
    """`result` as a labelled table: metric | value | what it means, one row a metric."""
    def meaning(key: str) -> str:
        kind, _, k = key.partition("@")
        if k:
            return {"pass": f"a task solved by any of {k} samples",
                    "mean": f"mean success of {k} samples (pass@1 at the rollout temperature)",
                    "distinct": f"distinct successful replies among {k} samples a task",
                    "format_failed": f"sampled replies ({k} a task) without the answer format"
                    }.get(kind, "")
        return MEANINGS.get(key, "")

    rows = [(k, f"{v:g}" if k in COUNTS else f"{v:.4f}", meaning(k))
            for k, v in sorted(result.items())]
    width = max(len("metric"), *(len(r[0]) for r in rows))
    vwidth = max(len("value"), *(len(r[1]) for r in rows))
    lines = [f"{'metric':<{width}} | {'value':>{vwidth}} | meaning",
             f"{'-' * width}-+-{'-' * vwidth}-+-{'-' * 7}"]
    lines += [f"{k:<{width}} | {v:>{vwidth}} | {m}".rstrip() for k, v, m in rows]
    return "\n".join(lines)
