"""Streaming a continuous-batcher ticket to an HTTP client as its tokens are decoded.

`ContinuousBatcher.submit(..., on_tokens=)` reports each running row's output after its
prefill and after every decode chunk, on the scheduler thread. `TicketEvents` hands those
reports to the event loop (the scheduler never waits on a client) and yields them coalesced:
a slow reader gets each row's latest output, not every chunk it missed. `TextStream` turns a
row's growing ids into text deltas a client may show at once: held back are an unfinished
UTF-8 character (the tokenizer decodes its first bytes as U+FFFD) and any tail that could be
the start of a stop string (the final reply cuts a stop string and all after it, and a
delta once sent cannot be taken back). `generate_events` is SGLang's /generate stream on top.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator, Callable, Optional, Sequence

from rl_tpu.core.engine import GenerateRequest
from rl_tpu.rollout.continuous import Ticket

log = logging.getLogger(__name__)


class IncrementalText:
    """The text `decode` gives a row's growing ids, kept up to date as ids come: each new id is
    decoded with the few ids before it (a token's text may depend on its neighbours: a leading
    space, a character split over byte tokens), not with the whole reply again, so a reply of
    n ids costs O(n) decoding, not O(n^2). Text that no later id can change ("settled": it does
    not end in an unfinished character) is kept; only the tail after it is decoded again. Were
    a new id to change settled text (a decoder that is not local), the whole is decoded again.

    `ends[k]` is the length of the text of ids[:k + 1]; `decoded` counts the ids passed to
    `decode` (what streaming a reply costs).
    """

    CONTEXT = 4  # settled ids decoded before the tail
    MAX_PENDING = 16  # a tail this long settles even if unfinished (invalid bytes never finish)

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self._decode = decode
        self.ids: list[int] = []
        self.ends: list[int] = []
        self.decoded = 0
        self._reset()

    def _reset(self) -> None:
        self.ids, self.ends = [], []
        self._settled, self._parts, self._chars = 0, [], 0  # ids, their text, its length
        self._before, self._tail = "", ""  # text of the context ids; of the ids after them

    def _text_of(self, ids: Sequence[int]) -> str:
        self.decoded += len(ids)
        return self._decode(ids)

    @property
    def text(self) -> str:
        return "".join(self._parts) + self._tail

    def update(self, ids: Sequence[int]) -> str:
        """The text of `ids`: the ids seen before with more after them (else all anew)."""
        n = len(self.ids)
        if len(ids) < n or list(ids[:n]) != self.ids:
            self._reset()
            n = 0
        for token in ids[n:]:
            self._append(int(token))
        return self.text

    def _append(self, token: int) -> None:
        self.ids.append(token)
        start = max(0, self._settled - self.CONTEXT)
        now = self._text_of(self.ids[start:])
        if now.startswith(self._before):
            self._tail = now[len(self._before):]
        else:  # settled text changed: decode the whole, and settle it
            self._parts, self._tail = [self._text_of(self.ids)], ""
            self._chars = len(self._parts[0])
            self._settle()
            self.ends.append(self._chars)
            return
        self.ends.append(self._chars + len(self._tail))
        if not self._tail.endswith("\ufffd") or \
                len(self.ids) - self._settled >= self.MAX_PENDING:
            self._parts.append(self._tail)
            self._chars += len(self._tail)
            self._tail = ""
            self._settle()

    def _settle(self) -> None:
        self._settled = len(self.ids)
        start = max(0, self._settled - self.CONTEXT)
        self._before = self._text_of(self.ids[start:]) if self._settled > start else ""


class TextStream:
    """The text of one row sent so far, and the next delta that is safe to send.

    Args:
      decode: ids -> text (the reply's own decoding, e.g. skipping special tokens).
      stops: the request's stop strings.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str] = ()):
        self._text, self._stops = IncrementalText(decode), tuple(s for s in stops if s)
        self.sent = ""
        self.tokens_sent = 0  # ids whose text lies within `sent` (their log-probs went out)

    @property
    def decoded(self) -> int:
        """Ids decoded so far (linear in the reply's length)."""
        return self._text.decoded

    def safe_text(self, ids: Sequence[int]) -> str:
        text = self._text.update(ids)
        cut = len(text)
        for stop in self._stops:
            at = text.find(stop)
            if at >= 0:
                cut = min(cut, at)
                continue
            for k in range(min(len(stop) - 1, len(text)), 0, -1):  # a stop's first k chars
                if text.endswith(stop[:k]):
                    cut = min(cut, len(text) - k)
                    break
        return text[:cut].rstrip("\ufffd")

    def advance(self, ids: Sequence[int]) -> str:
        """The new text of `ids` (the row's whole output so far) that is safe to send."""
        text = self.safe_text(ids)
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""  # nothing new, or a decoding that rewrote the past: wait for the end
        delta, self.sent = text[len(self.sent):], text
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of the reply's final text (what `advance` held back)."""
        if not final_text.startswith(self.sent):  # a tokenizer whose prefix decodes differ
            log.warning("streamed text %r is not a prefix of the final %r", self.sent[-40:],
                        final_text[-40:])
        delta, self.sent = final_text[len(self.sent):], final_text
        return delta

    def released(self, ids: Sequence[int]) -> tuple[int, int]:
        """(first, end) of the ids newly covered by the text sent: the tokens whose
        log-probs may go out with it."""
        first, end = self.tokens_sent, self.tokens_sent
        self._text.update(ids)
        ends = self._text.ends
        while end < len(ids) and ends[end] <= len(self.sent):
            end += 1
        self.tokens_sent = end
        return first, end


class TicketEvents:
    """A ticket submitted with a streaming hook, read from the event loop. Iterating yields
    ("tokens", {row index: (ids, logprobs)}) batches and ends with ("done", results)."""

    def __init__(self, submit: Callable[..., Ticket]):
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self.ticket = submit(on_tokens=self._on_tokens)
        self.ticket.add_done_callback(
            lambda _: self._loop.call_soon_threadsafe(self._queue.put_nowait, None))

    def _on_tokens(self, index: int, ids: list, logprobs: list) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, (index, ids, logprobs))

    async def __aiter__(self) -> AsyncIterator[tuple[str, Any]]:
        done = False
        while not done:
            items = [await self._queue.get()]
            while not self._queue.empty():
                items.append(self._queue.get_nowait())
            latest = {}
            for item in items:
                if item is None:
                    done = True
                else:
                    latest[item[0]] = (item[1], item[2])
            if latest:
                yield "tokens", latest
        yield "done", self.ticket.wait(0)  # raises the scheduler's error, if it failed

    def close(self) -> None:
        """Aborts the rows still running (the client went away mid-stream)."""
        if not self.ticket.done():
            log.info("stream closed before its end: aborting its rows")
            self.ticket.cancel()


def partial_reply(request: GenerateRequest, ids: list, logprobs: list, text: str,
                  weight_version: Optional[str], with_logprobs: bool) -> dict:
    """SGLang's /generate stream chunk of a row still running: its output so far."""
    meta = {"id": request.request_id, "finish_reason": None,
            "prompt_tokens": len(request.prompt_ids), "completion_tokens": len(ids),
            "cached_tokens": 0, "weight_version": weight_version}
    if with_logprobs:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(logprobs, ids)]
        meta["input_token_logprobs"] = []
    return {"text": text, "output_ids": ids, "meta_info": meta}


async def generate_events(service: Any, prepared: Any, body: dict, events: TicketEvents
                          ) -> AsyncIterator[dict]:
    """SGLang's /generate stream: for each row, chunks with its whole output so far (text,
    output_ids, meta_info; SGLang's stream is cumulative), then its final reply; rows of a
    batch carry "index". `service` is the RolloutService, `prepared` its Prepared body,
    `events` its ticket's (submitted before the reply starts, so a refusal is still a 400)."""
    rows = [(req, raw) for req, raw in zip(prepared.requests, prepared.raw_params)
            for _ in range(req.sampling.n)]
    tokenizer = service.tokenizer
    streams = []
    for req, raw in rows:
        skip = bool(raw.get("skip_special_tokens", True))
        decode = (lambda ids, skip=skip: tokenizer.decode(ids, skip_special_tokens=skip)) \
            if tokenizer is not None else (lambda ids: "")
        streams.append(TextStream(decode, req.sampling.stop))
    single = len(rows) == 1
    try:
        async for kind, payload in events:
            if kind == "tokens":
                for index, (ids, logprobs) in sorted(payload.items()):
                    streams[index].advance(ids)
                    chunk = partial_reply(rows[index][0], ids, logprobs, streams[index].sent,
                                          service.sampler.weight_version,
                                          bool(body.get("return_logprob")))
                    yield chunk if single else dict(chunk, index=index)
            else:
                replies = service.replies(prepared, body, payload)
                for index, reply in enumerate([replies] if isinstance(replies, dict)
                                              else replies):
                    yield reply if single else dict(reply, index=index)
    finally:
        events.close()


async def sse_stream(chunks) -> Any:
    """Server-sent events of `chunks` (dicts), then `data: [DONE]`; an error mid-stream (the
    scheduler failed) is sent as an {"error"} event, since the 200 has gone out already."""
    try:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
    except Exception as err:  # noqa: BLE001 - reported to the client, logged here
        log.exception("stream failed")
        yield f"data: {json.dumps({'error': {'message': f'{type(err).__name__}: {err}'}})}\n\n"
    yield "data: [DONE]\n\n"
