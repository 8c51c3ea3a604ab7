"""The embedded JAX sampler: exact greedy, trainer-equal logprobs, SGLang stop semantics."""

import jax
import numpy as np
import pytest

from rl_tpu.models import hf, tiny
from rl_tpu.models.logprobs import token_logprobs
from rl_tpu.models.tokenizer import load_tokenizer
from rl_tpu.models.transformer import Transformer
from rl_tpu.rollout.engine import GenerateRequest, SamplingParams
from rl_tpu.rollout.sampler import JaxSampler, decode, prefill

GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7], list(range(10, 30)), [100, 101, 102, 103, 104]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampler")
    tiny.write_tiny_model(str(root / "a"), "qwen3", vocab_size=320, seed=0)
    tiny.write_tiny_model(str(root / "b"), "qwen3", vocab_size=320, seed=1)
    cfg, params = hf.load(str(root / "a"))
    tok = load_tokenizer(str(root / "a"))
    sampler = JaxSampler(cfg, params, tokenizer=tok, version="v0")
    forward = jax.jit(lambda p, x: Transformer(cfg).apply({"params": p}, x))
    return dict(root=root, cfg=cfg, params=params, tok=tok, sampler=sampler, forward=forward)


def full_forward_greedy(setup, params, prompt, n):
    seq, width = list(prompt), len(prompt) + n
    for _ in range(n):
        x = np.zeros((1, width), np.int32)
        x[0, :len(seq)] = seq
        seq.append(int(np.argmax(setup["forward"](params, x)[0, len(seq) - 1])))
    return seq[len(prompt):]


def gen(setup, prompts, **sampling):
    return setup["sampler"].generate([GenerateRequest(p, SamplingParams(**sampling))
                                      for p in prompts])


def test_greedy_equals_full_forward_argmax_and_logprobs_equal_trainer(setup):
    results = gen(setup, PROMPTS, max_new_tokens=12, **GREEDY)
    for prompt, res in zip(PROMPTS, results):
        assert res.output_ids == full_forward_greedy(setup, setup["params"], prompt, 12)
        assert res.finish_reason == "length" and res.weight_version == "v0"
        tokens = np.array([prompt + res.output_ids], np.int32)
        lp, _ = token_logprobs(Transformer(setup["cfg"]), setup["params"], {"tokens": tokens})
        np.testing.assert_allclose(res.logprobs, np.asarray(lp)[0, len(prompt):], atol=1e-5)


def test_stop_token_ids_and_eos(setup):
    free = gen(setup, PROMPTS[:1], max_new_tokens=8, **GREEDY)[0].output_ids
    stop = free[2]
    first = free.index(stop)
    sampler = JaxSampler(setup["cfg"], setup["params"], tokenizer=setup["tok"])
    run = lambda **kw: sampler.generate([GenerateRequest(  # noqa: E731
        PROMPTS[0], SamplingParams(max_new_tokens=8, temperature=0.0, **kw))])[0]
    sampler.eos_ids = ()
    res = run(stop_token_ids=(stop,))
    assert res.output_ids == free[:first + 1]  # the stop token is kept, as SGLang does
    assert (res.finish_reason, res.matched_stop) == ("stop", stop)
    # ignore_eos turns off every token stop, stop_token_ids included (SGLang's semantics)
    assert run(stop_token_ids=(stop,), ignore_eos=True).output_ids == free
    # the eos ids (model config + tokenizer) stop a sample unless ignore_eos
    sampler.eos_ids = (stop,)
    res = run()
    assert res.output_ids == free[:first + 1] and res.finish_reason == "stop"
    assert run(ignore_eos=True).output_ids == free


def test_stop_strings_cut_at_the_completing_token(setup):
    free = gen(setup, PROMPTS[:1], max_new_tokens=10, **GREEDY)[0].output_ids
    text = setup["tok"].decode(free)
    needle = text[len(setup["tok"].decode(free[:3])):][:2]  # starts inside the 4th token's text
    res = gen(setup, PROMPTS[:1], max_new_tokens=10, stop=(needle,), **GREEDY)[0]
    cut = setup["tok"].decode(res.output_ids)
    assert needle in cut and needle not in setup["tok"].decode(res.output_ids[:-1])
    assert (res.finish_reason, res.matched_stop) == ("stop", needle)


def test_max_new_tokens_and_n(setup):
    results = gen(setup, PROMPTS[:2], max_new_tokens=5, temperature=1.0, n=3, seed=7,
                  ignore_eos=True)
    assert len(results) == 6 and all(len(r.output_ids) == 5 for r in results)
    assert all(r.prompt_tokens == len(PROMPTS[i // 3]) for i, r in enumerate(results))  # p-major
    assert len({tuple(r.output_ids) for r in results[:3]}) > 1  # the n samples differ
    again = gen(setup, PROMPTS[:2], max_new_tokens=5, temperature=1.0, n=3, seed=7,
                ignore_eos=True)
    assert [r.output_ids for r in again] == [r.output_ids for r in results]  # seeded
    assert gen(setup, PROMPTS[:1], max_new_tokens=0, **GREEDY)[0].output_ids == []


def test_top_k_one_and_tiny_top_p_are_greedy(setup):
    greedy = gen(setup, PROMPTS, max_new_tokens=6, **GREEDY)
    for kwargs in (dict(top_k=1), dict(top_p=1e-6)):
        sampled = gen(setup, PROMPTS, max_new_tokens=6, temperature=1.0, ignore_eos=True,
                      **kwargs)
        assert [r.output_ids for r in sampled] == [r.output_ids for r in greedy]


def test_update_weights_switches_model_and_version(setup):
    cfg_b, params_b = hf.load(str(setup["root"] / "b"))
    sampler = JaxSampler(setup["cfg"], setup["params"], tokenizer=setup["tok"])
    sampler.update_weights(params_b, "v1")
    res = sampler.generate([GenerateRequest(PROMPTS[0], SamplingParams(max_new_tokens=6,
                                                                       **GREEDY))])[0]
    assert res.weight_version == "v1" and sampler.weight_version == "v1"
    assert res.output_ids == full_forward_greedy(setup, params_b, PROMPTS[0], 6)


def test_shapes_are_bucketed(setup):
    before = prefill._cache_size(), decode._cache_size()
    for n_prompts, length in ((1, 3), (2, 5), (3, 9), (2, 14)):
        gen(setup, [list(range(1, length + 1))] * n_prompts, max_new_tokens=7, **GREEDY)
    # batch buckets 1, 2, 4 with one prompt bucket (16) and one length bucket (16)
    assert prefill._cache_size() - before[0] <= 3 and decode._cache_size() - before[1] <= 3


def test_bad_requests_are_clear(setup):
    with pytest.raises(ValueError, match="outside the vocab"):
        gen(setup, [[1, 2, 999]], max_new_tokens=2)
    with pytest.raises(ValueError, match="empty prompt"):
        gen(setup, [[]], max_new_tokens=2)
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(top_p=0)


def test_weight_update_mid_sample_and_abort_between_chunks(setup):
    """A weight update between decode chunks: the sample continues on the new weights and
    reports both versions; an abort returns the partial sample with finish 'abort'."""
    cfg_b, params_b = hf.load(str(setup["root"] / "b"))
    sampler = JaxSampler(setup["cfg"], setup["params"], tokenizer=setup["tok"], decode_chunk=4,
                         version="a")
    swapped = {}
    real_decode = decode

    def decode_then_swap(*args, **kwargs):
        out = real_decode(*args, **kwargs)
        if not swapped:  # after the first chunk (tokens 0..4), publish new weights
            swapped["at"] = int(out.step)
            sampler.update_weights(params_b, "b")
        return out

    import rl_tpu.rollout.sampler as sampler_module
    sampler_module.decode, original = decode_then_swap, sampler_module.decode
    try:
        res = sampler.generate([GenerateRequest(PROMPTS[0], SamplingParams(max_new_tokens=12,
                                                                           **GREEDY))])[0]
    finally:
        sampler_module.decode = original
    at = swapped["at"]
    assert res.info["weight_versions"] == [{"version": "a", "start": 0, "end": at},
                                           {"version": "b", "start": at, "end": 12}]
    assert res.weight_version == "b"
    # the first `at` tokens are model a's greedy choices
    assert res.output_ids[:at] == full_forward_greedy(setup, setup["params"], PROMPTS[0], at)

    sampler.abort()  # aborts what was admitted before: nothing now, so this one runs in full
    full = sampler.generate([GenerateRequest(PROMPTS[0], SamplingParams(max_new_tokens=12,
                                                                        **GREEDY))])[0]
    assert full.finish_reason == "length" and len(full.output_ids) == 12
    sampler.pause()
    import threading
    out = {}
    worker = threading.Thread(target=lambda: out.update(r=sampler.generate([GenerateRequest(
        PROMPTS[0], SamplingParams(max_new_tokens=12, **GREEDY), request_id="r1")])))
    worker.start()
    worker.join(timeout=0.5)
    assert worker.is_alive()  # held by the pause
    sampler.abort("r1")
    sampler.resume()
    worker.join(timeout=60)
    [partial] = out["r"]
    assert partial.finish_reason == "abort" and len(partial.output_ids) < 12
    assert partial.output_ids == full.output_ids[:len(partial.output_ids)]


def test_scanned_layers_sample_the_same(setup):
    """The stacked [L, ...] cache of scanned layers decodes exactly as per-layer caches do."""
    cfg, params = hf.load(str(setup["root"] / "a"), scan_layers=True)
    scanned = JaxSampler(cfg, params, tokenizer=setup["tok"])
    requests = [GenerateRequest(p, SamplingParams(max_new_tokens=6, **GREEDY)) for p in PROMPTS]
    expected = [r.output_ids for r in setup["sampler"].generate(requests)]
    assert [r.output_ids for r in scanned.generate(requests)] == expected


def test_update_weights_from_a_trainer_mesh_reshards(setup):
    """Params sharded fsdp x tensor over 8 devices (a trainer's) land on the sampler's own
    one-device mesh, and scanned (stacked) params are unstacked, with no host round trip."""
    from rl_tpu import parallel

    mesh = parallel.make_mesh({"fsdp": 4, "tensor": 2})
    cfg, trainer_params = hf.load(str(setup["root"] / "b"), mesh=mesh, scan_layers=True)
    leaf = trainer_params["layers"]["mlp"]["up_proj"]["kernel"]
    assert len(leaf.sharding.device_set) == 8
    sampler = JaxSampler(setup["cfg"], setup["params"], tokenizer=setup["tok"])
    sampler.update_weights(trainer_params, "trainer-1")
    held = sampler._params["layers_0"]["mlp"]["up_proj"]["kernel"]
    assert held.sharding.device_set == {jax.devices()[0]}
    _, params_b = hf.load(str(setup["root"] / "b"))
    res = sampler.generate([GenerateRequest(PROMPTS[0], SamplingParams(max_new_tokens=6,
                                                                       **GREEDY))])[0]
    assert res.output_ids == full_forward_greedy(setup, params_b, PROMPTS[0], 6)
