"""The RL trainer: `run(config, workdir)`, the loop of docs/architecture.md, top to bottom.

    python -m launch.train --config configs/quickstart.py --workdir /tmp/quickstart

One step (each phase a method of `Trainer`, so other loops can compose them):
  rollout     the step's task groups, G samples each, from the producer (rl_tpu/offpolicy/
              producer.py): played now (on-policy), or taken from an asynchronous producer
              within `rollout.max_staleness` versions; plus replayed groups (`train.replay`)
  batch       trajectories -> one padded [B, T] batch (rl_tpu/train/rollout_batch.py)
  score       proximal log-probs (the params at the start of this update), reference
              log-probs when a KL term is on, critic values for PPO; then the advantages
  update      K epochs x minibatches of the jitted policy step (then the value step)
  sync        the producer's engine gets the new weights, version = the step number
  eval        every `eval.every` steps (and at step 0, the start of RL): held-out tasks at a
              fixed horizon
  log         one record per step in W/metrics.jsonl + TensorBoard
  checkpoint  every `checkpoint.every` steps and at the end; rerunning the same command resumes

What differs between algorithms is in the algorithm table's hooks (rl_tpu/recipes/
algorithms.py): reward shaping and group selection at rollout, the batch keys the loss may
use, the learner's settings. The loop itself has no branch per algorithm.

Steps count updates: step 0 is the policy before RL (after the SFT warm start, if any), step k
the policy after k updates. Metrics of the SFT warm start are logged at negative steps
(-N..-1), so a resumed run's metrics file is cut at its resumed step without losing them.
Everything random is a function of (config.seed, step), and the task stream's position, the
producer's and the replay buffer's state and every train state are checkpointed, so a resumed
run repeats an uninterrupted one number for number (asynchronous: in deterministic mode).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from rl_tpu import metrics as metrics_lib
from rl_tpu import parallel
from rl_tpu.agent import play_partial
from rl_tpu.agent.program import player_for
from rl_tpu.persistence.checkpoint import Checkpointer
from rl_tpu.persistence.checkpoint_errors import RunWriteError
from rl_tpu.data.tasks import TaskStream, eval_tasks
from rl_tpu.heartbeat import Heartbeat
from rl_tpu.agent.env_failures import EnvFailureWatch
from rl_tpu.agent.evaluation import episode_stats, oldest_version_over_hosts
from rl_tpu.models import lora
from rl_tpu.models.value import ValueModel
from rl_tpu.persistence.preemption import PreemptionGuard, stop_here
from rl_tpu.recipes import (algorithms, engines, env_factory, eval_suite, placement, policy_io,
                            resume, rollout_settings, run_summary, sft, shapes, train_states)
from rl_tpu.recipes.config import check
from rl_tpu.rewards.mix import RewardMix, source_metrics
from rl_tpu.offpolicy.producer import (AsyncProducer, PartialRollouts, SyncProducer,
                                     metrics_over_hosts)
from rl_tpu.train import rollout_batch
from rl_tpu.train.batching import bucket_length
from rl_tpu.train.learner import Learner
from rl_tpu.offpolicy.replay import ReplayBuffer, ReplayConfig
from rl_tpu.train.state import step_schedule
from rl_tpu.core.batch import RolloutBatch
from rl_tpu.core.trajectory import Trajectory, groups_of

log = logging.getLogger(__name__)

TIME_KEYS_PREFIX = "time/"  # wall-clock metrics: the only ones a resumed run may not repeat
REFERENCE = "reference"  # the frozen reference policy: saved once per run, not every step
FINISHED_FILE = "finished.json"  # written last by Trainer.finish: the run reached its end
# a step still running prints `step k/N, <s> s, <phase>` every STEP_BEATS x log.every_s
# seconds: one line a half-minute (at the default 5 s) through a real model's minutes-long
# step on a CPU, nothing in a toy's second-long one
STEP_BEATS = 6
# the SFT warm start's checkpoints (fresh runs: RL's first checkpoint holds its result)
WARM_START_DIR = os.path.join("warm_start", "checkpoints")


def run(config: ml_collections.ConfigDict, workdir: str, trainer_class=None
        ) -> dict[str, float]:
    """Trains with RL per `config`; returns the final eval metrics. `trainer_class`: a
    subclass of `Trainer` that changes a phase (recipes/selfplay.py's rollout)."""
    finished = finished_run(config, workdir)
    if finished is not None:
        return finished
    metrics_lib.announce_start(config, workdir, config.train.steps)
    # SIGTERM / SIGINT: stop after the step, checkpointed (the warm start's SFT steps too)
    with PreemptionGuard():
        trainer = (trainer_class or Trainer)(config, workdir)
        try:
            trainer.start_producer()
            for step in metrics_lib.progress(range(trainer.start + 1, config.train.steps + 1),
                                             "RL steps", enabled=trainer.is_chief):
                # a step of minutes (a real model on a CPU) says which phase it is in
                with Heartbeat(f"step {step}/{config.train.steps}",
                               every_s=STEP_BEATS * config.log.every_s,
                               enabled=trainer.is_chief, detail=lambda: trainer.phase):
                    _, record = trainer.train_step(step)  # rollout, batch, score, update, sync
                trainer.end_step(step, record)            # eval (when due), log, checkpoint
                trainer.stop_if_signalled(step)           # pre-emption: every host agrees
            trainer.finish()
        except BaseException:
            trainer.close(after_error=True)  # the error that stopped the run is the one raised
            raise
        trainer.close()
    return {k: v for k, v in trainer.last_eval.items() if k.startswith("eval/")}


def finished_run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float] | None:
    """A rerun of a run that already reached `config.train.steps` (W/finished.json): says so
    and where its results are, and returns its final eval metrics, without building anything;
    None (train or resume) otherwise, or when any host lacks the file. A changed config is
    refused as a resume would refuse it; a raised train.steps trains on."""
    path = os.path.join(workdir, FINISHED_FILE)
    record = None
    if os.path.isfile(path):
        with open(path) as f:
            record = json.load(f)
    done = record is not None and record["step"] >= config.train.steps
    parallel.maybe_initialize_distributed()
    if not parallel.across_hosts(done, "all"):
        return None
    resume.check_resume(record["config"], config, workdir)
    if jax.process_index() == 0:
        evals = ", ".join(f"{k} {v:.3f}" for k, v in sorted(record["eval"].items())
                          if k in ("eval/success", "eval/reward"))
        outputs = ", ".join(os.path.join(workdir, name) for name in record["outputs"])
        print(f"{workdir} finished at step {record['step']} ({evals}); nothing to train. "
              f"Results: {outputs}. To train on, raise --config.train.steps; to start over, "
              "use a new --workdir.", flush=True)
    return record["eval"]


class Trainer:
    """Everything one RL run holds, built from its config (and restored from its workdir),
    with the loop's phases as methods."""

    curve_keys = metrics_lib.DEFAULT_CURVES  # what W/curves.png draws (absent keys skipped)

    def __init__(self, config: ml_collections.ConfigDict, workdir: str):
        self.compiles = metrics_lib.CompileCounter()  # from here: the setup's compiles too
        check(config)
        # saved with every checkpoint; made now, so a value JSON cannot hold fails at once
        self.config_record = resume.config_record(config)
        parallel.maybe_initialize_distributed()
        os.makedirs(workdir, exist_ok=True)
        self.config, self.workdir = config, workdir
        self.is_chief = jax.process_index() == 0
        self.phase = "starting"  # the phase of the step running (the step's heartbeat says it)
        self.step_log = metrics_lib.StepLog(config.train.steps, every_s=config.log.every_s,
                                            enabled=self.is_chief)
        self.asynchronous = config.rollout.max_staleness > 0
        placement.check_hosts(config)
        learner_devices, sampler_devices = placement.split_devices(config, jax.devices())
        self.mesh = placement.make_mesh(config, learner_devices)
        path = policy_io.model_path(config, workdir)
        self.model_cfg, model, params, self.tokenizer = policy_io.load_policy(
            config, path, self.mesh)
        if algorithms.records_routing(config.algo) and self.model_cfg.moe is None:
            raise ValueError(
                f"algo.routing_replay={config.algo.routing_replay!r} / "
                f"algo.log_routing_mismatch={config.algo.log_routing_mismatch}: the policy "
                f"({self.model_cfg.arch}) is not a mixture of experts, it has no routing to "
                "record; turn them off, or train a Qwen3-MoE")
        self.make_env = env_factory.make_env_factory(config)
        # every episode failing, step after step, stops the run (and W/env_errors.log)
        self.env_failures = EnvFailureWatch(workdir, config.env.max_failed_steps,
                                            jax.process_index())
        env_factory.check_call_format(self.make_env, self.tokenizer)
        source = env_factory.task_source(config, self.make_env)
        env_cfg, algo = config.env, config.algo

        self.ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=config.checkpoint.keep,
                                 async_save=config.checkpoint.async_save)
        resume_step = self.ckpt.latest_step()
        run_summary.announce(config, path, self.model_cfg, params, run_summary.warm_start_plan(
            config, done="" if resume_step is None else f"none (resuming at step {resume_step})"))
        self.writer = None
        sft_offset = -config.sft.steps - 1  # SFT step j is logged at j + sft_offset (< 0)

        def open_metrics(sft_start: int = 0):
            """A fresh run rewrites the metrics file from scratch; a warm start resumed from
            its step k keeps the lines up to k's."""
            self.writer = metrics_lib.MetricsWriter(
                workdir, resume_step=sft_start + sft_offset + 1 if sft_start else -sys.maxsize,
                tensorboard=config.log.tensorboard, enabled=self.is_chief,
                wandb_project=config.log.wandb_project, wandb_config=self.config_record)
            return self.writer

        # --- warm start (fresh runs only: a checkpoint already holds its result) ---------
        self.eval_list = [t for _, t in eval_tasks(source, env_cfg.eval_split,
                                                   config.eval.num_tasks)]
        start_metrics: dict[str, float] = {}
        if resume_step is None and config.sft.steps > 0:
            if not config.sft.data_path:
                start_metrics["eval/teacher_success"] = sft.teacher_success(
                    self.make_env, self.eval_list, config.sft.teacher_skill, config.seed,
                    max_turns=eval_suite.eval_horizon(config))
            # checkpointed, so SIGTERM / SIGINT stop it at a step (Preempted) and the rerun
            # resumes there, rather than the signal waiting for RL's first step
            try:
                params = sft.warm_start(config, params, model, self.mesh, self.tokenizer,
                                        self.make_env, open_metrics, step_offset=sft_offset,
                                        checkpoint_dir=os.path.join(workdir, WARM_START_DIR))
            except BaseException:
                if self.writer is not None:
                    self.writer.close()
                raise
        elif resume_step is None:
            open_metrics()

        # --- learner: policy, critic, reference ---------------------------------------
        update_cfg = algorithms.update_config(config)
        # the KL reference: the start's params; a LoRA policy's start adapters alone, which the
        # learner puts on the policy's frozen base (Learner.reference)
        reference = jax.tree.map(jnp.copy, lora.adapters(params) if lora.is_on(self.model_cfg)
                                 else params) if update_cfg.use_reference else None
        critic, value_model = None, None
        if algorithms.uses_critic(algo):
            value_model = ValueModel(self.model_cfg, mesh=self.mesh)
            critic = train_states.new_critic_state(config, params, self.model_cfg, self.mesh)
        policy_optim = train_states.rl_optim_config(config, config.optim.lr)
        self.lr_at = step_schedule(policy_optim)  # lr of an RL step, for the log
        policy = train_states.new_state(params, policy_optim)
        del params  # donated into the state
        self.learner = Learner(model, policy, self.mesh,
                               algorithms.loss_config(algo, env_cfg.max_new_tokens), update_cfg,
                               critic=critic, value_model=value_model,
                               reference_params=reference)
        r = config.train.replay
        self.replay = ReplayBuffer(ReplayConfig(capacity=r.capacity, fraction=r.fraction,
                                                max_staleness=r.max_staleness, seed=config.seed))
        self.stream = TaskStream(source, env_cfg.train_split,
                                 tasks_per_step=config.train.tasks_per_step, seed=config.seed)

        # --- restore ------------------------------------------------------------------
        self.start, host_state = 0, None
        self.saved_step: int | None = None  # the newest step this run saved
        if resume_step is not None:
            # The step restored may be older than the latest (a damaged checkpoint is
            # skipped): the metrics file keeps exactly the lines before it.
            self.start, restored, meta = self.ckpt.restore(self._checkpoint_state())
            resume.check_resume(meta.get("config"), config, workdir)
            self._load_checkpoint_state(restored)
            # None for a checkpoint from before host state existed (the stream is in meta);
            # a damaged one already made `ckpt.restore` fall back to an earlier step
            host_state = self.ckpt.restore_host_state(self.start) or {
                "producer": {"stream": meta["stream"]}}
            self.writer = metrics_lib.MetricsWriter(
                workdir, resume_step=self.start + 1, tensorboard=config.log.tensorboard,
                enabled=self.is_chief, wandb_project=config.log.wandb_project,
                wandb_config=self.config_record)
            run_summary.say(f"resumed from step {self.start}")
        elif self.learner.reference_params is not None:
            self.ckpt.save_static(REFERENCE, self.learner.reference_params)
        self.ckpt.prepare(self._checkpoint_state())  # the first save then compiles nothing

        # --- engines and the producer ---------------------------------------------------
        self.engine = engines.make_engine(config, self.model_cfg, self.learner.policy.params,
                                          self.tokenizer, workdir, version=str(self.start),
                                          devices=sampler_devices)
        # Asynchronous, the producer's engine lags the learner: eval samples from the
        # learner's own params, with an engine on this host's learner devices (each host
        # plays its own eval tasks, as a sampler does: no program spans hosts).
        self.eval_engine = self.engine
        if self.asynchronous and config.rollout.engine == "jax":
            here = [d for d in learner_devices if d.process_index == jax.process_index()]
            self.eval_engine = engines.make_engine(
                config, self.model_cfg, self.learner.policy.params, self.tokenizer, workdir,
                version=str(self.start), devices=here)
        # Learned rewards beside the env's (reward.*: a reward model, a judge): scored where
        # the rollouts are played, on this host's sampler devices (rl_tpu/rewards/mix.py)
        sampler_here = sampler_devices or [d for d in learner_devices
                                           if d.process_index == jax.process_index()]
        self.reward_mix = RewardMix.from_config(config, sampler_here, self.engine,
                                                self.tokenizer)
        self.producer = self._make_producer()
        if self.asynchronous and self.eval_engine is self.engine and \
                config.rollout.deterministic:
            # evals borrow the servers (`engine_at`): the producer gets its start version as
            # a copy it can load back after one
            self.producer.publish(self.learner.policy.params, self.start)
        if host_state is not None:
            self.producer.load_state(host_state["producer"], self.start)
            self.replay.load_state(host_state.get("replay", []))

        self._engine_counts: dict[str, int] = {}  # the sampler's counters at the last log
        # a resumed run's, from its log
        self.last_eval = metrics_lib.last_eval(workdir, self.start)
        if self.start == 0:
            self.last_eval = self.evaluate(0) | start_metrics
            self.writer.write(0, self.last_eval)
        if start_metrics and self.is_chief:
            print(f"teacher success {start_metrics['eval/teacher_success']:.3f}, "
                  f"policy at the start of RL {self.last_eval['eval/success']:.3f}", flush=True)

    # -- one step ------------------------------------------------------------------------

    def train_step(self, step: int) -> tuple[list[Trajectory], dict[str, Any]]:
        """Step `step`'s phases up to the weight sync: (the trajectories it trained on, its
        record of rollout and train metrics with each phase's time)."""
        t_step = time.time()
        self.phase = "rollout"
        trajectories, rollout_metrics = self.rollout(step)                    # rollout
        t_rollout = time.time() - t_step
        t0 = time.time()
        self.phase = "scoring"
        batch = self.score(self.batch(trajectories, step))                    # batch, score
        t_score = time.time() - t0
        t0 = time.time()
        self.phase = "update"
        train_metrics = self.update(batch, step)                              # update
        t_update = time.time() - t0
        t0 = time.time()
        self.phase = "weight sync"
        self.sync(step)                                                       # sync
        t_sync = time.time() - t0
        return trajectories, {
            **rollout_metrics, **train_metrics,
            "time/rollout_s": t_rollout, "time/score_s": t_score, "time/update_s": t_update,
            "time/sync_s": t_sync, "time/step_s": time.time() - t_step,
            "time/rollout_tokens_per_s":
                rollout_metrics.get("rollout/played_tokens", 0.0) / max(t_rollout, 1e-9)}

    def end_step(self, step: int, record: dict) -> None:
        """After step `step`'s update: the eval when it is due (every eval.every steps and
        at the last), the step's log line, and a checkpoint when one is due."""
        config = self.config
        if step % config.eval.every == 0 or step == config.train.steps:
            record.update(self.evaluate(step))
            if self.is_chief:
                print(f"step {step}: eval success {record['eval/success']:.3f}, "
                      f"rollout reward {record['rollout/reward']:.3f}", flush=True)
        record.update(self.compiles.take())
        self.log(step, record)
        self.step_log(step, record)  # a line every few seconds when the bar is off
        if step % config.checkpoint.every == 0 or step == config.train.steps:
            self.save(step)

    # -- phases -------------------------------------------------------------------------

    def rollout(self, step: int) -> tuple[list[Trajectory], dict[str, Any]]:
        """The trajectories step `step` trains on (fresh, then replayed) and rollout metrics."""
        trajectories, metrics = self.producer.next_batch(step)
        stats = episode_stats(trajectories)  # over every host: each decides to stop alike
        self.env_failures.observe(step, trajectories, stats["episodes"], stats["env_errors"])
        self.env_failures.stop_if_failing(step, last=step == self.config.train.steps)
        metrics = dict(metrics, **self._rollout_metrics(trajectories, step, stats),
                       **self._prefill_metrics())
        if self.replay.cfg.capacity:
            groups, replay_metrics = self.replay.mix(
                groups_of(trajectories), step - 1, step,
                lambda n: int(parallel.across_hosts(n, "min")))
            trajectories = [t for g in groups for t in g]
            metrics.update(replay_metrics)
        # the producer's and the replay buffer's per-host counts over every host, in one go
        return trajectories, metrics_over_hosts(metrics)

    def batch(self, trajectories: list[Trajectory], step: int) -> RolloutBatch:
        """Trajectories -> the global padded batch the learner takes."""
        buckets = self.config.train.length_buckets
        host = rollout_batch.trajectories_to_batch(
            trajectories, length_buckets=buckets, row_multiple=self._row_multiple(),
            length=_agreed_length(trajectories, buckets))
        if self.config.rollout.mask_stale_tokens:
            # partial rollouts: tokens sampled more than k versions ago carry no loss
            versions = host.token_versions
            host = host.replace(loss_mask=host.loss_mask & ~((versions >= 0) & (
                step - 1 - versions > self.config.rollout.max_staleness)))
        host = host.replace(**algorithms.batch_arrays(host, trajectories, self.config.algo))
        arrays = host.only(algorithms.batch_keys(trajectories, self.config.algo))
        if "length_normalizer" in self.learner.carried_fields():
            # Dr.GRPO's constant normaliser is the generation budget (SIRI moves it) each row
            # was sampled with: a [B] array in the batch, so one compiled update serves every
            # budget, and a stale row keeps the budget of the chunk that sampled it.
            arrays = arrays.replace(length_normalizer=rollout_batch.sampled_budgets(
                trajectories, len(host.tokens),
                rollout_settings.budget_at(self.config, step - 1)))
        return parallel.host_to_global(arrays.check(), self.mesh)

    def score(self, batch: RolloutBatch) -> RolloutBatch:
        """Proximal / reference log-probs and values, then the advantages."""
        batch = self.learner.advantages(self.learner.score(batch))
        jax.block_until_ready(batch["advantages"])
        return batch

    def update(self, batch: RolloutBatch, step: int) -> dict[str, float]:
        """The learner's update; a run whose params it made non-finite stops here, before
        they are synced, evaluated or checkpointed (so every checkpoint holds finite ones)."""
        metrics = self.learner.update(batch, step)
        # the last checkpoint: after the save in flight (of checked, finite params) lands
        self.learner.check_finite(step, lambda: self.ckpt.wait() or self.ckpt.latest_step())
        metrics["train/lr"] = float(self.lr_at(step - 1))
        return metrics

    def sync(self, step: int) -> None:
        """The engine(s) sample with the new weights (version = step) from now on."""
        self.producer.publish(self.learner.policy.params, step)

    def evaluate(self, step: int) -> dict[str, float]:
        started = time.time()
        params = self.learner.policy.params
        if self.eval_engine is not self.engine:  # the asynchronous embedded sampler's own
            self.eval_engine.update_weights(engines.engine_weights(params), str(step))
            serving = contextlib.nullcontext(self.eval_engine)
        else:  # shared with the producer: serving `step`, not a version behind it
            serving = self.producer.engine_at(params, step)
        beat = Heartbeat(f"eval at step {step}: {len(self.eval_list)} tasks",
                         every_s=self.config.log.every_s, enabled=self.is_chief)
        with serving as engine, beat:
            result = eval_suite.evaluate_policy(
                self.config, engine, self.make_env, self.eval_list, self.tokenizer,
                rollout_settings.step_seed(self.config.seed, step, 1),
                failures=self.env_failures, step=step,
                replies_path=eval_suite.replies_file(self.workdir, f"eval_step{step}"))
        self.last_eval = {f"eval/{k}": v for k, v in result.items()}
        return dict(self.last_eval, **{"time/eval_s": time.time() - started})

    def log(self, step: int, record: dict) -> None:
        try:
            self.writer.write(step, record)
        except RunWriteError:
            # a full disk fails the checkpoint in flight too: that error, naming the last
            # good step, is the one to report
            self.ckpt.wait()
            raise

    def save(self, step: int) -> None:
        """Host-side state first (producer, replay), then the sharded state: a checkpoint
        step that exists always has its host state."""
        # The previous (async) save must be complete first: writing this host state prunes
        # the host states of steps not (yet) on disk, and the previous step is the one a kill
        # during this save resumes from. (`ckpt.save` waits for it anyway.)
        self.ckpt.wait()
        state = {"producer": self.producer.state(step), "replay": self.replay.state()}
        self.ckpt.save_host_state(step, state)  # checksummed data, no pickle
        meta = {"config": self.config_record}
        if not self.asynchronous:
            meta["stream"] = state["producer"]["stream"]
        self.ckpt.save(step, self._checkpoint_state(), meta)
        self.saved_step = step

    def stop_if_signalled(self, step: int) -> None:
        """After step `step` (before the last): when any host got SIGTERM / SIGINT, the
        step's checkpoint (unless it was just saved) on disk, then `Preempted` is raised on
        every host (rl_tpu/persistence/preemption.py)."""
        if step >= self.config.train.steps:
            return

        def save():
            if self.saved_step != step:
                self.save(step)
            self.ckpt.wait()
        stop_here(step, os.path.join(self.workdir, "checkpoints"), save)

    def finish(self) -> None:
        """After the last step: checkpoints written, the final policy exported, curves drawn.
        Non-finite params are never exported (nor is the run marked finished)."""
        self.ckpt.wait()
        self.learner.check_finite(self.config.train.steps, self.ckpt.latest_step)
        lora_run = lora.is_on(self.model_cfg)
        if self.config.checkpoint.export_hf:
            policy_io.export_hf(os.path.join(self.workdir, "final_hf"), self.model_cfg,
                                self.learner.policy.params, self.tokenizer)
            if lora_run:  # the adapters alone as well, in PEFT's format
                policy_io.export_adapter(os.path.join(self.workdir, "final_adapter"),
                                         self.model_cfg, self.learner.policy.params,
                                         policy_io.model_path(self.config, self.workdir))
        outputs = [metrics_lib.METRICS_FILE]
        if self.is_chief and self.config.log.plot:
            metrics_lib.plot_curves(self.workdir, self.curve_keys)
            outputs.append("curves.png")
        if self.config.checkpoint.export_hf:
            outputs += ["final_hf"] + (["final_adapter"] if lora_run else [])
        if self.is_chief:  # last: a run killed before this point resumes and finishes again
            record = {"step": self.config.train.steps, "config": self.config_record,
                      "eval": {k: float(v) for k, v in self.last_eval.items()
                               if k.startswith("eval/")},
                      "outputs": outputs}
            metrics_lib.atomic_write_text(os.path.join(self.workdir, FINISHED_FILE),
                                          json.dumps(record, indent=1) + "\n")

    def close(self, after_error: bool = False) -> None:
        """Stops the producer, lets the checkpoint in flight land, closes the writers: each
        of them, whichever fails. The first failure is raised after all are closed, unless
        the run is `after_error` (a checkpoint or metrics write that failed: closing fails
        the same way): that error is the one reported, these are logged in a line each."""
        closers = [self.ckpt.close] + ([self.writer.close] if self.writer is not None else [])
        if getattr(self, "producer", None) is not None:
            closers.insert(0, self.producer.close)
        first = None
        for close in closers:
            try:
                close()
            except Exception as err:  # pylint: disable=broad-except
                if after_error:
                    log.warning("while stopping after an error, closing failed too: %s",
                                str(err).splitlines()[0][:300] if str(err) else repr(err))
                first = first or err
        if first is not None and not after_error:
            raise first

    def start_producer(self) -> None:
        if self.asynchronous:
            self.producer.start()

    # -- rollout pieces -----------------------------------------------------------------

    def _make_producer(self):
        config = self.config
        algo, g = config.algo, config.train.samples_per_task
        per_host = config.train.tasks_per_step // jax.process_count()

        def select(played, play_more, any_host):
            return algorithms.select_groups(played, per_host, g, algo, play_more, any_host)

        to_engine = engines.engine_weights
        if not self.asynchronous:
            return SyncProducer(self._play, select, self.stream, self.engine, to_engine,
                                lambda flag: parallel.across_hosts(flag, "any"))
        partial = None
        if config.rollout.partial_token_budget:
            partial = PartialRollouts(self._play_partial, g)
        return AsyncProducer(self._play, select, self.stream, self.engine, to_engine,
                             max_staleness=config.rollout.max_staleness,
                             deterministic=config.rollout.deterministic,
                             groups_per_step=per_host, partial=partial,
                             keep_stale=config.rollout.mask_stale_tokens,
                             shared_with_eval=self.eval_engine is self.engine)

    def episode_args(self, tasks: list, chunk: int, round_index: int) -> dict:
        """The episode loop's keyword arguments for chunk `chunk`'s tasks: the chunk's plan
        (its horizon, budget and seeds, worked out here alone) and sampling; self-play's
        solver plays with the same. The loop records the horizon and budget on each
        trajectory (info), where the normaliser and the metrics read them, however many steps
        later a free-running producer's rows are trained on."""
        config, env_cfg = self.config, self.config.env
        return dict(
            tokenizer=self.tokenizer, max_turns=rollout_settings.horizon_at(config, chunk - 1),
            group_ids=[p for p, _ in tasks],
            max_new_tokens_per_turn=rollout_settings.budget_at(config, chunk - 1),
            max_context_tokens=env_cfg.max_context_tokens,
            sampling=rollout_settings.sampling_params(
                config, rollout_settings.step_seed(config.seed, chunk, 10 + round_index)),
            samples_per_task=config.train.samples_per_task,
            step_timeout_s=env_cfg.step_timeout_s, reward_reduce=env_cfg.reward_reduce)

    def _play_partial(self, tasks: list, chunk: int, round_index: int, resume: list):
        """Partial rollouts: the paused episodes `resume`, then `tasks`, within the chunk's
        token budget; (ended trajectories, episodes still running)."""
        args = self.episode_args(tasks, chunk, round_index)
        ended, paused = play_partial(
            self.engine, self.make_env, [t for _, t in tasks],
            token_budget=self.config.rollout.partial_token_budget, resume=resume, **args)
        known = dict(tasks) | {ep.group_id: ep.task for ep in resume}
        for traj in ended:
            traj.info["task"] = (traj.group_id, known[traj.group_id])
        self._score(ended)
        algorithms.shape_overlong(ended, self.config.algo, args["max_new_tokens_per_turn"])
        return ended, paused

    def _play(self, tasks: list, chunk: int, round_index: int) -> list[Trajectory]:
        """G episodes of each (position, task), sampled for step `chunk`: task-major, each
        group id the task's global stream position (the same whichever host plays it)."""
        config = self.config
        # TL-GRPO: branching; env agent_program: the user's program (rl_tpu/agent/program.py)
        play = player_for(config, algorithms.episode_player(config.algo, config.seed))
        args = self.episode_args(tasks, chunk, round_index)
        trajectories = play(self.engine, self.make_env, [t for _, t in tasks], **args)
        g = config.train.samples_per_task
        for i, traj in enumerate(trajectories):
            if traj.group_id != tasks[i // g][0]:
                raise RuntimeError("the agent loop returned trajectories out of task order")
            traj.info["task"] = tasks[i // g]  # for a resumed producer to play it again
        self._score(trajectories)
        algorithms.shape_overlong(trajectories, config.algo, args["max_new_tokens_per_turn"])
        return trajectories

    def _score(self, trajectories: list[Trajectory]) -> None:
        """The learned rewards' part of each played trajectory's reward (reward.*: a reward
        model, a judge), before any shaping, so DAPO's overlong penalty applies to the mix as
        to a rule."""
        if self.reward_mix is not None:
            self.reward_mix.apply(trajectories)

    def _rollout_metrics(self, trajectories: list[Trajectory], step: int,
                         stats: dict[str, float] | None = None) -> dict[str, float]:
        """Of the trajectories trained on (after DAPO's selection), over every host; `stats`
        their `episode_stats` when the caller has them (a collective, made once)."""
        stats, out = stats or episode_stats(trajectories), {}
        n = max(stats["episodes"], 1)
        # an env that reports rule decisions (envs/tipping.py): the rate of rule-breaking
        # among valid replies, and the share of replies that were valid, apart; an env that
        # checks an answer format (envs/word_problems.py): the share of replies without it
        for rate in ("violation_rate", "format_valid_rate", "format_failed"):
            if rate in stats:
                out[f"rollout/{rate}"] = stats[rate]
        out |= source_metrics(trajectories, self.reward_mix.sources if self.reward_mix else ())
        return out | {
            "rollout/weight_version": float(oldest_version_over_hosts(trajectories)),
            "rollout/reward": stats["reward"], "rollout/success": stats["success"],
            "rollout/response_length": stats["tokens"], "rollout/turns": stats["turns"],
            # env steps this step's episodes took (the env's own count: unparseable replies
            # and agent-program calls step no env): ScalingInter-RL compares horizons at equal
            # interaction (benchmarks/compare_runs.py --x env_steps)
            "rollout/env_steps": float(stats["env_steps"]),
            "rollout/env_error_frac": stats["env_errors"] / n,
            "rollout/context_limit_frac": stats["context_limits"] / n,
            # the schedules at this step (what chunk `step` is sampled with), and the budget
            # the rows trained on were sampled with (earlier chunks' in free-running mode)
            "train/horizon": rollout_settings.horizon_at(self.config, step - 1),
            "train/max_new_tokens": rollout_settings.budget_at(self.config, step - 1),
            "rollout/max_new_tokens": float(np.mean(rollout_batch.sampled_budgets(
                trajectories, len(trajectories),
                rollout_settings.budget_at(self.config, step - 1))))}

    def _prefill_metrics(self) -> dict[str, float]:
        """The embedded sampler's prompt tokens since the last call (eval's included): those
        run through the model, and those whose K/V came from its prefix cache; and the
        prefill / decode shapes it has compiled so far (a count that grows mid-run means
        compiles mid-run). Under time/: they measure speed, and a resumed run starts with an
        empty cache."""
        stats = getattr(self.engine, "stats", None)
        if not callable(stats):
            return {}
        now, before = stats(), self._engine_counts
        self._engine_counts = now
        out = {f"time/{key}": float(now[key] - before.get(key, 0))
               for key in ("prefill_tokens", "reused_tokens") if key in now}
        if "compiled_programs" in now:
            out["time/sampler_programs"] = float(now["compiled_programs"])
        return out

    def _row_multiple(self) -> int:
        """This host's share of the learner's row multiple (compile_check pads as this does)."""
        return shapes.host_row_multiple(self.learner.row_multiple(), jax.process_count())

    # -- checkpoint pieces --------------------------------------------------------------

    def _checkpoint_state(self) -> dict:
        """What a checkpoint holds: the learner's states, each cut to what it trains (LoRA:
        the adapters and their moments; the frozen base is reloaded at start)."""
        state = {"policy": self.learner.policy.checkpoint_view()}
        if self.learner.critic is not None:
            state["critic"] = self.learner.critic.checkpoint_view()
        return state

    def _load_checkpoint_state(self, restored: dict) -> None:
        self.learner.policy = self.learner.policy.from_checkpoint(restored["policy"])
        if "critic" in restored:
            self.learner.critic = self.learner.critic.from_checkpoint(restored["critic"])
        if self.learner.reference_params is not None:
            self.learner.reference_params = self.ckpt.restore_static(
                REFERENCE, self.learner.reference_params)


# ----------------------------------------------------------------------------- shapes


def _agreed_length(trajectories, buckets) -> int:
    """The length bucket every host uses this step: the bucket of the longest row anywhere."""
    longest = int(parallel.across_hosts(max(len(t) for t in trajectories), "max"))
    return bucket_length(longest, buckets)
