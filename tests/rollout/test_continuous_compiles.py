"""No compile in a request's path: after `ContinuousBatcher.warmup()`, rounds of 1 and 8
concurrent clients of varied prompt and output lengths (multi-turn, so prompts reuse and evict
prefix-cache pages) compile nothing, as JAX's own compile events count it
(`sampler.stats()['compiled_programs']`, compile_count.py)."""

import random
import threading

import jax
import pytest

from rl_tpu.core.engine import GenerateRequest, SamplingParams
from rl_tpu.models import hf, tiny
from rl_tpu.rollout.continuous import ContinuousBatcher
from rl_tpu.rollout.pool_programs import Ladders, fit, ladder
from rl_tpu.rollout.sampler import JaxSampler


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("compiles")
    tiny.write_tiny_model(str(root / "m"), "qwen2", vocab_size=320, seed=0)
    return hf.load(str(root / "m"))


def test_ladders_by_hand():
    assert ladder(1, 64, 8) == (1, 8, 64)
    assert ladder(1, 100, 8) == (1, 8, 64, 100)  # the bound itself is the last rung
    assert ladder(256, 2048, 8) == (256, 2048)
    assert ladder(256, 64, 8) == (64,)  # a pool smaller than the first rung: one rung
    assert ladder(16, 2048, 4) == (16, 64, 256, 1024, 2048)
    assert fit((1, 8, 64), 1) == 1 and fit((1, 8, 64), 2) == 8 and fit((1, 8, 64), 64) == 64
    with pytest.raises(ValueError, match="65 is over the largest size 64"):
        fit((1, 8, 64), 65)
    with pytest.raises(ValueError, match="needs low >= 1 and step >= 2"):
        ladder(1, 64, 1)  # would never reach 64
    server = Ladders.build(rows=64, slots=2048, suffix_low=16)
    assert (server.rows, server.slots, server.join, server.group) == ((1, 8, 64), (256, 2048),
                                                                      (1, 4), (1, 8))
    assert server.suffixes(256) == (16, 64, 256) and server.shapes() == 6


def _client(batcher, seed: int, turns: int, errors: list):
    """A multi-turn episode: each prompt is the last prompt + its output + a new observation
    (a prefix-cache hit), restarted short when it would not fit a 64-slot row."""
    rng = random.Random(seed)
    history = [rng.randrange(3, 300) for _ in range(rng.randint(3, 30))]
    try:
        for _ in range(turns):
            new = rng.randint(1, 16)
            result = batcher.generate([GenerateRequest(history, SamplingParams(
                max_new_tokens=new, temperature=1.0, ignore_eos=True))], timeout=300)[0]
            assert len(result.output_ids) == new
            history = history + result.output_ids + [rng.randrange(3, 300)
                                                     for _ in range(rng.randint(1, 8))]
            if len(history) > 40:  # 48 (prompt rounded to 16) + 16 new = the row's 64 slots
                history = history[:rng.randint(3, 20)]
    except Exception as err:  # noqa: BLE001 - reported by the test's thread
        errors.append(err)


def test_no_compile_after_warmup_with_1_and_8_clients(model):
    cfg, params = model
    jax.clear_caches()  # the counts below are this test's own, not what earlier tests left
    sampler = JaxSampler(cfg, params, prefix_cache_tokens=256)  # 16 pages: evictions
    batcher = ContinuousBatcher(sampler, slots=8, slot_tokens=64, decode_chunk=4)
    try:
        ladders = batcher.ladders
        assert (ladders.rows, ladders.slots, ladders.join, ladders.suffixes(64)) == (
            (1, 8), (64,), (1, 4), (16, 64))
        warm = batcher.warmup()
        # by hand: the prefix pool's allocation 1, the row keys of 1 and 4 rows 2, prefill
        # per rows rung and suffix rung 2 x 2; per pool shape (1 row: empty, scatter of 1,
        # decode, read and save of 1 row, end_rows, growth to 8 rows = 7; 8 rows: empty,
        # scatters of 1 and 4, decode, read and save of 1 and of 8 rows, end_rows = 9)
        assert warm["programs"] == 1 + 2 + 4 + 7 + 9, sampler.compiles.by_name()
        before = sampler.stats()["compiled_programs"]
        for clients, turns in ((1, 6), (8, 4), (3, 3)):
            errors: list = []
            threads = [threading.Thread(target=_client, args=(batcher, 100 * clients + i,
                                                              turns, errors))
                       for i in range(clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert not errors, errors
            assert sampler.stats()["compiled_programs"] == before, sampler.compiles.by_name()
        stats = sampler.stats()
        # the paths that used to compile were taken: prefixes reused, pages evicted
        assert stats["cache_hits"] > 0 and stats["cache_evictions"] > 0, stats
    finally:
        batcher.close()


def test_without_a_prefix_cache_too(model):
    """Prefills gather from one blank page instead of the prefix pool: the same programs."""
    cfg, params = model
    jax.clear_caches()
    sampler = JaxSampler(cfg, params, prefix_cache_tokens=0)
    batcher = ContinuousBatcher(sampler, slots=16, slot_tokens=32, decode_chunk=4)
    try:
        # rows (1, 8, 16), slots (32,), join (1, 4), group (1, 8), suffixes (16, 32): keys 2,
        # prefill 2 x 2; 1 row: empty, scatter of 1, decode, read of 1, end_rows, growth = 6;
        # 8 rows: empty, scatters of 1 and 4, decode, reads of 1 and 8, end_rows, growth = 8;
        # 16 rows: as 8 but no growth = 7 (no saves without a prefix cache)
        assert batcher.warmup()["programs"] == 2 + 4 + 6 + 8 + 7, sampler.compiles.by_name()
        before = sampler.stats()["compiled_programs"]
        tickets = [batcher.submit([GenerateRequest(list(range(3, 3 + n)), SamplingParams(
            max_new_tokens=m, temperature=1.0, ignore_eos=True))])
            for n, m in ((3, 5), (12, 12), (1, 1), (9, 16), (16, 16), (2, 16))]
        assert [len(t.wait(300)[0].output_ids) for t in tickets] == [5, 12, 1, 16, 16, 16]
        assert sampler.stats()["compiled_programs"] == before, sampler.compiles.by_name()
    finally:
        batcher.close()


@pytest.mark.slow
def test_the_launcher_warms_up_before_it_listens_and_requests_compile_nothing(tmp_path):
    """`python -m launch.serve_rollout` (warm-up on, its default): /load already counts the
    warmed programs when /health first answers, and requests of two lengths and two batch
    sizes add none."""
    import httpx
    from sglang_server import start_rollout_server

    tiny.write_tiny_model(str(tmp_path / "m"), "qwen2", vocab_size=320, seed=0)
    with start_rollout_server(str(tmp_path / "m"), "--warmup", "--max_batch", "8",
                              "--max_context_tokens", "256", timeout=600) as server:
        warmed = httpx.get(server.url + "/load", timeout=30).json()["compiled_programs"]
        assert warmed > 10
        for prompts, new in (([[5, 6, 7]], 4), ([[5, 6, 7, 8] * 10] * 3, 30)):
            reply = httpx.post(server.url + "/generate", timeout=120, json={
                "input_ids": prompts, "sampling_params": {
                    "max_new_tokens": new, "temperature": 1.0, "ignore_eos": True}})
            assert reply.status_code == 200, reply.text
        assert httpx.get(server.url + "/load", timeout=30).json()["compiled_programs"] == warmed
