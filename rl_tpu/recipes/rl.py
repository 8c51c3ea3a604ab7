"""The RL trainer: `run(config, workdir)`, the loop of docs/architecture.md, top to bottom.

    python -m launch.train --config configs/quickstart.py --workdir /tmp/quickstart

One step:
  rollout     this host's share of the step's tasks, G samples each, through the agent loop
              (single-turn tasks and multi-turn envs alike); DAPO's dynamic sampling refills
              groups whose rewards are all equal
  batch       trajectories -> one padded [B, T] batch (rl_tpu/train/rollout_batch.py)
  score       old log-probs (the policy that sampled: on-policy, the current params), reference
              log-probs when a KL term is on, critic values for PPO
  advantages  the algorithm's estimator over the global batch
  update      K epochs x minibatches of the jitted policy step (then the value step)
  sync        the engine gets the new weights, version = the step number
  eval        every `eval.every` steps (and at step 0, the start of RL): held-out tasks
  log         one record per step in W/metrics.jsonl + TensorBoard: rollout, train, eval and
              time metrics
  checkpoint  every `checkpoint.every` steps and at the end; rerunning the same command resumes

Steps count updates: step 0 is the policy before RL (after the SFT warm start, if any), step k
the policy after k updates. Metrics of the SFT warm start are logged at negative steps
(-N..-1), so a resumed run's metrics file is cut at its resumed step without losing them.
Everything random is a function of (config.seed, step), and the task stream's position and
every state are checkpointed, so a resumed run repeats an uninterrupted one number for number.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from rl_tpu import metrics as metrics_lib
from rl_tpu import parallel, schedules
from rl_tpu.agent import Trajectory, run_episodes
from rl_tpu.checkpoint import Checkpointer
from rl_tpu.data.tasks import TaskStream, eval_tasks
from rl_tpu.evaluation import episode_stats, evaluate
from rl_tpu.models import hf
from rl_tpu.models.value import ValueModel
from rl_tpu.recipes import algorithms, components, sft
from rl_tpu.recipes.config import check
from rl_tpu.train import rollout_batch, steps
from rl_tpu.train.batching import bucket_length
from rl_tpu.train.learner import Learner, UpdateConfig

log = logging.getLogger(__name__)

TIME_KEYS_PREFIX = "time/"  # wall-clock metrics: the only ones a resumed run may not repeat


def step_seed(seed: int, step: int, what: int = 0) -> int:
    """The sampling seed of one step (and purpose): fresh each step, the same on a rerun."""
    return int(np.random.SeedSequence([seed, step, what]).generate_state(1)[0] & 0x7FFFFFFF)


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
    """Trains with RL per `config`; returns the final eval metrics."""
    check(config)
    parallel.maybe_initialize_distributed()
    os.makedirs(workdir, exist_ok=True)
    is_chief = jax.process_index() == 0
    mesh = components.make_mesh(config)
    path = components.model_path(config, workdir)
    model_cfg, model, params, tokenizer = components.load_policy(config, path, mesh)
    make_env = components.make_env_factory(config)
    source = components.task_source(config, make_env)
    env_cfg, train_cfg, algo = config.env, config.train, config.algo

    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=config.checkpoint.keep,
                        async_save=config.checkpoint.async_save)
    resume_step = ckpt.latest_step()
    # A fresh run rewrites the metrics file from scratch (SFT lines sit at negative steps).
    writer = None
    if resume_step is None:
        writer = metrics_lib.MetricsWriter(workdir, resume_step=-sys.maxsize,
                                           tensorboard=config.log.tensorboard, enabled=is_chief)

    # --- warm start (fresh runs only: a checkpoint already holds its result) -------------
    eval_list = [t for _, t in eval_tasks(source, env_cfg.eval_split, config.eval.num_tasks)]
    start_metrics: dict[str, float] = {}
    if resume_step is None and config.sft.steps > 0:
        if not config.sft.data_path:
            start_metrics["eval/teacher_success"] = sft.teacher_success(
                make_env, eval_list, config.sft.teacher_skill, config.seed)
        params = sft.warm_start(config, params, model, mesh, tokenizer, make_env, writer,
                                step_offset=-config.sft.steps - 1)

    # --- learner: policy, critic, reference ---------------------------------------------
    loss_cfg = algorithms.loss_config(algo, env_cfg.max_new_tokens)
    update_cfg = UpdateConfig(
        epochs=train_cfg.epochs, minibatches=train_cfg.minibatches,
        step=steps.StepConfig(micro_batches=train_cfg.micro_batches,
                              logprob_chunk=train_cfg.logprob_chunk,
                              temperature=config.rollout.temperature),
        advantage=algo.advantage, advantage_options=algorithms.advantage_options(algo),
        value_clip=algo.value_clip or None, use_reference=algorithms.uses_reference(algo),
        reward_kl_coef=algo.reward_kl_coef if algo.advantage == "reinforce_pp" else 0.0)
    reference = jax.tree.map(jnp.copy, params) if update_cfg.use_reference else None
    critic, value_model = None, None
    if algorithms.uses_critic(algo):
        value_model = ValueModel(model_cfg, mesh=mesh)
        critic = components.new_critic_state(config, params, model_cfg, mesh)
    policy = components.new_state(
        params, components.optim_config(config.optim.lr, config, train_cfg.steps))
    del params  # donated into the state
    learner = Learner(model, policy, mesh, loss_cfg, update_cfg, critic=critic,
                      value_model=value_model, reference_params=reference)

    stream = TaskStream(source, env_cfg.train_split, tasks_per_step=train_cfg.tasks_per_step,
                        seed=config.seed)
    start = 0
    if resume_step is not None:
        # The step restored may be older than the latest (a damaged checkpoint is skipped):
        # the metrics file keeps exactly the lines before it.
        start, restored, meta = ckpt.restore(_checkpoint_state(learner))
        _load_checkpoint_state(learner, restored)
        stream.set_state(meta["stream"])
        writer = metrics_lib.MetricsWriter(workdir, resume_step=start + 1,
                                           tensorboard=config.log.tensorboard, enabled=is_chief)
        log.warning("resumed from step %d", start)
    engine = components.make_engine(config, model_cfg, learner.policy.params, tokenizer, workdir,
                                    version=str(start))

    def run_eval(step: int, extra: dict | None = None) -> dict[str, float]:
        started = time.time()
        result = evaluate(engine, make_env, eval_list, tokenizer=tokenizer,
                          max_turns=config.eval.max_turns or _horizon(config, step),
                          max_new_tokens=env_cfg.max_new_tokens,
                          max_context_tokens=env_cfg.max_context_tokens,
                          pass_k=config.eval.pass_k,
                          sampling=components.sampling_params(config, None),
                          seed=step_seed(config.seed, step, 1),
                          step_timeout_s=env_cfg.step_timeout_s,
                          reward_reduce=env_cfg.reward_reduce)
        out = {f"eval/{k}": v for k, v in result.items()} | (extra or {})
        out["time/eval_s"] = time.time() - started
        return out

    last_eval = {}
    if start == 0:
        last_eval = run_eval(0, start_metrics)
        writer.write(0, last_eval)
    if start_metrics and is_chief:
        print(f"teacher success {start_metrics['eval/teacher_success']:.3f}, "
              f"policy at the start of RL {last_eval['eval/success']:.3f}", flush=True)

    for step in metrics_lib.progress(range(start + 1, train_cfg.steps + 1), "RL steps",
                                     enabled=is_chief):
        t_step = time.time()
        # --- rollout -------------------------------------------------------------------
        horizon = _horizon(config, step - 1)
        trajectories, group_ids, rollout_metrics = _rollout(
            config, engine, make_env, stream, tokenizer, horizon, step)
        t_rollout = time.time() - t_step

        # --- batch + score + advantages -----------------------------------------------
        t0 = time.time()
        host = rollout_batch.trajectories_to_batch(
            trajectories, length_buckets=train_cfg.length_buckets,
            row_multiple=_row_multiple(config, mesh), group_ids=group_ids,
            length=_agreed_length(trajectories, train_cfg.length_buckets))
        keys = ["tokens", "positions", "segment_ids", "loss_mask", "token_rewards", "rewards",
                "group_ids", "turn_ids"]
        if _behaviour_logprobs_usable(trajectories, algo):
            keys.append("behaviour_logprobs")
        batch = parallel.host_to_global({k: host[k] for k in keys}, mesh)
        batch = learner.advantages(learner.score(batch))
        jax.block_until_ready(batch["advantages"])
        t_score = time.time() - t0

        # --- update ----------------------------------------------------------------------
        t0 = time.time()
        train_metrics = learner.update(batch)
        t_update = time.time() - t0

        # --- sync ------------------------------------------------------------------------
        t0 = time.time()
        engine.update_weights(components.host_local_params(learner.policy.params), str(step))
        t_sync = time.time() - t0

        # --- eval --------------------------------------------------------------------------
        elapsed = time.time() - t_step
        generated = rollout_metrics.pop("_generated_tokens")
        record = {**rollout_metrics, **train_metrics, "train/horizon": horizon,
                  "time/rollout_s": t_rollout, "time/score_s": t_score,
                  "time/update_s": t_update, "time/sync_s": t_sync, "time/step_s": elapsed,
                  "time/rollout_tokens_per_s": generated / max(t_rollout, 1e-9)}
        if step % config.eval.every == 0 or step == train_cfg.steps:
            last_eval = run_eval(step)
            record.update(last_eval)
            if is_chief:
                print(f"step {step}: eval success {last_eval['eval/success']:.3f}, "
                      f"rollout reward {record['rollout/reward']:.3f}", flush=True)

        # --- log: one record per step ------------------------------------------------------
        writer.write(step, record)

        # --- checkpoint --------------------------------------------------------------------
        if step % config.checkpoint.every == 0 or step == train_cfg.steps:
            ckpt.save(step, _checkpoint_state(learner), {"stream": stream.get_state()})

    ckpt.wait()
    ckpt.close()
    if config.checkpoint.export_hf:
        hf.save(os.path.join(workdir, "final_hf"), model_cfg, learner.policy.params,
                tokenizer=tokenizer.hf)
    writer.close()
    if is_chief and config.log.plot:
        metrics_lib.plot_curves(workdir)
    return {k: v for k, v in last_eval.items() if k.startswith("eval/")}


# ----------------------------------------------------------------------------- rollout


def _rollout(config, engine, make_env, stream: TaskStream, tokenizer, horizon: int, step: int
             ) -> tuple[list[Trajectory], list[int], dict[str, Any]]:
    """This host's trajectories for one step, their group ids, and rollout metrics."""
    env_cfg, algo, g = config.env, config.algo, config.train.samples_per_task

    def play(tasks, round_index):
        # group_id_offset: each host's tasks are a contiguous run of the step's global
        # positions, so group ids (and the per-episode seeds keyed by them) are global.
        trajs = run_episodes(
            engine, make_env, [t for _, t in tasks], tokenizer=tokenizer, max_turns=horizon,
            group_id_offset=tasks[0][0],
            max_new_tokens_per_turn=env_cfg.max_new_tokens,
            max_context_tokens=env_cfg.max_context_tokens,
            sampling=components.sampling_params(
                config, step_seed(config.seed, step, 10 + round_index)),
            samples_per_task=g, step_timeout_s=env_cfg.step_timeout_s,
            reward_reduce=env_cfg.reward_reduce)
        if any(traj.group_id != tasks[i // g][0] for i, traj in enumerate(trajs)):
            raise RuntimeError("run_episodes returned trajectories out of task order")
        algorithms.shape_overlong(trajs, algo, env_cfg.max_new_tokens)
        return trajs

    tasks = stream.next()
    played = play(tasks, 0)
    metrics = _rollout_metrics(played)
    if algo.dynamic_sampling:
        groups = algorithms.informative_groups(played)
        for round_index in range(1, algo.max_refill_rounds + 1):
            # every host refills in the same rounds, so their task streams stay in step
            if not _any_host(len(groups) < len(tasks)):
                break
            more = play(stream.next(), round_index)
            played += more
            groups += algorithms.informative_groups(more)
        # The batch keeps its size: short of informative groups, the rest are filled with
        # equal-reward groups (zero advantage: they add no gradient, only shape).
        kept_ids = {grp[0].group_id for grp in groups[:len(tasks)]}
        chosen = [t for t in played if t.group_id in kept_ids]
        others = [t for t in played if t.group_id not in kept_ids]
        chosen += others[:len(tasks) * g - len(chosen)]
        metrics["rollout/informative_group_frac"] = len(groups) / max(len(played) // g, 1)
        metrics["rollout/refill_rounds"] = float(len(played) // (len(tasks) * g) - 1)
        played = chosen
    metrics["_generated_tokens"] = sum(t.num_generated for t in played)
    return played, [t.group_id for t in played], metrics


def _behaviour_logprobs_usable(trajectories: list[Trajectory], algo) -> bool:
    """Whether the engine's log-probs may enter the loss. They must be of the full
    distribution (docs/architecture.md, logprob conventions): renormalised top-p / top-k
    log-probs differ by -log(kept mass) per token and would bias IS weights and BAPO's Eq. 8
    weights. Needed but truncated: a clear error. Not needed: left out of the batch."""
    truncated = any(t.logprob_convention != "full" for t in trajectories)
    if not truncated:
        return True
    needs = algo.behaviour_is != "none" or (algo.loss == "bapo" and algo.bapo.variant == "paper")
    if needs:
        raise ValueError(
            "the rollout engine reported truncated (top-p/top-k renormalised) log-probs, but "
            f"algo.behaviour_is={algo.behaviour_is!r} / BAPO's Eq. 8 weights need log-probs of "
            "the full distribution. Sample without truncation (rollout.top_p=1, "
            "rollout.top_k=-1), use an engine that reports full log-probs, or set "
            "algo.behaviour_is='none' (and algo.bapo.variant='verl' for BAPO)")
    return False


def _any_host(flag: bool) -> bool:
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils
    return bool(np.any(multihost_utils.process_allgather(np.bool_(flag))))


def _rollout_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    stats = episode_stats(trajectories)
    n = max(stats["episodes"], 1)
    versions = [_as_int(v) for t in trajectories for v in t.weight_versions]
    # the oldest policy any sample of this step came from (on-policy: the previous step)
    return {"rollout/weight_version": float(min(versions, default=-1)),
            "rollout/reward": stats["reward"], "rollout/success": stats["success"],
            "rollout/response_length": stats["tokens"], "rollout/turns": stats["turns"],
            "rollout/env_error_frac": stats["env_errors"] / n,
            "rollout/context_limit_frac": stats["context_limits"] / n}


def _as_int(version) -> int:
    try:
        return int(version)
    except (TypeError, ValueError):
        return -1


# ----------------------------------------------------------------------------- shapes


def _horizon(config, step: int) -> int:
    return schedules.horizon(step, tuple(config.schedules.horizon_turns),
                             config.schedules.horizon_every, config.env.max_turns)


def _row_multiple(config, mesh) -> int:
    """Local rows must make a global batch that splits into data-parallel shards x
    minibatches x micro-batches."""
    t = config.train
    global_multiple = components.data_parallel_size(mesh) * t.minibatches * t.micro_batches
    return global_multiple // math.gcd(global_multiple, jax.process_count())


def _agreed_length(trajectories, buckets) -> int:
    """The length bucket every host uses this step: the bucket of the longest row anywhere."""
    longest = max(len(t) for t in trajectories)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        longest = int(np.max(multihost_utils.process_allgather(np.int32(longest))))
    return bucket_length(longest, buckets)


# ----------------------------------------------------------------------------- checkpoint


def _checkpoint_state(learner: Learner) -> dict:
    state = {"policy": learner.policy}
    if learner.critic is not None:
        state["critic"] = learner.critic
    if learner.reference_params is not None:
        state["reference"] = learner.reference_params
    return state


def _load_checkpoint_state(learner: Learner, restored: dict) -> None:
    learner.policy = restored["policy"]
    if "critic" in restored:
        learner.critic = restored["critic"]
    if "reference" in restored:
        learner.reference_params = restored["reference"]
