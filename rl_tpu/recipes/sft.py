"""Supervised fine-tuning: on an env teacher's demonstrations or on a JSONL of chats.

    python -m launch.sft --config configs/quickstart.py --workdir /tmp/sft

Used two ways: as the quickstart's warm start before RL (`warm_start`, called by the RL recipe
when `sft.steps > 0`), and on its own (`run`), which trains, evaluates and exports an HF dir.

Examples are token-exact with the RL rollouts that follow: a demonstration is the chat
template's prompt (system + first observation + generation prompt) followed by the reply's ids
and the eos id, exactly the ids the agent loop would hold had the policy sampled that reply;
the loss covers the reply and its eos. A JSONL chat ({"messages": [...]}) is built the same
way turn by turn, each assistant turn carrying loss.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from typing import Any, Callable, Iterator, Optional, Sequence

import jax
import ml_collections
import numpy as np

from rl_tpu import metrics as metrics_lib
from rl_tpu import parallel
from rl_tpu.agent import conversation_start, env_tools, observation_messages
from rl_tpu.core.env import Env, Task
from rl_tpu.data.tasks import eval_tasks
from rl_tpu.heartbeat import Heartbeat
from rl_tpu.metrics import StepLog, progress
from rl_tpu.models import lora
from rl_tpu.models.tokenizer import ChatTokenizer
from rl_tpu.persistence import preemption
from rl_tpu.persistence.checkpoint import Checkpointer
from rl_tpu.recipes import (engines, env_factory, eval_suite, placement, policy_io, run_summary,
                            train_states)
from rl_tpu.recipes.config_checks import check
from rl_tpu.train import steps
from rl_tpu.train.batching import bucket_length
from rl_tpu.train.state import TrainState

log = logging.getLogger(__name__)

Example = tuple[list[int], list[bool]]  # (ids, loss mask)


def teacher_episode(env: Env, task: Task, rng: random.Random, skill: float,
                    max_turns: int) -> tuple[list[dict], bool]:
    """Plays the env's teacher (`env.teacher_reply(task, rng, skill)`, its reply in the env's
    current state) through one episode of up to `max_turns` turns, as the agent loop would:
    (the chat, conversation start included, ending with the teacher's last reply; success).
    A function-calling env's tool results come back as its observation messages (role
    "tool"), as the loop appends them; render the chat with the env's `env_tools(env)`."""
    observation = env.reset(task)
    messages = conversation_start(env) + [{"role": "user", "content": observation}]
    success = False
    for turn in range(max_turns):
        reply = env.teacher_reply(task, rng, skill)
        messages.append({"role": "assistant", "content": reply})
        result = env.step(reply)
        success = bool(result.info.get("success"))
        if result.done or turn + 1 >= max_turns:
            break  # the final observation is never followed by a turn: nothing to learn
        messages += observation_messages(env.name, result)
    return messages, success


def _teacher_env(make_env: Callable[[], Env]) -> Env:
    env = make_env()
    if not hasattr(env, "teacher_reply"):
        env.close()
        raise ValueError(f"env {env.name!r} has no teacher (teacher_reply); give demonstrations "
                         "as a JSONL of chats with sft.data_path")
    return env


def teacher_examples(make_env: Callable[[], Env], tasks: Sequence[Task],
                     tokenizer: ChatTokenizer, skill: float, seed: int,
                     max_turns: int = 1) -> list[Example]:
    """One demonstration episode per task from the env's teacher; every teacher turn carries
    loss, token-exact with what the agent loop holds had the policy sampled those replies."""
    env, rng = _teacher_env(make_env), random.Random(seed)
    out = []
    for task in tasks:
        messages, _ = teacher_episode(env, task, rng, skill, max_turns)
        out.append(chat_example(messages, tokenizer, f"teacher demo of {task.task_id}",
                                tools=env_tools(env)))
    env.close()
    return out


def teacher_success(make_env: Callable[[], Env], tasks: Sequence[Task], skill: float,
                    seed: int, max_turns: int = 1) -> float:
    """The teacher's own success rate on `tasks` (this host's share: the rate is over every
    host's), episodes of up to `max_turns` turns. Each task's draws are seeded by the task
    itself, so the rate does not depend on how the tasks are split between hosts."""
    env = _teacher_env(make_env)
    wins = sum(teacher_episode(env, task, random.Random(f"{seed}/{task.task_id}"), skill,
                               max_turns)[1] for task in tasks)
    env.close()
    wins, count = parallel.across_hosts(np.array([wins, len(tasks)], np.float64), "sum")
    return float(wins / max(count, 1))


def chat_examples(path: str, tokenizer: ChatTokenizer) -> list[Example]:
    """A JSONL of {"messages": [{"role", "content"}, ...]}; every assistant turn is trained."""
    out = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                messages = json.loads(line)["messages"]
                assert isinstance(messages, list) and messages
            except (ValueError, KeyError, TypeError, AssertionError):
                raise ValueError(f"{path}:{number}: expected a JSON object with a non-empty "
                                 "'messages' list of {role, content}") from None
            out.append(chat_example(messages, tokenizer, f"{path}:{number}"))
    if not out:
        raise ValueError(f"{path} holds no chats")
    return out


def chat_example(messages, tokenizer: ChatTokenizer, where: str,
                 tools: Optional[Sequence[dict]] = None) -> Example:
    """The ids of a chat and its loss mask (on every assistant turn and its eos), built as the
    agent loop builds a history: the prompt rendered once, each assistant turn its own ids,
    each run of other messages (observations; a reply's tool results) appended after it
    token-exactly. `tools`: the schemas the chat is rendered with (function calling)."""
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
    if first is None:
        raise ValueError(f"{where}: the chat has no assistant message to learn from")
    ids = tokenizer.apply_chat_template(messages[:first], add_generation_prompt=True,
                                        tools=tools)
    mask = [False] * len(ids)
    i = first
    while i < len(messages):
        if messages[i].get("role") == "assistant":
            reply = tokenizer.encode(messages[i]["content"]) + [tokenizer.eos_token_id]
            ids, mask, i = ids + reply, mask + [True] * len(reply), i + 1
            continue
        # A run of messages goes in at once: a template may render consecutive tool
        # results as one turn (Qwen2.5), which one-at-a-time appends would not reproduce.
        end = next((j for j in range(i, len(messages))
                    if messages[j].get("role") == "assistant"), len(messages))
        new = tokenizer.append_messages(ids, messages[:i], messages[i:end],
                                        add_generation_prompt=end < len(messages), tools=tools)
        mask += [False] * (len(new) - len(ids))
        ids, i = new, end
    return ids, mask


def padded_rows(examples: Sequence[Example], t: int) -> dict:
    """(ids, loss mask) examples as [B, t] tokens, loss_mask, segment_ids, positions."""
    b = len(examples)
    tokens = np.zeros((b, t), np.int32)
    mask = np.zeros((b, t), bool)
    segments = np.zeros((b, t), np.int32)
    for i, (ids, m) in enumerate(examples):
        tokens[i, :len(ids)], mask[i, :len(ids)], segments[i, :len(ids)] = ids, m, 1
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy()
    return {"tokens": tokens, "loss_mask": mask, "segment_ids": segments, "positions": positions}


class ExampleBatches:
    """This host's rows of global batches of `batch_size` examples, reshuffled each epoch
    (deterministic by seed, the same order on every host). host = (index, count).

    group_by_length=k > 0 draws k batches' worth of examples at a time, sorts them by length
    and cuts them into k batches served in random order: rows of a batch are of like length,
    so a batch pads to its own bucket instead of to its longest outlier's. Multi-turn episodes
    range from a few hundred tokens to the context limit, and attention's cost grows with the
    square of the padded length.

    An iterator whose position is checkpointable: `get_state()` is a JSON-able dict (the
    shuffling rng's state and the drawn-but-unserved rows) that `set_state` puts back, so a
    resumed SFT run sees exactly the batches an uninterrupted one would have."""

    def __init__(self, examples: Sequence[Example], batch_size: int, buckets: Sequence[int],
                 seed: int, host: tuple[int, int] = (0, 1), group_by_length: int = 0):
        if not examples:
            raise ValueError("no examples to make SFT batches of")
        # each host takes its slice of the same global list: a host with another list would
        # train on rows no one chose (or skip some), silently
        parallel.check_same_on_every_host("SFT examples", list(examples))
        self.examples, self.batch_size, self.buckets = examples, batch_size, tuple(buckets)
        self.host, self.group_by_length = host, group_by_length
        self._rng = np.random.RandomState(seed)
        self._order: list[int] = []
        self._ready: list[list[int]] = []

    def __iter__(self) -> "ExampleBatches":
        return self

    def __next__(self) -> dict:
        if not self._ready:
            self._draw_pool()
        rows = self._ready.pop(0)
        # every host pads to the bucket of the longest row of the GLOBAL batch
        t = bucket_length(max(self.length(r) for r in rows), self.buckets)
        index, count = self.host
        local = self.batch_size // count
        return self.collate(rows[index * local:(index + 1) * local], t)

    def length(self, r: int) -> int:
        """Example r's length in tokens (what a batch pads to)."""
        return len(self.examples[r][0])

    def collate(self, rows: Sequence[int], t: int) -> dict:
        """This host's rows as the padded [rows, t] arrays a step takes."""
        return padded_rows([self.examples[r] for r in rows], t)

    def _draw_pool(self) -> None:
        pool = max(1, self.group_by_length) * self.batch_size
        while len(self._order) < pool:
            self._order += [int(i) for i in self._rng.permutation(len(self.examples))]
        drawn, self._order = self._order[:pool], self._order[pool:]
        if self.group_by_length > 0:
            drawn.sort(key=self.length)
            cuts = [drawn[i:i + self.batch_size] for i in range(0, pool, self.batch_size)]
            self._ready = [cuts[i] for i in self._rng.permutation(len(cuts))]
        else:
            self._ready = [drawn]

    def get_state(self) -> dict:
        kind, keys, pos, has_gauss, gauss = self._rng.get_state()
        return {"rng": [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(gauss)],
                "order": list(self._order), "ready": [list(r) for r in self._ready],
                "num_examples": len(self.examples)}

    def set_state(self, state: dict) -> None:
        if state["num_examples"] != len(self.examples):
            raise ValueError(f"the checkpointed SFT data position is over "
                             f"{state['num_examples']} examples, but {len(self.examples)} were "
                             "given: resume with the same data (or start a new workdir)")
        kind, keys, pos, has_gauss, gauss = state["rng"]
        self._rng.set_state((kind, np.asarray(keys, np.uint32), pos, has_gauss, gauss))
        self._order, self._ready = list(state["order"]), [list(r) for r in state["ready"]]


def train(state: TrainState, model, mesh, data: Iterator[dict], *, num_steps: int,
          start_step: int = 0,
          on_step: Optional[Callable[[int, TrainState, dict], None]] = None) -> TrainState:
    """SFT steps `start_step + 1 .. num_steps` on `data` (this host's rows of each global
    batch); on_step(step, state, host metrics) after each (to log, or to checkpoint)."""
    step_fn = steps.compile_step(steps.make_sft_step(model), state, mesh)

    for i in progress(range(start_step, num_steps), "SFT steps",
                      enabled=jax.process_index() == 0):
        state, m = step_fn(state, parallel.host_to_global(next(data), mesh))
        if on_step is not None:
            on_step(i + 1, state, {k: float(v) for k, v in jax.device_get(m).items()})
    return state


def example_batches(config: ml_collections.ConfigDict, examples: Sequence[Example], mesh,
                    batch_size: int, max_length: int) -> ExampleBatches:
    """The config's SFT batches of `examples` for this host (sft.group_by_length, seed)."""
    if batch_size % parallel.data_parallel_size(mesh):
        raise ValueError(f"the SFT batch size {batch_size} must divide by the data-parallel "
                         f"size {parallel.data_parallel_size(mesh)}")
    return ExampleBatches(examples, batch_size, bucket_lengths(config, max_length), config.seed,
                          host=(jax.process_index(), jax.process_count()),
                          group_by_length=config.sft.group_by_length)


def restore(ckpt, state: TrainState, data: ExampleBatches) -> tuple[int, TrainState]:
    """The latest SFT checkpoint in `ckpt` (a `Checkpointer`), if any: (its step, the state),
    with `data` moved to the position it had then; (0, state) for a fresh run."""
    if ckpt.latest_step() is None:
        return 0, state
    step, restored, saved = ckpt.restore({"policy": state.checkpoint_view()})
    data.set_state(saved["data"])
    return step, state.from_checkpoint(restored["policy"])


def checkpoint_every(ckpt, data: ExampleBatches, every: int, last: int,
                     meta: Optional[dict] = None) -> Callable[[int, TrainState], None]:
    """An after-step hook that saves the state and the data position every `every` steps and
    at step `last`: a run killed mid-way and started again (`restore`) repeats the
    uninterrupted run number for number."""
    def save(step: int, state: TrainState) -> None:
        due = step % every == 0 or step == last
        if due:
            ckpt.save(step, {"policy": state.checkpoint_view()},
                      {"data": data.get_state(), **(meta or {})})
        if step < last:  # SIGTERM / SIGINT on any host: this step's checkpoint, then stop

            def save_now():
                if not due:
                    ckpt.save(step, {"policy": state.checkpoint_view()},
                              {"data": data.get_state(), **(meta or {})})
                ckpt.wait()
            preemption.stop_here(step, str(ckpt.directory), save_now)
    return save


def checkpointed_steps(config: ml_collections.ConfigDict, checkpoint_dir: str,
                       state: TrainState, data: ExampleBatches, step_fn, mesh, num_steps: int,
                       prefix: str) -> tuple[TrainState, dict[str, float]]:
    """Steps 1..num_steps of a compiled `step_fn` on `data`, checkpointed in `checkpoint_dir`
    every checkpoint.every steps with the data position and resumed from it (a killed run
    started again repeats the uninterrupted one); (the state, the last step's metrics as
    {prefix/name: value}). DPO's and the reward model's optimisers run on it."""

    last: dict[str, float] = {}
    with Checkpointer(checkpoint_dir, keep=config.checkpoint.keep,
                      async_save=config.checkpoint.async_save) as ckpt:
        start, state = restore(ckpt, state, data)
        save = checkpoint_every(ckpt, data, config.checkpoint.every, num_steps)
        for step in range(start + 1, num_steps + 1):
            state, m = step_fn(state, parallel.host_to_global(next(data), mesh))
            last = {f"{prefix}/{k}": float(v) for k, v in jax.device_get(m).items()}
            save(step, state)
        ckpt.wait()
    return state, last


def fine_tune(config: ml_collections.ConfigDict, params, model, mesh,
              examples: Sequence[Example], *, steps: int, lr: float, batch_size: int,
              checkpoint_dir: Optional[str] = None, on_metrics=None,
              on_start: Optional[Callable[[int], None]] = None):
    """`steps` SFT steps of `params` on `examples` at `lr` (the config's schedule, warmup
    sft.warmup_steps), checkpointed in `checkpoint_dir` every checkpoint.every steps when it
    is given (and resumed from it; SIGTERM / SIGINT then save the step and stop the run:
    rl_tpu/persistence/preemption.py); returns the new params. The sampling loops (expert iteration,
    RLoop) call this for each round's fine-tune; on_start(the step it resumes from, 0 when
    fresh) before the first step, on_metrics(step, metrics) after each."""

    optim = train_states.optim_config(lr, config, steps, warmup_steps=config.sft.warmup_steps)
    state = train_states.new_state(params, optim)
    data = example_batches(config, examples, mesh, batch_size, config.sft.max_length)
    if checkpoint_dir is None:
        if on_start is not None:
            on_start(0)
        return train(state, model, mesh, data, num_steps=steps,
                     on_step=lambda i, _, m: on_metrics and on_metrics(i, m)).params
    with Checkpointer(checkpoint_dir, keep=config.checkpoint.keep,
                      async_save=config.checkpoint.async_save) as ckpt:
        start, state = restore(ckpt, state, data)
        if on_start is not None:
            on_start(start)
        save = checkpoint_every(ckpt, data, config.checkpoint.every, steps)

        def after(step, state, metrics):
            if on_metrics is not None:
                on_metrics(step, metrics)
            save(step, state)

        state = train(state, model, mesh, data, num_steps=steps, start_step=start,
                      on_step=after)
        ckpt.wait()
    return state.params


def demonstrations(config: ml_collections.ConfigDict, make_env: Callable[[], Env],
                   tokenizer) -> list[Example]:
    """The config's SFT examples: the chats of sft.data_path, else sft.num_demos episodes of
    the env's teacher at sft.teacher_skill on the first train tasks."""
    s = config.sft
    if s.data_path:
        return chat_examples(s.data_path, tokenizer)
    source = env_factory.task_source(config, make_env)
    tasks = [source.get(config.env.train_split, i) for i in range(s.num_demos)]
    return teacher_examples(make_env, tasks, tokenizer, s.teacher_skill, config.seed,
                            max_turns=config.env.max_turns)


def warm_start(config: ml_collections.ConfigDict, params, model, mesh, tokenizer,
               make_env: Callable[[], Env], open_writer: Callable[[int], Any],
               step_offset: int = 0, checkpoint_dir: Optional[str] = None):
    """SFT the initial params on the configured demonstrations; returns the new params.
    Checkpointed in `checkpoint_dir` when given: a signal saves the step and stops the run
    there (Preempted), and the rerun resumes from it. Metrics go to `open_writer(k)`'s writer
    (k: the SFT step resumed from, 0 when fresh; it is opened then, so that a resumed log keeps
    exactly the lines before it) at step `step_offset + sft_step` (the RL recipe logs them at
    negative steps, before RL's step 0)."""

    s = config.sft
    examples = demonstrations(config, make_env, tokenizer)
    started = last = time.time()
    writer = None
    # where no progress bar shows (a log file): a line every log.every_s seconds
    step_log = StepLog(s.steps, every_s=config.log.every_s, enabled=jax.process_index() == 0,
                       what="warm start: SFT step")

    def on_start(step):
        nonlocal writer
        writer = open_writer(step)
        if step:
            run_summary.say(f"resumed the SFT warm start from its step {step}")

    def on_metrics(step, m):
        nonlocal last
        record = {f"sft/{k}": v for k, v in m.items()} | {"time/sft_s": time.time() - started}
        if step % 10 == 0 or step == s.steps:
            writer.write(step + step_offset, record)
        step_log(step, record | {"time/step_s": time.time() - last})
        last = time.time()

    params = fine_tune(config, params, model, mesh, examples, steps=s.steps, lr=s.lr,
                       batch_size=s.batch_size, checkpoint_dir=checkpoint_dir,
                       on_metrics=on_metrics, on_start=on_start)
    log.info("SFT warm start: %d steps on %d examples in %.1fs", s.steps, len(examples),
             time.time() - started)
    return params


def bucket_lengths(config, max_length: int) -> tuple[int, ...]:
    """The lengths a batch of examples of up to `max_length` tokens may pad to: the
    train.length_buckets below it and the first at or above it (else max_length itself)."""
    buckets = sorted(config.train.length_buckets)
    covering = [b for b in buckets if b >= max_length]
    return tuple(b for b in buckets if b < max_length) + (covering[0] if covering
                                                          else max_length,)


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
    """SFT on its own: sft.steps steps, checkpointed in W/checkpoints (rerunning the command
    resumes), then a greedy eval on the eval split and an HF export to W/final_hf."""

    check(config)
    os.makedirs(workdir, exist_ok=True)
    parallel.maybe_initialize_distributed()
    metrics_lib.announce_start(config, workdir, config.sft.steps, "SFT steps",
                               what=f"sft (on {config.env.name})")
    mesh = placement.make_mesh(config)
    path = policy_io.model_path(config, workdir)
    model_cfg, model, params, tokenizer = policy_io.load_policy(config, path, mesh)
    run_summary.announce(config, path, model_cfg, params,
                         f"n/a (the run itself is {config.sft.steps} SFT steps)")
    make_env = env_factory.make_env_factory(config)
    s = config.sft
    examples = demonstrations(config, make_env, tokenizer)
    optim = train_states.optim_config(s.lr, config, s.steps, warmup_steps=s.warmup_steps)
    state = train_states.new_state(params, optim)
    del params  # donated into the state
    data = example_batches(config, examples, mesh, s.batch_size, s.max_length)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=config.checkpoint.keep,
                        async_save=config.checkpoint.async_save)
    start, state = restore(ckpt, state, data)
    if start:
        run_summary.say(f"resumed SFT from step {start}")
    writer = metrics_lib.MetricsWriter(workdir, resume_step=start + 1,
                                       enabled=jax.process_index() == 0,
                                       tensorboard=config.log.tensorboard,
                                       wandb_project=config.log.wandb_project)
    save = checkpoint_every(ckpt, data, config.checkpoint.every, s.steps)
    step_log = metrics_lib.StepLog(s.steps, every_s=config.log.every_s,
                                   enabled=jax.process_index() == 0, what="SFT step")
    started = last = time.time()

    def after(step, state, m):
        nonlocal last
        record = {f"sft/{k}": v for k, v in m.items()} | {"time/sft_s": time.time() - started}
        if step % 10 == 0 or step == s.steps:
            writer.write(step, record)
        step_log(step, record | {"time/step_s": time.time() - last})
        last = time.time()
        save(step, state)

    try:
        state = train(state, model, mesh, data, num_steps=s.steps, start_step=start,
                      on_step=after)
        ckpt.wait()
        engine = engines.make_engine(config, model_cfg, state.params, tokenizer, workdir)
        source = env_factory.task_source(config, make_env)
        tasks = [t for _, t in eval_tasks(source, config.env.eval_split,
                                          config.eval.num_tasks)]
        with Heartbeat(f"eval: {len(tasks)} tasks", every_s=config.log.every_s,
                       enabled=jax.process_index() == 0):
            result = eval_suite.evaluate_policy(
                config, engine, make_env, tasks, tokenizer, config.seed,
                replies_path=eval_suite.replies_file(workdir, f"eval_step{s.steps}"))
        writer.write(s.steps, {f"eval/{k}": v for k, v in result.items()})
        policy_io.export_hf(os.path.join(workdir, "final_hf"), model_cfg, state.params,
                            tokenizer)
        if lora.is_on(model_cfg):  # the adapters alone as well, in PEFT's format
            policy_io.export_adapter(os.path.join(workdir, "final_adapter"), model_cfg,
                                     state.params, path)
    finally:
        try:
            ckpt.close()
        finally:
            writer.close()  # also after a failed checkpoint: its files must be closed
    return result
