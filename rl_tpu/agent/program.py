"""Agent programs: train an existing agent, written against an OpenAI-style endpoint, as it is.

An agent program is a plain Python function

    def agent(base_url: str, task: dict) -> float | dict

that talks to a model only through `openai.OpenAI(base_url=base_url, api_key=...)` (any key,
any model name) and returns the episode's reward: a number, or a dict with "reward" (a
number) and optionally "success" (a bool; default reward > 0) and anything else, kept in
`Trajectory.info["program"]`. `task` is a copy of the task's data (`Task.data`); its id is
`task["task_id"]`. The env `agent_program` (rl_tpu/envs/agent_programs.py) names the program
and its tasks in a config: `env.name = "agent_program"`, `env.kwargs.program =
"pkg.module:function"`, `env.kwargs.tasks = "pkg.module:task_source"` (or `env.dataset_dir`).

`play_programs` is the trainer's episode player for such a config (the same arguments and
return as `agent.run_episodes`): it runs G = samples_per_task episodes of every task at once,
each program on a thread of its own, against the recording endpoint
(rl_tpu/agent/recording.py), which answers every call with the rollout engine and records it
token-exactly. Each episode becomes one `Trajectory`:

- tokens, loss mask, behaviour log-probs and weight versions of ONE conversation: the segment
  of the episode's last call (a program that keeps one `messages` list and appends to it has
  only that one). The ids are the ones the engine saw and sampled; the loss mask is True on
  exactly the sampled ids; turn k is the k-th call of that conversation, and the reward sits
  on its last turn (`rewards = [0, ..., reward]`).
- The replies outside it are not trained on: those of conversations it does not continue
  (the program rewrote its history, or ran a side conversation) and of branches it left (a
  retry from an earlier turn keeps the ids up to that turn, and drops the replies after it).
  `info["segments"]` counts the conversations and branches, `info["dropped_sampled_tokens"]`
  the sampled ids left out. Training on each would need a row per conversation in one group,
  which GRPO's group statistics would count as extra samples.
- finish: "done"; "turn_limit" (a call beyond `max_turns` was refused), "context_limit" (a
  prompt or reply ran into `max_context_tokens`), "abort" (the engine aborted a call), the
  program's reward kept either way; "env_error" when the program raised, returned no reward,
  made no model call, or ran past the env's `timeout_s` (reward 0, the error in
  `info["error"]`; such rows carry no loss and stay out of their group's statistics, as an
  env's failures do). A program's exception never fails the step; the engine's does.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
import time
import traceback
from typing import Any, Callable, Optional, Sequence

import numpy as np

from rl_tpu.agent.recording import EpisodeRecorder, RecordingServer
from rl_tpu.core.engine import RolloutEngine, SamplingParams
from rl_tpu.core.env import Env, Task
from rl_tpu.core.trajectory import Trajectory
from rl_tpu.models.tokenizer import ChatTokenizer

AGENT_PROGRAM_ENV = "agent_program"  # the env name that makes the trainer play programs


def play_programs(engine: RolloutEngine, make_env: Callable[[], Env], tasks: Sequence[Task], *,
                  tokenizer: ChatTokenizer, max_turns: int, max_new_tokens_per_turn: int,
                  max_context_tokens: int, sampling: SamplingParams = SamplingParams(),
                  samples_per_task: int = 1, group_id_offset: int = 0,
                  group_ids: Optional[Sequence[int]] = None, num_threads: Optional[int] = None,
                  batch_window_s: float = 0.02, step_timeout_s: Optional[float] = None,
                  reward_reduce: Any = None, parse_action: Any = None,
                  token_budget: Optional[int] = None, resume: Sequence = (),
                  paused: Optional[list] = None, forker=None) -> list[Trajectory]:
    """Plays `samples_per_task` episodes of the agent program of `make_env()` on every task;
    one Trajectory each, task-major (t0s0, t0s1, ..., t1s0, ...), as `run_episodes`.

    `max_turns` caps an episode's model calls, `max_new_tokens_per_turn` each reply (a
    request's `max_tokens` may lower it), `max_context_tokens` each conversation. `sampling`
    is how the engine samples every call (its seed, if any, drawn afresh per episode and call,
    keyed by group id and sample as the agent loop's). `num_threads` programs run at once
    (default every episode, at most 256); `batch_window_s`: see RecordingServer. The agent
    loop's `step_timeout_s`, `reward_reduce` and `parse_action` do not apply (the env's
    `timeout_s` bounds an episode; the program returns one reward) and are ignored; partial
    and branching rollouts (`token_budget`, `resume`, `paused`, `forker`) are refused.

    Raises:
      ValueError: a bad argument. The engine's errors propagate once every program has ended.
    """
    if token_budget is not None or resume or paused is not None or forker is not None:
        raise ValueError("agent programs cannot be paused or forked: partial rollouts "
                         "(rollout.partial_token_budget) and branching (tl_grpo) do not apply")
    if max_turns < 1 or max_new_tokens_per_turn < 1 or max_context_tokens < 2:
        raise ValueError(f"max_turns={max_turns} and max_new_tokens_per_turn="
                         f"{max_new_tokens_per_turn} must be >= 1, max_context_tokens="
                         f"{max_context_tokens} >= 2")
    if samples_per_task < 1:
        raise ValueError(f"samples_per_task (G) must be >= 1, got {samples_per_task}")
    if sampling.n != 1:
        raise ValueError(f"sampling.n={sampling.n}: set samples_per_task instead")
    if group_ids is None:
        group_ids = [group_id_offset + i for i in range(len(tasks))]
    if len(group_ids) != len(tasks):
        raise ValueError(f"{len(group_ids)} group_ids for {len(tasks)} tasks")
    env = make_env()
    try:
        program, timeout_s = program_of(env), float(getattr(env, "timeout_s", 600.0))
    finally:
        env.close()
    episodes = [(task, int(gid), s) for task, gid in zip(tasks, group_ids)
                for s in range(samples_per_task)]
    if not episodes:
        return []
    server = RecordingServer(engine, batch_window_s)
    try:
        recorders = [EpisodeRecorder(f"{gid}-{s}-{id(server):x}", tokenizer, sampling,
                                     max_turns=max_turns, max_new_tokens=max_new_tokens_per_turn,
                                     max_context_tokens=max_context_tokens,
                                     seed_key=(gid & 0x7FFFFFFF, s))
                     for _, gid, s in episodes]
        runs = [ProgramRun(program, server, server.register(rec), task)
                for rec, (task, _, _) in zip(recorders, episodes)]
        at_once = num_threads or min(256, len(runs))
        server.expect(len(runs), at_once)
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=at_once,
                                                     thread_name_prefix="agent-program")
        try:
            futures = [pool.submit(run.play) for run in runs]
            _wait(runs, futures, recorders, timeout_s)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)  # a stuck program is abandoned
    finally:
        server.shutdown()
    if server.engine_error is not None:
        raise server.engine_error
    return [episode_trajectory(rec, run, gid, s, task, max_turns, max_new_tokens_per_turn)
            for rec, run, (task, gid, s) in zip(recorders, runs, episodes)]


def program_of(env: Env) -> Callable[[str, dict], Any]:
    """The agent program an `agent_program` env holds; TypeError for any other env."""
    program = getattr(env, "program", None)
    if not callable(program):
        raise TypeError(f"env {getattr(env, 'name', type(env).__name__)!r} holds no agent "
                        f"program; set env.name={AGENT_PROGRAM_ENV!r} and env.kwargs.program")
    return program


class ProgramRun:
    """One episode's program on its thread: its outcome (reward, success, extra info) or error,
    and how long it ran."""

    def __init__(self, program, server: RecordingServer, base_url: str, task: Task):
        self.program, self.server, self.base_url, self.task = program, server, base_url, task
        self.started: Optional[float] = None
        self.seconds = 0.0
        self.reward, self.success, self.extra = 0.0, None, {}
        self.error: Optional[str] = None
        self.traceback: Optional[str] = None  # the program's, when it raised
        self.done = threading.Event()
        self._end_lock = threading.Lock()

    def end(self, error: Optional[str] = None) -> None:
        """Marks the episode over, once: by the program's return, or by its time limit."""
        with self._end_lock:
            if self.done.is_set():
                return
            if error is not None:
                self.error = error
            self.seconds = time.monotonic() - self.started
            self.done.set()
        self.server.program_ended()

    def play(self) -> None:
        self.started = time.monotonic()
        try:
            value = self.program(self.base_url, {**self.task.data, "task_id": self.task.task_id})
            outcome = program_outcome(value)
        except Exception as err:  # noqa: BLE001 - the program's failure ends its episode only
            tail = "".join(traceback.format_exception(err)[-3:])
            self.traceback = "".join(traceback.format_exception(err))
            self.end(f"the program raised {type(err).__name__}: {err}\n{tail}"[:2000])
        else:
            with self._end_lock:
                if not self.done.is_set():  # not already abandoned
                    self.reward, self.success, self.extra = outcome
            self.end()


def program_outcome(value: Any) -> tuple[float, Optional[bool], dict]:
    """A program's return value -> (reward, success or None, extra info); ValueError for a
    value that is not a finite number or a dict with one under "reward"."""
    extra: dict = {}
    success = None
    if isinstance(value, dict):
        if "reward" not in value:
            raise ValueError(f"the program returned a dict without 'reward': {value!r:.200}")
        extra = {k: v for k, v in value.items() if k not in ("reward", "success")}
        if "success" in value:
            success = bool(value["success"])
        value = value["reward"]
    if isinstance(value, (bool, np.bool_)):
        value = float(value)
    if not isinstance(value, (int, float, np.integer, np.floating)) or not math.isfinite(value):
        raise ValueError(f"the program returned {value!r:.200}; return a finite number (the "
                         "reward) or a dict with 'reward'")
    return float(value), success, extra


def _wait(runs: list[ProgramRun], futures: list, recorders: list[EpisodeRecorder],
          timeout_s: float) -> None:
    """Until every program has ended or run `timeout_s` seconds (then its episode is closed:
    its calls are refused, its thread abandoned)."""
    pending = set(range(len(runs)))
    while pending:
        concurrent.futures.wait([futures[i] for i in pending], timeout=0.05,
                                return_when=concurrent.futures.FIRST_COMPLETED)
        now = time.monotonic()
        for i in list(pending):
            run = runs[i]
            if run.done.is_set():
                pending.discard(i)
            elif run.started is not None and now - run.started > timeout_s:
                recorders[i].close(f"the program ran past timeout_s={timeout_s:g}")
                run.end(f"the program ran past timeout_s={timeout_s:g} (abandoned)")
                pending.discard(i)


def episode_trajectory(rec: EpisodeRecorder, run: ProgramRun, group_id: int, sample_index: int,
                       task: Task, max_turns: int, max_new_tokens: int) -> Trajectory:
    """One episode's Trajectory (module doc): the segment of its last call."""
    seg = rec.segments[rec.last_segment] if rec.last_segment is not None else None
    info = {"sample_index": sample_index, "env_steps": 0, "env_step_s": 0.0,
            "program_s": run.seconds, "calls": rec.calls, "segments": len(rec.segments),
            "dropped_sampled_tokens": rec.sampled - (seg.sampled if seg else 0),
            "max_turns": max_turns, "max_new_tokens_per_turn": max_new_tokens}
    if run.extra:
        info["program"] = run.extra
    if rec.notes:
        info["refused"] = list(rec.notes)
    reward, finish = run.reward, rec.finish or "done"
    if run.error is None and seg is None:
        run.error = "the program made no model call that was answered"
        info["program_reward"] = reward
    if run.error is not None:
        reward, finish, info["error"] = 0.0, "env_error", run.error
        if run.traceback:
            info["error_traceback"] = run.traceback
    success = run.success if run.success is not None else reward > 0
    if seg is None:
        tokens, mask, logprobs, turns, versions = [], [], [], [], []
        rewards, weight_versions, messages, convention = [], [], [], "full"
    else:
        tokens, mask, logprobs, turns, versions = (seg.tokens, seg.mask, seg.logprobs,
                                                   seg.turn_ids, seg.versions)
        rewards = [0.0] * seg.calls
        rewards[-1] = reward
        weight_versions, messages = list(seg.weight_versions), list(seg.messages)
        convention = seg.logprob_convention
    return Trajectory(
        tokens=np.asarray(tokens, np.int32), loss_mask=np.asarray(mask, bool),
        behaviour_logprobs=np.asarray(logprobs, np.float32),
        turn_ids=np.asarray(turns, np.int32), rewards=rewards, reward=float(reward),
        success=bool(success) and finish != "env_error", num_turns=len(rewards),
        weight_versions=weight_versions, task_id=task.task_id, group_id=group_id,
        finish=finish, messages=messages, info=info, logprob_convention=convention,
        token_versions=np.asarray(versions, np.int32))


def player_for(config, default: Callable[..., list[Trajectory]]) -> Callable[..., list[Trajectory]]:
    """The episode player of a run: `play_programs` when the config's env is an agent program,
    else `default` (the algorithm's player, e.g. `agent.run_episodes`)."""
    if config.env.name != AGENT_PROGRAM_ENV:
        return default
    return play_programs


def check_config(config) -> None:
    """What an agent-program run cannot do, refused before it starts (ValueError)."""
    if config.env.name != AGENT_PROGRAM_ENV:
        return
    if config.recipe == "selfplay":
        raise ValueError(f"recipe='selfplay' plays its own game env, not env.name="
                         f"{AGENT_PROGRAM_ENV!r}; use recipe='rl' (or a loop recipe)")
    if config.rollout.partial_token_budget:
        raise ValueError(f"env.name={AGENT_PROGRAM_ENV!r} with rollout.partial_token_budget="
                         f"{config.rollout.partial_token_budget}: a program's episode cannot be "
                         "paused; set rollout.partial_token_budget=0")
    if config.algo.advantage == "tl_grpo":
        raise ValueError(f"env.name={AGENT_PROGRAM_ENV!r} with algo.advantage='tl_grpo': a "
                         "program's episode cannot be forked; use grpo (or another estimator)")
    if config.sft.steps > 0 and not config.sft.data_path:
        raise ValueError(f"env.name={AGENT_PROGRAM_ENV!r} has no teacher to warm start from: "
                         "set sft.steps=0 or give sft.data_path")
