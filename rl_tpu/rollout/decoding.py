"""The embedded sampler's device programs: `prefill` and chunked KV-cache `decode`, and the
draw of a token from the trainer's own distribution.

Shape letters: B batch (rows = samples), P prompt length (bucketed), L new tokens (bucketed),
S = P + L cache slots, V vocab, X stop ids per row, NB x BS the vocab in blocks (two-level draw).

Sampling parameters (greedy, temperature, top-p and top-k, stop token ids, min_new_tokens and
max_new_tokens) are per-row *arrays*, not compile-time constants, so one compiled prefill and
one compiled decode per (B, P, L) bucket serve every mix of them. Prompts are right-padded; row
r's token at position p sits in cache slot p, so rows of different prompt lengths decode side
by side with no left padding. Decode is a `lax.while_loop` over up to `chunk` tokens that ends
as soon as every row has stopped.

A mixture-of-experts policy's samples also record which experts routed every token they
computed (`DecodeState.experts`), for the trainer to replay that routing (R3, arXiv
2510.11370: the learner's router would otherwise pick other experts for some tokens than the
ones that sampled them, and the ratios of those tokens are off); a dense model carries none.

Log-probs are computed exactly as the trainer computes them (`rl_tpu.models.logprobs`): the
final hidden state through `logits_from_hidden`, divided by the temperature, log-softmax
('full' convention: before top-p/top-k truncation). Tokens are drawn from exactly that
distribution (renormalised over the kept tokens when truncated): a Gumbel-max draw in two
levels, see `sample_next`. `JaxSampler` (sampler.py) drives these programs.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import math
import threading
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rl_tpu.models.logprobs import logits_from_hidden, logprobs_of
from rl_tpu.models.moe import sown_routing
from rl_tpu.models.transformer import ModelConfig, Transformer, cache_slots, init_cache
from rl_tpu.rollout import compile_count
from rl_tpu.rollout.prefix_cache import gather_pages

GREEDY_BELOW = 1e-6  # SGLang's convention: a temperature below this means greedy


def gumbel_from_bits(hi, lo):
    """Standard Gumbel variates from two uint32 words each (any shape): g = -log(E), E ~ Exp(1).

    What decides a Gumbel-max draw is the upper tail of g, i.e. E near 0. `E = -log(U)` with a
    float32 uniform U (steps of 2^-23 below 1) stops at E = 2^-23, g <= 15.9, so each entry
    loses the draws it would win only with a larger g: up to ~1.2e-7 of probability apiece,
    which adds up over sqrt(V) or V entries. Here W = 1 - U carries 56 random bits in floating
    point (the top 24 exactly, the next 32 below them), so E = -log1p(-W) keeps full relative
    precision down to 2^-56 and g reaches 38.8: the tail cut is P(g > 38.8) ~ 1e-17 per entry.
    """
    v = (hi >> 8).astype(jnp.float32) * 2.0 ** -24 + lo.astype(jnp.float32) * 2.0 ** -56
    # v rounds up to 1.0 with probability 2^-25 (E = inf, g = -inf would lose even as the one
    # candidate left): clamp to the largest uniform below 1, a shift far below fp32 precision.
    v = jnp.minimum(v, 1.0 - 2.0 ** -24)
    return -jnp.log(-jnp.log1p(-v))


def _gumbel_argmax(scores, gumbel):
    """scores [B, N] log-weights (-inf = never), gumbel [B, N] standard Gumbel noise -> [B]
    index drawn with prob softmax(scores)."""
    noisy = scores + gumbel
    # -inf + inf (a zero exponential, p = 2^-56) would be nan, which argmax would pick
    return jnp.argmax(jnp.where(scores > -jnp.inf, noisy, -jnp.inf), axis=-1)


def _block_size(v: int) -> int:
    """BS: the power of two at or above sqrt(V), so both levels of the draw are ~sqrt(V) wide."""
    return 1 << max(0, math.ceil(math.log2(math.sqrt(v))))


def two_level_logits(logits):
    """logits [B, V] (-inf = removed) -> (block log-masses [B, NB], logits in blocks
    [B, NB, BS], V padded to NB x BS with -inf). Token `NB_index * BS + j` is drawn with
    probability softmax(block log-masses)[NB_index] x softmax(block NB_index)[j], which is
    softmax(logits) up to the rounding of the block logsumexps (~1e-7 relative)."""
    b, v = logits.shape
    bs = _block_size(v)
    nb = -(-v // bs)
    # centred on the row max: scores stay O(1), where fp32 adds Gumbel noise most precisely
    top = jnp.max(logits, axis=-1, keepdims=True)
    padded = jnp.pad(logits - top, ((0, 0), (0, nb * bs - v)), constant_values=-jnp.inf)
    blocks = padded.reshape(b, nb, bs)
    return jax.nn.logsumexp(blocks, axis=-1), blocks


def draw_from_logits(logits, keys):
    """One exact draw per row from softmax(logits [B, V]); keys [B]. Returns tokens [B] i32.

    Gumbel-max (argmax of logits + Gumbel noise is an exact draw) in two levels: a block by
    Gumbel-max over the NB block log-masses, then a token inside it by Gumbel-max over its BS
    logits. That needs NB + BS ~ 2 sqrt(V) noise values per row instead of V, and no
    cumulative sum, whose fp32 rounding (not even monotone at V = 152k) and the uniform's 2^-23
    steps made the former inverse-CDF draw differ from the reported distribution by 1.5e-3 to
    2.4e-3 in total variation at V = 152k (now < 1e-6; tests/rollout/test_sampler.py).
    """
    block_logits, blocks = two_level_logits(logits)
    nb = block_logits.shape[1]
    # one draw of bits a row for both levels (disjoint columns: independent noise): each
    # threefry call is ~0.25 s of a program's compile on a CPU, and this one runs in both
    # prefill and decode
    bits = jax.vmap(lambda k: jax.random.bits(k, (2, nb + blocks.shape[2]), jnp.uint32))(keys)
    gumbel = gumbel_from_bits(bits[:, 0], bits[:, 1])  # [B, NB + BS]
    block = _gumbel_argmax(block_logits, gumbel[:, :nb])
    inside = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]  # [B, BS]
    token = _gumbel_argmax(inside, gumbel[:, nb:])
    return (block * blocks.shape[-1] + token).astype(jnp.int32)


def truncate(scaled, top_p, top_k):
    """scaled logits [B, V] -> the same with every token outside the top-k [B] (-1 = all) and
    outside the smallest prefix of mass >= top-p [B] set to -inf."""
    order = jnp.argsort(-scaled, axis=-1)  # sort once for both
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    rank = jnp.arange(scaled.shape[-1])[None, :]
    # top_p = 1 keeps all: in fp32 the mass before the last tokens can round up to 1.0, which
    # would drop them from a row that asked for no top-p (it shares the batch with one that did)
    keep = (((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))
            & ((top_k[:, None] < 0) | (rank < top_k[:, None])))
    filtered = jnp.full_like(scaled, -jnp.inf)
    return jax.vmap(lambda f, o, v: f.at[o].set(v))(
        filtered, order, jnp.where(keep, sorted_logits, -jnp.inf))


def sample_next(logits, temperature, top_p, top_k, key):
    """One token per row. logits [B, V] fp32; temperature/top_p [B] f32; top_k [B] i32
    (-1 = all); key [B] keys. Returns (token [B], logprob [B] of the temperature-scaled
    distribution before truncation, the quantity the trainer recomputes).

    The token is an exact draw from softmax(logits / T) restricted to the top-k tokens and the
    smallest top-p prefix (renormalised); greedy rows (T < 1e-6) take the argmax.
    """
    greedy = temperature < GREEDY_BELOW
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]

    def sample():
        needs_truncation = jnp.any((top_p < 1.0) | (top_k > 0))
        candidates = jax.lax.cond(needs_truncation, lambda: truncate(scaled, top_p, top_k),
                                  lambda: scaled)
        return draw_from_logits(candidates, key)

    argmax = jnp.argmax(scaled, axis=-1)
    sampled = jax.lax.cond(jnp.all(greedy), lambda: argmax.astype(jnp.int32), sample)
    token = jnp.where(greedy, argmax, sampled).astype(jnp.int32)
    logprob, _ = logprobs_of(scaled, token, with_entropy=False)
    return token, logprob


def ban_tokens(logits, ids, active):
    """logits [B, V] with the ids [B, X] (-1 = none) of rows where `active` [B] set to -inf."""
    b, v = logits.shape
    cols = jnp.where((ids >= 0) & (ids < v) & active[:, None], ids, v)  # v: dropped
    return logits.at[jnp.arange(b)[:, None], cols].set(-jnp.inf, mode="drop")


@struct.dataclass
class DecodeState:
    """Everything the decode loop carries, per row r of the batch: the sampling settings, the
    KV cache, the output so far. Lives on device between chunks."""

    step: jax.Array  # decode iterations run + 1 (a batch's next output index; see `decode`)
    token: jax.Array  # [B] last sampled token
    cache: dict  # {'k', 'v'} [L, B, K, S, H]
    tokens: jax.Array  # [B, L] output ids
    logprobs: jax.Array  # [B, L]
    count: jax.Array  # [B] tokens generated
    done: jax.Array  # [B]
    stopped: jax.Array  # [B] ended by a stop id (else by max_new, or not yet)
    prompt_lens: jax.Array  # [B]
    max_new: jax.Array  # [B]
    min_new: jax.Array  # [B] no stop id may be sampled at output index < min_new
    temperature: jax.Array  # [B]
    top_p: jax.Array  # [B]
    top_k: jax.Array  # [B]
    stop_ids: jax.Array  # [B, X] ids that end a sample (-1 = none)
    ban_ids: jax.Array  # [B, X] ids masked before min_new (eos + stop_token_ids, -1 = none)
    keys: jax.Array  # [B] PRNG keys
    adapter: jax.Array  # [B] i32 the LoRA slot each row samples with (a serving model's; 0)
    # [B, S, sparse layers, k] i32, a mixture of experts' only (None: dense): experts[r, p] are
    # the experts that routed row r's token at position p in the forward pass that computed
    # its K/V here; -1 where this state computed none (a reused prefix, positions not reached,
    # and the last sampled token, never fed back)
    experts: Optional[jax.Array] = None


def routing_shape(cfg: ModelConfig) -> Optional[tuple[int, int]]:
    """(sparse layers, k) of the experts a token of this model is routed to; None for a dense
    model (or one whose layers are all dense), whose programs then record nothing."""
    if cfg.moe is None or not cfg.moe.sparse_layers(cfg.num_layers):
        return None
    return len(cfg.moe.sparse_layers(cfg.num_layers)), cfg.moe.top_k


def empty_experts(cfg: ModelConfig, rows: int, slots: int) -> Optional[jax.Array]:
    """`DecodeState.experts` of rows that have computed nothing yet (None: a dense model)."""
    shape = routing_shape(cfg)
    return None if shape is None else jnp.full((rows, slots) + shape, -1, jnp.int32)


def row_routing(cfg: ModelConfig, experts: Optional[np.ndarray], length: int
                ) -> Optional[np.ndarray]:
    """`GenerateResult.routed_experts` of a row: its `DecodeState.experts` [S, ...] (on the
    host; None: a row that never ran, all -1) at its sequence's first `length` positions,
    prompt_ids + output_ids but the last output id (sampled, never fed: nothing routed it);
    None for a dense model. (max_new_tokens=0 reports no output: the prompt's own last id
    then has no row either.)"""
    shape = routing_shape(cfg)
    if shape is None:
        return None
    if experts is None:
        return np.full((length,) + shape, -1, np.int32)
    # a copy: a view would keep the whole batch's buffer alive as long as the result
    return np.array(experts[:length], np.int32)


def _forward(model: Transformer, params, ids, positions, cache, adapter):
    """(final hidden [B, T, D], the cache with ids' K/V written, the experts that routed each
    token [B, T, sparse layers, k] i32, or None for a dense model). A dense model's call is
    the plain apply: its programs stay what they were, no routing collected."""
    if routing_shape(model.cfg) is None:
        hidden, cache = model.apply({"params": params}, ids, positions, cache=cache,
                                    return_hidden=True, adapter_rows=adapter)
        return hidden, cache, None
    (hidden, cache), sown = model.apply({"params": params}, ids, positions, cache=cache,
                                        return_hidden=True, adapter_rows=adapter,
                                        mutable=["intermediates"])
    _, experts = sown_routing(sown["intermediates"], model.cfg.num_layers)
    return hidden, cache, experts.reshape(ids.shape + experts.shape[1:])


def _write_experts(buffer, experts, positions, valid):
    """buffer [B, S, ...] with experts [B, T, ...] written at positions [B, T] where valid
    [B, T]; the rest is dropped (padding must not overwrite a real token's routing)."""
    rows = jnp.arange(buffer.shape[0])[:, None]
    at = jnp.where(valid, positions, buffer.shape[1])  # past the buffer: dropped
    return buffer.at[rows, at].set(experts, mode="drop")


def _emit(model: Transformer, params, hidden, state: DecodeState, index):
    """The next token of each row at output index `index` [B] (its own count: rows of a
    continuous batch are at different indices; the key of a row's token depends on its index
    alone, so a row draws the same tokens whatever batch it runs in)."""
    keys = jax.vmap(jax.random.fold_in)(state.keys, index)
    logits = logits_from_hidden(model.cfg, params, hidden)
    # min_new_tokens as SGLang's MinNewTokensPenalizer: the stop ids' logits are -inf until
    # `min_new` tokens exist, so the reported logprob is then that of the penalised
    # distribution, exactly as SGLang reports it (the trainer, which applies no penalty, sees a
    # ratio != 1 on those tokens: the price of the constraint).
    logits = ban_tokens(logits, state.ban_ids, index < state.min_new)
    token, logprob = sample_next(logits, state.temperature, state.top_p, state.top_k, keys)
    is_stop = jnp.any(token[:, None] == state.stop_ids, axis=-1)
    return token, logprob, is_stop


def _prompt_hidden(model: Transformer, params, prompt_ids, positions, cache, last, chunk: int,
                   adapter):
    """(hidden [B, D] of each row's token at index last [B] of prompt_ids [B, P], the cache
    with every prompt token's K/V written at positions [B, P], the experts that routed every
    prompt token [B, P, sparse layers, k], or None for a dense model).

    chunk > 0 (dividing P): the prompt runs `chunk` tokens at a time in a scan, each chunk
    attending to the cache the chunks before it wrote: the same attention over the same slots
    (every query sees slots <= its position), holding one chunk's activations, [B, C, F] in
    the MLP and [B, K, G*C, S] logits, not the whole prompt's.
    """
    b, t = prompt_ids.shape
    if not chunk or t <= chunk:
        hidden, cache, experts = _forward(model, params, prompt_ids, positions, cache, adapter)
        return jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0], cache, experts
    if t % chunk:
        raise ValueError(f"prefill chunk {chunk} does not divide the prompt bucket {t}; use a "
                         f"power of two (prompt buckets are powers of two)")
    n = t // chunk

    def one_chunk(carry, xs):
        cache, picked = carry
        k, ids, pos = xs
        hidden, cache, experts = _forward(model, params, ids, pos, cache, adapter)
        local = last - k * chunk  # the wanted token's index inside this chunk, if it is here
        here = (local >= 0) & (local < chunk)
        mine = jnp.take_along_axis(hidden, jnp.clip(local, 0, chunk - 1)[:, None, None],
                                   axis=1)[:, 0]
        return (cache, jnp.where(here[:, None], mine, picked)), experts

    split = lambda x: x.reshape(b, n, chunk).swapaxes(0, 1)  # noqa: E731  [n, B, C]
    picked = jnp.zeros((b, model.cfg.hidden_size), model.cfg.compute_dtype)
    (cache, picked), experts = jax.lax.scan(one_chunk, (cache, picked),
                                            (jnp.arange(n), split(prompt_ids), split(positions)))
    if experts is not None:  # [n, B, C, ...] -> [B, P, ...]
        experts = experts.swapaxes(0, 1).reshape((b, t) + experts.shape[3:])
    return picked, cache, experts


@functools.partial(jax.jit, static_argnames=("model", "max_steps", "chunk"))
def prefill(model: Transformer, params, prompt_ids, prompt_lens, max_new, min_new, temperature,
            top_p, top_k, stop_ids, ban_ids, keys, adapter=None, *, max_steps: int,
            starts=None, pool=None, page_table=None, chunk: int = 0) -> DecodeState:
    """Runs the prompts [B, P] (right-padded) through the model and samples token 0.

    prompt_lens, max_new, min_new [B] i32; temperature, top_p [B] f32; top_k [B] i32 (-1 =
    all); stop_ids, ban_ids [B, X] i32 (-1 = none); keys [B] PRNG keys; adapter [B] i32 each
    row's LoRA slot (a serving model's `lora.slots`; None: 0, else unused); max_steps = L, the
    output capacity.

    Prefix reuse: with `pool`, the first starts[r] [B] prompt tokens of row r have K/V in the
    pool's pages page_table [B, S / PS] (S = P + L slots, `prefix_cache.gather_pages`), and
    prompt_ids [B, Q] hold only the rest, run at positions starts[r] + 0..Q-1.

    chunk: prefill `chunk` prompt tokens at a time (0 = the whole prompt at once), see
    `_prompt_hidden`.

    A mixture of experts' state records the prompt tokens' experts at their positions, those
    of a reused prefix left -1 (computed by an earlier call, whose routing is not kept).
    """
    b, t = prompt_ids.shape
    adapter = jnp.zeros((b,), jnp.int32) if adapter is None else adapter
    if pool is None:
        cache, starts = init_cache(model.cfg, b, t + max_steps), jnp.zeros((b,), jnp.int32)
    else:
        cache = gather_pages(pool, page_table)
    # Padding past a row's prompt writes slots >= its length (clamped into the cache), which
    # decode overwrites before any query can see them.
    positions = jnp.minimum(starts[:, None] + jnp.arange(t, dtype=jnp.int32),
                            cache_slots(cache) - 1)
    last, cache, prompt_experts = _prompt_hidden(model, params, prompt_ids, positions, cache,
                                                 prompt_lens - starts - 1, chunk, adapter)
    experts = empty_experts(model.cfg, b, cache_slots(cache))
    if experts is not None:
        real = jnp.arange(t)[None, :] < (prompt_lens - starts)[:, None]
        experts = _write_experts(experts, prompt_experts, positions, real)
    state = DecodeState(
        step=jnp.int32(1), token=jnp.zeros((b,), jnp.int32), cache=cache,
        tokens=jnp.zeros((b, max_steps), jnp.int32),
        logprobs=jnp.zeros((b, max_steps), jnp.float32), count=jnp.ones((b,), jnp.int32),
        done=jnp.zeros((b,), bool), stopped=jnp.zeros((b,), bool), prompt_lens=prompt_lens,
        max_new=max_new, min_new=min_new, temperature=temperature, top_p=top_p, top_k=top_k,
        stop_ids=stop_ids, ban_ids=ban_ids, keys=keys, adapter=adapter, experts=experts)
    token, logprob, is_stop = _emit(model, params, last, state, jnp.zeros((b,), jnp.int32))
    return state.replace(token=token, tokens=state.tokens.at[:, 0].set(token),
                         logprobs=state.logprobs.at[:, 0].set(logprob), stopped=is_stop,
                         done=is_stop | (max_new <= 1))


@functools.partial(jax.jit, static_argnames=("model",), donate_argnames=("state",))
def decode(model: Transformer, params, state: DecodeState, chunk, min_chunk=None
           ) -> DecodeState:
    """Up to `chunk` more tokens per live row; returns early once every row is done, and, with
    `min_chunk`, once a row has ended after at least min_chunk steps (both traced: one program
    serves every value).

    Each row advances from its own output index, `count` (its token at index count - 1 sits
    at position prompt_len + count - 1): rows admitted at different times decode side by side
    (continuous.py); in a batch that started together every live row's count is `step`.
    Decoding in chunks lets the host look in between (aborts, pauses, a weight swap, rows
    joining and leaving) at the cost of one tiny device->host read per chunk.

    A mixture of experts' live rows record the experts of the token each step feeds (their
    last sampled one) at its position; done rows, whose step only recomputes, record nothing.
    """
    capacity = state.tokens.shape[1]
    rows = jnp.arange(state.tokens.shape[0])

    min_chunk = chunk if min_chunk is None else min_chunk

    def cond(carry):
        i, st = carry
        ended = jnp.any(st.done & ~state.done)  # a row that was live when the chunk began
        return (i < chunk) & ~jnp.all(st.done) & ~((i >= min_chunk) & ended)

    def body(carry):
        i, st = carry
        pos = (st.prompt_lens + st.count - 1)[:, None]
        hidden, cache, experts = _forward(model, params, st.token[:, None], pos, st.cache,
                                          st.adapter)
        new, logprob, is_stop = _emit(model, params, hidden[:, 0], st, st.count)
        live = ~st.done
        if experts is not None:
            st = st.replace(experts=_write_experts(st.experts, experts, pos, live[:, None]))
        at = jnp.where(live, st.count, capacity)  # done rows write nothing (dropped)
        count = st.count + live
        return i + 1, st.replace(
            step=st.step + 1, token=jnp.where(live, new, st.token), cache=cache,
            tokens=st.tokens.at[rows, at].set(new, mode="drop"),
            logprobs=st.logprobs.at[rows, at].set(logprob, mode="drop"),
            count=count, stopped=st.stopped | (live & is_stop),
            # max_new <= capacity (the sampler's bucket, the pool's slots); the capacity term
            # keeps a row that asked for more from writing past its buffer all the same
            done=st.done | (live & (is_stop | (count >= jnp.minimum(st.max_new, capacity)))))

    _, state = jax.lax.while_loop(cond, body, (jnp.int32(0), state))
    return state


_AHEAD = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rl_tpu-decode-ahead")


class DecodeAhead:
    """Compiles the `decode` a batch will run on a background thread while its `prefill`
    compiles on the caller's, so that a new bucket's first batch waits for the longer of the
    two compiles instead of their sum (a first rollout's largest cost on a CPU: ~1 s and ~2 s
    at the peer shape). XLA releases the GIL while it compiles.

    decode's program depends on the shardings of prefill's outputs, which XLA decides as it
    compiles prefill; on a one-device mesh every one is that device, replicated, so the state
    is lowered with that sharding and jit's cache serves the real call. On a larger mesh
    (a tensor-parallel sampler) the guess could be wrong and cost a second compile, so
    nothing is compiled ahead there.
    """

    def __init__(self, mesh: Mesh):
        self._sharding = NamedSharding(mesh, PartitionSpec()) if mesh.size == 1 else None
        self._lock = threading.Lock()
        self._started: set = set()  # prefill input signatures whose decode was compiled
        self._pending: list[concurrent.futures.Future] = []

    def start(self, model: Transformer, params, prefill_call: functools.partial,
              chunk: int) -> None:
        """Compiles, once per prefill input signature, `decode(model, params, state,
        chunk=chunk)` for the state `prefill_call()` (a partial of `prefill`) will return."""
        if self._sharding is None:
            return
        key = repr(jax.tree.map(  # arrays by shape and dtype, static arguments by value
            lambda x: (x.shape, str(x.dtype)) if hasattr(x, "shape") else x,
            (prefill_call.args[2:], prefill_call.keywords)))
        with self._lock:
            if key in self._started:
                return
            self._started.add(key)
        state = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self._sharding),
            # the jitted function's own eval_shape: its trace is the one the call reuses
            prefill_call.func.eval_shape(*prefill_call.args, **prefill_call.keywords))
        counter = compile_count.active()  # the compile counts where the caller's would

        def compile_decode():
            with counter.counting() if counter else contextlib.nullcontext():
                decode.lower(model, params, state, chunk=chunk).compile()

        future = _AHEAD.submit(compile_decode)
        with self._lock:
            self._pending.append(future)

    @property
    def started(self) -> int:
        """How many decode programs were compiled ahead here."""
        with self._lock:
            return len(self._started)

    def wait(self) -> None:
        """Blocks until every decode compile started here is done (before a decode call, so
        that one program is never compiled on two threads at once); raises its error."""
        with self._lock:
            pending, self._pending = self._pending, []
        for future in pending:
            future.result()
