"""The multi-turn agent loop: envs <-> engine -> trajectories (AgentGym-RL's rollout phase).

`run_episodes` plays every episode of a rollout batch at once. Each turn it makes ONE batched
`engine.generate` call over all live episodes (each request is that episode's whole token
history), decodes each sample into an action, steps the envs in parallel threads (a
`rl_tpu.env_serving.workers.WorkerPool`: a time limit per call, stuck envs abandoned), appends each
observation to its history as a new user message, and repeats until every episode has ended.

Token accounting, the part the trainer depends on:

- The history is built token-exactly. The prompt is the chat template over
  [system (env.system_prompt), user (first observation)] plus the generation prompt (or, for an
  env that defines `conversation_start()`, over the messages it returns followed by the first
  observation as a user message: see `conversation_start`); after that
  the model's sampled ids are appended as they are, and each observation is tokenized once
  (`ChatTokenizer.append_messages`) and appended. Nothing is ever re-tokenized, so the
  behaviour logprobs stay attached to the very ids they were computed for.
- `loss_mask` is True on exactly the ids the engine sampled; the prompt, the template text the
  model did not write (e.g. the `<|im_end|>\\n` after a length-cut turn, the "\\n" after the
  model's own `<|im_end|>`), and observations carry no loss.
- `tokens` ends with the last generated id: the final observation (the env's answer to the last
  action) conditions nothing the policy produced, so it is kept in `messages` for logging but
  not tokenized.

Function calling: an env with `tools` (tool schemas, see `env_tools`) has them rendered into
every template call of its episodes, and a step may answer with role "tool" messages in place
of the user message (`observation_messages`); they are appended the same token-exact way.

When `tokens` equals the chat template of the conversation: if every turn's sampled ids are
the tokenizer's own encoding of their text followed by eos, then
`tokens + encode(closing) == tokenizer.apply_chat_template(messages through the last assistant
message)`, where `closing` is the template's text after the final eos ("\\n" for ChatML). It
differs where the model sampled a non-canonical tokenization of its text (the history keeps
the sampled ids; the template would re-tokenize them), and where a turn was cut by length: its
missing `<|im_end|>` is appended as template text, unmasked (the same ids as the template's
when the cut ids are canonical), and the action text sent to the env is the cut text.

The stop that ended a turn is never part of the action or of the assistant message: the one
the engine reports (`GenerateResult.matched_stop`: a stop id such as Llama 3's
`<|end_of_text|>`, which is not the tokenizer's eos, or a stop string, cut from the text as
SGLang does), else a trailing eos or `sampling.stop_token_ids` id. Its ids stay in `tokens`
with loss (the model sampled them); when it is not the template's own end of turn, the
template's closing text follows them as template text without loss, as after a length cut.

Episodes end (`Trajectory.finish`) with:
  done           the env said done;
  turn_limit     H actions were taken without the env saying done;
  context_limit  no room is left for another token within `max_context_tokens` (a turn cut by
                 the context room, or an observation that would not fit, which is then dropped);
  env_error      make_env/reset/step raised, timed out, or returned something malformed (the
                 message is in `info["error"]`, a raised error's traceback in
                 `info["error_traceback"]`); the other episodes go on;
  abort          the engine aborted the request.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Iterator, Optional, Sequence, Union

import numpy as np

from rl_tpu.core.env import Env, StepResult, Task, invalid_action
from rl_tpu.env_serving.workers import Outcome, WorkerPool
from rl_tpu.models.tokenizer import ChatTokenizer
from rl_tpu.core.engine import GenerateRequest, GenerateResult, RolloutEngine, SamplingParams
from rl_tpu.core.trajectory import (NO_VERSION, EpisodeStats,  # noqa: F401 (EpisodeStats: API)
                               Trajectory, token_versions)

log = logging.getLogger(__name__)

FINISH_REASONS = ("done", "turn_limit", "context_limit", "env_error", "abort")

RewardReduce = Union[str, Callable[[Sequence[float]], float]]
_REDUCERS: dict[str, Callable[[Sequence[float]], float]] = {
    "sum": lambda r: float(sum(r)),
    "last": lambda r: float(r[-1]) if r else 0.0,
    "max": lambda r: float(max(r)) if r else 0.0,
}


def default_parse_action(text: str) -> str:
    """The action is the generated text, stripped; the env parses it (and answers a bad one
    with an "Invalid action" observation). A custom parser may raise ValueError instead: the
    episode then gets an invalid-action observation without stepping the env."""
    return text.strip()


class Episode:
    """Mutable state of one episode while the loop runs."""

    def __init__(self, index: int, task: Task, group_id: int, sample_index: int):
        self.index, self.task, self.group_id = index, task, group_id
        self.env: Optional[Env] = None
        self.abandoned = False  # its env is stuck in a timed-out call: never touch it again
        self.tokens: list[int] = []
        self.mask: list[bool] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []  # per token: the weight version that sampled it, or -1
        self.turn_ids: list[int] = []
        self.messages: list[dict] = []
        self.tools: Optional[list[dict]] = None  # the env's tool schemas (function calling)
        self.rewards: list[float] = []
        self.weight_versions: list = []
        self.logprob_convention = "full"
        self.routing: Optional[np.ndarray] = None  # int32 [ids so far (or fewer), S, k]
        self.step_infos: list[dict] = []
        self.success: Optional[bool] = None  # last `success` an env info reported
        self.finish: Optional[str] = None
        self.info: dict = {"sample_index": sample_index, "env_steps": 0, "env_step_s": 0.0}
        self.pending_action: Optional[str] = None  # parsed action awaiting env.step
        self.pending_invalid: Optional[StepResult] = None  # answer to an unparseable action
        # A turn cut by a token budget (partial rollout): where its ids start in `tokens`, how
        # many new tokens it may still take, and how many parts it has had.
        self.turn_start: Optional[int] = None
        self.turn_left = 0
        self.parts = 0
        # What the env said, for a branching rollout to restore this state in a fresh env by
        # replaying (rl_tpu/agent/branching.py): reset's observation, then (action, observation,
        # reward, done) of every step the env took (unparseable actions never reach it).
        self.first_observation: Optional[str] = None
        self.env_trace: list[tuple[str, str, float, bool]] = []

    @property
    def turn(self) -> int:
        """The action turn being generated: 0-based, counting completed actions."""
        return len(self.rewards)

    def extend(self, ids: Sequence[int], generated: bool, turn: int,
               logprobs: Optional[Sequence[float]] = None,
               versions: Optional[Sequence[int]] = None):
        self.tokens.extend(int(i) for i in ids)
        self.mask.extend([generated] * len(ids))
        self.logprobs.extend([float(x) for x in logprobs] if generated else [0.0] * len(ids))
        self.versions.extend(list(versions) if generated else [NO_VERSION] * len(ids))
        self.turn_ids.extend([turn] * len(ids))

    def record_routing(self, rows) -> None:
        """Merges an engine's routed experts (rows for this episode's ids from position 0,
        -1 where its pass computed none) into the episode's. A later pass's record wins: it
        computed the context the latest turn was sampled from (without prefix reuse a turn's
        prefill recomputes the ids before it; with reuse it computes only the new ones)."""
        rows = np.asarray(rows, np.int32)
        if self.routing is None:
            self.routing = np.full((0,) + rows.shape[1:], -1, np.int32)
        if len(self.routing) < len(rows):
            pad = np.full((len(rows) - len(self.routing),) + rows.shape[1:], -1, np.int32)
            self.routing = np.concatenate([self.routing, pad])
        recorded = (rows >= 0).all(axis=(1, 2))
        self.routing[:len(rows)][recorded] = rows[recorded]

    def routed_experts(self) -> Optional[np.ndarray]:
        """[len(tokens), S, k], -1 where nothing was recorded (ids never fed to the engine:
        each turn's last one, the final observation); None when no engine recorded any."""
        if self.routing is None:
            return None
        missing = len(self.tokens) - len(self.routing)
        return np.concatenate([self.routing, np.full((missing,) + self.routing.shape[1:], -1,
                                                     np.int32)])

    def end(self, finish: str, error: Optional[str] = None):
        self.finish = finish
        if error is not None:
            self.info["error"] = error


def _close_quietly(env: Optional[Env]):
    if env is None:
        return
    try:
        env.close()
    except Exception as e:  # noqa: BLE001 - the episode is over; a failed close is only logged
        log.warning("env.close() failed for %r: %s", getattr(env, "name", env), e)


def _request_seed(seed: int, group_id: int, sample_index: int, turn: int, part: int = 0) -> int:
    # Every episode needs its own stream: G samples of one task send the same first prompt, and
    # one shared seed would make them identical. Keyed by (group id, sample), not by the
    # episode's position in this call, so a task draws the same samples whichever host plays
    # it and however the step's tasks are split into calls. A resumed part of a turn (partial
    # rollouts) draws a stream of its own.
    key = [seed, group_id & 0x7FFFFFFF, sample_index, turn] + ([part] if part else [])
    return int(np.random.SeedSequence(key).generate_state(1)[0] & 0x7FFFFFFF)


def _play_groups(
    engine: RolloutEngine,
    make_env: Callable[[], Env],
    tasks: Sequence[Task],
    *,
    tokenizer: ChatTokenizer,
    max_turns: int,
    max_new_tokens_per_turn: int,
    max_context_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    samples_per_task: int = 1,
    parse_action: Callable[[str], str] = default_parse_action,
    step_timeout_s: Optional[float] = 60.0,
    num_threads: Optional[int] = None,
    reward_reduce: RewardReduce = "sum",
    group_id_offset: int = 0,
    group_ids: Optional[Sequence[int]] = None,
    token_budget: Optional[int] = None,
    resume: Sequence["Episode"] = (),
    paused: Optional[list] = None,
    forker=None,
) -> Iterator[tuple[int, list[Trajectory]]]:
    """Plays `samples_per_task` episodes of every task, all at once; yields (task index, its
    trajectories) for each task as soon as all its episodes have ended.

    Args:
      engine: the policy; called once per turn with every live episode's history.
      make_env: builds a fresh env; called once per episode (in a worker thread).
      tasks: the tasks; trajectories come back task-major (t0s0, t0s1, ..., t1s0, ...).
      tokenizer: the policy's chat tokenizer.
      max_turns: H, the most actions an episode takes (a schedule may change it every step).
      max_new_tokens_per_turn: L, the generation budget of one turn (SIRI schedules change it).
      max_context_tokens: cap on a trajectory's total length; each turn generates at most
        min(L, room left).
      sampling: everything but `max_new_tokens` (set per request) and `n` (must be 1: use
        `samples_per_task`); a `seed` is turned into a distinct seed per episode and turn
        (the same across calls: fold the training step into it for fresh samples).
      samples_per_task: G; the G episodes of a task share `group_id`.
      parse_action: a turn's text, without the stop that ended it (the stop id or stop string
        the engine reports as `matched_stop`) -> action text for `env.step`.
      step_timeout_s: limit on each make_env+reset and each step call (None: no limit). A call
        that times out or raises ends its episode with finish="env_error".
      num_threads: env worker threads (default: one per episode, at most 64); 0 runs env calls
        inline on this thread, without timeouts.
      reward_reduce: "sum" | "last" | "max" | callable(rewards) -> float, giving `reward`.
      group_id_offset: added to the task index to form `group_id` (keeps ids unique across
        calls, e.g. when a replay buffer mixes batches).
      group_ids: one id per task instead (tasks that are not a contiguous run of positions,
        e.g. those a resumed producer plays again); overrides group_id_offset.
      token_budget, resume, paused: partial rollouts (see `play_partial`); with a budget every
        episode is yielded on its own, as its group may end in another call.
      forker: branching rollouts (rl_tpu/agent/branching.py): one episode a task is played, and the
        forker adds its other samples_per_task - 1 episodes to its group as copies of it.

    Yields:
      (task index, list[Trajectory] of samples_per_task), every task once.

    Raises:
      ValueError: a bad argument. Errors of the engine itself propagate (no episode can go on
        without it); the envs are closed either way.
    """
    if max_turns < 1:
        raise ValueError(f"max_turns (H) must be >= 1, got {max_turns}")
    if max_new_tokens_per_turn < 1:
        raise ValueError(f"max_new_tokens_per_turn (L) must be >= 1, got {max_new_tokens_per_turn}")
    if max_context_tokens < 2:
        raise ValueError(f"max_context_tokens must be >= 2, got {max_context_tokens}")
    if samples_per_task < 1:
        raise ValueError(f"samples_per_task (G) must be >= 1, got {samples_per_task}")
    if step_timeout_s is not None and not step_timeout_s > 0:
        raise ValueError(f"step_timeout_s must be > 0 seconds (None: no limit), "
                         f"got {step_timeout_s}")
    if num_threads is not None and num_threads < 0:
        raise ValueError(f"num_threads must be >= 0 (0 runs env calls inline), got {num_threads}")
    if sampling.n != 1:
        raise ValueError(f"sampling.n={sampling.n}: each episode's history diverges after its "
                         f"first turn, so set samples_per_task={sampling.n} instead of n")
    if isinstance(reward_reduce, str):
        if reward_reduce not in _REDUCERS:
            raise ValueError(f"reward_reduce={reward_reduce!r}; use one of {sorted(_REDUCERS)} "
                             "or a callable(rewards) -> float")
        reward_reduce = _REDUCERS[reward_reduce]
    stop_ids = set(sampling.stop_token_ids)
    if tokenizer.eos_token_id is not None:
        stop_ids.add(tokenizer.eos_token_id)

    if group_ids is None:
        group_ids = [group_id_offset + ti for ti in range(len(tasks))]
    if len(group_ids) != len(tasks):
        raise ValueError(f"{len(group_ids)} group_ids for {len(tasks)} tasks")
    if token_budget is not None and (token_budget < 1 or paused is None):
        raise ValueError(f"token_budget={token_budget} must be >= 1, with a `paused` list")
    if forker is not None and (token_budget is not None or resume):
        raise ValueError("branching rollouts do not combine with partial rollouts")
    played = 1 if forker is not None else samples_per_task  # the forker makes the others
    fresh = [Episode(ti * played + s, task, int(group_ids[ti]), s)
             for ti, task in enumerate(tasks) for s in range(played)]
    episodes = fresh + list(resume)
    if num_threads is None:
        num_threads = min(64, max(1, len(tasks) * samples_per_task + len(resume)))
    workers = WorkerPool(num_threads, step_timeout_s)
    if token_budget is None:
        groups = [episodes[ti * played:(ti + 1) * played] for ti in range(len(tasks))]
        size = samples_per_task
    else:
        groups, size = [[ep] for ep in episodes], 1
    handed_on: set[int] = set()
    try:
        start_episodes(fresh, make_env, tokenizer, workers, max_context_tokens)
        if forker is not None:
            forker.bind(groups, make_env, tokenizer, workers, max_turns, max_context_tokens)
        for _ in _play(episodes, engine, tokenizer, workers, max_turns, max_new_tokens_per_turn,
                       max_context_tokens, sampling, parse_action, stop_ids, token_budget,
                       paused, forker):
            for ti, group in enumerate(groups):
                if (ti not in handed_on and len(group) == size
                        and all(ep.finish is not None for ep in group)):
                    handed_on.add(ti)
                    _close_envs(group, workers)
                    yield ti, [_finalize(ep, reward_reduce, max_turns, max_new_tokens_per_turn)
                               for ep in group]
    finally:
        _close_envs(episodes, workers)
        workers.shutdown()


def play_episodes(engine: RolloutEngine, make_env: Callable[[], Env], tasks: Sequence[Task],
                  **kwargs) -> Iterator[list[Trajectory]]:
    """`run_episodes` as a stream: yields each task's group (its `samples_per_task`
    trajectories, in sample order) as soon as every episode of it has ended, in the order
    groups finish, and closes that group's envs then. Same arguments as `run_episodes`. A
    producer hands finished groups on while longer episodes still play."""
    for _, group in _play_groups(engine, make_env, tasks, **kwargs):
        yield group


def play_partial(engine: RolloutEngine, make_env: Callable[[], Env], tasks: Sequence[Task], *,
                 token_budget: int, resume: Sequence["Episode"] = (), **kwargs
                 ) -> tuple[list[Trajectory], list["Episode"]]:
    """Partial rollouts: plays `resume` (episodes paused by an earlier call, with their envs)
    and fresh episodes of `tasks` until `token_budget` generated tokens are spent. Returns the
    trajectories that ended (in any order: group them by `group_id`) and the episodes still
    running, paused mid-turn or between turns, to pass as `resume` to a later call (the next
    weights then go on where these stopped, the history re-prefilled, so every token's
    behaviour log-prob is exactly its own version's). `close_paused` releases them."""
    paused: list = []
    ended = [traj for _, group in _play_groups(engine, make_env, tasks,
                                               token_budget=token_budget, resume=resume,
                                               paused=paused, **kwargs) for traj in group]
    return ended, paused


def close_paused(episodes: Sequence["Episode"]) -> None:
    """Closes the envs of paused episodes that will not be resumed."""
    for ep in episodes:
        if not ep.abandoned:
            _close_quietly(ep.env)
        ep.env = None


def paused_task(ep: "Episode") -> tuple[int, Task]:
    """The (group id, task) a paused episode plays: what a restarted producer plays again."""
    return ep.group_id, ep.task


def run_episodes(engine: RolloutEngine, make_env: Callable[[], Env], tasks: Sequence[Task],
                 **kwargs) -> list[Trajectory]:
    """Plays `samples_per_task` episodes of every task, all at once; one Trajectory each,
    task-major (t0s0, t0s1, ..., t1s0, ...). Arguments: see `_play_groups`."""
    by_task = dict(_play_groups(engine, make_env, tasks, **kwargs))
    return [traj for ti in range(len(tasks)) for traj in by_task[ti]]


def _close_envs(episodes, workers: WorkerPool) -> None:
    live = [ep for ep in episodes if ep.env is not None and not ep.abandoned]
    for outcome, ep in zip(workers.map([ep.env.close for ep in live]), live):
        if outcome.error:
            log.warning("env.close() failed for %r: %s", getattr(ep.env, "name", ep.env),
                        outcome.error)
        ep.env = None  # closed: never again


def conversation_start(env: Env) -> list[dict]:
    """The messages an episode's prompt holds before the env's first observation.

    An env may define `conversation_start(self) -> list[dict]` (chat messages, each with a
    string `role` and `content`): AgentGym-RL starts every conversation with the env's
    instruction as a user turn and a fixed assistant acknowledgement, then the first
    observation as the next user turn, and an env that wants that prompt returns the first two
    messages. Returning None, or not defining it, gives rl_tpu's default: a system message with
    `env.system_prompt` (none when it is empty). Called after `reset`, so it may depend on the
    task. Raises ValueError for anything but a list of such messages.
    """
    method = getattr(env, "conversation_start", None)
    start = method() if callable(method) else None
    if start is None:
        system = getattr(env, "system_prompt", "") or ""
        return [{"role": "system", "content": system}] if system else []
    if not isinstance(start, (list, tuple)) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in start):
        raise ValueError(f"{type(env).__name__}.conversation_start() returned {start!r:.200}; "
                         "it must return a list of {'role': str, 'content': str} messages "
                         "(or None for the system-prompt default)")
    if start and start[-1]["role"] == "user":
        # The first observation follows as a user message; two user turns in a row would
        # make a prompt the model never saw in training.
        raise ValueError(f"{type(env).__name__}.conversation_start() ends with a user message; "
                         "the first observation is the user turn that follows it, so end with "
                         "an assistant (or system) message")
    return [dict(m) for m in start]


def env_tools(env: Env) -> Optional[list[dict]]:
    """The tool schemas a function-calling env states (`env.tools`: OpenAI-style
    `{"type": "function", "function": {...}}` dicts, rendered into the prompt by the chat
    template), or None for an env without tools. Read after `reset`, so they may depend on
    the task. Raises ValueError for anything but a list of dicts."""
    tools = getattr(env, "tools", None)
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools):
        raise ValueError(f"{type(env).__name__}.tools is {tools!r:.200}; it must be a list of "
                         "tool schemas (dicts), or None for an env without tools")
    return [dict(t) for t in tools] or None


def observation_messages(env_name: str, result: StepResult) -> list[dict]:
    """The chat messages that carry a step's observation: one user message by default; an env
    may instead put the messages in `result.info["observation_messages"]` (a function-calling
    env: one role "tool" message per call's result, which the template wraps its own way).
    Raises ValueError for anything but a non-empty list of {"role": str, "content": str}."""
    messages = result.info.get("observation_messages")
    if messages is None:
        return [{"role": "user", "content": result.observation}]
    if not isinstance(messages, (list, tuple)) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in messages):
        raise ValueError(f"{env_name}'s step returned info['observation_messages'] = "
                         f"{messages!r:.200}; it must be a non-empty list of "
                         "{'role': str, 'content': str} messages")
    return [dict(m) for m in messages]


def start_episodes(episodes, make_env, tokenizer, workers, max_context_tokens):
    """Builds and resets every env in parallel; tokenizes each first prompt."""

    def start(ep):
        def call():
            ep.env = make_env()  # set before reset, so a timed-out reset can still be closed
            first = ep.env.reset(ep.task)
            # In the worker too: a remote env may answer over the network.
            return first, conversation_start(ep.env), env_tools(ep.env)
        return call

    for ep, outcome in zip(episodes, workers.map([start(ep) for ep in episodes])):
        if ended_on_failure(ep, outcome, "make_env/reset/conversation_start"):
            continue
        first, start_messages, ep.tools = outcome.value
        if not isinstance(first, str):
            ep.end("env_error", f"reset returned {type(first).__name__}, not the first "
                                "observation (str)")
            continue
        ep.first_observation = first
        ep.messages = start_messages + [{"role": "user", "content": first}]
        ep.extend(tokenizer.apply_chat_template(ep.messages, add_generation_prompt=True,
                                                tools=ep.tools),
                  generated=False, turn=-1)
        if len(ep.tokens) >= max_context_tokens:
            ep.end("context_limit", f"the first prompt has {len(ep.tokens)} tokens, no room "
                                    f"left within max_context_tokens={max_context_tokens}")


def ended_on_failure(ep: Episode, outcome: Outcome, what: str) -> bool:
    """Ends the episode on a failed env call; a stuck env is closed once its call returns."""
    if outcome.error is None:
        return False
    ep.end("env_error", f"{what}: {outcome.error}")
    if outcome.traceback:  # for the run's env error log (rl_tpu/agent/env_failures.py)
        ep.info["error_traceback"] = outcome.traceback
    if outcome.timed_out:
        ep.abandoned = True
        outcome.on_return(lambda ep=ep: _close_quietly(ep.env))
    return True


def _play(episodes, engine, tokenizer, workers, max_turns, max_new, max_context, sampling,
          parse_action, stop_ids, token_budget=None, paused=None, fork=None):
    """The turn loop: one batched generate, then one parallel env step, per round; yields
    after each round (and once before the first) so the caller can hand on finished groups.

    With `token_budget` (partial rollouts), the round's generations share what is left of it
    (at least one token each); a turn cut by the budget stays unfinished, its ids kept, and
    goes on in the next round. Once the budget is spent, the live episodes are moved to
    `paused` (a list) as they are, envs open, for a later call to resume.

    `fork(episodes)` (branching rollouts), called before each round, may append episodes."""
    spent = 0
    while True:
        yield
        if fork is not None:
            fork(episodes)
        live = [ep for ep in episodes if ep.finish is None]
        if not live:
            return
        cap = None
        if token_budget is not None:
            left = token_budget - spent
            if left <= 0:
                paused.extend(live)
                for ep in live:
                    episodes.remove(ep)
                return
            cap = max(1, left // len(live))
        # --- generate: one call for every live episode --------------------------------------
        requests = []
        for ep in live:
            room = max_context - len(ep.tokens)  # >= 1, checked when the history last grew
            budget = ep.turn_left if ep.turn_start is not None else max_new
            want = min(budget, room, cap or budget)
            params = dataclasses.replace(
                sampling, max_new_tokens=want,
                seed=(None if sampling.seed is None
                      else _request_seed(sampling.seed, ep.group_id,
                                         ep.info["sample_index"], ep.turn, ep.parts)))
            part = f"-part{ep.parts}" if ep.parts else ""
            requests.append(GenerateRequest(
                prompt_ids=list(ep.tokens), sampling=params,
                request_id=f"g{ep.group_id}s{ep.info['sample_index']}-turn{ep.turn}{part}"))
        results = engine.generate(requests)
        if len(results) != len(requests):
            raise RuntimeError(f"engine returned {len(results)} results for {len(requests)} "
                               "requests with n=1; the engine breaks the RolloutEngine contract")

        stepping = []
        for ep, request, result in zip(live, requests, results):
            spent += len(result.output_ids)
            if _add_generation(ep, request, result, tokenizer, stop_ids, parse_action,
                               max_context, max_new, capped=cap is not None):
                stepping.append(ep)

        # --- env steps, in parallel ---------------------------------------------------------
        to_step = [ep for ep in stepping if ep.pending_invalid is None]
        outcomes = dict(zip(map(id, to_step), workers.map(
            [lambda ep=ep: ep.env.step(ep.pending_action) for ep in to_step])))
        for ep in stepping:
            outcome = outcomes.get(id(ep)) or Outcome(value=ep.pending_invalid)
            _add_observation(ep, outcome, ep.turn - 1, tokenizer, max_turns, max_context)


def _add_generation(ep: Episode, request: GenerateRequest, result: GenerateResult,
                    tokenizer: ChatTokenizer, stop_ids: set, parse_action, max_context: int,
                    max_new: int, capped: bool = False) -> bool:
    """Appends one generation to its episode; True when the turn's action is ready to step."""
    ids, logprobs = list(result.output_ids), list(result.logprobs)
    if len(logprobs) != len(ids):
        raise RuntimeError(f"engine returned {len(ids)} ids but {len(logprobs)} logprobs for "
                           f"request {request.request_id}")
    turn = ep.turn
    if ep.turn_start is None:
        ep.turn_start, ep.turn_left = len(ep.tokens), max_new
    # Per-token versions: a generation may span a weight update (the engine's spans say where).
    versions = token_versions(len(ids), result.weight_version,
                              result.info.get("weight_versions"))
    ep.extend(ids, generated=True, turn=turn, logprobs=logprobs, versions=versions)
    if result.routed_experts is not None:
        ep.record_routing(result.routed_experts)
    elif request.sampling.return_routed_experts:
        raise RuntimeError(f"request {request.request_id} asked for routed experts and the "
                           "engine returned none: it cannot record them (routing replay needs "
                           "the embedded sampler and a mixture-of-experts policy)")
    ep.turn_left -= len(ids)
    if result.logprob_convention != "full":
        ep.logprob_convention = result.logprob_convention
    cut_by_budget = (capped and result.finish_reason == "length" and ids
                     and len(ids) == request.sampling.max_new_tokens and ep.turn_left > 0
                     and len(ep.tokens) < max_context and ids[-1] not in stop_ids
                     and result.matched_stop is None)
    if cut_by_budget:  # a partial rollout: the turn goes on in a later round or call
        ep.parts += 1
        return False
    turn_ids = ep.tokens[ep.turn_start:]
    ep.turn_start, ep.turn_left, ep.parts = None, 0, 0
    ep.weight_versions.append(result.weight_version)
    ep.rewards.append(0.0)  # replaced by the env's reward if the step happens
    text = content_text(turn_ids, result.matched_stop, tokenizer, stop_ids)
    ep.messages.append({"role": "assistant", "content": text})
    ep.pending_action = ep.pending_invalid = None
    if result.finish_reason == "abort":
        ep.end("abort", f"the engine aborted turn {turn}")
        return False
    if result.finish_reason == "length" and len(ep.tokens) >= max_context:
        # Cut by the context room, not by L: the action is unfinished and nothing fits after it.
        ep.end("context_limit")
        return False
    try:
        ep.pending_action = parse_action(text)
    except ValueError as e:
        # An unparseable action is an observation, as in the envs themselves.
        ep.pending_invalid = invalid_action(str(e))
    return True


def content_text(ids: Sequence[int], matched, tokenizer: ChatTokenizer, stop_ids: set) -> str:
    """The text of a turn without the stop that ended it: the action an env gets and the
    assistant message's content (the template writes its own end of turn).

    `matched` is the engine's `GenerateResult.matched_stop`. A stop id (Llama 3 ends turns on
    either `<|eot_id|>` or `<|end_of_text|>`, only one of which is the tokenizer's eos) is
    dropped from the end of the ids; a stop string is cut from the text with whatever the
    token that completed it decodes to after it, as SGLang trims it by default. An engine that
    does not say what matched gets the known stop ids (sampling's and the tokenizer's eos)
    stripped. Either way, whatever the finish reason: an engine may report a stop sampled as
    the last budgeted token as "length". Only the text changes: the sampled ids all stay in
    the token history.
    """
    if isinstance(matched, str) and matched:
        text = tokenizer.decode(ids)
        at = text.find(matched)  # the earliest occurrence is the one that stopped generation
        return text[:at] if at >= 0 else text
    ids = list(ids)
    matched_id = (isinstance(matched, (int, np.integer)) and not isinstance(matched, bool)
                  and bool(ids) and ids[-1] == matched)
    if matched_id or (ids and ids[-1] in stop_ids):
        return tokenizer.decode(ids[:-1])
    return tokenizer.decode(ids)


def _add_observation(ep: Episode, outcome: Outcome, turn: int, tokenizer: ChatTokenizer,
                     max_turns: int, max_context: int):
    if ep.pending_invalid is None:  # the env was stepped
        ep.info["env_steps"] += 1
        ep.info["env_step_s"] += outcome.seconds
    if ended_on_failure(ep, outcome, f"step (turn {turn})"):
        return
    result = outcome.value
    if not isinstance(result, StepResult) or not isinstance(result.observation, str):
        ep.end("env_error", f"step returned {result!r:.200}, not a StepResult with a str "
                            "observation")
        return
    ep.rewards[-1] = float(result.reward)
    if ep.pending_invalid is None:
        ep.env_trace.append((ep.pending_action, result.observation, float(result.reward),
                             bool(result.done)))
    ep.step_infos.append(dict(result.info))
    if "success" in result.info:
        ep.success = bool(result.info["success"])
    try:
        observation = observation_messages(type(ep.env).__name__, result)
    except ValueError as e:
        ep.end("env_error", str(e))
        return
    if result.done or turn + 1 >= max_turns:
        ep.messages.extend(observation)
        ep.info["final_observation"] = result.observation
        ep.end("done" if result.done else "turn_limit")
        return
    new = tokenizer.append_messages(ep.tokens, ep.messages, observation,
                                    add_generation_prompt=True, tools=ep.tools)
    ep.messages.extend(observation)
    if len(new) >= max_context:
        # Appending would leave no room to generate; the observation stays in the transcript.
        ep.info["final_observation"] = result.observation
        ep.end("context_limit")
        return
    ep.extend(new[len(ep.tokens):], generated=False, turn=turn)


def _finalize(ep: Episode, reward_reduce, max_turns: int, max_new_tokens_per_turn: int
              ) -> Trajectory:
    ep.info["step_infos"] = ep.step_infos
    # The horizon and budget it was played with (a partial rollout's: the call that ended it),
    # for whatever reads them later, a step or more after a free-running producer sampled it
    # (Dr.GRPO's normaliser, the rollout metrics).
    ep.info["max_turns"], ep.info["max_new_tokens_per_turn"] = max_turns, max_new_tokens_per_turn
    reward = float(reward_reduce(ep.rewards))
    if "branch_turn" in ep.info:  # a branch's own reward: its turns from the fork on
        own = ep.rewards[ep.info["branch_turn"]:]
        ep.info["branch_reward"] = float(reward_reduce(own)) if own else 0.0
    if ep.success is not None:  # the env's own verdict wins
        success = ep.success
    else:
        success = ep.finish == "done" and reward > 0
    return Trajectory(
        tokens=np.asarray(ep.tokens, np.int32),
        loss_mask=np.asarray(ep.mask, bool),
        behaviour_logprobs=np.asarray(ep.logprobs, np.float32),
        turn_ids=np.asarray(ep.turn_ids, np.int32),
        rewards=list(ep.rewards), reward=reward, success=bool(success),
        num_turns=len(ep.rewards), weight_versions=list(ep.weight_versions),
        logprob_convention=ep.logprob_convention,
        token_versions=np.asarray(ep.versions, np.int32),
        routed_experts=ep.routed_experts(),
        task_id=ep.task.task_id, group_id=ep.group_id, finish=ep.finish or "env_error",
        messages=ep.messages, info=ep.info)
