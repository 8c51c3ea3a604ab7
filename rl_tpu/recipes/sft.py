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
from typing import Callable, Iterator, Optional, Sequence

import jax
import ml_collections
import numpy as np

from rl_tpu import parallel
from rl_tpu.agent import conversation_start
from rl_tpu.envs.base import Env, Task
from rl_tpu.models.tokenizer import ChatTokenizer
from rl_tpu.recipes import components
from rl_tpu.train import steps
from rl_tpu.train.batching import bucket_length
from rl_tpu.train.state import TrainState

log = logging.getLogger(__name__)

Example = tuple[list[int], list[bool]]  # (ids, loss mask)


def teacher_episode(env: Env, task: Task, rng: random.Random, skill: float,
                    max_turns: int) -> tuple[list[dict], bool]:
    """Plays the env's teacher (`env.teacher_reply(task, rng, skill)`, its reply in the env's
    current state) through one episode of up to `max_turns` turns, as the agent loop would:
    (the chat, conversation start included, ending with the teacher's last reply; success)."""
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
        messages.append({"role": "user", "content": result.observation})
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
    out = [_chat_example(teacher_episode(env, task, rng, skill, max_turns)[0], tokenizer,
                         f"teacher demo of {task.task_id}") for task in tasks]
    env.close()
    return out


def teacher_success(make_env: Callable[[], Env], tasks: Sequence[Task], skill: float,
                    seed: int, max_turns: int = 1) -> float:
    """The teacher's own success rate on `tasks`, episodes of up to `max_turns` turns."""
    env, rng = _teacher_env(make_env), random.Random(seed)
    wins = sum(teacher_episode(env, task, rng, skill, max_turns)[1] for task in tasks)
    env.close()
    return wins / max(len(tasks), 1)


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
            out.append(_chat_example(messages, tokenizer, f"{path}:{number}"))
    if not out:
        raise ValueError(f"{path} holds no chats")
    return out


def _chat_example(messages, tokenizer: ChatTokenizer, where: str) -> Example:
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
    if first is None:
        raise ValueError(f"{where}: the chat has no assistant message to learn from")
    ids = tokenizer.apply_chat_template(messages[:first], add_generation_prompt=True)
    mask = [False] * len(ids)
    for i in range(first, len(messages)):
        message = messages[i]
        if message.get("role") == "assistant":
            reply = tokenizer.encode(message["content"]) + [tokenizer.eos_token_id]
            ids, mask = ids + reply, mask + [True] * len(reply)
        else:
            nxt = i + 1 < len(messages) and messages[i + 1].get("role") == "assistant"
            new = tokenizer.append_message(ids, messages[:i], message, add_generation_prompt=nxt)
            mask += [False] * (len(new) - len(ids))
            ids = new
    return ids, mask


def batches(examples: Sequence[Example], batch_size: int, buckets: Sequence[int],
            seed: int, host: tuple[int, int] = (0, 1),
            group_by_length: int = 0) -> Iterator[dict]:
    """This host's rows of global batches of `batch_size` examples, reshuffled each epoch
    (deterministic by seed, the same order on every host). host = (index, count).

    group_by_length=k > 0 draws k batches' worth of examples at a time, sorts them by length
    and cuts them into k batches served in random order: rows of a batch are of like length,
    so a batch pads to its own bucket instead of to its longest outlier's. Multi-turn episodes
    range from a few hundred tokens to the context limit, and attention's cost grows with the
    square of the padded length."""
    index, count = host
    local = batch_size // count
    rng = np.random.RandomState(seed)
    order: list[int] = []
    ready: list[list[int]] = []
    pool = max(1, group_by_length) * batch_size
    while True:
        if not ready:
            while len(order) < pool:
                order += list(rng.permutation(len(examples)))
            drawn, order = order[:pool], order[pool:]
            if group_by_length > 0:
                drawn.sort(key=lambda r: len(examples[r][0]))
                cuts = [drawn[i:i + batch_size] for i in range(0, pool, batch_size)]
                ready = [cuts[i] for i in rng.permutation(len(cuts))]
            else:
                ready = [drawn]
        rows = ready.pop(0)
        # every host pads to the bucket of the longest row of the GLOBAL batch
        t = bucket_length(max(len(examples[r][0]) for r in rows), buckets)
        rows = rows[index * local:(index + 1) * local]
        tokens = np.zeros((local, t), np.int32)
        mask = np.zeros((local, t), bool)
        segments = np.zeros((local, t), np.int32)
        for i, r in enumerate(rows):
            ids, m = examples[r]
            tokens[i, :len(ids)], mask[i, :len(ids)], segments[i, :len(ids)] = ids, m, 1
        positions = np.broadcast_to(np.arange(t, dtype=np.int32), (local, t)).copy()
        yield {"tokens": tokens, "loss_mask": mask, "segment_ids": segments,
               "positions": positions}


def train(state: TrainState, model, mesh, examples: Sequence[Example], *, num_steps: int,
          batch_size: int, buckets: Sequence[int], seed: int, group_by_length: int = 0,
          on_step: Optional[Callable[[int, dict], None]] = None) -> TrainState:
    """`num_steps` SFT steps; on_step(step, host metrics) after each."""
    if batch_size % components.data_parallel_size(mesh):
        raise ValueError(f"sft.batch_size={batch_size} must divide by the data-parallel size "
                         f"{components.data_parallel_size(mesh)}")
    step_fn = steps.compile_step(steps.make_sft_step(model), state, mesh)
    data = batches(examples, batch_size, buckets, seed,
                   host=(jax.process_index(), jax.process_count()),
                   group_by_length=group_by_length)
    from rl_tpu.metrics import progress

    for i in progress(range(num_steps), "SFT steps", enabled=jax.process_index() == 0):
        state, m = step_fn(state, parallel.host_to_global(next(data), mesh))
        if on_step is not None:
            on_step(i + 1, {k: float(v) for k, v in jax.device_get(m).items()})
    return state


def warm_start(config: ml_collections.ConfigDict, params, model, mesh, tokenizer,
               make_env: Callable[[], Env], writer,
               step_offset: int = 0):
    """SFT the initial params on the configured demonstrations; returns the new params.
    Metrics go to `writer` at step `step_offset + sft_step` (the RL recipe logs them at
    negative steps, before RL's step 0)."""
    s = config.sft
    if s.data_path:
        examples = chat_examples(s.data_path, tokenizer)
    else:
        source = components.task_source(config, make_env)
        tasks = [source.get(config.env.train_split, i) for i in range(s.num_demos)]
        examples = teacher_examples(make_env, tasks, tokenizer, s.teacher_skill, config.seed,
                                    max_turns=config.env.max_turns)
    optim = components.optim_config(s.lr, config, s.steps, warmup_steps=s.warmup_steps)
    state = components.new_state(params, optim)
    started = time.time()

    def on_step(step, m):
        if step % 10 == 0 or step == s.steps:
            writer.write(step + step_offset, {f"sft/{k}": v for k, v in m.items()}
                         | {"time/sft_s": time.time() - started})

    state = train(state, model, mesh, examples, num_steps=s.steps, batch_size=s.batch_size,
                  buckets=_buckets(config, s.max_length), seed=config.seed,
                  group_by_length=s.group_by_length, on_step=on_step)
    log.info("SFT warm start: %d steps on %d examples in %.1fs", s.steps, len(examples),
             time.time() - started)
    return state.params


def _buckets(config, max_length: int) -> tuple[int, ...]:
    return tuple(b for b in config.train.length_buckets if b <= max_length) or (max_length,)


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
    """SFT on its own: warm start, greedy eval on the eval split, HF export to W/final_hf."""
    from rl_tpu import metrics as metrics_lib
    from rl_tpu.recipes.config import check

    check(config)
    os.makedirs(workdir, exist_ok=True)
    parallel.maybe_initialize_distributed()
    mesh = components.make_mesh(config)
    path = components.model_path(config, workdir)
    model_cfg, model, params, tokenizer = components.load_policy(config, path, mesh)
    make_env = components.make_env_factory(config)
    writer = metrics_lib.MetricsWriter(workdir, enabled=jax.process_index() == 0,
                                       tensorboard=config.log.tensorboard)
    params = warm_start(config, params, model, mesh, tokenizer, make_env, writer)
    engine = components.make_engine(config, model_cfg, params, tokenizer, workdir)
    from rl_tpu.data.tasks import eval_tasks
    source = components.task_source(config, make_env)
    tasks = [t for _, t in eval_tasks(source, config.env.eval_split, config.eval.num_tasks)]
    result = components.evaluate_policy(config, engine, make_env, tasks, tokenizer, config.seed)
    writer.write(config.sft.steps, {f"eval/{k}": v for k, v in result.items()})
    writer.close()
    from rl_tpu.models import hf
    hf.save(os.path.join(workdir, "final_hf"), model_cfg, params, tokenizer=tokenizer.hf)
    return result
