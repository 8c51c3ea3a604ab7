"""The embedded JAX rollout engine: `JaxSampler` batches requests into bucketed shapes and runs
decoding.py's compiled prefill and decode chunks on them.

Between decode chunks the host applies aborts, pauses and weight updates. With prefix reuse
(prefix_cache.py) a prompt that extends an earlier request's prompt + output prefills only its
new suffix, each row from its own start position. Log-probs are the trainer's, exactly (see
decoding.py).
"""

from __future__ import annotations

import collections
import functools
import itertools
import threading
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from rl_tpu import parallel
from rl_tpu.models import lora
from rl_tpu.models.transformer import ModelConfig, Transformer
from rl_tpu.rollout.adapter_slots import AdapterSlots
from rl_tpu.rollout.adapter_weights import AdapterWeights
from rl_tpu.rollout.compile_count import CompileCounter
from rl_tpu.rollout.decoding import DecodeAhead, decode, prefill, row_routing
from rl_tpu.core.engine import (GenerateRequest, GenerateResult, RolloutEngine,
                                   check_stop_token_ids)
from rl_tpu.rollout.own_copy import OwnCopy
from rl_tpu.rollout.prefix_cache import Plan, PrefixCache, next_power_of_two

STOP_WIDTH = 4  # the fewest stop-id slots a row has (more round up to a power of two)
INT32_MAX = 2**31 - 1  # the largest length, top_k or stop id a row's int32 arrays hold

# seeds [B] uint32 -> PRNG keys [B]; jitted, as vmap run eagerly traces anew on every call
keys_from_seeds = jax.jit(jax.vmap(jax.random.key))


class JaxSampler(RolloutEngine):
    """RolloutEngine over `prefill` + chunked `decode`, batching requests into bucketed shapes.

    Weights: the sampler owns its own copy of the weights it samples with. The constructor and
    `update_weights` copy the given params on device, with no host round trip, into the
    sampler's shardings on `mesh` (unstacking scanned layers, casting to `dtype` when given,
    e.g. "bfloat16"); the copy never shares a buffer with its source, so the trainer may
    donate or delete its params the moment the call returns (a compiled train step donates its
    state), and nothing but `update_weights` changes what the sampler samples with. The price
    is one params-sized copy per update (benchmarks/weight_copy.py) and the memory of a
    second set of weights. A LoRA policy (`cfg.lora`) copies its frozen base once and then only
    its adapters, merged into the kernels or applied as they are (`cfg.lora.sampler`,
    adapter_weights.py), and a batch keeps the adapters it started with to its end (its
    samples report one version), as SGLang's per-request `lora_path` does.

    A weight update lands between decode chunks: samples in flight continue on the new weights
    and report both versions (`info['weight_versions']` spans, as SGLang's `retract` does).
    The spans say which weights sampled each id; the ids after the swap still attend to K/V
    the old weights computed, so a trajectory counts them as the old version
    (`trajectory.token_versions`).
    `abort` ends samples between chunks, returning what they generated so far (finish
    'abort'), the basis of partial rollouts; `pause`/`resume` hold decoding between chunks.

    Prefix reuse (`prefix_cache_tokens` > 0, see prefix_cache.py): a prompt that extends an
    earlier request's prompt + output (the next turn of an episode) gathers that K/V from a
    bounded LRU pool of pages and prefills only the new suffix; each row then decodes from its
    own length. `update_weights` drops the cache unless `keep_prefix_cache_on_update`.
    `stats()` counts prompt tokens computed and reused.

    Sharding: `rules` (default SAMPLER_RULES) on `mesh`, best built by
    `parallel.sampler_mesh`: heads, mlp and vocab split across `tensor`, rows across `data`,
    the model width whole, so decode all-gathers no weight per token (the trainer's fsdp
    layout would). The sampler's copy is resharded into that layout on every update.

    Memory at long context: `prefill_chunk` runs prompts that many tokens at a time (see
    `_prompt_hidden`), and `kv_dtype` (e.g. "bfloat16") stores the cache apart from the
    compute dtype; both default to what the trainer computes, exactly.

    Batches: requests run `max_batch` rows at a time, and with `kv_tokens` > 0 in runs whose
    padded cache (rows x (prompt + output buckets) slots) holds at most that many tokens, so a
    turn deep into a long episode runs in fewer rows than the first turn, in the same memory.
    """

    def __init__(self, cfg: ModelConfig, params, *, mesh: Optional[Mesh] = None,
                 rules=parallel.SAMPLER_RULES, tokenizer=None, max_batch: int = 64,
                 kv_tokens: int = 0,
                 min_prompt_bucket: int = 16, min_new_bucket: int = 16, decode_chunk: int = 64,
                 seed: int = 0, version: str = "0", dtype: Optional[str] = None,
                 kv_dtype: Optional[str] = None, prefill_chunk: int = 0,
                 prefix_cache_tokens: int = 65536, prefix_page_size: int = 16,
                 keep_prefix_cache_on_update: bool = False):
        # Decoding always runs unrolled layers, whatever the trainer uses: each layer's cache
        # is then its own buffer, updated in place, where a scan would slice the stacked cache
        # in and out every step. Scanned params are unstacked on the way in.
        cfg = cfg.replace(scan_layers=False, remat="none")
        if dtype is not None:  # sample in another precision than the trainer's (weights + math)
            cfg = cfg.replace(dtype=str(jnp.dtype(dtype)), param_dtype=str(jnp.dtype(dtype)))
        if kv_dtype is not None:  # the cache alone in another dtype (e.g. bf16 under fp32)
            cfg = cfg.replace(cache_dtype=str(jnp.dtype(kv_dtype)))
        if prefill_chunk < 0 or prefill_chunk & (prefill_chunk - 1):
            raise ValueError(f"prefill_chunk={prefill_chunk}: use 0 (whole prompts) or a power "
                             f"of two, which divides every prompt bucket it is smaller than")
        self.prefill_chunk = prefill_chunk
        self.cfg = cfg
        self.mesh = mesh or parallel.make_mesh({}, devices=jax.devices()[:1])
        # The base model's params (a LoRA policy's frozen base, or the whole policy) and, for
        # LoRA, the adapters beside them: copied once, adapters each update (adapter_weights.py)
        self._copy_plain = OwnCopy(cfg.replace(lora=None), self.mesh, rules,
                                   None if dtype is None else cfg.param_dtype)
        # a serving model's adapter slots (cfg.lora.slots: adapter_slots.py), loaded by name
        self.adapter_slots = AdapterSlots(cfg, self.mesh, rules) if (
            lora.is_on(cfg) and cfg.lora.slots) else None
        self._adapters = None if not lora.is_on(cfg) or self.adapter_slots else AdapterWeights(
            cfg, self.mesh, rules, self._copy_plain, self._copy_plain.shardings)
        model_cfg = cfg if self._adapters is None else self._adapters.model_cfg
        self.model = Transformer(model_cfg, mesh=self.mesh, rules=rules)
        self.tokenizer = tokenizer
        if max_batch < 1 or kv_tokens < 0:
            raise ValueError(f"max_batch={max_batch} and kv_tokens={kv_tokens}: a batch needs "
                             "at least one row, and the KV budget is 0 (off) or positive")
        self.max_batch, self.kv_tokens = max_batch, kv_tokens
        self.min_prompt_bucket, self.min_new_bucket = min_prompt_bucket, min_new_bucket
        self.decode_chunk = decode_chunk
        self._decode_ahead = DecodeAhead(self.mesh)  # decode compiles beside prefill
        self._seed = seed
        self._counter = itertools.count()
        self._weights_lock = threading.Lock()
        self._device_lock = threading.Lock()  # one batch on the device at a time
        # every program this sampler's device work compiles (prefix cache and batcher too)
        self.compiles = CompileCounter()
        self._counts = dict(prompt_tokens=0, prefill_tokens=0, reused_tokens=0, cache_rows=0,
                            cache_hits=0, last_sync_bytes=0)
        with self.compiles.counting():
            self._params = self._own_copy(params)
        self._version = str(version)
        self._resume = threading.Event()
        self._resume.set()
        self._control_lock = threading.Lock()
        self._aborted_ids: set[str] = set()
        self._running_ids: collections.Counter = collections.Counter()  # ids in generate()
        self._abort_epoch = 0  # batches admitted in an earlier epoch are aborted
        default_stops = tuple(cfg.eos_token_ids)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            default_stops = tuple(dict.fromkeys(default_stops + (tokenizer.eos_token_id,)))
        self.eos_ids = default_stops
        if prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens={prefix_cache_tokens}: use 0 (no prefix "
                             "reuse) or a positive token budget")
        self._prefix = PrefixCache(cfg, self.mesh, rules, prefix_cache_tokens, prefix_page_size,
                                   min(min_prompt_bucket, min_new_bucket)) if (
                                       prefix_cache_tokens) else None
        self.keep_prefix_cache_on_update = keep_prefix_cache_on_update

    # -- RolloutEngine -------------------------------------------------------------------

    @property
    def weight_version(self) -> Optional[str]:
        return self._version

    def health(self) -> bool:
        return self._params is not None

    def update_weights(self, params, version: str) -> None:
        """Samples from a copy of `params` from the next decode chunk on; `params` stay the
        caller's (see the class docstring)."""
        with self.compiles.counting():
            params = self._own_copy(params)  # outside the lock: decoding goes on meanwhile
        with self._weights_lock:
            self._params, self._version = params, str(version)
            if self._prefix is not None and not self.keep_prefix_cache_on_update:
                self._prefix.clear()  # K/V of the old weights (batches in flight skip saving)

    def load_adapter(self, name: str, path: str) -> None:
        """Loads the PEFT dir `path` into a free adapter slot under `name` (a serving sampler's:
        `cfg.lora.slots`); requests naming it (`GenerateRequest.lora_slot`, from
        `adapter_slots.acquire(name)`) sample with it from their first token. Rows running
        meanwhile keep their own slots' values (adapter_slots.py)."""
        if self.adapter_slots is None:
            raise ValueError("this sampler serves no LoRA adapters: build it with a ModelConfig "
                             "from adapter_slots.slot_config (launch.serve_rollout --enable_lora)")
        with self._weights_lock:
            base = lora.without_adapters(self._params)
        self.adapter_slots.load(name, path, self.cfg.replace(lora=None), base)
        with self._weights_lock:  # the newest stack (another load may have finished first)
            self._params = lora.with_adapters(lora.without_adapters(self._params),
                                              self.adapter_slots.stacked)

    def prefix_salt(self, slot: int) -> int:
        """The prefix-cache salt of rows sampling with adapter slot `slot` (0: the base)."""
        return self.adapter_slots.salt(slot) if slot and self.adapter_slots else 0

    def flush_cache(self) -> None:
        """Drops every cached prefix (SGLang's /flush_cache). Under the weights lock, as a
        weight update clears it: a batch in flight then sees a new generation and skips saving."""
        with self._weights_lock:
            if self._prefix is not None:
                self._prefix.clear()

    def stats(self) -> dict:
        """Counters since construction, for the trainer to log: `prompt_tokens` (of every
        row admitted), `prefill_tokens` (those run through the model), `reused_tokens` (those
        whose K/V came from the prefix cache), `reuse_fraction`, `cache_rows` / `cache_hits`
        (rows looked up / that reused a prefix), and the cache's own `cache_entries`,
        `cache_tokens_used`, `cache_pages_used`, `cache_pages`, `cache_capacity_tokens`,
        `cache_evictions`, `cache_flushes`; `last_sync_bytes`, the bytes the last weight
        update copied (a LoRA policy's adapters, once the base is held), `weight_bytes`, those
        of the weights it holds; `compiled_programs`, the XLA programs its device
        work has compiled (or loaded from the persistent cache) in this process, as JAX
        reports them: the weight copy, prefill, decode, the prefix cache's and a
        `ContinuousBatcher`'s programs (flat after `warmup` when the run stays in its
        buckets; compile_count.py)."""
        with self._weights_lock:
            weight_bytes = sum(x.nbytes for x in jax.tree.leaves(self._params)) + (
                0 if self._adapters is None else self._adapters.extra_bytes())
        with self._control_lock:
            out = dict(self._counts, compiled_programs=self.compiles.count,
                       weight_bytes=weight_bytes)
        out["reuse_fraction"] = out["reused_tokens"] / max(out["prompt_tokens"], 1)
        if self._prefix is not None:
            out.update(self._prefix.stats())
        return out

    def warmup(self, shapes: Sequence[tuple[int, int, int]]) -> int:
        """Compiles the prefill and decode of each (rows, prompt tokens, new tokens) in
        `shapes`, as their buckets, before any request needs them, so a run whose batches stay
        in those buckets compiles nothing mid-way (`stats()['compiled_programs']` stays flat).
        Each runs once on placeholder rows that end at their first token: the cost of one
        prefill. Returns the number of programs compiled (the row keys' too). (The
        prefix-reuse prefill compiles at its first use.)"""
        with self.compiles.counting() as counter:
            before = counter.count
            self._warm(shapes)
            return counter.count - before

    def _warm(self, shapes: Sequence[tuple[int, int, int]]) -> None:
        for rows, prompt, new in shapes:
            b, p, steps = self._batch_shape(min(rows, self.max_batch), prompt, new)
            i32 = np.int32
            stop_ids = np.full((b, STOP_WIDTH), -1, i32)
            keys = keys_from_seeds(np.arange(b, dtype=np.uint32))
            sampling = (np.ones((b,), i32), np.zeros((b,), i32), np.zeros((b,), np.float32),
                        np.ones((b,), np.float32), np.full((b,), -1, i32), stop_ids, stop_ids,
                        keys, np.zeros((b,), i32))
            with self._device_lock:
                params, _ = self.weights()
                state = prefill(self.model, params, np.zeros((b, p), i32), np.ones((b,), i32),
                                *sampling, max_steps=steps, chunk=self.prefill_chunk)
                jax.block_until_ready(decode(self.model, params, state,
                                             chunk=self.decode_chunk).done)

    def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        rows = [(req, k) for req in requests for k in range(req.sampling.n)]
        for req, _ in rows:
            self.validate(req)
        ids = [req.request_id for req in requests if req.request_id is not None]
        with self._control_lock:
            epoch = self._abort_epoch
            self._running_ids.update(ids)
        try:
            results: list[GenerateResult] = []
            with self.compiles.counting():
                for batch in self._batches(rows):
                    results.extend(self._generate_batch(batch, epoch))
        finally:
            with self._control_lock:  # these requests are over: forget them and their aborts
                self._running_ids.subtract(ids)
                for rid in ids:
                    if self._running_ids[rid] <= 0:
                        self._running_ids.pop(rid, None)
                        self._aborted_ids.discard(rid)
        return results

    # -- control (between decode chunks) --------------------------------------------------

    def abort(self, request_id: Optional[str] = None) -> None:
        """Ends the running request with this id, or every request admitted so far (None).
        An id that is not running is ignored, as SGLang does: it must not end a later
        request that happens to reuse it."""
        with self._control_lock:
            if request_id is None:
                self._abort_epoch += 1
            elif str(request_id) in self._running_ids:
                self._aborted_ids.add(str(request_id))

    def pause(self) -> None:
        self._resume.clear()

    def resume(self) -> None:
        self._resume.set()

    # -- what a batcher over this sampler's programs uses (ContinuousBatcher) -----------

    @property
    def prefix_cache(self) -> Optional[PrefixCache]:
        """The prefix cache (None with prefix_cache_tokens=0)."""
        return self._prefix

    def snapshot(self):
        """(params, version, prefix-cache generation), read together: K/V computed with these
        params may be saved under that generation (a weight update moves it on)."""
        with self._weights_lock:
            generation = self._prefix.generation if self._prefix is not None else 0
            return self._params, self._version, generation

    @property
    def paused(self) -> bool:
        return not self._resume.is_set()

    def wait_resumed(self, timeout: Optional[float] = None) -> bool:
        """Blocks while paused (at most `timeout` s); True once not paused."""
        return self._resume.wait(timeout)

    def validate(self, req: GenerateRequest) -> None:
        """ValueError naming what is wrong with `req` for this sampler (its prompt ids, its
        sampling numbers, stop strings without a tokenizer); None when it can run."""
        if len(req.prompt_ids) == 0:
            raise ValueError("empty prompt: a request needs at least one prompt token")
        bad = [t for t in req.prompt_ids if not 0 <= int(t) < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocab "
                             f"[0, {self.cfg.vocab_size})")
        if req.sampling.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: build the sampler with tokenizer=")
        slots = self.adapter_slots.spec.slots if self.adapter_slots else 1
        if not 0 <= req.lora_slot < slots:
            raise ValueError(f"lora_slot={req.lora_slot}: this sampler has {slots} adapter "
                             "slot(s); a request's slot comes from adapter_slots.acquire")
        # row_arrays keeps these in int32: a bigger number must be refused here, with its
        # name, not fail while the row is built beside other requests' rows
        s = req.sampling
        for name, value in (("max_new_tokens", s.max_new_tokens),
                            ("min_new_tokens", s.min_new_tokens), ("top_k", s.top_k)):
            low = -1 if name == "top_k" else 0
            try:
                fits = low <= value <= INT32_MAX
            except TypeError:  # not a number at all
                fits = False
            if not fits:
                raise ValueError(f"sampling {name}={value!r}: must be an integer in [{low}, "
                                 f"{INT32_MAX}]")
        check_stop_token_ids(s.stop_token_ids, self.cfg.vocab_size)

    def weights(self):
        """(params, version) that decoding uses now, read together."""
        with self._weights_lock:
            return self._params, self._version

    def prefill_rows(self, params, n: int, ids, lens, sampling, steps: int, slots: int = 0,
                     bucket=None, blank_pool=None):
        """(`prefill`, from the prefix pool when some of the n real rows of ids [B, P] have a
        cached prefix; the lookups, None without a prefix cache).

        With `slots` (a `ContinuousBatcher`): always the pool's form, into a cache of `slots`
        slots with an output buffer of 1 (the pool holds the rest), the suffix bucketed by
        `bucket`, from `blank_pool` (pages of nothing) without a prefix cache: one program per
        (rows, suffix bucket, slots), whatever the prompt lengths."""
        if slots:
            return self._pool_prefill(params, n, ids, lens, sampling, slots, bucket,
                                      blank_pool)
        plan = None if self._prefix is None else self._prefix.plan(
            ids, lens, n, ids.shape[1] + steps, self.min_prompt_bucket,
            salts=self._salts(sampling, n))
        self._count_prefill(n, lens, plan)
        matches = None if plan is None else plan.matches
        if plan is None or plan.suffix is None:
            call = functools.partial(prefill, self.model, params, ids, lens, *sampling,
                                     max_steps=steps, chunk=self.prefill_chunk)
        else:
            call = functools.partial(prefill, self.model, params, plan.suffix, lens, *sampling,
                                     max_steps=steps, starts=plan.starts,
                                     pool=self._prefix.pool, page_table=plan.table,
                                     chunk=self.prefill_chunk)
        self._decode_ahead.start(self.model, params, call, self.decode_chunk)
        return call(), matches

    def result(self, req, tokens, logprobs, stopped, aborted, spans,
               experts=None) -> GenerateResult:
        """The GenerateResult of one row of `req`: its output ids and log-probs (numpy, as
        decoded), whether it stopped on a stop id or was aborted, and its weight-version
        spans [(version, first output index)]; stop strings cut here. `experts`: a mixture of
        experts' `DecodeState.experts` row (numpy), None for a row that never ran."""
        s = req.sampling
        tokens, logprobs = tokens.tolist(), logprobs.tolist()
        if s.max_new_tokens == 0:
            tokens, logprobs, stopped = [], [], False
        if stopped:
            finish, matched = "stop", tokens[-1]
        else:
            finish, matched = ("abort" if aborted else "length"), None
        if s.stop:
            cut = self._first_stop_string(tokens, s.stop)
            if cut is not None:
                end, text = cut
                tokens, logprobs, finish, matched = tokens[:end], logprobs[:end], "stop", text
        # The versions this sample was decoded with, as SGLang's meta_info.weight_versions.
        used = [{"version": v, "start": start, "end": min(end, len(tokens))}
                for (v, start), end in zip(spans, [e for _, e in spans[1:]] + [len(tokens)])
                if start < len(tokens)] or [{"version": spans[0][0], "start": 0, "end": 0}]
        return GenerateResult(output_ids=tokens, logprobs=logprobs, finish_reason=finish,
                              weight_version=used[-1]["version"], matched_stop=matched,
                              prompt_tokens=len(req.prompt_ids), info={"weight_versions": used},
                              logprob_convention="full",
                              routed_experts=(row_routing(
                                  self.cfg, experts, len(req.prompt_ids) + len(tokens) - 1)
                                  if s.return_routed_experts else None))

    # -- internals -----------------------------------------------------------------------

    def _own_copy(self, params):
        """A copy of `params` (the trainer's layout: scanned or not, any mesh) in the sampler's
        shardings, made on device, sharing no buffer with `params`; for a LoRA policy, the
        adapters only once the base is held (adapter_weights.py)."""
        if self._adapters is not None:
            params = self._adapters.own_copy(params)
            self._counts["last_sync_bytes"] = self._adapters.last_sync_bytes
            return params
        if self.adapter_slots is not None:  # a new base under the loaded adapters
            base = self._copy_plain(lora.without_adapters(params))
            self._counts["last_sync_bytes"] = sum(x.nbytes for x in jax.tree.leaves(base))
            return lora.with_adapters(base, self.adapter_slots.stacked)
        params = self._copy_plain(params)
        self._counts["last_sync_bytes"] = sum(x.size * x.dtype.itemsize
                                         for x in jax.tree.leaves(params))
        return params

    def _aborted_rows(self, rows, epoch: int, b: int) -> np.ndarray:
        with self._control_lock:
            all_aborted = epoch < self._abort_epoch
            ids = set(self._aborted_ids)
        out = np.zeros((b,), bool)
        for i, (req, _) in enumerate(rows):
            out[i] = all_aborted or (req.request_id is not None and req.request_id in ids)
        return out

    def _batch_shape(self, n: int, longest: int, max_new: int) -> tuple[int, int, int]:
        """(rows B, prompt bucket P, output bucket L) a batch of n rows is padded to."""
        return (next_power_of_two(n, 1), next_power_of_two(longest, self.min_prompt_bucket),
                next_power_of_two(max(max_new, 1), self.min_new_bucket))

    def _batches(self, rows) -> list[list]:
        """Consecutive runs of `rows`, each at most max_batch rows and, with a KV budget, at
        most kv_tokens cache slots as padded (B x (P + L)); a row alone over the budget runs
        alone. In order: results come back as the rows came in."""
        out, current, longest, most_new = [], [], 0, 0
        for row in rows:
            req = row[0]
            grown = (max(longest, len(req.prompt_ids)), max(most_new, req.sampling.max_new_tokens))
            b, p, steps = self._batch_shape(len(current) + 1, *grown)
            if current and (len(current) == self.max_batch
                            or (self.kv_tokens and b * (p + steps) > self.kv_tokens)):
                out.append(current)
                current, grown = [], (len(req.prompt_ids), req.sampling.max_new_tokens)
            current.append(row)
            longest, most_new = grown
        return out + ([current] if current else [])

    def _generate_batch(self, rows, epoch: int) -> list[GenerateResult]:
        n = len(rows)
        b, p, steps = self._batch_shape(n, max(len(req.prompt_ids) for req, _ in rows),
                                        max(req.sampling.max_new_tokens for req, _ in rows))
        width = self.stop_width([req for req, _ in rows])
        ids, lens, sampling = self.row_arrays(rows, b, p, width)
        aborted = np.zeros((b,), bool)
        with self._device_lock:
            self._resume.wait()
            params, version, generation = self.snapshot()
            state, matches = self.prefill_rows(params, n, ids, lens, sampling, steps)
            spans = [(version, 0)]  # (version, first output index decoded with it)
            while True:
                done = np.asarray(state.done)
                newly = self._aborted_rows(rows, epoch, b) & ~done
                if newly.any():
                    aborted |= newly
                    done = done | newly
                    state = state.replace(done=jnp.asarray(done))
                if done[:n].all():
                    break
                self._resume.wait()
                if self._adapters is None:  # a LoRA batch keeps the adapters it started with
                    params, version = self.weights()
                if version != spans[-1][0]:
                    spans.append((version, int(state.step)))
                self._decode_ahead.wait()
                state = decode(self.model, params, state, chunk=self.decode_chunk)
            tokens, logprobs, count, stopped = (np.asarray(x) for x in (
                state.tokens, state.logprobs, state.count, state.stopped))
            # the routing buffer crosses to the host only when a request asked for it
            # (Qwen3-30B-A3B: 1.5 KB a slot)
            wanted = any(req.sampling.return_routed_experts for req, _ in rows)
            experts = (np.asarray(state.experts) if wanted and state.experts is not None
                       else None)
            if matches is not None:
                # Slots 0..len+count-2 hold K/V: the prompt and every output id but the last
                # (sampled, never fed back). Raw ids: a stop-string cut changes nothing here.
                seqs = [np.concatenate([ids[i, :lens[i]], tokens[i, :count[i] - 1]])
                        for i in range(n)]
                self._prefix.insert(seqs, [m.hashes for m in matches], state.cache, generation,
                                    salts=self._salts(sampling, n))
        return [self.result(rows[i][0], tokens[i, :count[i]], logprobs[i, :count[i]],
                             bool(stopped[i]), bool(aborted[i]), spans,
                             None if experts is None else experts[i]) for i in range(n)]

    def stop_width(self, requests) -> int:
        """X, the stop (and banned) ids a row of these requests holds: a power of two from 4,
        so eos ids, a few stop ids or none share one program (bans are the stop ids too, or
        nothing; see `_ban_ids`)."""
        return next_power_of_two(max(1, *(max(len(self._stop_ids(req)), len(
            self._ban_ids(req))) for req in requests)), STOP_WIDTH)

    def row_arrays(self, rows, b: int, p: int, width: int):
        """(ids [B, P] right-padded, lens [B], the per-row sampling arrays `prefill` takes:
        max_new, min_new, temperature, top_p, top_k [B], stop_ids, ban_ids [B, X], keys [B],
        adapter slots [B])
        of `rows`, (request, sample index) pairs, padded to B rows (padding rows end at their
        first token). A sample's key depends on its request's seed and its index alone."""
        ids = np.zeros((b, p), np.int32)
        lens = np.ones((b,), np.int32)
        max_new = np.ones((b,), np.int32)
        min_new = np.zeros((b,), np.int32)
        temperature = np.zeros((b,), np.float32)
        top_p = np.ones((b,), np.float32)
        top_k = np.full((b,), -1, np.int32)
        stop_ids = np.full((b, width), -1, np.int32)
        ban_ids = np.full((b, width), -1, np.int32)
        seeds = np.zeros((b,), np.uint32)
        adapter = np.zeros((b,), np.int32)
        for i, (req, k) in enumerate(rows):
            s = req.sampling
            stops, bans = self._stop_ids(req), self._ban_ids(req)  # at most `width` each
            ids[i, :len(req.prompt_ids)] = req.prompt_ids
            lens[i], max_new[i] = len(req.prompt_ids), max(s.max_new_tokens, 1)
            min_new[i] = s.min_new_tokens
            temperature[i], top_p[i], top_k[i] = s.temperature, s.top_p, s.top_k
            stop_ids[i, :len(stops)] = stops
            ban_ids[i, :len(bans)] = bans
            seed = s.seed if s.seed is not None else hash((self._seed, next(self._counter)))
            seeds[i] = np.uint32(hash((seed, k)) & 0xFFFFFFFF)
            adapter[i] = req.lora_slot
        keys = keys_from_seeds(seeds)
        return ids, lens, (max_new, min_new, temperature, top_p, top_k, stop_ids, ban_ids, keys,
                           adapter)

    def _salts(self, sampling, n: int) -> Optional[list[int]]:
        """The prefix-cache salts of the n real rows of `row_arrays`' sampling arrays."""
        if self.adapter_slots is None:
            return None
        return [self.prefix_salt(int(slot)) for slot in sampling[-1][:n]]

    def _pool_prefill(self, params, n: int, ids, lens, sampling, slots: int, bucket,
                      blank_pool):
        if self._prefix is not None:
            plan = self._prefix.plan(ids, lens, n, slots, self.min_prompt_bucket, bucket,
                                     always=True, salts=self._salts(sampling, n))
            pool, matches = self._prefix.ensure_pool(), plan.matches
        else:
            b, page = ids.shape[0], blank_pool["k"][0].shape[2]
            plan = Plan([], np.zeros((b,), np.int32), np.zeros((b, bucket(int(lens.max()))),
                                                               np.int32),
                        np.zeros((b, slots // page), np.int32))
            for i in range(n):
                plan.suffix[i, :lens[i]] = ids[i, :lens[i]]
            pool, matches = blank_pool, None
        self._count_prefill(n, lens, plan if self._prefix is not None else None)
        return prefill(self.model, params, plan.suffix, lens, *sampling, max_steps=1,
                       starts=plan.starts, pool=pool, page_table=plan.table,
                       chunk=self.prefill_chunk), matches

    def _count_prefill(self, n: int, lens, plan) -> None:
        starts = np.zeros((n,), np.int32) if plan is None else plan.starts[:n]
        with self._control_lock:
            c = self._counts
            c["prompt_tokens"] += int(lens[:n].sum())
            c["reused_tokens"] += int(starts.sum())
            c["prefill_tokens"] += int((lens[:n] - starts).sum())
            c["cache_rows"] += n if plan is not None else 0
            c["cache_hits"] += int((starts > 0).sum())

    def _stop_ids(self, req: GenerateRequest) -> tuple[int, ...]:
        s = req.sampling
        if s.ignore_eos:  # SGLang: ignore_eos turns off every token-based stop, not just eos
            return ()
        return tuple(dict.fromkeys(tuple(s.stop_token_ids) + self.eos_ids))

    def _ban_ids(self, req: GenerateRequest) -> tuple[int, ...]:
        """The ids min_new_tokens masks: SGLang's penalizer takes stop_token_ids and eos
        whether or not ignore_eos is set, and so do we (its distributions are the reference)."""
        if req.sampling.min_new_tokens <= 0:
            return ()
        return tuple(dict.fromkeys(tuple(req.sampling.stop_token_ids) + self.eos_ids))

    def _first_stop_string(self, tokens, stops) -> Optional[tuple[int, str]]:
        """(number of tokens up to and including the one completing the earliest stop string,
        that string), or None. Tokens past it are dropped: they were sampled after the stop."""
        text = self.tokenizer.decode(tokens)
        hits = [(text.find(stop), stop) for stop in stops if stop and stop in text]
        if not hits:
            return None
        position, stop = min(hits)
        need = position + len(stop)
        for end in range(1, len(tokens) + 1):
            if len(self.tokenizer.decode(tokens[:end])) >= need:
                return end, stop
        return len(tokens), stop
