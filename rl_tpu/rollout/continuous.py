"""Continuous batching over the embedded sampler's programs: a fixed pool of KV slots that
requests join and leave between decode chunks.

`JaxSampler.generate` (the trainer's path) runs a call's rows as whole batches: a batch decodes
until its longest row ends and a request arriving meanwhile waits for the device. A server
with many clients wants the opposite, and `ContinuousBatcher` does it:

- the pool is one `DecodeState` of at most B rows (`slots`) x S cache slots (`slot_tokens`):
  its memory is bounded at construction, so no request can make the server run out of it (one
  whose prompt + max_new_tokens exceeds S is refused at submission, one that finds no free row
  waits in the queue). Below that bound it is as big as its rows need (rows and slots in
  powers of two), growing while rows run and dropped when none does: each decode step computes
  every pool row over every slot, so one short request runs in a small pool;
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
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from rl_tpu.models.transformer import Transformer, init_cache
from rl_tpu.rollout.decoding import DecodeState, decode
from rl_tpu.rollout.engine import GenerateRequest, GenerateResult
from rl_tpu.rollout.prefix_cache import _next_power_of_two
from rl_tpu.rollout.sampler import JaxSampler

log = logging.getLogger(__name__)


@functools.partial(jax.jit, static_argnames=("model", "rows", "slots", "width"))
def empty_pool(model: Transformer, rows: int, slots: int, width: int) -> DecodeState:
    """A pool of `rows` free rows of `slots` cache slots, X = width stop ids a row: a pool of
    none, grown (`grow_pool` says what a free row holds)."""
    none = lambda *shape, dtype=jnp.int32: jnp.zeros((0,) + shape, dtype)  # noqa: E731
    f32 = jnp.float32
    return grow_pool(DecodeState(
        step=jnp.int32(1), token=none(), cache=init_cache(model.cfg, 0, slots),
        tokens=none(slots), logprobs=none(slots, dtype=f32), count=none(), done=none(dtype=bool),
        stopped=none(dtype=bool), prompt_lens=none(), max_new=none(), min_new=none(),
        temperature=none(dtype=f32), top_p=none(dtype=f32), top_k=none(),
        stop_ids=none(width), ban_ids=none(width),
        keys=jax.vmap(jax.random.key)(jnp.zeros((0,), jnp.uint32))), rows, slots, width)


@functools.partial(jax.jit, donate_argnames=("pool",))
def scatter_rows(pool: DecodeState, new: DecodeState, rows) -> DecodeState:
    """`pool` with the A prefilled rows of `new` written at pool rows `rows` [A] (a row index
    past the pool, a padding row, is dropped). new's cache has the pool's S slots; its output
    buffer [A, S - P] is padded to the pool's [B, S]."""
    put = lambda p, n: p.at[rows].set(n, mode="drop")  # noqa: E731
    out_pad = pool.tokens.shape[1] - new.tokens.shape[1]
    fields = {f.name: put(getattr(pool, f.name), getattr(new, f.name))
              for f in dataclasses.fields(DecodeState)
              if f.name not in ("step", "cache", "tokens", "logprobs")}
    return pool.replace(
        cache=jax.tree.map(put, pool.cache, new.cache),
        tokens=put(pool.tokens, jnp.pad(new.tokens, ((0, 0), (0, out_pad)))),
        logprobs=put(pool.logprobs, jnp.pad(new.logprobs, ((0, 0), (0, out_pad)))), **fields)


@jax.jit
def read_rows(pool: DecodeState, rows):
    """(tokens, logprobs [F, S], stopped [F]) of the pool rows `rows` [F], in one program
    (indexing eagerly costs a dispatch and Python work per array)."""
    return pool.tokens[rows], pool.logprobs[rows], pool.stopped[rows]


@jax.jit
def take_rows(cache: dict, rows) -> dict:
    """The cache's rows `rows` [F] (a copy)."""
    return jax.tree.map(lambda x: x[rows], cache)


@functools.partial(jax.jit, donate_argnames=("pool",))
def end_rows(pool: DecodeState, ended) -> DecodeState:
    """`pool` with the rows where ended [B] marks done (aborted, or freed)."""
    return pool.replace(done=pool.done | ended)


@functools.partial(jax.jit, static_argnames=("rows", "slots", "width"))
def grow_pool(pool: DecodeState, rows: int, slots: int, width: int) -> DecodeState:
    """`pool` grown to `rows` rows (free: done), `slots` cache slots and output positions a
    row, and `width` stop ids a row; what it held stays where it was."""
    r = rows - pool.tokens.shape[0]
    s = slots - pool.tokens.shape[1]
    x = width - pool.stop_ids.shape[1]

    def pad(a, value=0, cols=0):
        return jnp.pad(a, ((0, r),) + ((0, cols),) * (a.ndim - 1), constant_values=value)

    fresh_keys = jax.vmap(jax.random.key)(jnp.arange(r, dtype=jnp.uint32))
    return pool.replace(
        cache=jax.tree.map(lambda c: jnp.pad(c, ((0, r), (0, 0), (0, s), (0, 0))), pool.cache),
        tokens=pad(pool.tokens, cols=s), logprobs=pad(pool.logprobs, cols=s),
        token=pad(pool.token), count=pad(pool.count, 1), done=pad(pool.done, True),
        stopped=pad(pool.stopped, False), prompt_lens=pad(pool.prompt_lens, 1),
        max_new=pad(pool.max_new, 1), min_new=pad(pool.min_new),
        temperature=pad(pool.temperature), top_p=pad(pool.top_p, 1.0),
        top_k=pad(pool.top_k, -1), stop_ids=pad(pool.stop_ids, -1, x),
        ban_ids=pad(pool.ban_ids, -1, x), keys=jnp.concatenate([pool.keys, fresh_keys]))


class Ticket:
    """One submitted call: its rows' results, in submission order, once all have ended."""

    def __init__(self, num_rows: int, batcher: "ContinuousBatcher"):
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


class ContinuousBatcher:
    """Continuous batching of `sampler`'s requests in a pool of `slots` rows x `slot_tokens`
    KV slots (see the module doc). `submit` is thread-safe and returns a `Ticket`; a
    scheduler thread does all device work. `stalled_for()` is how long work has waited on a
    decode chunk that has not come back (the server's /health)."""

    def __init__(self, sampler: JaxSampler, slots: int = 64, slot_tokens: int = 2048,
                 decode_chunk: int = 16, stop_width: int = 8):
        page = sampler._prefix.page if sampler._prefix is not None else 1
        if slots < 1 or slot_tokens < 2 or slot_tokens % max(page, sampler.min_prompt_bucket):
            raise ValueError(
                f"slots={slots}, slot_tokens={slot_tokens}: need at least one row of at least "
                f"two tokens, slot_tokens a multiple of the prompt bucket "
                f"({sampler.min_prompt_bucket}) and of the prefix-cache page ({page})")
        self.sampler, self.slots, self.slot_tokens = sampler, slots, slot_tokens
        # a prompt bucket that is not a power of two is a multiple of this (prefill chunks
        # must divide it)
        self._unit = max(sampler.min_prompt_bucket, sampler.prefill_chunk)
        self.decode_chunk, self.stop_width = decode_chunk, _next_power_of_two(stop_width, 4)
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

    def submit(self, requests: Sequence[GenerateRequest]) -> Ticket:
        """Queues every sample of `requests`; ValueError (nothing queued) for a row the pool
        cannot hold or the sampler refuses."""
        rows = [(req, k) for req in requests for k in range(req.sampling.n)]
        for req, _ in rows:
            self.sampler._check(req)
            prompt = -(-len(req.prompt_ids) // self._unit) * self._unit
            need = prompt + max(req.sampling.max_new_tokens, 1)
            if need > self.slot_tokens:
                raise ValueError(f"a prompt of {len(req.prompt_ids)} tokens (padded to "
                                 f"{prompt}) + max_new_tokens={req.sampling.max_new_tokens} "
                                 f"needs {need} KV slots; a row of this server holds "
                                 f"{self.slot_tokens} (--max_context_tokens)")
        ticket = Ticket(len(rows), self)
        if not rows:
            ticket._finish()
            return ticket
        with self._cond:
            if self._stop:
                raise RuntimeError("the batcher is closed")
            self._waiting += [_Row(req, k, ticket, i) for i, (req, k) in enumerate(rows)]
            self._cond.notify_all()
        return ticket

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
                self._step()
            except Exception as err:  # noqa: BLE001 - fail what runs, keep serving the rest
                log.exception("continuous batcher step failed")
                self._fail_all(err, queued_too=False)
            finally:
                self._busy_since = None
        self._fail_all(RuntimeError("the rollout server is shutting down"), queued_too=True)

    def _step(self) -> None:
        self._end_aborted_queued()
        if not self.sampler._resume.is_set():  # paused: aborts still end rows, nothing decodes
            self._end_aborted_running()
            self.sampler._resume.wait(timeout=0.05)
            return
        # aborted rows leave before the admission (a prefill can take longer than a chunk),
        # and again after it (rows aborted while they were being prefilled)
        self._end_aborted_running()
        self._admit()
        self._end_aborted_running()
        if not self._active:
            return
        params, version = self.sampler._weights()
        for row in self._active.values():
            if row.spans[-1][0] != version:
                row.spans.append((version, int(self._counts[row.slot])))
        self.sampler._note_program("decode", self._rows(), self._width(), self._width(),
                                   self.stop_width)
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
            row.ticket._set(row.index, self.sampler._result(
                row.request, np.zeros((0,), np.int32), np.zeros((0,), np.float32), False, True,
                row.spans))

    def _prompt_bucket(self, prompt_len: int, fit_to: int) -> int:
        """The prompt bucket P of an admission: a power of two, or, when that would leave
        too few slots under `fit_to`, the prompt rounded up to the prompt unit."""
        sampler = self.sampler
        p = _next_power_of_two(prompt_len, sampler.min_prompt_bucket)
        return p if p <= fit_to else -(-prompt_len // self._unit) * self._unit

    def _admit(self) -> None:
        """Prefills queued rows into the lowest free pool rows, in arrival order, as many as
        there are free rows and as fit one prefill (P + the most new tokens <= slot_tokens);
        the pool grows to the rows and slots they need."""
        sampler = self.sampler
        with self._cond:
            free = [r for r in range(self.slots) if r not in self._active]
            take, longest, most_new = [], 0, 0
            for row in self._waiting[:len(free)]:
                grown = (max(longest, len(row.request.prompt_ids)),
                         max(most_new, row.request.sampling.max_new_tokens, 1))
                p = self._prompt_bucket(grown[0], self.slot_tokens - grown[1])
                if take and p + grown[1] > self.slot_tokens:
                    break  # the next admission takes it
                take.append(row)
                longest, most_new = grown
            self._waiting = self._waiting[len(take):]
            self._admitting = take  # an abort meanwhile marks them (ended after admission)
        if not take:
            return
        n = len(take)
        b = _next_power_of_two(n, 1)
        p = self._prompt_bucket(longest, self.slot_tokens - most_new)
        rows = min(self.slots, max(self._rows(), _next_power_of_two(free[n - 1] + 1, 1)))
        slots = min(self.slot_tokens, max(self._width(), _next_power_of_two(p + most_new, 16)))
        try:
            width = max(self.stop_width, sampler.stop_width([row.request for row in take]))
            ids, lens, sampling = sampler.row_arrays(
                [(row.request, row.sample) for row in take], b, p, width)
        except Exception as err:  # noqa: BLE001 - a request's own fault: it alone fails
            self._fail_unbuildable(take, p, err)
            return
        self.stop_width = width
        self._busy_since = time.monotonic()
        try:
            self._reshape_pool(rows, slots)
            with sampler._weights_lock:  # the prefix cache's generation goes with the weights
                params, version = sampler._params, sampler._version
                generation = sampler._prefix.generation if sampler._prefix is not None else 0
            new, matches = sampler._prefill(params, n, ids, lens, sampling, slots - p)
            targets = np.full((b,), rows, np.int32)  # padding rows: past the pool, dropped
            targets[:n] = free[:n]
            self._pool = scatter_rows(self._pool, new, jnp.asarray(targets))
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
                self._active[row.slot] = row
            self._admitting = []
        # each prefilled row has its first token (count 1); kept on the host, no device read
        counts = np.ones((rows,), np.int32)
        kept = min(rows, len(self._counts))
        counts[:kept] = self._counts[:kept]
        counts[free[:n]] = 1
        self._counts = counts

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
        """Makes the pool at least rows x slots with stop_width stop ids a row. It only
        grows while rows run (their K/V stays where it is) and is dropped when none runs:
        decode works on the whole pool, so it is kept no bigger than what runs needs."""
        if self._pool is None:
            self._pool = empty_pool(self.sampler.model, rows, slots, self.stop_width)
            self._pool = jax.device_put(self._pool,
                                        NamedSharding(self.sampler.mesh, PartitionSpec()))
        elif (rows, slots, self.stop_width) != (self._rows(), self._width(),
                                                self._pool.stop_ids.shape[1]):
            self._pool = grow_pool(self._pool, rows, slots, self.stop_width)

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
        if not ended:
            return
        slots = np.full((_next_power_of_two(len(ended), 1),), ended[0].slot, np.int32)
        slots[:len(ended)] = [row.slot for row in ended]
        tokens, logprobs, stopped = (np.asarray(x) for x in read_rows(pool, slots))
        if aborted:
            mask = np.zeros((self._rows(),), bool)
            mask[[row.slot for row in aborted]] = True
            self._pool = end_rows(pool, jnp.asarray(mask))
        self._save_prefixes(ended, tokens)
        with self._cond:
            for row in ended:
                del self._active[row.slot]
            if not self._active:
                self._pool = None  # the next admission starts one sized to what it needs
        for i, row in enumerate(ended):
            count = int(self._counts[row.slot])
            try:
                result = self.sampler._result(
                    row.request, tokens[i, :count], logprobs[i, :count],
                    bool(stopped[i]) and row not in aborted, row in aborted, row.spans)
            except Exception as err:  # noqa: BLE001 - this request's reply alone fails
                log.exception("request %s: its result could not be built",
                              row.request.request_id)
                row.ticket._fail(err)
                continue
            row.ticket._set(row.index, result)

    def _save_prefixes(self, ended: list[_Row], tokens: np.ndarray) -> None:
        """Ended rows' K/V into the prefix cache: slots 0..len+count-2 hold the prompt and
        every output id but the last (sampled, never fed back)."""
        prefix = self.sampler._prefix
        if prefix is None:
            return
        for generation in {row.generation for row in ended}:
            # rows decoded under one set of weights only (a weight update mid-row mixes K/V)
            saved = [(i, row) for i, row in enumerate(ended)
                     if row.generation == generation and len(row.spans) == 1]
            if not saved:
                continue
            # the saved rows alone, padded to a power of two (one program per bucket): the
            # save copies the rows it is given, and the pool is far bigger than what ended
            f = _next_power_of_two(len(saved), 1)
            take = np.full((f,), saved[0][1].slot, np.int32)
            take[:len(saved)] = [row.slot for _, row in saved]
            seqs: list = [None] * f
            hashes: list = [[] for _ in range(f)]
            for j, (i, row) in enumerate(saved):
                count = int(self._counts[row.slot])
                seqs[j] = np.concatenate([np.asarray(row.request.prompt_ids),
                                          tokens[i, :count - 1]]).astype(np.int32)
                hashes[j] = row.hashes or []
            prefix.insert(seqs, hashes, take_rows(self._pool.cache, jnp.asarray(take)),
                          generation)

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
