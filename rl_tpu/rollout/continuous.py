"""Continuous batching over the embedded sampler's programs: a fixed pool of KV slots that
requests join and leave between decode chunks.

`JaxSampler.generate` (the trainer's path) runs a call's rows as whole batches: a batch decodes
until its longest row ends and a request arriving meanwhile waits for the device. A server
with many clients wants the opposite, and `ContinuousBatcher` does it:

- the pool is one `DecodeState` of at most B rows (`slots`) x S cache slots (`slot_tokens`):
  its memory is bounded at construction, so no request can make the server run out of it (one
  whose prompt + max_new_tokens exceeds S is refused at submission, one that finds no free row
  waits in the queue). Below that bound it is as big as its rows need, growing while rows run
  and dropped when none does: each decode step computes every pool row over every slot, so
  one short request runs in a small pool;
- every shape comes from a short fixed ladder (`Ladders`, pool_programs.py): pool rows 1, 8,
  64..., pool slots 256, 2048... (then `slot_tokens`), prompt suffixes 16, 64, 256..., rows prefilled together 1
  or 4, and rows read or saved together 1 or 8 (more go 4 or 8 at a time). So the programs
  are few and all known at construction: `warmup()` compiles every one (a server does it
  before it answers), after which no request waits on a compile
  (`sampler.stats()['compiled_programs']` stays flat);
- between decode chunks the scheduler thread prefills waiting rows into free pool rows (with
  prefix reuse when the sampler has a prefix cache) and scatters them in; every row then
  decodes from its own output index (`decoding.decode`); a chunk ends at the step a row
  ends (after a quarter of `decode_chunk` at least), so that row leaves then, its slot is
  free for the next, and its request is answered as soon as its last row ends;
- aborts (a request id, everything, a client gone: `Ticket.cancel`), pause / resume and weight
  updates (`JaxSampler.update_weights`, picked up at the next chunk, recorded per row as
  SGLang's weight_versions spans) act between chunks, as in the batch path.

Log-probs and draws are the batch path's exactly: the same prefill, the same decode body, and
a row's random key depends on its request's seed and its own output index only.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from typing import Callable, Optional, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from rl_tpu.core.engine import GenerateRequest, GenerateResult
from rl_tpu.rollout.decoding import DecodeState, decode, prefill
from rl_tpu.rollout.pool_programs import (Ladders, empty_pool, end_rows, fit, grow_pool,
                                          read_experts, read_rows, scatter_rows)
from rl_tpu.rollout.prefix_cache import next_power_of_two
from rl_tpu.rollout.sampler import JaxSampler

log = logging.getLogger(__name__)


# on_tokens(row index, output ids so far, their log-probs): a streaming caller's progress hook
TokensCallback = Callable[[int, list, list], None]


class Ticket:
    """One submitted call: its rows' results, in submission order, once all have ended.
    `on_tokens`, when given, is told each running row's output so far after its prefill and
    after every decode chunk, on the scheduler thread (so it must be quick: a server hands
    the lists to its event loop); the row's last tokens come with its result instead."""

    def __init__(self, num_rows: int, batcher: "ContinuousBatcher",
                 on_tokens: Optional[TokensCallback] = None):
        self.on_tokens = on_tokens
        self.results: list[Optional[GenerateResult]] = [None] * num_rows
        self.error: Optional[BaseException] = None
        self._left = num_rows
        self._batcher = batcher
        self._done = threading.Event()
        self._callbacks: list[Callable[["Ticket"], None]] = []
        self._lock = threading.Lock()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Optional[float] = None) -> list[GenerateResult]:
        """The results; TimeoutError after `timeout` s, or the scheduler's error."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"no result within {timeout} s")
        if self.error is not None:
            raise self.error
        return list(self.results)

    def add_done_callback(self, fn: Callable[["Ticket"], None]) -> None:
        """fn(ticket) once it is done, on the scheduler thread (at once if done already)."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def cancel(self) -> None:
        """Aborts every row still running (a client that went away): they end with what they
        have, finish 'abort'."""
        self._batcher._abort(lambda row: row.ticket is self)

    def _set(self, index: int, result: GenerateResult) -> None:
        self.results[index] = result
        self._left -= 1
        if self._left == 0:
            self._finish()

    def _fail(self, error: BaseException) -> None:
        if not self._done.is_set():
            self.error = error
            self._finish()

    def _finish(self) -> None:
        with self._lock:
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)


@dataclasses.dataclass(eq=False)
class _Row:
    request: GenerateRequest
    sample: int  # k of the request's n samples
    ticket: Ticket
    index: int  # its place in the ticket's results
    aborted: bool = False
    slot: int = -1
    spans: list = dataclasses.field(default_factory=list)  # [(version, first output index)]
    generation: int = 0  # the prefix cache's, at prefill
    hashes: Optional[list] = None  # the prompt's chain hashes (prefix reuse), at prefill
    salt: int = 0  # its adapter's prefix-cache salt, read at prefill (its slot held since)


class ContinuousBatcher:
    """Continuous batching of `sampler`'s requests in a pool of `slots` rows x `slot_tokens`
    KV slots (see the module doc). `submit` is thread-safe and returns a `Ticket`; a
    scheduler thread does all device work. `stalled_for()` is how long work has waited on a
    decode chunk that has not come back (the server's /health)."""

    def __init__(self, sampler: JaxSampler, slots: int = 64, slot_tokens: int = 2048,
                 decode_chunk: int = 16, stop_width: int = 8):
        page = sampler.prefix_cache.page if sampler.prefix_cache is not None else 1
        if slots < 1 or slot_tokens < 2 or slot_tokens % max(page, sampler.min_prompt_bucket):
            raise ValueError(
                f"slots={slots}, slot_tokens={slot_tokens}: need at least one row of at least "
                f"two tokens, slot_tokens a multiple of the prompt bucket "
                f"({sampler.min_prompt_bucket}) and of the prefix-cache page ({page})")
        self.sampler, self.slots, self.slot_tokens = sampler, slots, slot_tokens
        # a prompt bucket that is not a power of two is a multiple of this (prefill chunks
        # must divide it)
        self._unit = max(sampler.min_prompt_bucket, sampler.prefill_chunk)
        self.decode_chunk, self.stop_width = decode_chunk, next_power_of_two(stop_width, 4)
        self.ladders = Ladders.build(slots, slot_tokens, self._unit)
        # without a prefix cache, prefills gather their (unused) prefix from one blank page:
        # every prefill is then the same program, the pool's
        self._blank = None if sampler.prefix_cache is not None else jax.device_put(
            {n: tuple(np.zeros((1, sampler.cfg.num_kv_heads, sampler.min_prompt_bucket,
                                sampler.cfg.head_dim), sampler.cfg.kv_dtype)
                      for _ in range(sampler.cfg.num_layers)) for n in ("k", "v")},
            NamedSharding(sampler.mesh, PartitionSpec()))
        self._cond = threading.Condition()
        self._waiting: list[_Row] = []
        self._active: dict[int, _Row] = {}  # pool row -> its row
        self._admitting: list[_Row] = []  # taken from the queue, being prefilled
        self._pool: Optional[DecodeState] = None
        self._counts = np.ones((slots,), np.int32)  # each pool row's count, as last read
        self._stop = False
        self._busy_since: Optional[float] = None  # a device call in flight since
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="continuous-batcher", daemon=True)
        self._thread.start()

    # -- callers ---------------------------------------------------------------------------

    def submit(self, requests: Sequence[GenerateRequest],
               on_tokens: Optional[TokensCallback] = None) -> Ticket:
        """Queues every sample of `requests`; ValueError (nothing queued) for a row the pool
        cannot hold or the sampler refuses. `on_tokens` streams the rows' progress (Ticket)."""
        rows = [(req, k) for req in requests for k in range(req.sampling.n)]
        for req, _ in rows:
            self.sampler.validate(req)
            prompt = -(-len(req.prompt_ids) // self._unit) * self._unit
            need = prompt + max(req.sampling.max_new_tokens, 1)
            if need > self.slot_tokens:
                raise ValueError(f"a prompt of {len(req.prompt_ids)} tokens (padded to "
                                 f"{prompt}) + max_new_tokens={req.sampling.max_new_tokens} "
                                 f"needs {need} KV slots; a row of this server holds "
                                 f"{self.slot_tokens} (--max_context_tokens)")
        ticket = Ticket(len(rows), self, on_tokens)
        if not rows:
            ticket._finish()
            return ticket
        with self._cond:
            if self._stop:
                raise RuntimeError("the batcher is closed")
            self._waiting += [_Row(req, k, ticket, i) for i, (req, k) in enumerate(rows)]
            self._cond.notify_all()
        return ticket

    def room(self, prompt_tokens: int) -> int:
        """The most new tokens a row with this prompt can hold (its prompt is padded to the
        prefill unit in the row's slots): an OpenAI request without max_tokens gets these."""
        return self.slot_tokens - -(-prompt_tokens // self._unit) * self._unit

    def warmup(self) -> dict:
        """Compiles every program a request can make the batcher run, over every rung of its
        `ladders` (prefills, pool shapes, growth, reads, prefix saves), by running each once
        on rows that hold nothing; afterwards requests compile nothing (a request with more
        than `stop_width` stop ids widens the rows: that compiles anew). Call it before
        serving. Returns {'programs': compiled, 'seconds': taken}."""
        sampler, ladders, x = self.sampler, self.ladders, self.stop_width
        start = time.monotonic()
        with sampler.compiles.counting() as counter:
            before = counter.count
            params, _ = sampler.weights()
            # (the prefix pool is fetched anew for each prefill: a save replaces its buffers)
            pages = (sampler.prefix_cache.ensure_pool if sampler.prefix_cache is not None
                     else lambda: self._blank)
            page = pages()["k"][0].shape[2]
            for s_rung, slots in enumerate(ladders.slots):
                new = {}
                for a in ladders.join:
                    _, lens, sampling = sampler.row_arrays([], a, 1, x)  # padding rows only
                    for q in ladders.suffixes(slots):  # prefill: (rows, suffix, slots)
                        new[a] = prefill(
                            sampler.model, params, np.zeros((a, q), np.int32), lens,
                            *sampling, max_steps=1, starts=np.zeros((a,), np.int32),
                            pool=pages(), page_table=np.zeros((a, slots // page), np.int32),
                            chunk=sampler.prefill_chunk)
                for r_rung, rows in enumerate(ladders.rows):  # the pool's: (rows, slots)
                    pool = self._new_pool(rows, slots, x)
                    for a in [a for a in ladders.join if a <= rows]:
                        pool = scatter_rows(pool, new[a], np.full((a,), rows, np.int32))
                    pool = decode(sampler.model, params, pool, chunk=self.decode_chunk,
                                  min_chunk=max(1, self.decode_chunk // 4))
                    for f in [f for f in ladders.group if f <= rows]:  # (F, rows, slots)
                        jax.block_until_ready(read_rows(pool, np.zeros((f,), np.int32)))
                        if pool.experts is not None:
                            jax.block_until_ready(read_experts(pool, np.zeros((f,), np.int32)))
                        if sampler.prefix_cache is not None:
                            sampler.prefix_cache.warm_save(pool.cache, np.zeros((f,), np.int32))
                    pool = end_rows(pool, np.zeros((rows,), bool))
                    if r_rung + 1 < len(ladders.rows):
                        grow_pool(pool, ladders.rows[r_rung + 1], slots, x)
                    if s_rung + 1 < len(ladders.slots):
                        grow_pool(pool, rows, ladders.slots[s_rung + 1], x)
                    jax.block_until_ready(pool.done)
            compiled = counter.count - before
        seconds = time.monotonic() - start
        log.info("continuous batcher warm-up: %d programs (%d pool shapes) in %.1f s", compiled,
                 ladders.shapes(), seconds)
        return {"programs": compiled, "seconds": seconds}

    def generate(self, requests: Sequence[GenerateRequest],
                 timeout: Optional[float] = None) -> list[GenerateResult]:
        return self.submit(requests).wait(timeout)

    def abort(self, request_id: Optional[str] = None) -> None:
        """Ends the rows of the request with this id (queued or running), or of every request
        submitted so far (None). Nothing is remembered for later requests."""
        if request_id is None:
            self._abort(lambda row: True)
        else:
            self._abort(lambda row: row.request.request_id == str(request_id))

    def stalled_for(self) -> float:
        """Seconds the current device call has run (0 when none runs)."""
        busy = self._busy_since
        return 0.0 if busy is None else time.monotonic() - busy

    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop

    def load(self) -> dict:
        with self._cond:
            return {"running_rows": len(self._active), "queued_rows": len(self._waiting),
                    "slots": self.slots, "slot_tokens": self.slot_tokens}

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=60)

    # -- scheduler thread ------------------------------------------------------------------

    def _abort(self, which: Callable[[_Row], bool]) -> None:
        with self._cond:
            for row in self._waiting + self._admitting + list(self._active.values()):
                if which(row):
                    row.aborted = True
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._stop or self._waiting or self._active):
                    self._cond.wait()
                if self._stop:
                    break
            try:
                with self.sampler.compiles.counting():
                    self._step()
            except Exception as err:  # noqa: BLE001 - fail what runs, keep serving the rest
                log.exception("continuous batcher step failed")
                self._fail_all(err, queued_too=False)
            finally:
                self._busy_since = None
        self._fail_all(RuntimeError("the rollout server is shutting down"), queued_too=True)

    def _step(self) -> None:
        self._end_aborted_queued()
        if self.sampler.paused:  # paused: aborts still end rows, nothing decodes
            self._end_aborted_running()
            self.sampler.wait_resumed(timeout=0.05)
            return
        # aborted rows leave before the admission (a prefill can take longer than a chunk),
        # and again after it (rows aborted while they were being prefilled)
        self._end_aborted_running()
        self._admit()
        self._end_aborted_running()
        if not self._active:
            return
        params, version = self.sampler.weights()
        for row in self._active.values():
            if row.spans[-1][0] != version:
                row.spans.append((version, int(self._counts[row.slot])))
        self._busy_since = time.monotonic()
        # the chunk ends with the first row that ends after a quarter of it: that reply goes
        # out and its pool row takes the next request then, not at the chunk's end; the
        # quarter keeps a full pool, where some row ends nearly every step, from paying the
        # host's look after every step
        self._pool = decode(self.sampler.model, params, self._pool, chunk=self.decode_chunk,
                            min_chunk=max(1, self.decode_chunk // 4))
        self._collect(force_aborted=False)

    def _end_aborted_running(self) -> None:
        with self._cond:
            any_aborted = any(row.aborted for row in self._active.values())
        if any_aborted:
            self._collect(force_aborted=True)

    def _end_aborted_queued(self) -> None:
        with self._cond:
            ended = [row for row in self._waiting if row.aborted]
            self._waiting = [row for row in self._waiting if not row.aborted]
        for row in ended:
            row.spans = [(self.sampler.weight_version, 0)]
            row.ticket._set(row.index, self.sampler.result(
                row.request, np.zeros((0,), np.int32), np.zeros((0,), np.float32), False, True,
                row.spans))

    def _suffix_bucket(self, slots: int):
        """Q of a prefill into `slots` slots: the rung of the suffix ladder that holds it."""
        return functools.partial(fit, self.ladders.suffixes(slots))

    def _admit(self) -> None:
        """Prefills queued rows into the lowest free pool rows, in arrival order, as many as
        there are free rows, a group (`Ladders.group`) per prefill; the pool grows to the
        rows and slots they need."""
        sampler, ladders = self.sampler, self.ladders
        with self._cond:
            free = [r for r in range(self.slots) if r not in self._active]
            take = self._waiting[:len(free)]
            self._waiting = self._waiting[len(take):]
            self._admitting = take  # an abort meanwhile marks them (ended after admission)
        if not take:
            return
        n = len(take)
        longest = max(len(row.request.prompt_ids) for row in take)
        need = max(len(row.request.prompt_ids) + max(row.request.sampling.max_new_tokens, 1)
                   for row in take)
        rows = fit(ladders.rows, max(self._rows(), free[n - 1] + 1))
        slots = fit(ladders.slots, max(self._width(), need))
        step = ladders.join[-1]
        groups = [take[i:i + step] for i in range(0, n, step)]
        try:
            width = max(self.stop_width, sampler.stop_width([row.request for row in take]))
            arrays = [sampler.row_arrays([(row.request, row.sample) for row in group],
                                         fit(ladders.join, len(group)), longest, width)
                      for group in groups]
        except Exception as err:  # noqa: BLE001 - a request's own fault: it alone fails
            self._fail_unbuildable(take, longest, err)
            return
        self.stop_width = width
        self._busy_since = time.monotonic()
        matches: Optional[list] = [] if sampler.prefix_cache is not None else None
        try:
            self._reshape_pool(rows, slots)
            params, version, generation = sampler.snapshot()
            start = 0
            for group, (ids, lens, sampling) in zip(groups, arrays):
                new, found = sampler.prefill_rows(params, len(group), ids, lens, sampling, 0,
                                              slots=slots, bucket=self._suffix_bucket(slots),
                                              blank_pool=self._blank)
                # padding rows target past the pool: dropped. (Index arrays go in as numpy:
                # jnp.asarray of one compiles a program of its own for each shape.)
                targets = np.full((ids.shape[0],), rows, np.int32)
                targets[:len(group)] = free[start:start + len(group)]
                self._pool = scatter_rows(self._pool, new, targets)
                if matches is not None:
                    matches += found[:len(group)]
                start += len(group)
        except Exception as err:  # these rows are in neither list: answer them here
            with self._cond:
                self._admitting = []
            for row in take:
                row.ticket._fail(err)
            raise
        with self._cond:
            for i, row in enumerate(take):
                row.slot, row.spans, row.generation = free[i], [(version, 0)], generation
                row.hashes = None if matches is None else matches[i].hashes
                row.salt = sampler.prefix_salt(row.request.lora_slot)
                self._active[row.slot] = row
            self._admitting = []
        # each prefilled row has its first token (count 1); kept on the host, no device read
        counts = np.ones((rows,), np.int32)
        kept = min(rows, len(self._counts))
        counts[:kept] = self._counts[:kept]
        counts[free[:n]] = 1
        self._counts = counts
        self._stream(take)  # a streaming client's first token: at prefill, not a chunk later

    def _fail_unbuildable(self, take: list[_Row], p: int, error: BaseException) -> None:
        """After the arrays of admitted rows `take` could not be built (before any device
        work): the requests whose rows cannot be built alone fail with their own error (their
        other rows, queued or running, are aborted), and the rest go back to the head of the
        queue for the next admission. Other requests generating meanwhile never see it.
        `error` is raised when every row builds alone (a fault of the batch, not a request)."""
        sampler, failed = self.sampler, []
        for row in take:
            try:
                sampler.row_arrays([(row.request, row.sample)], 1, p,
                                   max(self.stop_width, sampler.stop_width([row.request])))
            except Exception as err:  # noqa: BLE001 - answered to its request below
                log.warning("request %s: its row cannot be built: %r", row.request.request_id,
                            err)
                failed.append((row, err))
        if not failed:
            with self._cond:
                self._admitting = []
            for row in take:
                row.ticket._fail(error)
            raise error
        tickets = {id(row.ticket): row.ticket for row, _ in failed}
        for row, err in failed:
            row.ticket._fail(err)  # its first error: the one its reply carries
        with self._cond:
            self._admitting = []
            self._waiting = [row for row in take if id(row.ticket) not in tickets] + \
                self._waiting
            for row in self._waiting + list(self._active.values()):
                if id(row.ticket) in tickets:
                    row.aborted = True  # the request has failed: its other rows end too

    def _rows(self) -> int:
        return 0 if self._pool is None else self._pool.tokens.shape[0]

    def _width(self) -> int:
        return 0 if self._pool is None else self._pool.tokens.shape[1]

    def _reshape_pool(self, rows: int, slots: int) -> None:
        """Makes the pool at least rows x slots (rungs of the ladders) with stop_width stop
        ids a row. It only grows while rows run (their K/V stays where it is) and is dropped
        when none runs: decode works on the whole pool, so it is kept no bigger than what runs
        needs. It grows a rung at a time (rows, then slots): one program per rung, not one
        per pair of shapes."""
        if self._pool is None:
            self._pool = self._new_pool(rows, slots, self.stop_width)
            return
        while (self._rows(), self._width(), self._pool.stop_ids.shape[1]) != (
                rows, slots, self.stop_width):
            r, s = self._rows(), self._width()
            if r < rows:
                r = self.ladders.rows[self.ladders.rows.index(r) + 1]
            elif s < slots:
                s = self.ladders.slots[self.ladders.slots.index(s) + 1]
            self._pool = grow_pool(self._pool, r, s, self.stop_width)

    def _new_pool(self, rows: int, slots: int, width: int) -> DecodeState:
        pool = empty_pool(self.sampler.model, rows, slots, width)
        return jax.device_put(pool, NamedSharding(self.sampler.mesh, PartitionSpec()))

    def _read(self, pool: DecodeState, slots: list[int], experts: bool = False
              ) -> tuple[Optional[np.ndarray], ...]:
        """(tokens, logprobs [len(slots), S], stopped, and with `experts` a mixture of experts'
        routing [len(slots), S, sparse layers, k], else None) of those pool rows, a group at
        a time (each padded to a rung of the group ladder with its first row)."""
        parts = []
        step = self.ladders.group[-1]
        with_experts = experts and pool.experts is not None
        for i in range(0, len(slots), step):
            part = slots[i:i + step]
            take = np.full((fit(self.ladders.group, len(part)),), part[0], np.int32)
            take[:len(part)] = part
            arrays = read_rows(pool, take) + ((read_experts(pool, take),) if with_experts else ())
            parts.append([np.asarray(x)[:len(part)] for x in arrays])
        out = tuple(np.concatenate(x) for x in zip(*parts))
        return out if with_experts else out + (None,)

    def _collect(self, force_aborted: bool) -> None:
        """Answers the rows that ended (and, with force_aborted, those aborted) and frees
        their pool rows."""
        pool = self._pool
        done, self._counts = (np.asarray(x) for x in (pool.done, pool.count))
        self._busy_since = None
        with self._cond:
            rows = list(self._active.values())
        aborted = [row for row in rows if row.aborted and not done[row.slot]] \
            if force_aborted else []
        ended = [row for row in rows if done[row.slot]] + aborted
        if not force_aborted:
            self._stream([row for row in rows if not done[row.slot]])
        if not ended:
            return
        tokens, logprobs, stopped, experts = self._read(
            pool, [row.slot for row in ended],
            experts=any(row.request.sampling.return_routed_experts for row in ended))
        if aborted:
            mask = np.zeros((self._rows(),), bool)
            mask[[row.slot for row in aborted]] = True
            self._pool = end_rows(pool, mask)
        self._save_prefixes(ended, tokens)
        with self._cond:
            for row in ended:
                del self._active[row.slot]
            if not self._active:
                self._pool = None  # the next admission starts one sized to what it needs
        for i, row in enumerate(ended):
            count = int(self._counts[row.slot])
            try:
                result = self.sampler.result(
                    row.request, tokens[i, :count], logprobs[i, :count],
                    bool(stopped[i]) and row not in aborted, row in aborted, row.spans,
                    None if experts is None else experts[i])
            except Exception as err:  # noqa: BLE001 - this request's reply alone fails
                log.exception("request %s: its result could not be built",
                              row.request.request_id)
                row.ticket._fail(err)
                continue
            row.ticket._set(row.index, result)

    def _stream(self, rows: list[_Row]) -> None:
        """Tells the streaming tickets among `rows` (running in the pool) their output so far:
        one read of those pool rows (the programs `_read` warms), none when nothing streams."""
        rows = [row for row in rows if row.ticket.on_tokens is not None and not row.aborted]
        if not rows:
            return
        tokens, logprobs, _, _ = self._read(self._pool, [row.slot for row in rows])
        for i, row in enumerate(rows):
            count = int(self._counts[row.slot])
            try:
                row.ticket.on_tokens(row.index, tokens[i, :count].tolist(),
                                     logprobs[i, :count].tolist())
            except Exception:  # noqa: BLE001 - a broken hook loses its stream, not the batch
                log.exception("request %s: its streaming hook failed", row.request.request_id)

    def _save_prefixes(self, ended: list[_Row], tokens: np.ndarray) -> None:
        """Ended rows' K/V into the prefix cache: slots 0..len+count-2 hold the prompt and
        every output id but the last (sampled, never fed back)."""
        prefix = self.sampler.prefix_cache
        if prefix is None:
            return
        for generation in {row.generation for row in ended}:
            # rows decoded under one set of weights only (a weight update mid-row mixes K/V)
            saved = [(i, row) for i, row in enumerate(ended)
                     if row.generation == generation and len(row.spans) == 1]
            if not saved:
                continue
            # the saved rows alone, a group at a time padded to a rung of the group ladder:
            # the save copies the rows it is given, and the pool is far bigger than what ended
            step = self.ladders.group[-1]
            for start in range(0, len(saved), step):
                part = saved[start:start + step]
                f = fit(self.ladders.group, len(part))
                take = np.full((f,), part[0][1].slot, np.int32)
                take[:len(part)] = [row.slot for _, row in part]
                seqs: list = [None] * f
                hashes: list = [[] for _ in range(f)]
                for j, (i, row) in enumerate(part):
                    count = int(self._counts[row.slot])
                    seqs[j] = np.concatenate([np.asarray(row.request.prompt_ids),
                                              tokens[i, :count - 1]]).astype(np.int32)
                    hashes[j] = row.hashes or []
                prefix.insert(seqs, hashes, self._pool.cache, generation, rows=take,
                              salts=[row.salt for _, row in part] + [0] * (f - len(part)))

    def _fail_all(self, error: BaseException, queued_too: bool) -> None:
        """Fails the running rows' tickets (their K/V is suspect: a fresh pool is built at the
        next admission) and, on shutdown, the queued ones."""
        with self._cond:
            rows = list(self._active.values()) + (self._waiting if queued_too else [])
            self._active = {}
            if queued_too:
                self._waiting = []
        self._pool = None
        for row in rows:
            row.ticket._fail(error)
