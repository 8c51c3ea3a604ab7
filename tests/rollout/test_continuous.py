"""Continuous batching (rl_tpu/rollout/continuous.py) without HTTP: exact samples whatever the
pool holds, rows joining while others decode, the pool's growth (a rung of its ladder at a
time), aborts queued and running,
pauses, weight updates mid-row, prefix reuse across turns, and what a row may ask for."""

import time

import pytest

from rl_tpu.core.engine import GenerateRequest, SamplingParams
from rl_tpu.models import hf, tiny
from rl_tpu.rollout.continuous import ContinuousBatcher
from rl_tpu.rollout.decoding import decode, prefill
from rl_tpu.rollout.sampler import JaxSampler


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("continuous")
    tiny.write_tiny_model(str(root / "m"), "qwen2", vocab_size=320, seed=0)
    return hf.load(str(root / "m"))


@pytest.fixture(scope="module")
def batcher(model):
    cfg, params = model
    sampler = JaxSampler(cfg, params, prefix_cache_tokens=1024)
    b = ContinuousBatcher(sampler, slots=8, slot_tokens=256, decode_chunk=4)
    yield b
    b.close()


def request(prompt, new, seed=0, rid=None, **kw):
    return GenerateRequest(list(prompt), SamplingParams(
        max_new_tokens=new, temperature=1.0, seed=seed, ignore_eos=True, **kw), rid)


def wait_for(condition, what, timeout_s=120.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_rows_joining_a_running_pool_sample_what_the_batch_path_samples(batcher):
    """Ten rows of different lengths, more than the pool's 8 rows, submitted one by one while
    the first decode: each row's tokens and log-probs are the batch path's (a row's key
    depends on its request's seed and its own output index only)."""
    requests = [request([5 + i, 6, 7], 3 + 5 * i, seed=i) for i in range(10)]
    expected = batcher.sampler.generate(requests)
    tickets = [batcher.submit([r]) for r in requests]
    got = [t.wait(300)[0] for t in tickets]
    for want, have in zip(expected, got):
        assert have.output_ids == want.output_ids
        assert have.logprobs == pytest.approx(want.logprobs, abs=1e-5)
        assert have.finish_reason == "length"
    assert batcher.load()["running_rows"] == 0 and batcher._pool is None  # dropped when idle


def test_a_chunk_ends_with_the_first_row_that_ends_after_min_chunk(batcher):
    """The batcher's decode chunks stop at the first step >= min_chunk where a row has ended
    (its reply goes out, its pool row is free); the batch path's run to the chunk's end."""
    sampler = batcher.sampler
    requests = [request([5, 6, 7], 3), request([8, 9], 40)]  # row 0 ends after 2 steps
    ids, lens, sampling = sampler.row_arrays([(r, 0) for r in requests], 2, 16, 4)
    for min_chunk, counts in ((1, [3, 3]), (2, [3, 3]), (5, [3, 6]), (None, [3, 17])):
        state = prefill(sampler.model, sampler._params, ids, lens, *sampling, max_steps=48)
        state = decode(sampler.model, sampler._params, state, chunk=16, min_chunk=min_chunk)
        assert state.count.tolist() == counts and state.done.tolist() == [True, False]


@pytest.mark.slow  # test_server.py shows it over HTTP too
def test_a_short_row_leaves_while_a_long_one_runs(batcher):
    long = batcher.submit([request([1, 2], 200, rid="long")])
    wait_for(lambda: batcher.load()["running_rows"] == 1, "the long row")
    short = batcher.submit([request([3, 4], 2)]).wait(120)
    assert len(short[0].output_ids) == 2 and not long.done()
    batcher.abort("long")
    out = long.wait(120)[0]
    assert out.finish_reason == "abort" and 0 < len(out.output_ids) < 200


def test_pause_holds_rows_and_an_abort_ends_queued_and_running_ones(batcher):
    running = batcher.submit([request([1, 2], 200, rid="a")])
    wait_for(lambda: batcher.load()["running_rows"] == 1, "the running row")
    batcher.sampler.pause()
    queued = batcher.submit([request([1, 2], 5, rid="b")])
    time.sleep(0.3)
    assert not queued.done() and not running.done()
    batcher.abort()  # everything, paused or not
    assert queued.wait(60)[0].finish_reason == "abort" and queued.results[0].output_ids == []
    assert running.wait(60)[0].finish_reason == "abort"
    batcher.sampler.resume()
    assert batcher.generate([request([1, 2], 3)], timeout=60)[0].finish_reason == "length"


def test_an_abort_of_an_id_not_running_is_forgotten(batcher):
    batcher.abort("later")
    assert batcher.generate([request([1, 2], 3, rid="later")], timeout=60)[0].finish_reason \
        == "length"


def test_a_weight_update_mid_row_shows_two_versions(batcher, model):
    cfg, params = model
    sampler = batcher.sampler
    ticket = batcher.submit([request([1, 2], 150, rid="w")])
    wait_for(lambda: batcher.load()["running_rows"] == 1, "the row")
    sampler.update_weights(params, "v2")
    out = ticket.wait(120)[0]
    spans = out.info["weight_versions"]
    assert [s["version"] for s in spans] == ["0", "v2"] and spans[0]["start"] == 0
    assert spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == 150
    sampler.update_weights(params, "0")


def test_the_next_turn_reuses_the_previous_turns_kv(batcher):
    first = batcher.generate([request(list(range(3, 40)), 20, seed=3)], timeout=120)[0]
    before = batcher.sampler.stats()["reused_tokens"]
    turn = list(range(3, 40)) + first.output_ids + [7, 8, 9]
    batcher.generate([request(turn, 4, seed=4)], timeout=120)
    assert batcher.sampler.stats()["reused_tokens"] - before >= 48  # 3 pages of 16


def test_the_pool_grows_to_what_its_rows_need(batcher):
    small = batcher.submit([request([1, 2], 100, rid="small")])
    wait_for(lambda: batcher.load()["running_rows"] == 1, "the first row")
    rows, slots = batcher._rows(), batcher._width()
    assert (rows, slots) == (1, 256)  # the first rungs: 1 row, 256 slots (2 + 100 fit)
    many_stops = GenerateRequest([3], SamplingParams(max_new_tokens=3, temperature=0,
                                                     stop_token_ids=tuple(range(300, 320))))
    wide = batcher.generate([many_stops] * 3, timeout=120)
    assert len(wide) == 3 and batcher.stop_width >= 32
    assert batcher._rows() == 8 and not small.done()  # rows 1..3 after row 0: rung 8
    batcher.abort("small")
    small.wait(60)


def test_what_a_row_may_ask_for(batcher):
    with pytest.raises(ValueError, match="needs 257 KV slots; a row of this server holds 256"):
        batcher.submit([request([1] * 16, 241)])
    with pytest.raises(ValueError, match="outside the vocab"):
        batcher.submit([request([1, 999], 2)])
    assert batcher.load()["queued_rows"] == 0  # nothing of a refused call was queued


def test_a_row_that_cannot_be_built_fails_its_request_alone(batcher):
    """A request whose row arrays cannot be built (an unhashable seed: nothing checks a seed's
    type before its row's key is made) fails with its own error; the row decoding meanwhile
    and a request queued beside the bad one run to their end."""
    running = batcher.submit([request([1, 2], 60, rid="running")])
    wait_for(lambda: batcher.load()["running_rows"] == 1, "the running row")
    bad = batcher.submit([request([3, 4], 5, seed=[1]), request([5, 6], 5)])
    beside = batcher.submit([request([7, 8], 5)])
    with pytest.raises(TypeError, match="unhashable"):
        bad.wait(120)
    assert [len(r.output_ids) for r in beside.wait(120)] == [5]
    assert [(r.finish_reason, len(r.output_ids)) for r in running.wait(120)] == [("length", 60)]
    # the bad request's good row ended (aborted) too: nothing of it is left in the pool
    wait_for(lambda: batcher.load()["running_rows"] == batcher.load()["queued_rows"] == 0,
             "an idle pool")


def test_the_sampler_refuses_integers_its_rows_cannot_hold(batcher):
    with pytest.raises(ValueError, match=r"top_k=9223372036854775808: must be an integer in "
                                         r"\[-1, 2147483647\]"):
        batcher.submit([request([1, 2], 2, top_k=2**63)])
    with pytest.raises(ValueError, match=r"stop_token_ids\[1\]=2147483648"):
        batcher.submit([request([1, 2], 2, stop_token_ids=(5, 2**31))])
    assert batcher.load()["queued_rows"] == 0


def test_limits_of_rows_context_and_tokens():
    from rl_tpu.core.engine import SamplingParams
    from rl_tpu.rollout.server import BadRequest, ServerLimits
    limits = ServerLimits(max_n=8, max_rows=10, max_context_tokens=16)
    limits.check([[1, 2]] * 2, [SamplingParams(max_new_tokens=14, n=5)] * 2, context=2048)
    with pytest.raises(BadRequest, match=r"11 rows \(prompts x n\) are over .* 10 a request"):
        limits.check([[1]] * 11, [SamplingParams(max_new_tokens=1)] * 11, context=2048)
    with pytest.raises(BadRequest, match="over the context length of 16 tokens"):
        limits.check([[1, 2]], [SamplingParams(max_new_tokens=15)], context=2048)
    with pytest.raises(BadRequest, match="over the context length of 8 tokens"):
        limits.check([[1, 2]], [SamplingParams(max_new_tokens=7)], context=8)  # the model's
    tokens = ServerLimits(max_request_tokens=100)
    tokens.check([[1] * 10], [SamplingParams(max_new_tokens=10, n=5)], context=2048)  # 100
    with pytest.raises(BadRequest, match=r"101 tokens .* over this server's limit of 100"):
        tokens.check([[1] * 10, [1]], [SamplingParams(max_new_tokens=10, n=5),
                                       SamplingParams(max_new_tokens=0)], context=2048)


