"""Prefix reuse in the embedded sampler: multi-turn episodes prefill only their new suffix, with
the same tokens and log-probs (1e-4) as a sampler that re-prefills everything."""

import threading

import jax
import numpy as np
import pytest

from rl_tpu import parallel
from rl_tpu.models import hf, tiny
from rl_tpu.models.logprobs import token_logprobs
from rl_tpu.models.transformer import Transformer
from rl_tpu.core.engine import GenerateRequest, SamplingParams
from rl_tpu.rollout.prefix_cache import PrefixCache, chain_hashes
from rl_tpu.rollout.decoding import prefill
from rl_tpu.rollout.sampler import JaxSampler


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix")
    tiny.write_tiny_model(str(root / "a"), "qwen3", vocab_size=320, seed=0)
    tiny.write_tiny_model(str(root / "b"), "qwen3", vocab_size=320, seed=1)
    cfg, params = hf.load(str(root / "a"))
    _, params_b = hf.load(str(root / "b"))
    return dict(cfg=cfg, params=params, params_b=params_b,
                plain=JaxSampler(cfg, params, prefix_cache_tokens=0, version="0"))


def play(sampler, turns=4, episodes=(37, 21, 50), new=10, obs=(18, 9, 25), temperature=0.0,
         seed=0, decode_chunk_abort=None):
    """Episodes of `turns` turns: each turn one generate call over all episodes (their whole
    histories, of different lengths), then an 'observation' of obs[e] fresh ids appended.
    Returns (histories, per-turn results)."""
    rng = np.random.RandomState(seed)
    histories = [list(rng.randint(1, 320, n)) for n in episodes]
    results = []
    for turn in range(turns):
        out = sampler.generate([GenerateRequest(h, SamplingParams(
            max_new_tokens=new, temperature=temperature, ignore_eos=True, seed=100 * turn + e))
            for e, h in enumerate(histories)])
        results.append(out)
        for e, res in enumerate(out):
            histories[e] += res.output_ids + list(rng.randint(1, 320, obs[e % len(obs)]))
    return histories, results


def assert_same(a, b, atol=1e-4):
    for turn_a, turn_b in zip(a, b):
        for x, y in zip(turn_a, turn_b):
            assert x.output_ids == y.output_ids
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=atol)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_multi_turn_reuse_is_exact_and_prefills_only_the_suffix(model, temperature):
    reuse = JaxSampler(model["cfg"], model["params"], version="0")
    before = model["plain"].stats()
    hist, with_reuse = play(reuse, temperature=temperature)
    _, without = play(model["plain"], temperature=temperature)
    assert_same(with_reuse, without)
    stats, plain = reuse.stats(), model["plain"].stats()
    computed = plain["prefill_tokens"] - before["prefill_tokens"]
    assert stats["prompt_tokens"] == computed  # the same prompts...
    assert stats["reused_tokens"] > 0 and stats["prefill_tokens"] < computed / 2  # ...less work
    assert stats["prefill_tokens"] + stats["reused_tokens"] == stats["prompt_tokens"]
    assert stats["cache_hits"] == 3 * 3  # every row of turns 1..3
    # each turn's entry extends (and replaces) the one before it: one entry per episode
    assert stats["cache_entries"] == 3
    # and the behaviour log-probs are the trainer's (fp32) on the final histories
    obs = (18, 9, 25)
    for e, h in enumerate(hist):
        lp, _ = token_logprobs(Transformer(model["cfg"]), model["params"],
                               {"tokens": np.array([h], np.int32)})
        for turn in range(4):  # turn t's outputs sit before the observations of turns >= t
            res = with_reuse[turn][e]
            end = len(h) - obs[e] - sum(len(r[e].output_ids) + obs[e]
                                        for r in with_reuse[turn + 1:])
            np.testing.assert_allclose(res.logprobs, np.asarray(lp)[0, end - 10:end],
                                       atol=1e-4)


def test_turn_suffix_compiles_once_per_bucket(model):
    reuse = JaxSampler(model["cfg"], model["params"])
    play(reuse, turns=2)
    sizes = prefill._cache_size()
    # more turns in the same (B, Q, P, L) buckets and pool size: nothing new to compile
    play(reuse, turns=3, episodes=(38, 22, 51), seed=1)
    assert prefill._cache_size() - sizes <= 1  # at most P's next bucket (128)


def test_weight_update_drops_the_cache_unless_kept(model):
    dropping = JaxSampler(model["cfg"], model["params"], version="0")
    keeping = JaxSampler(model["cfg"], model["params"], version="0",
                         keep_prefix_cache_on_update=True)
    for sampler in (dropping, keeping):
        play(sampler, turns=1)
        assert sampler.stats()["cache_entries"] == 3
        sampler.update_weights(model["params_b"], "1")
    assert dropping.stats()["cache_entries"] == 0 and dropping.stats()["cache_flushes"] == 1
    assert keeping.stats()["cache_entries"] == 3
    # after the update, dropping re-prefills everything and matches a fresh sampler of b
    fresh = JaxSampler(model["cfg"], model["params_b"], prefix_cache_tokens=0)
    _, got = play(dropping, turns=2)
    _, want = play(fresh, turns=2)
    assert_same(got, want)
    reused = dropping.stats()["reused_tokens"]
    play(dropping, turns=1, seed=5)  # unrelated prompts: nothing to reuse
    assert dropping.stats()["reused_tokens"] == reused
    dropping.flush_cache()
    assert dropping.stats()["cache_entries"] == 0


def test_update_between_chunks_saves_nothing_stale(model):
    """Weights change while a batch decodes: its K/V span two versions, so it is not cached."""
    sampler = JaxSampler(model["cfg"], model["params"], decode_chunk=4)
    import rl_tpu.rollout.sampler as sampler_module
    real, swapped = sampler_module.decode, []

    def decode_then_swap(*args, **kwargs):
        out = real(*args, **kwargs)
        if not swapped:
            swapped.append(1)
            sampler.update_weights(model["params_b"], "b")
        return out

    sampler_module.decode = decode_then_swap
    try:
        [res] = sampler.generate([GenerateRequest(list(range(1, 40)), SamplingParams(
            max_new_tokens=12, temperature=0.0, ignore_eos=True))])
    finally:
        sampler_module.decode = real
    assert [s["version"] for s in res.info["weight_versions"]] == ["0", "b"]
    assert sampler.stats()["cache_entries"] == 0


def test_bounded_cache_evicts_lru_and_stays_exact(model):
    """A pool of 8 pages (128 tokens) cannot hold three growing episodes: entries are evicted
    least recently used first, the pool never exceeds its bound, and outputs stay exact."""
    small = JaxSampler(model["cfg"], model["params"], prefix_cache_tokens=128)
    _, got = play(small, turns=4)
    _, want = play(model["plain"], turns=4)
    assert_same(got, want)
    stats = small.stats()
    assert stats["cache_pages"] <= 8 and stats["cache_pages_used"] <= 8
    assert stats["cache_evictions"] > 0 and stats["cache_tokens_used"] <= 128


def test_abort_then_resume_reuses_the_partial_turn(model):
    """A turn aborted between chunks (a partial rollout) is cached as far as it got; the
    request that resumes it reuses that and continues exactly."""
    sampler = JaxSampler(model["cfg"], model["params"], decode_chunk=4)
    prompt = list(np.random.RandomState(3).randint(1, 320, 45))
    sampler.pause()
    out = {}
    worker = threading.Thread(target=lambda: out.update(r=sampler.generate([GenerateRequest(
        prompt, SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True),
        request_id="r")])))
    worker.start()
    worker.join(timeout=0.5)
    sampler.abort("r")
    sampler.resume()
    worker.join(timeout=120)
    [partial] = out["r"]
    assert partial.finish_reason == "abort"
    rest = 30 - len(partial.output_ids)
    [cont] = sampler.generate([GenerateRequest(prompt + partial.output_ids, SamplingParams(
        max_new_tokens=rest, temperature=0.0, ignore_eos=True))])
    assert sampler.stats()["reused_tokens"] >= 32
    [whole] = model["plain"].generate([GenerateRequest(prompt, SamplingParams(
        max_new_tokens=30, temperature=0.0, ignore_eos=True))])
    assert partial.output_ids + cont.output_ids == whole.output_ids


def test_reuse_on_a_sharded_mesh(model):
    """kv heads sharded over a tensor axis, rows over fsdp: the same outputs as one device."""
    mesh = parallel.make_mesh({"fsdp": 2, "tensor": 2}, devices=jax.devices()[:4])
    sharded = JaxSampler(model["cfg"], model["params"], mesh=mesh)
    _, got = play(sharded, turns=3)
    _, want = play(model["plain"], turns=3)
    assert_same(got, want)
    assert sharded.stats()["reused_tokens"] > 0
    pool_leaf = sharded._prefix.pool["k"][0]
    assert len(pool_leaf.sharding.device_set) == 4


def test_lookup_needs_a_page_and_leaves_a_token(model):
    """Unit: matches are whole pages or more, capped one short of the prompt (whose last
    token's hidden state draws the first sample); shared pages are reference counted."""
    cfg = model["cfg"]
    cache = PrefixCache(cfg, parallel.make_mesh({}, devices=jax.devices()[:1]),
                        parallel.DEFAULT_RULES, max_tokens=1024, page_size=16)
    seq = np.arange(1, 41, dtype=np.int32)  # 40 tokens: pages 0, 1 full, 2 partial
    kv = {n: tuple(jax.numpy.ones((1, cfg.num_kv_heads, 128, cfg.head_dim)) * (i + 1)
                   for i in range(cfg.num_layers)) for n in ("k", "v")}
    assert cache.insert([seq], [chain_hashes(seq[:20], 16)], kv, cache.generation) == 3
    assert cache.lookup(seq[:15]).length == 0  # under a page
    assert cache.lookup(seq[:30]).length == 29
    full = cache.lookup(seq)
    assert full.length == 39 and len(full.pages) == 3
    other = np.concatenate([seq[:33], [300, 301]]).astype(np.int32)
    assert cache.lookup(other).length == 33
    # an extension shares the two full pages and replaces the entry it extends
    longer = np.concatenate([seq, np.arange(100, 130)]).astype(np.int32)
    assert cache.insert([longer], [[]], kv, cache.generation) == 3  # pages 2, 3, 4 written
    st = cache.stats()  # the old entry's partial page 2 was freed; 0 and 1 are shared
    assert st["cache_entries"] == 1 and st["cache_pages_used"] == 5
    assert cache.lookup(longer).length == len(longer) - 1
    stale = cache.generation
    cache.clear()
    assert cache.insert([seq], [[]], kv, stale) == 0  # a batch from before the clear
    assert cache.stats()["cache_entries"] == 0
