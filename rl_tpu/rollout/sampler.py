"""The embedded JAX rollout engine: batched prefill + KV-cache decode in compiled chunks.

Shape letters: B batch (rows = samples), P prompt length (bucketed), L new tokens (bucketed),
S = P + L cache slots, V vocab, X stop ids per row.

One compiled prefill and one compiled decode per (B, P, L) bucket serve every mix of sampling
parameters: greedy, temperature, top-p and top-k, stop token ids and max_new_tokens are
per-row *arrays*, not compile-time constants. Prompts are right-padded; row r's token at
position p sits in cache slot p, so rows of different prompt lengths decode side by side with
no left padding. Decode is a `lax.while_loop` over up to `decode_chunk` tokens that ends as
soon as every row has stopped; between chunks the host applies aborts, pauses and weight
updates.

Log-probs are computed exactly as the trainer computes them (`rl_tpu.models.logprobs`): the
final hidden state through `logits_from_hidden`, divided by the temperature, log-softmax.
"""

from __future__ import annotations

import functools
import itertools
import threading
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh

from rl_tpu import parallel
from rl_tpu.models.logprobs import logits_from_hidden, logprobs_of
from rl_tpu.models.transformer import ModelConfig, Transformer, init_cache, unstack_layers
from rl_tpu.rollout.engine import GenerateRequest, GenerateResult, RolloutEngine

GREEDY_BELOW = 1e-6  # SGLang's convention: a temperature below this means greedy


def _next_power_of_two(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, (n - 1).bit_length()))


def sample_next(logits, temperature, top_p, top_k, key):
    """One token per row. logits [B, V] fp32; temperature/top_p [B] f32; top_k [B] i32
    (-1 = all); key [B] keys. Returns (token [B], logprob [B] of the temperature-scaled
    distribution before truncation, the quantity the trainer recomputes)."""
    greedy = temperature < GREEDY_BELOW
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]

    def truncated():
        # Sort once; keep the top-k and the smallest prefix whose mass reaches top-p.
        order = jnp.argsort(-scaled, axis=-1)
        sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        rank = jnp.arange(scaled.shape[-1])[None, :]
        keep = (mass_before < top_p[:, None]) & ((top_k[:, None] < 0) | (rank < top_k[:, None]))
        filtered = jnp.full_like(scaled, -jnp.inf)
        return jax.vmap(lambda f, o, v: f.at[o].set(v))(
            filtered, order, jnp.where(keep, sorted_logits, -jnp.inf))

    def sample():
        needs_truncation = jnp.any((top_p < 1.0) | (top_k > 0))
        candidates = jax.lax.cond(needs_truncation, truncated, lambda: scaled)
        # Inverse-CDF sampling: one uniform per row instead of a Gumbel draw per vocab entry
        # (B x V random bits per step would cost more than the model on small batches).
        probs = jax.nn.softmax(candidates, axis=-1)
        cdf = jnp.cumsum(probs, axis=-1)
        u = jax.vmap(lambda k: jax.random.uniform(k))(key) * cdf[:, -1]
        index = jnp.sum(cdf <= u[:, None], axis=-1)
        # never land on a token the filter removed (possible only through rounding at the edge)
        return jnp.where(jnp.take_along_axis(probs, jnp.minimum(index, scaled.shape[-1] - 1)[:, None],
                                             -1)[:, 0] > 0,
                         jnp.minimum(index, scaled.shape[-1] - 1), jnp.argmax(candidates, -1))

    argmax = jnp.argmax(scaled, axis=-1)
    sampled = jax.lax.cond(jnp.all(greedy), lambda: argmax, sample)
    token = jnp.where(greedy, argmax, sampled).astype(jnp.int32)
    logprob, _ = logprobs_of(scaled, token, with_entropy=False)
    return token, logprob


@struct.dataclass
class DecodeState:
    """Everything the decode loop carries, per row r of the batch: the sampling settings, the
    KV cache, the output so far. Lives on device between chunks."""

    step: jax.Array  # next output index (all rows advance together)
    token: jax.Array  # [B] last sampled token
    cache: dict  # {'k', 'v'} [L, B, K, S, H]
    tokens: jax.Array  # [B, L] output ids
    logprobs: jax.Array  # [B, L]
    count: jax.Array  # [B] tokens generated
    done: jax.Array  # [B]
    stopped: jax.Array  # [B] ended by a stop id (else by max_new, or not yet)
    prompt_lens: jax.Array  # [B]
    max_new: jax.Array  # [B]
    temperature: jax.Array  # [B]
    top_p: jax.Array  # [B]
    top_k: jax.Array  # [B]
    stop_ids: jax.Array  # [B, X]
    keys: jax.Array  # [B] PRNG keys


def _emit(model: Transformer, params, hidden, state: DecodeState, step):
    keys = jax.vmap(lambda k: jax.random.fold_in(k, step))(state.keys)
    logits = logits_from_hidden(model.cfg, params, hidden)
    token, logprob = sample_next(logits, state.temperature, state.top_p, state.top_k, keys)
    is_stop = jnp.any(token[:, None] == state.stop_ids, axis=-1)
    return token, logprob, is_stop


@functools.partial(jax.jit, static_argnames=("model", "max_steps"))
def prefill(model: Transformer, params, prompt_ids, prompt_lens, max_new, temperature, top_p,
            top_k, stop_ids, keys, max_steps: int) -> DecodeState:
    """Runs the prompts [B, P] (right-padded) through the model and samples token 0.

    prompt_lens, max_new [B] i32; temperature, top_p [B] f32; top_k [B] i32 (-1 = all);
    stop_ids [B, X] i32 (-1 = none); keys [B] PRNG keys; max_steps = L, the output capacity.
    """
    cfg = model.cfg
    b, p = prompt_ids.shape
    cache = init_cache(cfg, b, p + max_steps)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    hidden, cache = model.apply({"params": params}, prompt_ids, positions, cache=cache,
                                return_hidden=True)
    last = jnp.take_along_axis(hidden, (prompt_lens - 1)[:, None, None], axis=1)[:, 0]
    state = DecodeState(
        step=jnp.int32(1), token=jnp.zeros((b,), jnp.int32), cache=cache,
        tokens=jnp.zeros((b, max_steps), jnp.int32),
        logprobs=jnp.zeros((b, max_steps), jnp.float32), count=jnp.ones((b,), jnp.int32),
        done=jnp.zeros((b,), bool), stopped=jnp.zeros((b,), bool), prompt_lens=prompt_lens,
        max_new=max_new, temperature=temperature, top_p=top_p, top_k=top_k, stop_ids=stop_ids,
        keys=keys)
    token, logprob, is_stop = _emit(model, params, last, state, 0)
    return state.replace(token=token, tokens=state.tokens.at[:, 0].set(token),
                         logprobs=state.logprobs.at[:, 0].set(logprob), stopped=is_stop,
                         done=is_stop | (max_new <= 1))


@functools.partial(jax.jit, static_argnames=("model", "chunk"), donate_argnames=("state",))
def decode(model: Transformer, params, state: DecodeState, chunk: int) -> DecodeState:
    """Up to `chunk` more tokens per live row; returns early once every row is done.

    Decoding in chunks lets the host look in between (aborts, pauses, a weight swap) at the
    cost of one tiny device->host read per chunk.
    """
    capacity = state.tokens.shape[1]
    end = jnp.minimum(state.step + chunk, capacity)

    def cond(st: DecodeState):
        return (st.step < end) & ~jnp.all(st.done)

    def body(st: DecodeState):
        pos = (st.prompt_lens + st.step - 1)[:, None]
        hidden, cache = model.apply({"params": params}, st.token[:, None], pos, cache=st.cache,
                                    return_hidden=True)
        new, logprob, is_stop = _emit(model, params, hidden[:, 0], st, st.step)
        live = ~st.done
        count = st.count + live
        return st.replace(
            step=st.step + 1, token=new, cache=cache,
            tokens=st.tokens.at[:, st.step].set(jnp.where(live, new, 0)),
            logprobs=st.logprobs.at[:, st.step].set(jnp.where(live, logprob, 0.0)),
            count=count, stopped=st.stopped | (live & is_stop),
            done=st.done | (live & (is_stop | (count >= st.max_new))))

    state = jax.lax.while_loop(cond, body, state)
    # Rows cut by capacity (the bucket of max_new) count as done too.
    return state.replace(done=state.done | (state.step >= capacity))


class JaxSampler(RolloutEngine):
    """RolloutEngine over `prefill` + chunked `decode`, batching requests into bucketed shapes.

    params live on `mesh` (sharded by the logical rules); `update_weights` moves the trainer's
    params there device to device (a no-op when they already are) with no host round trip. A
    weight update lands between decode chunks: samples in flight continue on the new weights
    and report both versions (`info['weight_versions']` spans, as SGLang's `retract` does).
    `abort` ends samples between chunks, returning what they generated so far (finish
    'abort'), the basis of partial rollouts; `pause`/`resume` hold decoding between chunks.
    """

    def __init__(self, cfg: ModelConfig, params, *, mesh: Optional[Mesh] = None,
                 rules=parallel.DEFAULT_RULES, tokenizer=None, max_batch: int = 64,
                 min_prompt_bucket: int = 16, min_new_bucket: int = 16, decode_chunk: int = 64,
                 seed: int = 0, version: str = "0"):
        # Decoding always runs unrolled layers, whatever the trainer uses: each layer's cache
        # is then its own buffer, updated in place, where a scan would slice the stacked cache
        # in and out every step. Scanned params are unstacked on the way in.
        cfg = cfg.replace(scan_layers=False, remat="none")
        self.cfg = cfg
        self.mesh = mesh or parallel.make_mesh({}, devices=jax.devices()[:1])
        self.model = Transformer(cfg, mesh=self.mesh, rules=rules)
        abstract, names = parallel.logical_axes_of(self.model, np.zeros((1, 1), np.int32))
        self._shardings = parallel.param_shardings(abstract, names, self.mesh, rules)
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.min_prompt_bucket, self.min_new_bucket = min_prompt_bucket, min_new_bucket
        self.decode_chunk = decode_chunk
        self._seed = seed
        self._counter = itertools.count()
        self._weights_lock = threading.Lock()
        self._device_lock = threading.Lock()  # one batch on the device at a time
        self._params = jax.device_put(unstack_layers(params, cfg.num_layers), self._shardings)
        self._version = str(version)
        self._resume = threading.Event()
        self._resume.set()
        self._control_lock = threading.Lock()
        self._aborted_ids: set[str] = set()
        self._abort_epoch = 0  # batches admitted in an earlier epoch are aborted
        default_stops = tuple(cfg.eos_token_ids)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            default_stops = tuple(dict.fromkeys(default_stops + (tokenizer.eos_token_id,)))
        self.eos_ids = default_stops

    # -- RolloutEngine -------------------------------------------------------------------

    @property
    def weight_version(self) -> Optional[str]:
        return self._version

    def health(self) -> bool:
        return self._params is not None

    def update_weights(self, params, version: str) -> None:
        # unstack scanned layers, and reshard if the trainer's mesh differs: device to device
        params = jax.device_put(unstack_layers(params, self.cfg.num_layers), self._shardings)
        with self._weights_lock:
            self._params, self._version = params, str(version)

    def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        rows = [(req, k) for req in requests for k in range(req.sampling.n)]
        for req, _ in rows:
            self._check(req)
        with self._control_lock:
            epoch = self._abort_epoch
        results: list[GenerateResult] = []
        for start in range(0, len(rows), self.max_batch):
            results.extend(self._generate_batch(rows[start:start + self.max_batch], epoch))
        with self._control_lock:  # these requests are over: forget their abort marks
            self._aborted_ids.difference_update(req.request_id for req in requests)
        return results

    # -- control (between decode chunks) --------------------------------------------------

    def abort(self, request_id: Optional[str] = None) -> None:
        """Ends the request with this id, or every request admitted so far (None)."""
        with self._control_lock:
            if request_id is None:
                self._abort_epoch += 1
            else:
                self._aborted_ids.add(str(request_id))

    def pause(self) -> None:
        self._resume.clear()

    def resume(self) -> None:
        self._resume.set()

    # -- internals -----------------------------------------------------------------------

    def _check(self, req: GenerateRequest):
        if len(req.prompt_ids) == 0:
            raise ValueError("empty prompt: a request needs at least one prompt token")
        bad = [t for t in req.prompt_ids if not 0 <= int(t) < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocab "
                             f"[0, {self.cfg.vocab_size})")
        if req.sampling.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: build the sampler with tokenizer=")

    def _weights(self):
        with self._weights_lock:
            return self._params, self._version

    def _aborted_rows(self, rows, epoch: int, b: int) -> np.ndarray:
        with self._control_lock:
            all_aborted = epoch < self._abort_epoch
            ids = set(self._aborted_ids)
        out = np.zeros((b,), bool)
        for i, (req, _) in enumerate(rows):
            out[i] = all_aborted or (req.request_id is not None and req.request_id in ids)
        return out

    def _generate_batch(self, rows, epoch: int) -> list[GenerateResult]:
        n = len(rows)
        b = _next_power_of_two(n, 1)
        longest = max(len(req.prompt_ids) for req, _ in rows)
        p = _next_power_of_two(longest, self.min_prompt_bucket)
        steps = _next_power_of_two(max(max(req.sampling.max_new_tokens, 1) for req, _ in rows),
                                   self.min_new_bucket)
        ids = np.zeros((b, p), np.int32)
        lens = np.ones((b,), np.int32)
        max_new = np.ones((b,), np.int32)
        temperature = np.zeros((b,), np.float32)
        top_p = np.ones((b,), np.float32)
        top_k = np.full((b,), -1, np.int32)
        stops = [self._stop_ids(req) for req, _ in rows]
        stop_ids = np.full((b, max(1, max(len(s) for s in stops))), -1, np.int32)
        seeds = np.zeros((b,), np.uint32)
        for i, (req, k) in enumerate(rows):
            s = req.sampling
            ids[i, :len(req.prompt_ids)] = req.prompt_ids
            lens[i], max_new[i] = len(req.prompt_ids), max(s.max_new_tokens, 1)
            temperature[i], top_p[i], top_k[i] = s.temperature, s.top_p, s.top_k
            stop_ids[i, :len(stops[i])] = stops[i]
            seed = s.seed if s.seed is not None else hash((self._seed, next(self._counter)))
            seeds[i] = np.uint32(hash((seed, k)) & 0xFFFFFFFF)
        keys = jax.vmap(jax.random.key)(jnp.asarray(seeds))
        aborted = np.zeros((b,), bool)
        with self._device_lock:
            self._resume.wait()
            params, version = self._weights()
            state = prefill(self.model, params, ids, lens, max_new, temperature, top_p, top_k,
                            stop_ids, keys, max_steps=steps)
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
                params, version = self._weights()
                if version != spans[-1][0]:
                    spans.append((version, int(state.step)))
                state = decode(self.model, params, state, chunk=self.decode_chunk)
        tokens, logprobs, count, stopped = (np.asarray(x) for x in (
            state.tokens, state.logprobs, state.count, state.stopped))
        return [self._result(rows[i][0], tokens[i, :count[i]], logprobs[i, :count[i]],
                             bool(stopped[i]), bool(aborted[i]), spans) for i in range(n)]

    def _stop_ids(self, req: GenerateRequest) -> tuple[int, ...]:
        s = req.sampling
        if s.ignore_eos:  # SGLang: ignore_eos turns off every token-based stop, not just eos
            return ()
        return tuple(dict.fromkeys(tuple(s.stop_token_ids) + self.eos_ids))

    def _result(self, req, tokens, logprobs, stopped, aborted, spans) -> GenerateResult:
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
                              prompt_tokens=len(req.prompt_ids), info={"weight_versions": used})

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
