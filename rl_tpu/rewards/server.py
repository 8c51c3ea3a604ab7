"""A reward-model server: one HF *ForSequenceClassification model (a `RewardScorer`) over HTTP.

  python -m launch.serve_reward --model_path DIR --port 30100

Endpoints (every error `{"error": {"message": ...}}`, rl_tpu/serving.py):

  POST /v1/classify  SGLang's (vLLM 0.7's) classification API: {"model", "input": a string,
                     a list of strings, a list of token ids or a list of such lists}
                     -> {"id", "object": "list", "created", "model", "data": [{"index",
                     "label", "probs", "num_classes", "scores"}], "usage"}
  POST /score        rl_tpu's token-exact form, what `RemoteRewardScorer` (remote.py) sends:
                     {"input_ids": [[int, ...], ...]} -> {"scores": [[float x C], ...],
                     "num_labels", "model"}
  GET  /health       200 while the scoring thread runs, else 503
  GET  /get_model_info, /model_info  {"model_path", "num_labels", "labels", "is_generation":
                     false, "limits"}
  GET  /load         requests queued, and the batches and sequences scored since start

`probs` is the softmax over the labels' scores, as SGLang's serving_classify.py computes it
(torch softmax over the head's output, `label` its argmax's id2label name). For a reward model
of one label that softmax is always [1.0] (SGLang answers the same), so the raw scores, which
the RL loop needs (a logit, not a probability), are in each item's `scores` too (an extra
field a vLLM / SGLang client ignores) and are all /score returns.

Concurrent requests are coalesced: one scoring thread takes every request waiting in its queue
and scores all their sequences in one `RewardScorer.score` call (which cuts them into length
buckets), so 64 clients of one sequence each make a few large batches, not 64 small ones, and
each request gets its own rows back. A request over a `RewardLimits` limit (sequences, tokens
a sequence, tokens a request) is answered 400 naming the limit, its flag and the value sent,
before it is queued; an empty sequence, an id outside the model's vocab or a value of the
wrong type is a 400 naming the field.

The server holds at most `max_queued_requests` requests at once (queued or being scored):
one more is answered 503 with `Retry-After` at once, so a flood makes clients back off
instead of waiting behind it without bound. A client that disconnects while its request
waits has it dropped before it is scored (its rows would go to nobody).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import threading
import time
import uuid
from typing import Any, Optional, Sequence

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool

from rl_tpu.http_limits import HttpLimits
from rl_tpu.models.tokenizer import ChatTokenizer
from rl_tpu.rewards.scorer import MIN_LENGTH, RewardScorer, padded_length
from rl_tpu.rewards.tokenizer_match import fingerprint
from rl_tpu.serving import (BadRequest, Server, client_disconnected, docs_routes,
                            error_response, guard, install_error_handlers, read_json)

log = logging.getLogger(__name__)

API_KEY_ENV = "RL_TPU_REWARD_API_KEY"  # the key's variable, for the server and its client


@dataclasses.dataclass(frozen=True)
class RewardLimits:
    """What one request may ask the server to score; over any of them it is answered 400,
    naming the limit and the flag of `launch.serve_reward` that sets it."""

    max_sequences: int = 1024  # sequences a request (--max_sequences)
    max_sequence_tokens: int = 0  # tokens a sequence; 0 = the model's positions
    max_request_tokens: int = 1 << 20  # tokens of all a request's sequences together
    max_queued_requests: int = 64  # requests held at once, queued or scored (server-wide)

    def __post_init__(self):
        for name in ("max_sequences", "max_request_tokens", "max_queued_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.max_sequence_tokens < 0:
            raise ValueError(f"--max_sequence_tokens must be >= 0 (0 = the model's positions), "
                             f"got {self.max_sequence_tokens}")

    def sequence_tokens(self, positions: int) -> int:
        return min(self.max_sequence_tokens or positions, positions)

    def check(self, lengths: Sequence[int], positions: int, field: str) -> None:
        """BadRequest naming the first limit `lengths` (a request's sequences' lengths) break;
        `field` names the sequences in the message."""
        if len(lengths) > self.max_sequences:
            raise BadRequest(f"'{field}': {len(lengths)} sequences are over this server's limit "
                             f"of {self.max_sequences} a request (--max_sequences); split the "
                             "request")
        longest = self.sequence_tokens(positions)
        for i, n in enumerate(lengths):
            if n > longest:
                raise BadRequest(f"'{field}[{i}]': {n} tokens are over this server's limit of "
                                 f"{longest} a sequence (--max_sequence_tokens, at most the "
                                 "model's positions)")
        total = int(sum(lengths))
        if total > self.max_request_tokens:
            raise BadRequest(f"'{field}': {total} tokens are over this server's limit of "
                             f"{self.max_request_tokens} a request (--max_request_tokens); "
                             "split the request")

    def as_json(self, positions: int) -> dict:
        return {"max_sequences": self.max_sequences,
                "max_sequence_tokens": self.sequence_tokens(positions),
                "max_request_tokens": self.max_request_tokens}


class ServerClosed(RuntimeError):
    """The scoring thread has stopped: the request is answered 503."""


class QueueFull(RuntimeError):
    """The server holds as many requests as it may: this one is answered 503 with
    Retry-After."""


class CoalescingScorer:
    """One thread that scores, for every request waiting when it looks, all their sequences in
    one `scorer.score` call; `submit` returns a future of the request's own [N, C] rows."""

    def __init__(self, scorer: RewardScorer, max_sequences: int = 4096,
                 max_queued: int = 1 << 30):
        self.scorer, self.max_sequences, self.max_queued = scorer, max_sequences, max_queued
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        # futures submitted and not done: a cancelled one (its client gone) leaves at once,
        # though its entry waits in the queue until the thread skips it
        self._held: set = set()
        self._held_lock = threading.Lock()
        self._closed = threading.Event()
        self.batches = self.sequences = 0
        self.error: Optional[str] = None
        self._thread = threading.Thread(target=self._serve, daemon=True, name="reward-scorer")
        self._thread.start()

    def submit(self, sequences: list[list[int]]) -> concurrent.futures.Future:
        if self._closed.is_set() or not self._thread.is_alive():
            raise ServerClosed(f"the scoring thread has stopped ({self.error or 'closed'})")
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._held_lock:
            if len(self._held) >= self.max_queued:
                raise QueueFull(f"this server holds {len(self._held)} requests, its limit "
                                f"(--max_queued_requests={self.max_queued}); retry shortly")
            self._held.add(future)
        future.add_done_callback(self._let_go)
        self._queue.put((sequences, future))
        return future

    def _let_go(self, future: concurrent.futures.Future) -> None:
        with self._held_lock:
            self._held.discard(future)

    def queued(self) -> int:
        """Requests held: queued or being scored (a departed client's not counted)."""
        with self._held_lock:
            return len(self._held)

    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed.is_set()

    def close(self, timeout: float = 10.0) -> None:
        """Stops the thread once what is queued before this call is scored."""
        if not self._closed.is_set():
            self._closed.set()
            self._queue.put(None)
        self._thread.join(timeout)

    def _take(self) -> tuple[list, bool]:
        """The waiting requests (blocking for the first), up to max_sequences sequences
        (one request alone may hold more); whether close() was seen."""
        first = self._queue.get()
        if first is None:
            return [], True
        taken, count = [first], len(first[0])
        while count < self.max_sequences:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                return taken, True
            taken.append(item)
            count += len(item[0])
        return taken, False

    def _serve(self) -> None:
        try:
            self._run()
        except BaseException as err:  # a bug of ours: /health then says so
            self.error = f"{type(err).__name__}: {err}"
            log.exception("the scoring thread died")
            raise
        finally:  # whatever is queued now is refused, not left hanging
            self._closed.set()
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None and item[1].set_running_or_notify_cancel():
                    item[1].set_exception(ServerClosed(
                        f"the scoring thread has stopped ({self.error or 'closed'})"))

    def _run(self) -> None:
        stop = False
        while not stop:
            taken, stop = self._take()
            # a client gone (its future cancelled) costs nothing more
            taken = [(seqs, f) for seqs, f in taken if f.set_running_or_notify_cancel()]
            if not taken:
                continue
            try:
                scores = self.scorer.score([s for seqs, _ in taken for s in seqs])
            except Exception as err:  # noqa: BLE001 - answered to each request; keep serving
                log.exception("scoring a batch of %d requests failed", len(taken))
                for _, future in taken:
                    future.set_exception(err)
                continue
            self.batches += 1
            self.sequences += len(scores)
            start = 0
            for seqs, future in taken:
                future.set_result(scores[start:start + len(seqs)])
                start += len(seqs)


class ClassifyBody(BaseModel):
    """SGLang's /v1/classify body (other fields, as user, rid or priority, are accepted and
    ignored)."""

    model_config = ConfigDict(extra="allow")
    model: Optional[str] = None
    input: Any = None


class ScoreBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    input_ids: Any = None


def _shown(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


class RewardService:
    """The server's state and logic, apart from HTTP (testable directly).

    Args:
      scorer: the reward model on this host's devices.
      model_path: the directory it came from (reported, and the default model name).
      tokenizer: for /v1/classify's text (None: token ids only).
      limits: what one request may ask for.
      served_name: the `model` replies carry (default: model_path).
    """

    def __init__(self, scorer: RewardScorer, model_path: str,
                 tokenizer: Optional[ChatTokenizer] = None,
                 limits: RewardLimits = RewardLimits(), served_name: Optional[str] = None):
        self.scorer, self.model_path, self.tokenizer = scorer, model_path, tokenizer
        self.limits = limits
        self.served_name = served_name or model_path
        self.num_labels = scorer.head.num_labels
        self.labels = list(scorer.head.labels) or [f"LABEL_{i}" for i in range(self.num_labels)]
        self.vocab = scorer.cfg.vocab_size
        # what a client compares with its policy's tokenizer (rewards/tokenizer_match.py)
        self.tokenizer_fingerprint = fingerprint(tokenizer) if tokenizer is not None else None
        self.positions = scorer.cfg.max_position_embeddings
        # a batch's sequences beyond one request's are not taken: a drained queue of many
        # large requests would otherwise be one call of unbounded size
        self.batcher = CoalescingScorer(scorer, max(limits.max_sequences, 256),
                                        limits.max_queued_requests)

    def close(self) -> None:
        self.batcher.close()

    def warmup(self) -> dict:
        """Scores a batch of each shape a request may reach (each length bucket, each padded
        row count: `RewardScorer.padded_rows`), so every program is compiled (or loaded from
        the compilation cache) before the first request waits on one."""
        start, shapes = time.perf_counter(), set()
        longest, length = self.limits.sequence_tokens(self.positions), MIN_LENGTH
        while True:
            length = min(length, longest)
            bucket = padded_length(length)  # as the scorer pads
            rows = 1
            while True:
                shape = (self.scorer.padded_rows(rows, bucket), bucket)
                if shape not in shapes:
                    shapes.add(shape)
                    self.scorer.score([[0] * length] * rows)
                if rows >= self.scorer.rows_for(bucket):
                    break
                rows *= 2
            if length >= longest:
                break
            length *= 2
        return {"programs": len(shapes), "seconds": time.perf_counter() - start}

    # -- checking requests ----------------------------------------------------------------

    def token_ids(self, value: Any, field: str) -> list[list[int]]:
        """A non-empty list of non-empty token-id lists, each id in the model's vocab, within
        the limits; BadRequest naming the first bad field otherwise."""
        if not isinstance(value, list) or not value:
            raise BadRequest(f"'{field}' must be a non-empty list of token-id lists, got "
                             f"{_shown(value)}")
        for i, seq in enumerate(value):
            if not isinstance(seq, list) or not seq:
                raise BadRequest(f"'{field}[{i}]' must be a non-empty list of token ids, got "
                                 f"{_shown(seq)}")
        # the sizes first: a request over a limit is refused before its ids are walked
        self.limits.check([len(s) for s in value], self.positions, field)
        for i, seq in enumerate(value):
            if not all(type(t) is int for t in seq):  # bool is an int subclass: refused too
                j = next(j for j, t in enumerate(seq) if type(t) is not int)
                raise BadRequest(f"'{field}[{i}][{j}]' must be a token id (an integer), got "
                                 f"{_shown(seq[j])}")
            low, high = min(seq), max(seq)
            if low < 0 or high >= self.vocab:
                j = next(j for j, t in enumerate(seq) if not 0 <= t < self.vocab)
                raise BadRequest(f"'{field}[{i}][{j}]' must be a token id in [0, {self.vocab}) "
                                 f"(the model's vocab), got {seq[j]}")
        return value

    def classify_inputs(self, value: Any) -> list[list[int]]:
        """/v1/classify's `input`, as SGLang reads it: a string, a list of strings, a list of
        token ids (one sequence) or a list of such lists; text through the tokenizer."""
        if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
            return self.token_ids(value, "input")
        if isinstance(value, list) and value and not isinstance(value[0], str):
            return self.token_ids([value], "input")
        single = isinstance(value, str)
        texts = [value] if single else value
        if not isinstance(texts, list) or not texts:
            raise BadRequest(f"'input' must be a string, a non-empty list of strings or of "
                             f"token ids, got {_shown(value)}")
        if len(texts) > self.limits.max_sequences:
            self.limits.check([1] * len(texts), self.positions, "input")
        if self.tokenizer is None:
            raise BadRequest("this server has no tokenizer (--skip_tokenizer_init): send token "
                             "ids in 'input', or use POST /score")
        ids = []
        for i, text in enumerate(texts):
            where = "input" if single else f"input[{i}]"
            if not isinstance(text, str):
                raise BadRequest(f"'{where}' must be a string, got {_shown(text)}")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as err:
                raise BadRequest(f"'{where}' is not valid Unicode text: {err.reason}") from err
            # no special tokens added (ChatTokenizer.encode): a chat already rendered by the
            # template holds the ones it wants, so text and the RL loop's ids score alike
            ids.append(self.tokenizer.encode(text))
            if not ids[-1]:
                raise BadRequest(f"'{where}' encodes to no tokens: a reward model scores a "
                                 "sequence's last token")
        return self.token_ids(ids, "input")

    # -- replies ------------------------------------------------------------------------

    def classify_reply(self, sequences: list[list[int]], scores: np.ndarray) -> dict:
        data = []
        for i, row in enumerate(scores.astype(np.float64)):
            probs = np.exp(row - row.max())
            probs /= probs.sum()
            data.append({"index": i, "label": self.labels[int(row.argmax())],
                         "probs": probs.tolist(), "num_classes": self.num_labels,
                         "scores": row.tolist()})
        tokens = int(sum(len(s) for s in sequences))
        return {"id": f"classify-{uuid.uuid4().hex}", "object": "list",
                "created": int(time.time()), "model": self.served_name, "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens,
                          "completion_tokens": 0, "prompt_tokens_details": None}}

    def model_info(self) -> dict:
        return {"model_path": self.model_path, "tokenizer_path": self.model_path,
                "served_model_name": self.served_name, "num_labels": self.num_labels,
                "labels": self.labels, "is_generation": False, "vocab_size": self.vocab,
                "limits": self.limits.as_json(self.positions),
                "tokenizer": self.tokenizer_fingerprint}

    def load(self) -> dict:
        return {"queued_requests": self.batcher.queued(), "batches": self.batcher.batches,
                "sequences_scored": self.batcher.sequences}


async def _scored(service: RewardService, sequences: list[list[int]],
                  request: Request) -> np.ndarray:
    """The rows of `sequences`, scored; _Gone when the client leaves first (its request is
    then dropped, unscored, if the thread has not taken it yet)."""
    try:
        future = service.batcher.submit(sequences)
    except QueueFull as err:
        raise _Unavailable(str(err), retry_after_s=1) from err
    except ServerClosed as err:
        raise _Unavailable(str(err)) from err
    scored = asyncio.wrap_future(future)  # cancelling it cancels `future`, if still queued
    gone = asyncio.ensure_future(client_disconnected(request))
    try:
        await asyncio.wait({scored, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not scored.done():
            scored.cancel()
    if scored.cancelled():
        raise _Gone()
    try:
        return scored.result()
    except ServerClosed as err:
        raise _Unavailable(str(err)) from err


class _Unavailable(Exception):
    """Answered 503 (with Retry-After when `retry_after_s` is set)."""

    def __init__(self, message: str, retry_after_s: Optional[int] = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class _Gone(Exception):
    """The client left before its rows were scored: answered 499 (to nobody)."""


def make_app(service: RewardService, api_key: Optional[str] = None,
             limits: Optional[HttpLimits] = None, docs: bool = False) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            yield
        finally:  # after uvicorn has let the requests in flight finish
            service.close()

    app = FastAPI(title="rl_tpu reward server", lifespan=lifespan, **docs_routes(docs))
    install_error_handlers(app)

    @app.exception_handler(_Unavailable)
    async def _unavailable(request: Request, err: _Unavailable):
        response = error_response(503, str(err))
        if err.retry_after_s is not None:
            response.headers["Retry-After"] = str(err.retry_after_s)
        return response

    @app.exception_handler(_Gone)
    async def _gone(request: Request, err: _Gone):
        return error_response(499, "client closed the request")

    guard(app, limits or HttpLimits(), api_key,
          key_hint=f"; RemoteRewardScorer sends the key in {API_KEY_ENV}")

    @app.post("/v1/classify")
    async def classify(request: Request):
        body = await read_json(request, ClassifyBody)
        if body.input is None:
            raise BadRequest("'input' is missing: send a string or a list of strings")
        # tokenizing may take a while: off the event loop
        sequences = await run_in_threadpool(service.classify_inputs, body.input)
        scores = await _scored(service, sequences, request)
        return JSONResponse(service.classify_reply(sequences, scores))

    @app.post("/score")
    async def score(request: Request):
        body = await read_json(request, ScoreBody)
        if body.input_ids is None:
            raise BadRequest("'input_ids' is missing: send a list of token-id lists")
        # walking up to max_request_tokens ids: off the event loop, as classify's tokenizing
        sequences = await run_in_threadpool(service.token_ids, body.input_ids, "input_ids")
        scores = await _scored(service, sequences, request)
        return JSONResponse({"scores": scores.tolist(), "num_labels": service.num_labels,
                             "model": service.served_name})

    @app.get("/health")
    def health():
        if service.batcher.alive():
            return Response("", 200, media_type="text/plain")
        return error_response(503, f"the scoring thread has stopped "
                                   f"({service.batcher.error or 'closed'}); restart the server")

    @app.get("/model_info")
    @app.get("/get_model_info")
    def model_info():
        return service.model_info()

    @app.get("/load")
    def load():
        return service.load()

    return app


def serve(service: RewardService, host: str = "127.0.0.1", port: int = 30100,
          api_key: Optional[str] = None, limits: Optional[HttpLimits] = None,
          docs: bool = False) -> Server:
    """Binds (loopback unless told otherwise) and returns the server: `serve_forever()`, or
    `start()` to serve from a thread (it returns the URL); `shutdown()` lets the requests in
    flight finish, then stops the scoring thread."""
    limits = limits or HttpLimits()
    return Server(make_app(service, api_key, limits, docs), host, port, limits=limits,
                  on_unserved_close=service.close)
