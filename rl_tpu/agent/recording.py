"""The recording endpoint: an OpenAI-style chat server on loopback that answers an agent
program's calls with the rollout engine and records each one token-exactly.

A user's agent program (rl_tpu/agent/program.py plays them) talks to
`http://127.0.0.1:PORT/episode/<key>/v1` with the `openai` client: `POST .../chat/completions`
and `GET .../models`. The key names the episode, so the episodes of a step, played at once on
threads, never mix. Each call is rendered to prompt ids, sent to the engine (the calls of all
episodes batched into one `generate`), and its sampled ids and log-probs are recorded before
the reply goes back in OpenAI's shape.

Segments. An episode's calls are recorded as conversations ("segments"). A call whose
messages EXTEND a segment (they start with that segment's messages, each assistant reply
sent back as the text or the tool calls it was answered with, and add at least one message)
is appended to it token-exactly: only the new messages are tokenized
(`ChatTokenizer.append_messages`) after the recorded ids, which hold the model's own sampled
ids, never re-tokenized. A call that repeats a segment's conversation only up to an earlier
reply (a retry from that turn) branches off there: a new segment that shares the recorded
ids up to that reply. Two calls sent at once on one segment: the first recorded extends it,
the other becomes a segment of its own (the same ids up to where both start). A call that
continues no segment (the program rewrote its history, or runs a second conversation)
starts a new segment from the chat template. What the trainer gets of them:
rl_tpu/agent/program.py.

Sampling. The engine samples with the player's `SamplingParams` (the trainer's temperature,
top-p and top-k: the log-probs it corrects for), whatever the program asks: a request's
`temperature`, `top_p`, `seed` and the like are ignored. `max_tokens` (or
`max_completion_tokens`) lowers the reply's budget below the turn budget L; `stop` strings
are honoured; `logprobs: true` returns the sampled ids' log-probs. A request with `tools` is
rendered with them, and a reply that calls one comes back as OpenAI `tool_calls`
(rl_tpu.tools.calls reads them from the text in the template's format). Requests are read and
replies written by the rollout server's own codec (rl_tpu/rollout/openai_api.py), so each
choice also carries `prompt_token_ids`, `token_ids` and `weight_version`.

Refusals (HTTP 400, which the `openai` client raises as BadRequestError): what the codec
refuses (penalties, logit_bias, top_logprobs, ...), `n` > 1 and `stream`, a call beyond the
episode's `max_turns` calls (the episode ends "turn_limit"), a prompt with no room left in
`max_context_tokens` ("context_limit"), an engine abort ("abort"), and calls after the episode
ended (its program timed out). A failed engine answers 500 and fails the step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import threading
import time
from typing import Any, Optional, Sequence

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rl_tpu.agent.loop import content_text
from rl_tpu.core.engine import GenerateRequest, GenerateResult, RolloutEngine, SamplingParams
from rl_tpu.core.trajectory import NO_VERSION, token_versions
from rl_tpu.http_limits import HttpLimits, JSONLimitError, loads
from rl_tpu.models.tokenizer import ChatTokenizer
from rl_tpu.rollout import openai_api
from rl_tpu.serving import BadRequest, Server, error_response, install_error_handlers
from rl_tpu.tools.calls import call_format_of, parse_tool_calls

MODEL_NAME = "rl_tpu-policy"  # what GET /v1/models lists; any model name is accepted


class Refused(Exception):
    """A call the endpoint answers with an error (`status`) instead of a completion; `finish`
    is how it ends the episode, if it does."""

    def __init__(self, message: str, status: int = 400, finish: Optional[str] = None):
        super().__init__(message)
        self.status, self.finish = status, finish


# --- the request ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ChatCall:
    """One chat-completions request, read: its messages as the chat template renders them and
    the keys they are matched by, its tools, and what of its sampling is honoured."""

    messages: list[dict]
    keys: list[str]
    tools: Optional[list[dict]]
    max_tokens: Optional[int]
    stop: tuple[str, ...]
    model: str
    logprobs: bool = False


def read_chat_call(body: Any) -> ChatCall:
    """A `/chat/completions` body -> ChatCall, read by the rollout server's own codec
    (rl_tpu/rollout/openai_api.py); Refused (400) naming what is wrong."""
    try:
        request = openai_api.parse_chat_request(body)
    except BadRequest as err:
        raise Refused(str(err)) from err
    if request.stream:
        raise Refused("'stream': streaming is not supported by the recording endpoint")
    if request.sampling.n != 1:
        raise Refused(f"'n'={request.sampling.n}: one reply a call (each sample is an episode "
                      "of its own: the trainer's samples_per_task plays them)")
    if request.max_tokens == 0:
        raise Refused("'max_tokens' must be >= 1")
    messages = [{k: v for k, v in m.items() if v is not None or k == "content"}
                for m in request.messages]
    return ChatCall(messages=messages, keys=[message_key(m) for m in messages],
                    tools=request.tools, max_tokens=request.max_tokens,
                    stop=tuple(request.sampling.stop), model=str(body.get("model") or MODEL_NAME),
                    logprobs=request.logprobs)


def message_key(message: dict) -> str:
    """What two messages must share to be the same turn of a conversation: role, content and
    the calls' names and arguments (not the ids a client may renumber, nor null fields)."""
    calls = [(c["function"]["name"], c["function"]["arguments"])
             for c in message.get("tool_calls", ())]
    return json.dumps([message["role"], message.get("content") or "", calls,
                       message.get("tool_call_id", "")], sort_keys=True)


# --- what an episode recorded ---------------------------------------------------------------

@dataclasses.dataclass
class Segment:
    """One conversation of an episode, token-exact (module doc). `messages` as rendered (a
    reply as its raw text); `accepts[i]`: the keys message i may come back as."""

    tools: Optional[list] = None
    tokens: list = dataclasses.field(default_factory=list)
    mask: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    versions: list = dataclasses.field(default_factory=list)
    turn_ids: list = dataclasses.field(default_factory=list)
    messages: list = dataclasses.field(default_factory=list)
    accepts: list = dataclasses.field(default_factory=list)
    weight_versions: list = dataclasses.field(default_factory=list)
    # (messages, tokens) it held after each of its calls' replies: where a later call may
    # branch off (a retry from an earlier turn, two calls sent at once)
    boundaries: list = dataclasses.field(default_factory=list)
    logprob_convention: str = "full"
    calls: int = 0
    revision: int = 0

    def copy(self) -> "Segment":
        return dataclasses.replace(self, **{f.name: list(getattr(self, f.name)) for f in
                                            dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), list)
                                            and f.name != "tools"})

    def extend(self, ids: Sequence[int], turn: int, logprobs: Optional[Sequence[float]] = None,
               versions: Optional[Sequence[int]] = None) -> None:
        generated = logprobs is not None
        self.tokens.extend(int(i) for i in ids)
        self.mask.extend([generated] * len(ids))
        self.logprobs.extend([float(x) for x in logprobs] if generated else [0.0] * len(ids))
        self.versions.extend(list(versions) if generated else [NO_VERSION] * len(ids))
        self.turn_ids.extend([turn] * len(ids))

    def branch_point(self, call: ChatCall) -> Optional[int]:
        """The latest of its calls whose conversation `call` extends (its messages up to that
        reply, then at least one more), or None."""
        if call.tools != self.tools:
            return None
        for k in range(len(self.boundaries) - 1, -1, -1):
            n_messages = self.boundaries[k][0]
            if len(call.keys) > n_messages and all(
                    key in accepted for key, accepted in zip(call.keys, self.accepts[:n_messages])):
                return k
        return None

    def up_to(self, k: int) -> "Segment":
        """A copy of itself as it was after its call k's reply (the whole of it for the last)."""
        n_messages, n_tokens = self.boundaries[k]
        out = self.copy()
        for name in ("tokens", "mask", "logprobs", "versions", "turn_ids"):
            del getattr(out, name)[n_tokens:]
        del out.messages[n_messages:], out.accepts[n_messages:]
        del out.weight_versions[k + 1:], out.boundaries[k + 1:]
        out.calls = k + 1
        return out

    @property
    def sampled(self) -> int:
        return int(sum(self.mask))


@dataclasses.dataclass
class PendingCall:
    """A call rendered and waiting for the engine."""

    recorder: "EpisodeRecorder"
    call: ChatCall
    request: GenerateRequest
    draft: Segment  # the segment it extends (a copy) with the new prompt ids appended
    extends: Optional[int]  # index of that segment, None for a new one
    revision: int
    prompt_tokens: int


class EpisodeRecorder:
    """The calls of one episode: prepares each (`prepare`), records its sample (`record`)."""

    def __init__(self, key: str, tokenizer: ChatTokenizer, sampling: SamplingParams, *,
                 max_turns: int, max_new_tokens: int, max_context_tokens: int,
                 seed_key: Sequence[int] = ()):
        self.key, self.tokenizer, self.sampling = key, tokenizer, sampling
        self.max_turns, self.max_new, self.max_context = max_turns, max_new_tokens, \
            max_context_tokens
        self.seed_key = list(seed_key)
        self.segments: list[Segment] = []
        self.last_segment: Optional[int] = None  # the segment of the last call recorded
        self.calls = 0  # calls taken within max_turns (answered or refused after)
        self.finish: Optional[str] = None  # turn_limit | context_limit | abort, once set
        self.closed: Optional[str] = None  # why calls are refused from now on
        self.notes: list[str] = []  # refusals, for the trajectory's info
        self.sampled = 0  # ids sampled over all its calls
        self._lock = threading.Lock()
        stop_ids = set(sampling.stop_token_ids)
        if tokenizer.eos_token_id is not None:
            stop_ids.add(tokenizer.eos_token_id)
        self._stop_ids = stop_ids

    def close(self, reason: str) -> None:
        with self._lock:
            self.closed = self.closed or reason

    def _refuse(self, message: str, finish: Optional[str] = None, close: bool = False):
        if finish and self.finish is None:
            self.finish = finish
        if close:
            self.closed = self.closed or message
        self.notes.append(message)
        return Refused(message, finish=finish)

    def prepare(self, call: ChatCall) -> PendingCall:
        with self._lock:
            if self.closed:
                raise Refused(f"episode {self.key} has ended: {self.closed}")
            if self.calls >= self.max_turns:
                raise self._refuse(f"turn limit: an episode makes at most max_turns="
                                   f"{self.max_turns} model calls", "turn_limit")
            index, self.calls = self.calls, self.calls + 1
            at, base = self._base_for(call)
            revision = base.revision  # what `record` checks the segment still is
        new = call.messages[len(base.messages):]
        try:
            if base.calls:
                ids = self.tokenizer.append_messages(base.tokens, base.messages, new,
                                                     add_generation_prompt=True, tools=call.tools)
                base.extend(ids[len(base.tokens):], turn=base.calls - 1)
            else:
                base.extend(self.tokenizer.apply_chat_template(new, add_generation_prompt=True,
                                                               tools=call.tools), turn=-1)
        except (ValueError, TypeError) as err:  # a template that cannot render these messages
            raise Refused(f"the chat template cannot render this request: {err}") from err
        base.messages.extend(new)
        base.accepts.extend({key} for key in call.keys[len(base.accepts):])
        room = self.max_context - len(base.tokens)
        if room < 1:
            with self._lock:
                raise self._refuse(f"context_length_exceeded: the prompt has {len(base.tokens)} "
                                   f"tokens, no room left within max_context_tokens="
                                   f"{self.max_context}", "context_limit")
        limit = min(self.max_new, room, call.max_tokens or self.max_new)
        seed = None
        if self.sampling.seed is not None:
            key = [self.sampling.seed, *self.seed_key, index]
            seed = int(np.random.SeedSequence(key).generate_state(1)[0] & 0x7FFFFFFF)
        sampling = dataclasses.replace(self.sampling, max_new_tokens=limit, seed=seed, n=1,
                                       stop=tuple(self.sampling.stop) + call.stop)
        # a copy: the draft grows by the reply, the request must keep what the engine saw
        request = GenerateRequest(tuple(base.tokens), sampling, request_id=f"{self.key}-{index}")
        return PendingCall(self, call, request, base, at, revision, len(base.tokens))

    def _base_for(self, call: ChatCall) -> tuple[Optional[int], Segment]:
        """(the segment `call` extends at its end, or None; what its prompt starts from): the
        conversation it continues, at the latest call whose messages it repeats (the longest
        such, the newest segment on a tie); an empty segment when it continues none."""
        best = None  # (messages repeated, segment index, call index)
        for i in range(len(self.segments) - 1, -1, -1):
            k = self.segments[i].branch_point(call)
            if k is not None and (best is None or self.segments[i].boundaries[k][0] > best[0]):
                best = (self.segments[i].boundaries[k][0], i, k)
        if best is None:
            return None, Segment(tools=call.tools)
        _, i, k = best
        segment = self.segments[i]
        if k == len(segment.boundaries) - 1:  # its end: the call extends it in place
            return i, segment.copy()
        return None, segment.up_to(k)  # an earlier turn: a branch, a segment of its own

    def record(self, pending: PendingCall, result: GenerateResult) -> dict:
        """Records the call's sample; its OpenAI reply (Refused for an aborted one)."""
        ids, logprobs = list(result.output_ids), list(result.logprobs)
        if len(ids) != len(logprobs):
            raise RuntimeError(f"the engine returned {len(ids)} ids but {len(logprobs)} "
                               f"log-probs for {pending.request.request_id}")
        if result.finish_reason == "abort":
            with self._lock:
                raise self._refuse("the engine aborted this call", "abort", close=True)
        draft = pending.draft
        versions = token_versions(len(ids), result.weight_version,
                                  result.info.get("weight_versions"))
        draft.extend(ids, turn=draft.calls, logprobs=logprobs, versions=versions)
        draft.calls += 1
        draft.weight_versions.append(result.weight_version)
        if result.logprob_convention != "full":
            draft.logprob_convention = result.logprob_convention
        text = content_text(ids, result.matched_stop, self.tokenizer, self._stop_ids)
        parsed = None
        raw = {"role": "assistant", "content": text}
        echoed = raw  # the reply as the program sends it back, in the template's form
        if pending.call.tools:
            parsed = parse_tool_calls(text, call_format_of(self.tokenizer))
            if parsed.calls:
                echoed = {"role": "assistant", "content": parsed.content or "",
                          "tool_calls": [c.as_message_call() for c in parsed.calls]}
        draft.messages.append(raw)
        draft.accepts.append({message_key(raw), message_key(echoed)})
        draft.boundaries.append((len(draft.messages), len(draft.tokens)))
        with self._lock:
            self.sampled += len(ids)
            at = pending.extends
            if at is not None and self.segments[at].revision == pending.revision:
                draft.revision = pending.revision + 1
                self.segments[at] = draft
            else:  # a new conversation or a branch, or its segment moved on meanwhile
                self.segments.append(draft)
                at = len(self.segments) - 1
            self.last_segment = at
            if result.finish_reason == "length" and len(draft.tokens) >= self.max_context:
                self.finish = self.finish or "context_limit"
        request_id = pending.request.request_id
        choice = openai_api.chat_choice(
            0, result, text, pending.request.prompt_ids, parsed, logprobs=pending.call.logprobs,
            token_text=lambda i: self.tokenizer.decode([i]), call_id_prefix=f"call_{request_id}")
        return openai_api.chat_response(f"chatcmpl-{request_id}", pending.call.model,
                                        int(time.time()), [choice],
                                        openai_api.usage([pending.prompt_tokens], [result]))


# --- the server -----------------------------------------------------------------------------

class RecordingServer:
    """The endpoint on 127.0.0.1 (a free port) for every episode `register`ed with it; one
    thread batches the waiting calls into `engine.generate` (module doc).

    Batching: once a call waits, the batch goes when every running program has a call
    waiting (`running`, from what the player says: `expect`, `program_ended`), or
    `batch_window_s` after the first, whichever comes first; one batch is on the engine at a
    time, and the calls that arrive meanwhile form the next.
    """

    def __init__(self, engine: RolloutEngine, batch_window_s: float = 0.02):
        self.engine, self.window = engine, float(batch_window_s)
        self.recorders: dict[str, EpisodeRecorder] = {}
        self.engine_error: Optional[BaseException] = None
        self._unfinished = self._at_once = 0  # programs yet to end, at most running at once
        self.batches: list[int] = []  # size of each batch sent, for tests and metrics
        self._queue: list[tuple[PendingCall, concurrent.futures.Future]] = []
        self._cond = threading.Condition()
        self._stop = False
        self.app = self._make_app()
        self.server = Server(self.app)
        self.url = self.server.start()
        self._thread = threading.Thread(target=self._batch_loop, daemon=True,
                                        name="recording-batcher")
        self._thread.start()

    def register(self, recorder: EpisodeRecorder) -> str:
        """Serves `recorder`'s episode; returns its base URL (for `openai.OpenAI(base_url=)`)."""
        self.recorders[recorder.key] = recorder
        return f"{self.url}/episode/{recorder.key}/v1"

    def expect(self, programs: int, at_once: int) -> None:
        """`programs` programs will call, `at_once` of them running at a time."""
        with self._cond:
            self._unfinished, self._at_once = programs, at_once

    def program_ended(self) -> None:
        with self._cond:
            self._unfinished -= 1
            self._cond.notify_all()

    @property
    def running(self) -> int:
        """Programs that may be calling now: the batch waits for no more calls than this."""
        return min(self._unfinished, self._at_once)

    def shutdown(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
        self.server.shutdown()

    def _make_app(self) -> FastAPI:
        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
        install_error_handlers(app)

        @app.get("/episode/{key}/v1/models")
        async def models(key: str):
            if key not in self.recorders:
                return error_response(404, f"no episode {key!r} is recording here")
            return openai_api.models_list(MODEL_NAME, 0)

        @app.post("/episode/{key}/v1/chat/completions")
        async def chat(key: str, request: Request):
            recorder = self.recorders.get(key)
            if recorder is None:
                return error_response(404, f"no episode {key!r} is recording here")
            try:  # the servers' bounded parse: a body nested past the limit is a 400, not a
                # RecursionError's 500
                body = loads(await request.body() or b"{}", HttpLimits.max_json_depth)
            except JSONLimitError as err:
                return error_response(400, str(err))
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                return error_response(400, f"the body is not JSON: {err}")
            try:
                call = read_chat_call(body)
                pending = await asyncio.to_thread(recorder.prepare, call)
                reply = await asyncio.wrap_future(self._submit(pending))
            except Refused as err:
                return error_response(err.status, str(err))
            except Exception as err:  # noqa: BLE001 - the engine's failure: the step fails
                return error_response(500, f"the rollout engine failed: "
                                           f"{type(err).__name__}: {err}")
            return JSONResponse(reply)

        return app

    def _submit(self, pending: PendingCall) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self.engine_error is not None:
                future.set_exception(self.engine_error)
            else:
                self._queue.append((pending, future))
                self._cond.notify_all()
        return future

    def _batch_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait()
                if self._stop and not self._queue:
                    return
                deadline = time.monotonic() + self.window
                while (len(self._queue) < self.running and not self._stop
                       and time.monotonic() < deadline):
                    self._cond.wait(max(deadline - time.monotonic(), 0.0))
                batch, self._queue = self._queue, []
            self._run(batch)

    def _run(self, batch: list[tuple[PendingCall, concurrent.futures.Future]]) -> None:
        self.batches.append(len(batch))
        try:
            results = self.engine.generate([pending.request for pending, _ in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"the engine returned {len(results)} results for "
                                   f"{len(batch)} requests")
        except Exception as err:  # noqa: BLE001 - handed to every caller, then to the player
            with self._cond:
                self.engine_error = self.engine_error or err
            for _, future in batch:
                future.set_exception(err)
            return
        for (pending, future), result in zip(batch, results):
            try:
                future.set_result(pending.recorder.record(pending, result))
            except Refused as err:  # this call's refusal alone
                future.set_exception(err)
            except Exception as err:  # noqa: BLE001 - a malformed result: the step fails
                with self._cond:
                    self.engine_error = self.engine_error or err
                future.set_exception(err)
