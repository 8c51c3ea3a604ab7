"""The embedded JAX sampler: exact greedy, trainer-equal logprobs, SGLang stop semantics."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_tpu import parallel
from rl_tpu.models import hf, tiny
from rl_tpu.models.logprobs import token_logprobs
from rl_tpu.models.tokenizer import load_tokenizer
from rl_tpu.models.transformer import Transformer, init_cache
from rl_tpu.core.engine import MAX_STOP_TOKEN_IDS, GenerateRequest, SamplingParams
from rl_tpu.rollout.decoding import decode, prefill
from rl_tpu.rollout.sampler import JaxSampler

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


def test_kv_budget_splits_batches_by_their_padded_cache(setup):
    # buckets of 16: a prompt of 3 or 5 tokens pads to 16, one of 20 to 32; 12 new tokens to 16
    sampler = JaxSampler(setup["cfg"], setup["params"], tokenizer=setup["tok"],
                         max_batch=8, kv_tokens=4 * 32, prefix_cache_tokens=0)
    short, long = PROMPTS[0], PROMPTS[1]
    requests = [GenerateRequest(p, SamplingParams(max_new_tokens=12, **GREEDY))
                for p in [short] * 5 + [long] * 3 + [short]]
    rows = [(r, 0) for r in requests]
    # 4 short rows: 4 x (16 + 16) = 128 slots; a 5th would pad the batch to 8 rows (256).
    # Then the 5th short row and a long one: 2 x (32 + 16) = 96; a third row pads to 4 x 48.
    # The last two long rows (96), then the last short row.
    assert [len(b) for b in sampler._batches(rows)] == [4, 2, 2, 1]
    sampler.kv_tokens = 16  # every row over the budget: each runs alone
    assert [len(b) for b in sampler._batches(rows)] == [1] * 9
    sampler.kv_tokens = 0  # the row cap alone
    assert [len(b) for b in sampler._batches(rows)] == [8, 1]
    sampler.kv_tokens = 4 * 32
    split = sampler.generate(requests)
    whole = gen(setup, [r.prompt_ids for r in requests], max_new_tokens=12, **GREEDY)
    assert [r.output_ids for r in split] == [r.output_ids for r in whole]  # in order
    for a, b in zip(split, whole):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    with pytest.raises(ValueError, match="kv_tokens=-1"):
        JaxSampler(setup["cfg"], setup["params"], kv_tokens=-1)


def test_bad_requests_are_clear(setup):
    with pytest.raises(ValueError, match="outside the vocab"):
        gen(setup, [[1, 2, 999]], max_new_tokens=2)
    with pytest.raises(ValueError, match="empty prompt"):
        gen(setup, [[]], max_new_tokens=2)
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(top_p=0)


def test_stop_ids_are_checked_against_the_vocab_and_capped(setup):
    """A stop id the model cannot sample, or more distinct ids than MAX_STOP_TOKEN_IDS, is
    refused before it reaches a row (the width of a row's stop ids is part of the compiled
    shapes: a million ids compiled new programs and slowed every later request); repeats of
    one id count once."""
    sampler = setup["sampler"]
    for ids, message in (([7, 320], r"stop_token_ids\[1\]=320: must be a token id in \[0, 320\)"),
                         (list(range(MAX_STOP_TOKEN_IDS + 1)), "257 distinct ids are over")):
        with pytest.raises(ValueError, match=message):
            sampler.validate(GenerateRequest([5, 6], SamplingParams(stop_token_ids=tuple(ids))))
    repeated = GenerateRequest([5, 6], SamplingParams(stop_token_ids=(9,) * 200))
    sampler.validate(repeated)
    assert sampler.stop_width([repeated]) == 4  # 9 and the eos: the narrowest program


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


def test_ids_sampled_after_a_mid_sample_swap_count_as_the_first_version(setup):
    """The sampler's spans say which weights sampled each id (3, then 4 from the swap on);
    the trajectory's per-token version is the one the sample's K/V started with: 3 for every
    id (its prompt and first ids were computed by version 3, and every later id attends to
    them), so the trainer's stale-token mask and staleness see them as that old."""
    from rl_tpu.core.trajectory import token_versions
    _, params_b = hf.load(str(setup["root"] / "b"))
    sampler = JaxSampler(setup["cfg"], setup["params"], decode_chunk=4, version="3")
    swapped = {}
    real_decode = decode

    def decode_then_swap(*args, **kwargs):
        out = real_decode(*args, **kwargs)
        if not swapped:  # new weights land after the first chunk, as a publisher's would
            swapped["at"] = int(out.step)
            sampler.update_weights(params_b, "4")
        return out

    import rl_tpu.rollout.sampler as sampler_module
    sampler_module.decode = decode_then_swap
    try:
        res = sampler.generate([GenerateRequest(PROMPTS[0], SamplingParams(max_new_tokens=12,
                                                                           **GREEDY))])[0]
    finally:
        sampler_module.decode = real_decode
    assert [s["version"] for s in res.info["weight_versions"]] == ["3", "4"]
    assert 0 < swapped["at"] < 12 and res.weight_version == "4"
    assert token_versions(len(res.output_ids), res.weight_version,
                          res.info["weight_versions"]) == [3] * 12


def test_scanned_layers_sample_the_same(setup):
    """The stacked [L, ...] cache of scanned layers decodes exactly as per-layer caches do."""
    cfg, params = hf.load(str(setup["root"] / "a"), scan_layers=True)
    scanned = JaxSampler(cfg, params, tokenizer=setup["tok"])
    requests = [GenerateRequest(p, SamplingParams(max_new_tokens=6, **GREEDY)) for p in PROMPTS]
    expected = [r.output_ids for r in setup["sampler"].generate(requests)]
    assert [r.output_ids for r in scanned.generate(requests)] == expected


def test_chunked_prefill_samples_what_a_whole_prefill_does(setup):
    """prefill_chunk=16: four prompts (3 to 40 tokens, one batch padded to the 64-token
    bucket) prefill in 4 chunks, with every greedy token and log-prob of one whole-prompt
    prefill: the rows whose last prompt token lies in the first, second or third chunk too."""
    prompts = PROMPTS + [list(range(40, 80))]
    requests = [GenerateRequest(p, SamplingParams(max_new_tokens=10, **GREEDY)) for p in prompts]
    chunked = JaxSampler(setup["cfg"], setup["params"], tokenizer=setup["tok"], prefill_chunk=16,
                         prefix_cache_tokens=0)
    for got, want in zip(chunked.generate(requests), setup["sampler"].generate(requests)):
        assert got.output_ids == want.output_ids
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
    with pytest.raises(ValueError, match="power of two"):
        JaxSampler(setup["cfg"], setup["params"], prefill_chunk=24)


def test_bf16_kv_cache_under_fp32_weights(setup):
    """kv_dtype='bfloat16' stores the cache in bf16 while weights and math stay fp32: the
    cache is half the bytes, and the log-probs move by bf16's rounding of K/V, not more."""
    cfg = setup["cfg"].replace(cache_dtype="bfloat16")
    assert init_cache(cfg, 2, 8)["k"][0].dtype == jnp.bfloat16
    assert init_cache(setup["cfg"], 2, 8)["k"][0].dtype == jnp.float32
    sampler = JaxSampler(setup["cfg"], setup["params"], tokenizer=setup["tok"],
                         kv_dtype="bfloat16")
    assert sampler.cfg.param_dtype == "float32" and sampler.cfg.kv_dtype == jnp.bfloat16
    prompt = PROMPTS[1]
    res = sampler.generate([GenerateRequest(prompt, SamplingParams(max_new_tokens=8,
                                                                   **GREEDY))])[0]
    tokens = np.array([prompt + res.output_ids], np.int32)
    lp, _ = token_logprobs(Transformer(setup["cfg"]), setup["params"], {"tokens": tokens})
    error = np.abs(np.asarray(res.logprobs) - np.asarray(lp)[0, len(prompt):])
    assert 0 < error.max() < 0.05, error  # inexact (bf16 K/V), but close


def test_warmup_compiles_the_buckets_so_generation_compiles_nothing(setup):
    """After warmup((4 rows, 32 prompt, 16 new)), batches inside those buckets (any prompt of
    17-32 tokens, up to 16 new tokens, 3-4 rows, with or without stop ids) add no program;
    a longer prompt adds its bucket's three (the row keys of 1 row, prefill, decode). Counts
    are JAX's compile events: the weight copy (1) counts too."""
    jax.clear_caches()  # this test's programs, not those earlier tests left compiled
    sampler = JaxSampler(setup["cfg"], setup["params"], tokenizer=setup["tok"],
                         prefix_cache_tokens=0)
    assert sampler.stats()["compiled_programs"] == 1, sampler.compiles.by_name()
    assert sampler.warmup([(4, 32, 16)]) == 3 and sampler.stats()["compiled_programs"] == 4
    jitted = (prefill._cache_size(), decode._cache_size())  # jax's own count agrees
    prompts = [list(range(10, 30)), list(range(5, 37)), list(range(3, 21))]
    sampler.generate([GenerateRequest(p, SamplingParams(max_new_tokens=9, **GREEDY))
                      for p in prompts])
    sampler.generate([GenerateRequest(p, SamplingParams(max_new_tokens=16, temperature=1.0,
                                                        stop_token_ids=(7, 8)))
                      for p in prompts + prompts[:1]])
    assert sampler.stats()["compiled_programs"] == 4
    assert (prefill._cache_size(), decode._cache_size()) == jitted
    sampler.generate([GenerateRequest(list(range(40)), SamplingParams(max_new_tokens=4))])
    assert sampler.stats()["compiled_programs"] == 7  # the 64-token, 1-row bucket


def test_a_new_bucket_compiles_its_decode_once_beside_its_prefill(setup):
    """The decode of a bucket is compiled on a background thread while its prefill compiles
    (DecodeAhead); the state's sharding is guessed right on one device, so jit's cache serves
    the real call: one decode program a bucket, counted by the sampler, not two."""
    jax.clear_caches()
    sampler = JaxSampler(setup["cfg"], setup["params"], tokenizer=setup["tok"],
                         prefix_cache_tokens=0)
    out = sampler.generate([GenerateRequest(list(range(3, 23)),
                                            SamplingParams(max_new_tokens=9, **GREEDY))])
    assert len(out[0].output_ids) == 9
    assert sampler._decode_ahead.started == 1
    programs = sampler.compiles.by_name()
    assert programs["jit(decode)"] == 1 and programs["jit(prefill)"] == 1, programs
    sampler.generate([GenerateRequest(list(range(5, 27)), SamplingParams(max_new_tokens=12))])
    assert sampler._decode_ahead.started == 1  # the same bucket: nothing more


def _decode_hlo(sampler: JaxSampler, rows: int, prompt: int, new: int) -> str:
    """The compiled text of the sampler's decode chunk for a (rows, prompt, new) bucket."""
    i32 = np.int32
    keys = jax.vmap(jax.random.key)(np.arange(rows, dtype=np.uint32))
    state = prefill(sampler.model, sampler._params, np.ones((rows, prompt), i32),
                    np.full((rows,), prompt, i32), np.full((rows,), new, i32),
                    np.zeros((rows,), i32), np.zeros((rows,), np.float32),
                    np.ones((rows,), np.float32), np.full((rows,), -1, i32),
                    np.full((rows, 1), -1, i32), np.full((rows, 1), -1, i32), keys,
                    max_steps=new)
    return decode.lower(sampler.model, sampler._params, state, chunk=4).compile().as_text()


def test_tensor_parallel_sampler_equals_one_device_and_gathers_no_weight(setup):
    """On its own mesh (8 devices: tensor 2 = the tiny model's kv heads, data 4) the sampler
    splits heads, mlp and vocab, not the model width, and samples what one device does. Its
    decode all-gathers only activations (a row's vocab shards for sampling), never a weight:
    nothing as large as the smallest kernel."""
    mesh = parallel.sampler_mesh(jax.devices(), setup["cfg"].num_kv_heads)
    assert dict(mesh.shape) == {"data": 4, "fsdp": 1, "expert": 1, "tensor": 2}
    tp = JaxSampler(setup["cfg"], setup["params"], mesh=mesh, tokenizer=setup["tok"])
    requests = [GenerateRequest(p, SamplingParams(max_new_tokens=8, **GREEDY)) for p in PROMPTS]
    expected = setup["sampler"].generate(requests)
    for got, want in zip(tp.generate(requests), expected):
        assert got.output_ids == want.output_ids
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
    smallest_kernel = min(x.size for x in jax.tree.leaves(setup["params"]) if x.ndim >= 2)
    gathered = [int(np.prod([int(d) for d in dims.split(",") if d]))
                for dims in re.findall(r"= \w+\[([\d,]*)\]\S* all-gather\(",
                                       _decode_hlo(tp, 4, 16, 16))]
    assert gathered and max(gathered) < smallest_kernel, (gathered, smallest_kernel)


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


# ------------------------------------------------------------------ weights: the sampler's own


@pytest.fixture(scope="module")
def trainer(setup):
    """An SFT step compiled once on the sampler's one-device mesh (where device_put onto the
    sampler's sharding is a no-op), fresh params and states for it."""
    import optax

    from rl_tpu import parallel
    from rl_tpu.train import steps
    from rl_tpu.train.state import create_state

    tx = optax.sgd(0.5)
    fresh_params = lambda: hf.load(str(setup["root"] / "a"))[1]  # noqa: E731
    fresh_state = lambda: create_state(fresh_params(), tx)  # noqa: E731  (donates the params)
    mesh = parallel.make_mesh({}, devices=jax.devices()[:1])
    step = steps.compile_step(steps.make_sft_step(Transformer(setup["cfg"])), fresh_state(), mesh)
    rng = np.random.RandomState(0)
    batch = dict(tokens=rng.randint(0, 320, (2, 16)).astype(np.int32),
                 loss_mask=np.ones((2, 16), bool))
    return dict(step=lambda state: step(state, batch)[0], fresh_params=fresh_params,
                fresh_state=fresh_state, tx=tx)


def greedy6(sampler):
    return sampler.generate([GenerateRequest(PROMPTS[0], SamplingParams(max_new_tokens=6,
                                                                        **GREEDY))])[0]


def buffer_pointers(tree) -> set:
    return {shard.data.unsafe_buffer_pointer() for x in jax.tree.leaves(tree)
            for shard in x.addressable_shards}


def test_sampler_owns_its_weights_in_every_order(setup, trainer):
    """The compiled train step donates its state: whatever the order of building, updating
    and stepping, the sampler keeps sampling with the weights it was last given."""
    from rl_tpu.train.state import create_state

    step, cfg, tok = trainer["step"], setup["cfg"], setup["tok"]
    # built before the state: create_state donates the very arrays the sampler was given
    params = trainer["fresh_params"]()
    sampler = JaxSampler(cfg, params, tokenizer=tok)
    state = step(create_state(params, trainer["tx"]))
    assert greedy6(sampler).output_ids == full_forward_greedy(setup, setup["params"], PROMPTS[0], 6)
    # built from the state, then a step
    before = full_forward_greedy(setup, state.params, PROMPTS[0], 6)
    sampler = JaxSampler(cfg, state.params, tokenizer=tok)
    state = step(state)
    assert greedy6(sampler).output_ids == before
    # update_weights, a step, generate
    before = full_forward_greedy(setup, state.params, PROMPTS[0], 6)
    sampler.update_weights(state.params, "2")
    state = step(state)
    res = greedy6(sampler)
    assert res.output_ids == before and res.weight_version == "2"


def test_generate_in_a_thread_while_steps_run(setup, trainer):
    """A rollout in flight while the trainer steps (donating its state) and publishes new
    weights: the steps run after the rollout's first decode chunk was dispatched, before its
    second; the sample finishes on the last published weights."""
    import threading

    import rl_tpu.rollout.sampler as sampler_module

    state = trainer["fresh_state"]()
    sampler = JaxSampler(setup["cfg"], state.params, tokenizer=setup["tok"], decode_chunk=4)
    out, errors = {}, []
    started, stepped = threading.Event(), threading.Event()
    real_decode = sampler_module.decode

    def decode_then_wait(*args, **kwargs):
        new_state = real_decode(*args, **kwargs)  # dispatched, maybe still running
        if not started.is_set():
            started.set()
            stepped.wait(timeout=120)
        return new_state

    def rollout():
        try:
            out["r"] = sampler.generate([GenerateRequest(PROMPTS[1], SamplingParams(
                max_new_tokens=20, **GREEDY))])[0]
        except Exception as err:  # noqa: BLE001 - reported by the assert below
            errors.append(err)

    worker = threading.Thread(target=rollout)
    sampler_module.decode = decode_then_wait
    try:
        worker.start()
        assert started.wait(timeout=120)
        for version in range(1, 4):
            state = trainer["step"](state)
            sampler.update_weights(state.params, str(version))
        state = trainer["step"](state)  # donates the params of version 3, which it samples with
        stepped.set()
        worker.join(timeout=120)
    finally:
        stepped.set()
        sampler_module.decode = real_decode
    assert not errors, errors
    assert len(out["r"].output_ids) == 20 and out["r"].finish_reason == "length"
    assert [span["version"] for span in out["r"].info["weight_versions"]] == ["0", "3"]
    res = greedy6(sampler)
    assert res.weight_version == "3" and len(res.output_ids) == 6


def test_the_copy_shares_no_buffer_and_outlives_its_source(setup, trainer):
    params = trainer["fresh_params"]()
    sampler = JaxSampler(setup["cfg"], params, tokenizer=setup["tok"])
    assert not buffer_pointers(params) & buffer_pointers(sampler._params)
    for leaf in jax.tree.leaves(params):
        leaf.delete()
    expected = full_forward_greedy(setup, setup["params"], PROMPTS[0], 6)
    assert greedy6(sampler).output_ids == expected
    # scanned (stacked) params, unstacked on the way in, and a bf16 copy of them
    _, scanned = hf.load(str(setup["root"] / "a"), scan_layers=True)
    with jax.transfer_guard("disallow_explicit"):  # device to device only: no host round trip
        sampler.update_weights(scanned, "scanned")
    assert not buffer_pointers(scanned) & buffer_pointers(sampler._params)
    bf16 = JaxSampler(setup["cfg"], scanned, tokenizer=setup["tok"], dtype="bfloat16")
    assert {x.dtype for x in jax.tree.leaves(bf16._params)} == {np.dtype(jax.numpy.bfloat16)}
    assert bf16.cfg.dtype == "bfloat16" and bf16.cfg.param_dtype == "bfloat16"
    for leaf in jax.tree.leaves(scanned):
        leaf.delete()
    assert greedy6(sampler).output_ids == expected
    res = greedy6(bf16)
    tokens = np.array([PROMPTS[0] + res.output_ids], np.int32)
    lp, _ = token_logprobs(Transformer(setup["cfg"]), setup["params"], {"tokens": tokens})
    # bf16 weights and math: the fp32 trainer's logprobs of the same tokens, to bf16 accuracy
    np.testing.assert_allclose(res.logprobs, np.asarray(lp)[0, len(PROMPTS[0]):], atol=0.1)


def test_a_replicated_trainer_copy_is_copied_not_aliased(setup):
    """device_put from a leaf replicated over 8 devices to one of them hands back the source's
    own shard (even with may_alias=False): the sampler must still own a copy."""
    from jax.sharding import NamedSharding, PartitionSpec

    from rl_tpu import parallel

    mesh = parallel.make_mesh({"data": 8})
    _, params_b = hf.load(str(setup["root"] / "b"))
    expected = full_forward_greedy(setup, params_b, PROMPTS[0], 6)
    # (this device_put itself reuses params_b's buffers as the device-0 shards)
    replicated = jax.device_put(params_b, NamedSharding(mesh, PartitionSpec()))
    sampler = JaxSampler(setup["cfg"], setup["params"], tokenizer=setup["tok"])
    sampler.update_weights(replicated, "rep")
    assert not buffer_pointers(replicated) & buffer_pointers(sampler._params)
    for leaf in jax.tree.leaves(replicated):
        leaf.delete()
    assert greedy6(sampler).output_ids == expected


def test_params_of_another_model_are_refused_clearly(setup):
    deep = tiny.tiny_config("qwen3", vocab_size=320, num_layers=3)
    with pytest.raises(ValueError, match="do not fit the sampler's model"):
        setup["sampler"].update_weights(tiny.random_params(deep), "deep")
    assert setup["sampler"].weight_version == "v0"


# ------------------------------------------------------------------ sampling: exact draws

# p = [.05, .3, .02, .15, .1, .2, .08, .04, .01, .05] (sums to 1), logits = log p + 3
BASE_P = np.array([.05, .3, .02, .15, .1, .2, .08, .04, .01, .05])
SQUARED = BASE_P ** 2 / 0.176  # T = 0.5: p^2 / sum p^2, sum p^2 = 0.176
DRAWS = 20000


def _on(indices, values):
    out = np.zeros(10)
    out[list(indices)] = values
    return out


@pytest.mark.parametrize("temperature,top_p,top_k,expected", [
    (1.0, 1.0, -1, BASE_P),
    (0.5, 1.0, -1, SQUARED),
    # top-p 0.7: sorted .3 .2 .15 .1 .08..., mass before each 0 .3 .5 .65 .75: keep 4 (.75)
    (1.0, 0.7, -1, _on([1, 5, 3, 4], np.array([.3, .2, .15, .1]) / .75)),
    (1.0, 1.0, 3, _on([1, 5, 3], np.array([.3, .2, .15]) / .65)),
    (1.0, 0.9, 2, _on([1, 5], [.6, .4])),
], ids=["plain", "temperature", "top_p", "top_k", "both"])
def test_draws_follow_the_stated_distribution(temperature, top_p, top_k, expected):
    """Chi-square over V = 10 (two levels of 3 blocks x 4, padded): plain, temperature, top-p,
    top-k sampling draw exactly softmax(logits / T) renormalised over the kept tokens."""
    from jax.scipy.stats import chi2

    from rl_tpu.rollout.decoding import sample_next

    logits = np.tile(np.log(BASE_P).astype(np.float32) + 3.0, (DRAWS, 1))
    keys = jax.vmap(jax.random.key)(jax.numpy.arange(DRAWS))
    full = lambda x: np.full(DRAWS, x)  # noqa: E731
    tokens, logprobs = jax.jit(sample_next)(logits, full(np.float32(temperature)),
                                            full(np.float32(top_p)), full(np.int32(top_k)), keys)
    counts = np.bincount(np.asarray(tokens), minlength=10)
    kept = expected > 0
    assert counts[~kept].sum() == 0  # never a truncated token
    stat = np.sum((counts[kept] - DRAWS * expected[kept]) ** 2 / (DRAWS * expected[kept]))
    assert float(chi2.sf(stat, kept.sum() - 1)) > 1e-3, (counts, DRAWS * expected)
    # the reported logprob is the full (untruncated) distribution's, convention "full"
    full_logp = np.log(np.where(temperature == 1.0, BASE_P, SQUARED))
    np.testing.assert_allclose(logprobs, full_logp[np.asarray(tokens)], atol=1e-5)


def test_sampled_distribution_is_the_reported_one_at_152k_vocab():
    """Total variation between the distribution the draw follows and exp(reported logprobs)
    at Qwen's V = 151,936. The draw is Gumbel-max over block log-masses, then over the chosen
    block's logits, so it follows softmax(block lse)[b] x softmax(block b)[j] exactly (given
    exact Gumbel noise, see the next test); that product is computed here in float64 from the
    sampler's own fp32 block quantities. The inverse-CDF draw it replaces was off by 2.4e-3 on
    these logits (2^-23 uniform steps and a non-monotone fp32 cumsum)."""
    from rl_tpu.rollout.decoding import truncate, two_level_logits

    v = 151936
    rng = np.random.RandomState(0)
    logits = jax.numpy.asarray((rng.randn(3, v) * 3).astype(np.float32))
    top_p, top_k = np.array([1.0, 0.9, 1.0], np.float32), np.array([-1, -1, 1000], np.int32)
    candidates = truncate(logits, top_p, top_k)
    block_lse, blocks = (np.asarray(x, np.float64) for x in two_level_logits(candidates))
    p_block = np.exp(block_lse - np.logaddexp.reduce(block_lse, axis=-1, keepdims=True))
    with np.errstate(invalid="ignore"):  # blocks with every token truncated: 0 / 0
        p_inside = np.exp(blocks - np.logaddexp.reduce(blocks, axis=-1, keepdims=True))
    drawn = np.nan_to_num(p_block[:, :, None] * p_inside).reshape(3, -1)[:, :v]
    # reported: log softmax of the whole vocab (what logprobs_of computes), renormalised over
    # the kept tokens for the truncated rows
    reported = np.exp(np.asarray(logits - jax.nn.logsumexp(logits, -1, keepdims=True),
                                 np.float64))
    kept = np.isfinite(np.asarray(candidates))
    assert kept[0].all() and 1000 < kept[1].sum() < v and kept[2].sum() == 1000
    target = np.where(kept, reported, 0.0)
    target /= target.sum(-1, keepdims=True)
    tv = 0.5 * np.abs(drawn - target).sum(-1)
    assert np.all(tv < 1e-5), tv


def test_gumbel_noise_reaches_the_far_tail():
    """The draw is exact only as far as the Gumbel noise is: its upper tail (E = -log U near
    0) must be resolved far below float32's 2^-23 uniform steps."""
    from rl_tpu.rollout.decoding import gumbel_from_bits

    hi = np.array([0, 0, 0, 1 << 8, 0xFFFFFFFF], np.uint32)
    lo = np.array([1, 2, 1 << 20, 0, 0xFFFFFFFF], np.uint32)
    g = np.asarray(gumbel_from_bits(hi, lo), np.float64)
    u = np.array([2.0 ** -56, 2.0 ** -55, 2.0 ** -36, 2.0 ** -24])  # 1 - U for the first four
    np.testing.assert_allclose(g[:4], -np.log(-np.log1p(-u)), rtol=1e-6)
    assert g[0] > 38 and np.isfinite(g[4]) and g[4] < -2.7  # 1 - U clamped below 1
    # and in bulk, the standard Gumbel CDF exp(-exp(-g)) (Kolmogorov-Smirnov, n = 1e5)
    bits = np.asarray(jax.random.bits(jax.random.key(0), (2, 100000), jax.numpy.uint32))
    sample = np.sort(np.asarray(gumbel_from_bits(bits[0], bits[1]), np.float64))
    cdf = np.exp(-np.exp(-sample))
    ks = np.max(np.abs(cdf - np.arange(1, sample.size + 1) / sample.size))
    assert ks < 1.95 / np.sqrt(sample.size)  # p ~ 1e-3


def test_draws_at_152k_vocab_land_on_the_right_tokens():
    """The block/offset arithmetic at full size: four likely tokens in different blocks (one in
    the padded last block), the rest e^-40 below: every draw is one of the four, at their odds."""
    from jax.scipy.stats import chi2

    from rl_tpu.rollout.decoding import sample_next

    v, b = 151936, 64
    heads, probs = np.array([7, 70000, 151000, 151935]), np.array([.4, .3, .2, .1])
    logits = np.full((b, v), -40.0, np.float32)
    logits[:, heads] = np.log(probs)
    keys = jax.vmap(jax.random.key)(jax.numpy.arange(b))
    tokens, _ = jax.jit(sample_next)(logits, np.ones(b, np.float32), np.ones(b, np.float32),
                                     np.full(b, -1, np.int32), keys)
    tokens = np.asarray(tokens)
    assert np.isin(tokens, heads).all()
    counts = np.array([(tokens == h).sum() for h in heads])
    assert float(chi2.sf(np.sum((counts - b * probs) ** 2 / (b * probs)), 3)) > 1e-3, counts


def test_results_declare_the_full_logprob_convention(setup):
    res = gen(setup, PROMPTS[:1], max_new_tokens=2, temperature=1.0, top_p=0.5, seed=1)[0]
    assert res.logprob_convention == "full"


# ------------------------------------------------------------------ min_new_tokens


def test_min_new_tokens_holds_off_likely_stops(setup):
    """A third of the vocab ends a sample (eos is likely): without min_new_tokens samples stop
    within a few tokens; with k, none stops (nor samples a stop id) before k tokens."""
    sampler = JaxSampler(setup["cfg"], setup["params"], tokenizer=setup["tok"])
    sampler.eos_ids = tuple(range(0, 320, 3))
    stops, k = set(sampler.eos_ids), 6
    run = lambda **kw: sampler.generate([GenerateRequest(PROMPTS[0], SamplingParams(  # noqa
        max_new_tokens=12, temperature=1.0, n=8, seed=3, **kw))])
    assert min(len(r.output_ids) for r in run()) < k
    held = run(min_new_tokens=k)
    for res in held:
        assert len(res.output_ids) >= k and not stops & set(res.output_ids[:k])
        assert (res.finish_reason == "stop") == (res.output_ids[-1] in stops)
    # per-row arrays: other values compile nothing new
    sizes = prefill._cache_size(), decode._cache_size()
    run(min_new_tokens=2)
    run(min_new_tokens=11)
    assert (prefill._cache_size(), decode._cache_size()) == sizes
    # stop_token_ids are held off as well, and the request's min applies per row
    sampler.eos_ids = ()
    rows = sampler.generate([GenerateRequest(PROMPTS[0], SamplingParams(
        max_new_tokens=12, temperature=1.0, n=8, seed=3, min_new_tokens=m,
        stop_token_ids=tuple(stops))) for m in (0, k)])
    assert min(len(r.output_ids) for r in rows[:8]) < k
    assert all(len(r.output_ids) >= k and not stops & set(r.output_ids[:k]) for r in rows[8:])


def test_min_new_tokens_reports_the_penalised_logprob(setup):
    """As SGLang: before the minimum the stop ids' logits are -inf, so a greedy sample takes
    the best other token and reports its logprob under that penalised distribution."""
    first = gen(setup, PROMPTS[:1], max_new_tokens=1, **GREEDY)[0].output_ids[0]
    sampler = JaxSampler(setup["cfg"], setup["params"], tokenizer=setup["tok"])
    sampler.eos_ids = (first,)
    res = sampler.generate([GenerateRequest(PROMPTS[0], SamplingParams(
        max_new_tokens=6, min_new_tokens=1, temperature=0.0))])[0]
    x = np.zeros((1, len(PROMPTS[0]) + 6), np.int32)
    x[0, :len(PROMPTS[0])] = PROMPTS[0]
    logits = np.array(setup["forward"](setup["params"], x))[0, len(PROMPTS[0]) - 1]
    logits[first] = -np.inf
    assert res.output_ids[0] == int(np.argmax(logits)) != first
    np.testing.assert_allclose(res.logprobs[0], logits.max() - np.logaddexp.reduce(logits),
                               atol=1e-5)


def test_submit_is_generate_without_blocking(setup):
    requests = [GenerateRequest(p, SamplingParams(max_new_tokens=6, **GREEDY)) for p in PROMPTS]
    future = setup["sampler"].submit(requests)
    other = setup["sampler"].submit(requests[:1])  # a second one queued beside it
    done = future.result(timeout=300)
    assert [r.output_ids for r in done] == [r.output_ids for r in
                                            setup["sampler"].generate(requests)]
    assert other.result(timeout=300)[0].output_ids == done[0].output_ids and future.done()
