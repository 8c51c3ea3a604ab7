"""A loop's policies P_0, P_1, ... as HF directories under its workdir, one round at a time.

The loops around the update (expert iteration, RLoop, online DPO) share this plumbing:

    W/start/policy_hf            P_0: the initial model, after the SFT warm start (sft.steps
                                 steps, checkpointed in W/start/checkpoints) when there is one
    W/round_R/...                round R's own work (samples, fine-tune checkpoints, an RL run)
    W/round_R/policy_hf          P_{R+1}, written when round R ends
    W/round_R/done.json          round R's summary; its presence says the round is complete
    W/metrics.jsonl              one line a round: step 0 is P_0's eval, step R+1 P_{R+1}'s

With model.lora.rank > 0 every round trains fresh adapters on its frozen P_r and P_{r+1} is
P_r with them merged in (each policy stays a plain HF dir): the chain keeps LoRA's training
memory (the optimizer holds adapters only) while each round's reference, P_r itself, is the
round's start with its adapters at zero. The loop's own engine samples and evaluates the
merged policy, synced whole once a round.

A round writes its policy before its done record, and every step of a round is resumable on
its own, so a loop killed anywhere and started again continues where it was: finished rounds
are skipped (their policy loaded from disk), an unfinished one resumes its own checkpoints.
"""

from __future__ import annotations

import json
import logging
import os
import time

import jax
import ml_collections

from rl_tpu import metrics as metrics_lib
from rl_tpu import parallel
from rl_tpu.core.shared_weights import wait_for_shared_weights
from rl_tpu.data.tasks import TaskStream, eval_tasks
from rl_tpu.heartbeat import Heartbeat
from rl_tpu.models import hf, lora
from rl_tpu.recipes import (engines, env_factory, eval_suite, placement, policy_io,
                            rollout_settings, run_summary, sft)
from rl_tpu.recipes.config import check
from rl_tpu.recipes.experience import read_json, write_json

log = logging.getLogger(__name__)

POLICY_DIR = "policy_hf"
# W/curves.png of a loop: one point a round (absent keys are skipped)
LOOP_CURVES = ("eval/success", "loop/sample_success", "loop/kept", "loop/pairs",
               "eval/violation_rate", "loop/total_sampled_tokens")
DONE_FILE = "done.json"


class PolicyChain:
    """Everything a loop of rounds holds: mesh, model, tokenizer, envs, eval tasks, a rollout
    engine re-pointed at each round's policy, and the metrics writer."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str):
        check(config)
        parallel.maybe_initialize_distributed()
        os.makedirs(workdir, exist_ok=True)
        self.config, self.workdir = config, workdir
        self.is_chief = jax.process_index() == 0
        self.mesh = placement.make_mesh(config)
        self.base_path = policy_io.model_path(config, workdir)
        self.model_cfg, self.model, params, self.tokenizer = policy_io.load_policy(
            config, self.base_path, self.mesh)
        self.make_env = env_factory.make_env_factory(config)
        self.source = env_factory.task_source(config, self.make_env)
        self.eval_list = [t for _, t in eval_tasks(self.source, config.env.eval_split,
                                                   config.eval.num_tasks)]
        self.rounds_done = 0
        while os.path.exists(self.done_path(self.rounds_done)):
            self.rounds_done += 1
        # the rounds every host sees done (one that saw the chief's newest record late
        # would otherwise start a round behind the others)
        self.rounds_done = int(parallel.across_hosts(self.rounds_done, "min"))
        made = os.path.isfile(os.path.join(self.policy_path(0), "config.json"))
        run_summary.announce(config, self.base_path, self.model_cfg, params,
                             run_summary.warm_start_plan(config, done="done (P_0 is saved)"
                                                         if made else ""))
        del params  # each round loads its own start
        self.writer = metrics_lib.MetricsWriter(
            workdir, resume_step=self.rounds_done + 1 if self.rounds_done else None,
            tensorboard=config.log.tensorboard, enabled=self.is_chief,
            wandb_project=config.log.wandb_project)
        self._engine = None
        self.started = time.time()

    # -- where things are ------------------------------------------------------------------

    def round_dir(self, r: int) -> str:
        return os.path.join(self.workdir, f"round_{r}")

    def done_path(self, r: int) -> str:
        return os.path.join(self.round_dir(r), DONE_FILE)

    def policy_path(self, r: int) -> str:
        """P_r's HF dir: W/start/policy_hf for r = 0, else round r-1's."""
        where = os.path.join(self.workdir, "start") if r == 0 else self.round_dir(r - 1)
        return os.path.join(where, POLICY_DIR)

    # -- policies ----------------------------------------------------------------------------

    def load(self, r: int):
        """P_r's params in their shardings (built first for r = 0); in a LoRA loop with fresh
        adapters, seeded by the round, that `self.model` trains on the frozen P_r."""
        if r == 0 and not os.path.isfile(os.path.join(self.policy_path(0), "config.json")):
            self._make_start()
        _, params = hf.load(self.policy_path(r), mesh=self.mesh, dtype=self.config.model.dtype,
                            remat=self.config.model.remat,
                            scan_layers=self.config.model.scan_layers,
                            attention_block=self.config.model.attention_block,
                            attention_impl=self.config.model.attention_impl)
        return self.adapted(params, r)

    def next_start(self, r: int, params):
        """What round r+1 starts from after round r ended with `params`: those themselves, or
        in a LoRA loop P_{r+1} (merged) with round r+1's fresh adapters, as `load(r + 1)`
        gives it on a resume, so a resumed loop repeats the uninterrupted one."""
        if not lora.is_on(self.model_cfg):
            return params
        return self.adapted(policy_io.merged(self.model_cfg, params)[1], r + 1)

    def adapted(self, base, r: int):
        """`base` as `self.model` reads it: with round r's fresh adapters in a LoRA loop."""
        if not lora.is_on(self.model_cfg):
            return base
        return policy_io.with_fresh_adapters(
            self.model, base, self.mesh, rollout_settings.step_seed(self.config.seed, r, 40))

    def _make_start(self) -> None:
        """P_0: the initial model, fine-tuned on the warm-start demonstrations when sft.steps
        > 0 (resumable), exported and evaluated (metrics step 0)."""
        config = self.config
        # as self.model reads it: in a LoRA loop with model.lora.path's adapter or fresh ones,
        # which the warm start trains and P_0 has merged in
        _, _, params, _ = policy_io.load_policy(config, self.base_path, self.mesh)
        record: dict[str, float] = {}
        if config.sft.steps > 0:
            if not config.sft.data_path:
                record["eval/teacher_success"] = sft.teacher_success(
                    self.make_env, self.eval_list, config.sft.teacher_skill, config.seed,
                    max_turns=eval_suite.eval_horizon(config))
            params = sft.warm_start(
                config, params, self.model, self.mesh, self.tokenizer, self.make_env,
                lambda _: _NoWriter(),
                checkpoint_dir=os.path.join(self.workdir, "start", "checkpoints"))
        record.update(self.evaluate(params, "start"))
        self._save_policy(0, params)
        self.writer.write(0, record | {"time/loop_s": time.time() - self.started})
        if self.is_chief:
            print(f"P_0: eval success {record['eval/success']:.3f}", flush=True)

    def _save_policy(self, r: int, params) -> None:
        """P_r's HF dir, written by process 0 into the workdir every host shares (as orbax's
        checkpoints need); every host waits for it, so none reads it half-written."""
        cfg, params = policy_io.merged(self.model_cfg, params)
        hf.save(self.policy_path(r), cfg, params, tokenizer=self.tokenizer.hf)
        parallel.sync_hosts(f"policy_{r}")

    def finish_round(self, r: int, params, record: dict) -> dict:
        """Writes P_{r+1}, evaluates it, logs the round at step r+1, marks it done.
        loop/total_sampled_tokens adds up the rounds' loop/sampled_tokens."""
        out = dict(record, **self.evaluate(params, f"round{r + 1}"))
        before = (read_json(self.done_path(r - 1)) or {}) if r else {}
        out["loop/total_sampled_tokens"] = (before.get("loop/total_sampled_tokens", 0.0)
                                            + record.get("loop/sampled_tokens", 0.0))
        out["time/loop_s"] = time.time() - self.started
        self._save_policy(r + 1, params)
        self.writer.write(r + 1, out)
        if self.is_chief:
            write_json(self.done_path(r), out)
            print(f"round {r}: P_{r + 1} eval success {out['eval/success']:.3f}", flush=True)
        self.rounds_done = r + 1
        return out

    def final_eval(self) -> dict:
        return read_json(self.done_path(self.rounds_done - 1)) or {}

    # -- sampling and evaluation ---------------------------------------------------------------

    def engine(self, params, version: str):
        """The rollout engine, serving `params` as `version` (made once, then re-pointed).
        A LoRA policy is served merged: each round has a new base, so the engine holds none."""
        cfg, params = policy_io.merged(self.model_cfg, params)
        if self._engine is None:
            self._engine = engines.make_engine(self.config, cfg, params,
                                               self.tokenizer, self.workdir, version=version)
        else:
            self._engine.update_weights(parallel.host_copies(params), version)
            wait_for_shared_weights(self._engine, version)
        return self._engine

    def evaluate(self, params, version: str) -> dict[str, float]:
        started = time.time()
        engine = self.engine(params, version)
        with Heartbeat(f"eval of {version}: {len(self.eval_list)} tasks",
                       every_s=self.config.log.every_s, enabled=self.is_chief):
            result = eval_suite.evaluate_policy(
                self.config, engine, self.make_env, self.eval_list, self.tokenizer,
                self.config.seed,
                replies_path=eval_suite.replies_file(self.workdir, f"eval_{version}"))
        return {f"eval/{k}": v for k, v in result.items()} | {
            "time/eval_s": time.time() - started}

    def round_tasks(self, r: int, num: int) -> list:
        """Round r's `num` training tasks: the stream's r-th chunk (disjoint across rounds)."""
        stream = TaskStream(self.source, self.config.env.train_split, tasks_per_step=num,
                            seed=self.config.seed, process_index=0, process_count=1)
        stream.set_state(dict(stream.get_state(), step=r))
        return [t for _, t in stream.next()]

    def host_tasks(self, r: int, num: int) -> tuple[int, list]:
        """(offset, tasks): this host's share of round r's `num` tasks, a contiguous run from
        position `offset` of the round's list (every host plays its own, with per-task seeds
        keyed by position, so the split does not change what is sampled)."""
        tasks = self.round_tasks(r, num)
        parallel.check_same_on_every_host(f"round {r}'s tasks", [t.task_id for t in tasks])
        index, count = jax.process_index(), jax.process_count()
        start, end = index * len(tasks) // count, (index + 1) * len(tasks) // count
        return start, tasks[start:end]

    def gather_records(self, record) -> list:
        """Every host's JSON-able `record` (its samples, its pairs), in host order, on every
        host: per-host lists are gathered explicitly (a collective)."""
        return [json.loads(b) for b in
                parallel.across_hosts_bytes(json.dumps(record).encode())]

    def host_file(self, r: int, name: str) -> str:
        """W/round_r/<name>.process<i>.json: what this host sampled in round r, its own to
        write and to read back on resume (hosts sample different tasks)."""
        return os.path.join(self.round_dir(r), f"{name}.process{jax.process_index()}.json")

    def fine_tune(self, r: int, params, examples, name: str = "rft") -> tuple:
        """loop.sft_steps steps of `params` on `examples`, checkpointed in W/round_r/<name>."""
        loop = self.config.loop
        if not examples:
            log.warning("round %d kept no samples: the policy is not fine-tuned", r)
            return params, {}
        last: dict[str, float] = {}

        def on_metrics(step, m):
            last.update({f"sft/{k}": v for k, v in m.items()})

        params = sft.fine_tune(self.config, params, self.model, self.mesh, examples,
                               steps=loop.sft_steps, lr=loop.sft_lr,
                               batch_size=loop.sft_batch_size,
                               checkpoint_dir=os.path.join(self.round_dir(r), name, "checkpoints"),
                               on_metrics=on_metrics)
        return params, last | {"loop/examples": float(len(examples))}

    def close(self) -> None:
        self.writer.close()
        if self.is_chief and self.config.log.plot and os.path.exists(self.writer.path):
            metrics_lib.plot_curves(self.workdir, LOOP_CURVES)


class _NoWriter:
    """The warm start's per-step metrics are not kept in a loop's round-indexed file."""

    def write(self, step, record) -> None:
        del step, record
