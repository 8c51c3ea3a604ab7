"""Rollout routing replay (R3, arXiv 2510.11370): the embedded sampler records, for a
mixture-of-experts policy, the experts that routed every token it computed, and they are the
experts one full forward pass over the sample chooses, by position, whatever path computed
them (whole or chunked prefill, decode, the continuous batcher's pool); positions a reused
prefix covered are -1; a dense model records nothing."""

import jax
import numpy as np
import pytest

from rl_tpu.core.engine import GenerateRequest, SamplingParams
from rl_tpu.models import tiny
from rl_tpu.models.moe import sown_routing
from rl_tpu.models.transformer import Transformer
from rl_tpu.rollout.continuous import ContinuousBatcher
from rl_tpu.rollout.decoding import decode, prefill
from rl_tpu.rollout.sampler import JaxSampler

# several lengths in one batch; 37 + 12 outputs leave three full pages (16) for a next turn
PROMPTS = [[5, 6, 7], list(range(10, 30)), list(range(40, 77))]
NEW = 12
WIDTH = 128  # the reference forward's padded length (causal: padding changes no position)


def greedy(new=NEW, routing=True):
    return SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True,
                          return_routed_experts=routing)


@pytest.fixture(scope="module")
def moe():
    cfg = tiny.tiny_config("qwen3_moe", vocab_size=320)  # float32, every layer sparse
    params = tiny.random_params(cfg, seed=0)
    sown = jax.jit(lambda x: Transformer(cfg).apply({"params": params}, x,
                                                    mutable=["intermediates"])[1])

    def full_forward(seq):
        """The experts [len(seq), sparse layers, k] one forward pass over seq chooses."""
        x = np.zeros((1, WIDTH), np.int32)
        x[0, :len(seq)] = seq
        return np.asarray(sown_routing(sown(x)["intermediates"], cfg.num_layers)[1])[:len(seq)]

    # whole prompts, reuse on (the batch path's prefix-reuse prefill); and chunked prompts
    # (8 tokens at a time: every prompt bucket runs >= 2 chunks), which the batcher also runs
    whole = JaxSampler(cfg, params, decode_chunk=8)
    chunked = JaxSampler(cfg, params, decode_chunk=8, prefill_chunk=8)
    return dict(cfg=cfg, params=params, full_forward=full_forward, whole=whole, chunked=chunked)


@pytest.fixture(scope="module")
def batcher(moe):
    b = ContinuousBatcher(moe["chunked"], slots=4, slot_tokens=128, decode_chunk=4)
    yield b
    b.close()


def assert_routed_as_full_forward(moe, prompt, res, reused=0):
    """res.routed_experts: a row per position of prompt + output but the last; the first
    `reused` (a reused prefix) -1, the rest the full forward's experts, exactly."""
    seq = list(prompt) + res.output_ids[:-1]
    routed = res.routed_experts
    s, k = len(moe["cfg"].moe.sparse_layers(moe["cfg"].num_layers)), moe["cfg"].moe.top_k
    assert routed.dtype == np.int32 and routed.shape == (len(seq), s, k)
    assert (routed[:reused] == -1).all()
    np.testing.assert_array_equal(routed[reused:], moe["full_forward"](seq)[reused:])


def test_batch_routing_equals_one_full_forward(moe):
    results = moe["whole"].generate([GenerateRequest(p, greedy(NEW - 3 * i))
                                     for i, p in enumerate(PROMPTS)])
    for prompt, res in zip(PROMPTS, results):
        assert_routed_as_full_forward(moe, prompt, res)


def test_chunked_prefill_routing_equals_one_full_forward(moe):
    results = moe["chunked"].generate([GenerateRequest(p, greedy()) for p in PROMPTS])
    for prompt, res in zip(PROMPTS, results):
        assert_routed_as_full_forward(moe, prompt, res)


def test_state_records_only_what_this_call_computed(moe):
    """In the DecodeState itself: positions < prompt_len + count - 1 routed, the rest -1 (the
    last sampled token, never fed; the slots no row reached; padding rows past their one
    token). The sampler's own programs (its shapes), called directly."""
    sampler = moe["whole"]
    rows = [(GenerateRequest(p, greedy(4 + 3 * i)), 0) for i, p in enumerate(PROMPTS)]
    ids, lens, sampling = sampler.row_arrays(rows, 4, 64, 4)
    state = prefill(sampler.model, sampler._params, ids, lens, *sampling, max_steps=16)
    while not np.asarray(state.done).all():
        state = decode(sampler.model, sampler._params, state, chunk=sampler.decode_chunk)
    experts, count = np.asarray(state.experts), np.asarray(state.count)
    assert experts.shape == (4, 64 + 16, 2, 2)
    for r in range(4):
        fed = lens[r] + count[r] - 1
        assert (experts[r, :fed] >= 0).all() and (experts[r, fed:] == -1).all()


def test_prefix_reuse_leaves_the_reused_positions_unrouted(moe):
    sampler = moe["whole"]
    first = sampler.generate([GenerateRequest(PROMPTS[2], greedy())])[0]
    turn = PROMPTS[2] + first.output_ids + [200, 201, 202]
    before = sampler.stats()["reused_tokens"]
    second = sampler.generate([GenerateRequest(turn, greedy())])[0]
    reused = sampler.stats()["reused_tokens"] - before
    assert reused >= 32
    assert_routed_as_full_forward(moe, turn, second, reused)


def test_continuous_batcher_routing_and_prefix_reuse(moe, batcher):
    """Rows of different lengths that end at different steps (a done row's steps record
    nothing), then a next turn of one of them from the prefix cache."""
    # prompts the sampler has not cached (its batch path ran PROMPTS): nothing reused
    prompts = [[t + 1 for t in p] for p in PROMPTS]
    requests = [GenerateRequest(p, greedy(NEW - 3 * i)) for i, p in enumerate(prompts)]
    results = batcher.submit(requests).wait(300)
    for prompt, res in zip(prompts, results):
        assert_routed_as_full_forward(moe, prompt, res)
    turn = prompts[2] + results[2].output_ids + [200, 201, 202]
    before = batcher.sampler.stats()["reused_tokens"]
    second = batcher.submit([GenerateRequest(turn, greedy())]).wait(300)[0]
    reused = batcher.sampler.stats()["reused_tokens"] - before
    assert reused >= 32
    assert_routed_as_full_forward(moe, turn, second, reused)


def test_routing_is_returned_only_when_asked(moe):
    asked, plain = moe["whole"].generate([GenerateRequest(PROMPTS[0], greedy(4)),
                                          GenerateRequest(PROMPTS[0], greedy(4, False))])
    assert asked.routed_experts is not None and plain.routed_experts is None
    assert asked.output_ids == plain.output_ids


def test_dense_model_records_no_routing():
    cfg = tiny.tiny_config("qwen3", vocab_size=320)
    sampler = JaxSampler(cfg, tiny.random_params(cfg, seed=0), prefix_cache_tokens=0)
    res = sampler.generate([GenerateRequest(PROMPTS[0], greedy(2))])[0]
    assert len(res.output_ids) == 2 and res.routed_experts is None
