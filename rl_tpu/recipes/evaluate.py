"""Evaluate a policy on an env's eval split: from a run's workdir or from an HF directory.

    python -m launch.eval --config configs/quickstart.py --workdir /tmp/quickstart
    python -m launch.eval --config configs/quickstart.py --model_path /tmp/quickstart/final_hf

With a workdir, the policy is the latest checkpoint's (restored into the same state layout the
trainer saved); with `model_path`, that HF directory. Greedy success, pass@k
(`--config.eval.pass_k=k`), mean turns and generated tokens over `eval.num_tasks` tasks, written
to <workdir>/eval.json when a workdir is given.
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
from rl_tpu.recipes import components
from rl_tpu.recipes.config import check


def _checkpoint_params(config, workdir: str, model_cfg, params, mesh):
    """The latest checkpoint's policy params, restored into the trainer's state layout."""
    from rl_tpu.checkpoint import Checkpointer
    from rl_tpu.recipes import algorithms

    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"))
    if ckpt.latest_step() is None:
        raise FileNotFoundError(f"no checkpoint under {workdir}/checkpoints; train first or "
                                "pass --model_path to an HF directory")
    target = {"policy": components.new_state(
        params, components.rl_optim_config(config, config.optim.lr))}
    if algorithms.uses_critic(config.algo):
        target["critic"] = components.new_critic_state(config, target["policy"].params,
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
        model_path: Optional[str] = None) -> dict[str, float]:
    check(config)
    if not workdir and not model_path:
        raise ValueError("give a workdir (its latest checkpoint) or a model_path (HF dir)")
    if not model_path and not _has_checkpoint(workdir):  # before anything is written there
        raise FileNotFoundError(f"no checkpoint in {workdir}: pass --model_path (an HF "
                                "directory) or the workdir of a training run")
    components.check_inputs(config, model_path)  # before a compile or a write
    parallel.maybe_initialize_distributed()
    mesh = components.make_mesh(config)
    path = model_path or components.model_path(config, workdir)
    model_cfg, _, params, tokenizer = components.load_policy(config, path, mesh)
    step = None
    if not model_path:
        step, params = _checkpoint_params(config, workdir, model_cfg, params, mesh)
    make_env = components.make_env_factory(config)
    components.check_call_format(make_env, tokenizer)
    source = components.task_source(config, make_env)
    tasks = [t for _, t in eval_tasks(source, config.env.eval_split, config.eval.num_tasks)]
    # an HF export for SGLang servers goes under the workdir, else a fresh temporary dir
    sync_root = workdir or tempfile.mkdtemp(prefix="rl_tpu_eval_")
    engine = components.make_engine(config, model_cfg, params, tokenizer, sync_root)
    result = components.evaluate_policy(config, engine, make_env, tasks, tokenizer, config.seed)
    result = dict(result, checkpoint_step=-1 if step is None else step)
    if workdir and jax.process_index() == 0:
        with open(os.path.join(workdir, "eval.json"), "w") as f:
            json.dump(result, f, indent=1)
    return result
