"""Prefix reuse for the embedded sampler: KV pages kept between requests, keyed by token ids.

Shape letters: Y layers, NP pool pages, PS page size (tokens), K kv heads, H head dim, B rows,
S cache slots of a batch (a multiple of PS), SP = S / PS pages per row, E entry length.

A multi-turn episode sends its whole history every turn; without reuse each turn re-prefills
it all (a 20-turn episode prefills ~10x the tokens it needs). As in SGLang's radix cache, the
sampler needs no help from the agent loop: after a batch, each row's sequence (prompt + the
generated ids whose KV was computed, i.e. all but the last) is an *entry* whose KV slots are
copied, PS at a time, into pages of a device pool. A later prompt that extends an entry's
tokens has its cache rows gathered from those pages and prefills only the rest (the new
observation and the chat template around it).

Exactness: the K/V of the token at position p depend only on tokens 0..p (causal attention),
so the slots of the common prefix are what a full prefill would compute, up to float rounding
(different matmul shapes); tests/rollout/test_prefix_reuse.py holds logprobs to 1e-4 and greedy
tokens equal. Slots past the match (the rest of a partly matched page, padding) hold other
tokens' K/V: harmless, since the model writes a slot before any query attends to it and a query
at position p sees slots <= p only.

Bookkeeping (host side, all under one lock):
  * entries in LRU order; each owns a list of pages, shared by reference count with the entry
    it extended (the pages fully inside the common prefix hold identical K/V), so a turn
    writes only the pages of its new tokens; an entry whose tokens a newer one extends is
    dropped (every lookup it could serve, the newer one serves at least as well);
  * an index from the chain hash of each full page of an entry's tokens (hash of the hash
    before it and the page's ids) to the entries with that prefix: a lookup finds the deepest
    shared page by bisection (a prefix shared at page j is shared at every page before it),
    then measures the exact common prefix against the tokens themselves (no trust in hashes);
  * a bounded pool of `max_tokens`, allocated whole at its first use (`ensure_pool`): its
    shape never changes, so the prefill and save programs that take it compile once per row
    shape, at a server's warm-up, never again while requests run (a pool that grew would
    recompile every one of them at each size). When it is full, allocation evicts least
    recently used entries. Entries made by the current insert are never evicted by it (their
    pages are being written by the same device call).

Weight updates: K/V computed by old weights are stale. `clear()` (the sampler calls it from
`update_weights` unless told to keep the cache) drops every entry and bumps `generation`; a
batch that saw the generation change while it ran does not insert (its K/V span versions).
The pool buffers stay allocated for the next entries.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from rl_tpu import parallel
from rl_tpu.models.transformer import ModelConfig

MAX_CANDIDATES = 4  # entries compared token by token at the deepest shared page


def gather_pages(pool: dict, table) -> dict:
    """pool {'k', 'v'}: Y-tuples of [NP, K, PS, H]; table [B, SP] page ids -> a cache as
    `init_cache` makes it: Y-tuples of [B, K, SP * PS, H] (slot s of row r from page
    table[r, s // PS]). Rows or slots without a page of their own may point anywhere (0)."""
    def one(layer):
        blocks = layer[table]  # [B, SP, K, PS, H]
        b, sp, k, ps, h = blocks.shape
        return blocks.transpose(0, 2, 1, 3, 4).reshape(b, k, sp * ps, h)
    return {n: tuple(one(layer) for layer in pool[n]) for n in ("k", "v")}


def _scatter_pages(pool: dict, cache: dict, table) -> dict:
    """The pool with page table[r, j] set to slots j*PS..(j+1)*PS-1 of cache row r; table
    entries >= NP (the sentinel NP) write nothing."""
    def one(layer, rows):
        np_, k, ps, h = layer.shape
        b, _, s, _ = rows.shape
        blocks = rows.reshape(b, k, s // ps, ps, h).transpose(0, 2, 1, 3, 4)
        return layer.at[table.reshape(-1)].set(
            blocks.reshape(-1, k, ps, h).astype(layer.dtype), mode="drop")
    return {n: tuple(one(p, c) for p, c in zip(pool[n], cache[n])) for n in ("k", "v")}


def _save_rows(pool: dict, cache: dict, rows, table) -> dict:
    """`_scatter_pages` of the cache rows `rows` [F] (table [F, SP]): a batcher saves the rows
    that ended straight from its pool, copying nothing else."""
    return _scatter_pages(pool, jax.tree.map(lambda x: x[rows], cache), table)


def chain_hashes(tokens: np.ndarray, page: int, known: Sequence[int] = (),
                 salt: int = 0) -> list[int]:
    """One hash per full page of `tokens`: h_j = hash(h_{j-1}, ids of page j), h_0 = salt.
    `known`: the hashes of a prefix of these tokens already computed (extended, not
    recomputed). `salt` keys K/V that other weights computed (a LoRA adapter's): the same
    ids under another salt share no hash, so never a page."""
    tokens = np.asarray(tokens, np.int32)  # the bytes hashed: one dtype for every caller
    out = list(known)
    h = out[-1] if out else salt
    for j in range(len(out), len(tokens) // page):
        h = hash((h, tokens[j * page:(j + 1) * page].tobytes()))
        out.append(h)
    return out


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


@dataclasses.dataclass
class _Entry:
    tokens: np.ndarray  # [E] int32: the ids whose K/V the pages hold, slot i = tokens[i]
    pages: list[int]  # ceil(E / PS) page ids
    hashes: list[int]  # chain hash of each full page (E // PS)
    insert_call: int  # the insert that made it (never evicted by that same insert)
    key: int  # its key in the LRU order and the index


@dataclasses.dataclass
class Match:
    """A lookup's answer for one prompt: `length` tokens (0 = none) of K/V in `pages`."""

    length: int
    pages: list[int]
    hashes: list[int]  # the prompt's chain hashes (reused by `insert`)


@dataclasses.dataclass
class Plan:
    """A batch's prefill with reuse: per row its `matches`, `starts` [B] (tokens reused), and
    for `prefill` from the pool (None when nothing matched) `suffix` [B, Q] ids and `table`
    [B, SP] page ids."""

    matches: list[Match]
    starts: np.ndarray
    suffix: Optional[np.ndarray] = None
    table: Optional[np.ndarray] = None


def next_power_of_two(n: int, floor: int) -> int:
    """The bucket of n: the power of two at or above it, at least `floor` (sampler's too)."""
    return max(floor, 1 << max(0, (n - 1).bit_length()))


class PrefixCache:
    """A bounded pool of K/V pages for the sampler's model, with the bookkeeping above.

    `max_tokens` bounds the pool (rounded down to whole pages); `min_bucket` is the sampler's
    smallest prompt / new-token bucket (cache lengths are sums of such powers of two). K/V of
    one token take 2 x Y x K x H x bytes(dtype) on each device the pool is replicated over
    (kv heads are sharded as the rules shard them: a tensor axis splits the pool).
    """

    def __init__(self, cfg: ModelConfig, mesh: Mesh, rules, max_tokens: int,
                 page_size: int = 16, min_bucket: int = 16):
        if page_size < 1 or page_size & (page_size - 1) or page_size > min_bucket:
            raise ValueError(
                f"prefix cache page size {page_size}: it must be a power of two that divides "
                f"every cache length, so at most the smallest length bucket ({min_bucket})")
        self.max_pages = max_tokens // page_size
        if self.max_pages < 1:
            raise ValueError(f"prefix cache of {max_tokens} tokens holds no page of "
                             f"{page_size}: give it at least {page_size} tokens (0 turns it off)")
        self.cfg, self.page = cfg, page_size
        shape = (1, cfg.num_kv_heads, page_size, cfg.head_dim)
        spec = parallel.logical_to_spec((None, "kv_heads", None, "kv"), mesh, rules, shape)
        self._sharding = NamedSharding(mesh, spec)
        self._pool_shardings = {n: (self._sharding,) * cfg.num_layers for n in ("k", "v")}
        self._save = jax.jit(_save_rows, donate_argnums=0, out_shardings=self._pool_shardings)
        self._lock = threading.RLock()
        self._pool: Optional[dict] = None
        self._num_pages = 0
        self._free: list[int] = []
        self._refs = np.zeros((0,), np.int32)
        self._entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()
        self._index: dict[int, dict[int, None]] = {}  # chain hash -> entry ids (ordered set)
        self._ids = itertools.count()
        self._calls = itertools.count(1)
        self.generation = 0
        self.evictions = self.clears = 0

    # -- queries ---------------------------------------------------------------------------

    @property
    def pool(self) -> Optional[dict]:
        return self._pool

    def lookup(self, prompt: np.ndarray, salt: int = 0) -> Match:
        """The longest cached prefix of `prompt` [P] that leaves at least one token to prefill
        (its hidden state gives the first sample), at least one page long, among entries
        saved under `salt` (chain_hashes); refreshes the entry's place in the LRU order."""
        with self._lock:
            hashes = chain_hashes(prompt, self.page, salt=salt)
            entry, length = self._best(prompt, hashes, cap=len(prompt) - 1)
            if entry is None or length < self.page:
                return Match(0, [], hashes)
            self._entries.move_to_end(entry.key)
            return Match(length, entry.pages[:-(-length // self.page)], hashes)

    def plan(self, ids: np.ndarray, lens: np.ndarray, n: int, slots: int,
             min_bucket: int, bucket: Optional[Callable[[int], int]] = None,
             always: bool = False, salts: Optional[Sequence[int]] = None) -> Plan:
        """Looks up the n real rows of ids [B, P] (lengths lens [B]) for a cache of `slots`
        S = P + L per row. Q, the suffix length, is bucketed to a power of two >= min_bucket
        like P (or by `bucket`, Q = bucket(longest suffix)): one compile per (B, Q, P, L),
        whatever the starts. `always`: a suffix and table even when nothing matched (starts
        0), so every prefill of a batcher is the pool's one program. `salts`: each row's
        (lookup), 0 when not given."""
        b = ids.shape[0]
        matches = [self.lookup(ids[i, :lens[i]], salts[i] if salts else 0) for i in range(n)]
        starts = np.zeros((b,), np.int32)
        starts[:n] = [m.length for m in matches]
        if not (starts.any() or always):
            return Plan(matches, starts)
        longest = int((lens - starts).max())
        q = bucket(longest) if bucket else next_power_of_two(longest, min_bucket)
        suffix = np.zeros((b, q), np.int32)
        table = np.zeros((b, slots // self.page), np.int32)
        for i, m in enumerate(matches):
            suffix[i, :lens[i] - starts[i]] = ids[i, starts[i]:lens[i]]
            table[i, :len(m.pages)] = m.pages
        return Plan(matches, starts, suffix, table)

    def stats(self) -> dict[str, int]:
        with self._lock:
            used = self._num_pages - len(self._free)
            return {"cache_entries": len(self._entries),
                    "cache_tokens_used": used * self.page,  # pages in use (shared once)
                    "cache_pages_used": used, "cache_pages": self._num_pages,
                    "cache_capacity_tokens": self.max_pages * self.page,
                    "cache_evictions": self.evictions, "cache_flushes": self.clears}

    # -- updates ---------------------------------------------------------------------------

    def clear(self) -> None:
        """Forgets every entry (weights changed); the pool stays allocated."""
        with self._lock:
            self._entries.clear()
            self._index.clear()
            self._free = list(range(self._num_pages))
            self._refs[:] = 0
            self.generation += 1
            self.clears += 1

    def ensure_pool(self) -> dict:
        """The pool, allocated (all `max_tokens`) if it was not yet."""
        with self._lock:
            if self._pool is None:
                self._allocate()
            return self._pool

    def warm_save(self, cache: dict, rows) -> None:
        """Compiles the save of cache rows `rows` [F] (a cache of the shape `insert` will be
        given) by running it with nothing to write."""
        with self._lock:
            self.ensure_pool()
            table = np.full((len(rows), cache["k"][0].shape[2] // self.page), self._num_pages,
                            np.int32)
            self._pool = self._save(self._pool, cache, np.asarray(rows, np.int32), table)

    def insert(self, sequences: Sequence[Optional[np.ndarray]], known_hashes: Sequence[list],
               cache: dict, generation: int, rows=None,
               salts: Optional[Sequence[int]] = None) -> int:
        """Saves cache row rows[r] (Y-tuples [B, K, S, H]; rows [F] defaults to every row)
        as an entry of `sequences[r]`, the ids whose K/V sit in its slots 0..E-1 (None: skip
        the row; rows past the list's end are padding). `known_hashes[r]`: chain hashes of a
        prefix of it (the prompt's, from `lookup`); `salts[r]`: the salt it was looked up with
        (0 when not given). Nothing is saved when the cache was cleared since `generation` was
        read. Returns the number of pages written."""
        with self._lock:
            if generation != self.generation:
                return 0
            call = next(self._calls)
            b, _, s, _ = cache["k"][0].shape
            rows = np.arange(b, dtype=np.int32) if rows is None else np.asarray(rows, np.int32)
            # F >= len(sequences): padding rows too
            table = np.full((len(rows), s // self.page), -1, np.int64)
            if max((len(q) for q in sequences if q is not None), default=0) > s:
                raise ValueError(f"a sequence is longer than the cache's {s} slots")
            for r, seq in enumerate(sequences):
                if seq is not None and len(seq) >= self.page:
                    self._insert_row(seq, known_hashes[r], table[r], call,
                                     salts[r] if salts else 0)
            written = int((table >= 0).sum())
            if written:
                table[table < 0] = self._num_pages  # out of range: dropped by the scatter
                self._pool = self._save(self._pool, cache, rows, table.astype(np.int32))
            return written

    def _insert_row(self, seq: np.ndarray, known: list, table_row: np.ndarray, call: int,
                    salt: int):
        hashes = chain_hashes(seq, self.page, known[:len(seq) // self.page], salt)
        base, length = self._best(seq, hashes, cap=len(seq))
        if base is not None and length == len(seq):  # an entry already holds all of it
            self._entries.move_to_end(base.key)
            return
        shared = base.pages[:length // self.page] if base is not None else []
        total = -(-len(seq) // self.page)
        for p in shared:  # held first, so eviction below cannot free them
            self._refs[p] += 1
        fresh = self._alloc(total - len(shared), call)
        if fresh is None:  # the pool cannot take it now: the row is simply not cached
            for p in shared:
                self._release(p)
            return
        table_row[len(shared):total] = fresh
        if (base is not None and length == len(base.tokens) and base.insert_call != call
                and base.key in self._entries):  # (not evicted just now)
            self._remove(base.key)  # the new entry extends it
        key = next(self._ids)
        self._entries[key] = _Entry(seq.copy(), shared + fresh, hashes, call, key)
        for h in hashes:
            self._index.setdefault(h, {})[key] = None

    # -- internals -------------------------------------------------------------------------

    def _best(self, tokens: np.ndarray, hashes: list[int], cap: int):
        """(entry, common prefix length <= cap) with the most tokens in common, found at the
        deepest full page shared with any entry; (None, 0) when not even one page is."""
        lo, hi = 0, min(len(hashes), cap // self.page)  # bisect: pages 1..lo are shared
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._index.get(hashes[mid - 1]):
                lo = mid
            else:
                hi = mid - 1
        if lo == 0:
            return None, 0
        best, best_len = None, 0
        for key in itertools.islice(reversed(self._index[hashes[lo - 1]]), MAX_CANDIDATES):
            entry = self._entries[key]
            length = min(common_prefix(tokens, entry.tokens), cap)
            if length > best_len:
                best, best_len = entry, length
        return best, best_len

    def _alloc(self, n: int, call: int) -> Optional[list[int]]:
        if self._pool is None:
            self._allocate()
        while len(self._free) < n:
            victim = next((k for k, e in self._entries.items() if e.insert_call != call), None)
            if victim is None:
                return None
            self._remove(victim)
            self.evictions += 1
        out, self._free = self._free[:n], self._free[n:]
        for p in out:
            self._refs[p] = 1
        return out

    def _allocate(self):
        pages = self.max_pages
        shape = (pages, self.cfg.num_kv_heads, self.page, self.cfg.head_dim)
        make = jax.jit(lambda: {n: tuple(jnp.zeros(shape, self.cfg.kv_dtype)
                                         for _ in range(self.cfg.num_layers))
                                for n in ("k", "v")}, out_shardings=self._pool_shardings)
        self._pool = make()
        self._free = list(range(pages))
        self._refs = np.zeros((pages,), np.int32)
        self._num_pages = pages

    def _release(self, page: int):
        self._refs[page] -= 1
        if self._refs[page] == 0:
            self._free.append(page)

    def _remove(self, key: int):
        entry = self._entries.pop(key)
        for p in entry.pages:
            self._release(p)
        for h in entry.hashes:
            ids = self._index.get(h)
            if ids is not None:
                ids.pop(key, None)
                if not ids:
                    del self._index[h]
