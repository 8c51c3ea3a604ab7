"""A mixture of experts' routed experts over HTTP in SGLang's format (`return_routed_experts`,
`meta_info["routed_experts"]`, base64 int32 [positions, layers, k]): rl_tpu's server sends
what its sampler recorded, the SGLang client reads it back into the trainer's layers, and what
cannot be read is an error naming why. (Real SGLang 0.5.23 records them on NVIDIA GPUs only:
on CPU its server does not start with --enable-return-routed-experts.)"""

import base64

import numpy as np
import pytest

from rl_tpu.core.engine import GenerateRequest, RolloutError, SamplingParams
from rl_tpu.models import tiny
from rl_tpu.models.moe import MoeConfig
from rl_tpu.rollout import routed_experts
from rl_tpu.rollout.sampler import JaxSampler
from rl_tpu.rollout.server import RolloutService, serve
from rl_tpu.rollout.sglang import SGLangEngine

# layer 1 dense: SGLang's layout has its row, the trainer's does not
CFG = tiny.tiny_config("qwen3_moe", vocab_size=320, num_layers=3, moe=MoeConfig(
    num_experts=8, top_k=2, intermediate_size=32, mlp_only_layers=(1,)))
PROMPTS = [[5, 6, 7, 8], list(range(20, 33))]


def greedy(routing):
    return SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True,
                          return_routed_experts=routing)


@pytest.fixture(scope="module")
def server():
    params = tiny.random_params(CFG, seed=0)
    service = RolloutService(JaxSampler(CFG, params, prefix_cache_tokens=0), "", None)
    http = serve(service, "127.0.0.1", 0)
    http.start()
    yield dict(url=http.url, params=params)
    http.shutdown()
    service.batcher.close()


def test_the_client_reads_what_the_sampler_recorded(server):
    engine = SGLangEngine([server["url"]], model_config=CFG, request_timeout_s=120)
    direct = JaxSampler(CFG, server["params"], prefix_cache_tokens=0)
    want = direct.generate([GenerateRequest(p, greedy(True)) for p in PROMPTS])
    got = engine.generate([GenerateRequest(p, greedy(True)) for p in PROMPTS])
    for g, w, prompt in zip(got, want, PROMPTS):
        assert g.output_ids == w.output_ids
        assert g.routed_experts.shape == (len(prompt) + 5 - 1, 2, 2)  # 2 sparse layers, top-2
        np.testing.assert_array_equal(g.routed_experts, w.routed_experts)
        assert (g.routed_experts >= 0).all()  # no reuse: every fed position was computed
    plain = engine.generate([GenerateRequest(PROMPTS[0], greedy(False))])[0]
    assert plain.routed_experts is None


def test_the_wire_is_sglangs_layout_every_layer_a_row():
    routed = np.arange(4 * 2 * 2, dtype=np.int32).reshape(4, 2, 2) % 8
    full = np.frombuffer(base64.b64decode(routed_experts.encode(routed, CFG)), np.int32)
    full = full.reshape(4, 3, 2)
    np.testing.assert_array_equal(full[:, [0, 2]], routed)
    assert (full[:, 1] == -1).all()  # the dense layer
    np.testing.assert_array_equal(routed_experts.decode(routed_experts.encode(routed, CFG), 4,
                                                        CFG), routed)


def test_what_cannot_be_read_is_refused_naming_why(server):
    text = routed_experts.encode(np.zeros((4, 2, 2), np.int32), CFG)
    with pytest.raises(ValueError, match="serves another model than the trainer's"):
        routed_experts.decode(text, 5, CFG)
    with pytest.raises(ValueError, match="names expert 9, but the model has 8"):
        routed_experts.decode(routed_experts.encode(np.full((4, 2, 2), 9, np.int32), CFG), 4,
                              CFG)
    with pytest.raises(ValueError, match="not base64"):
        routed_experts.decode("not base64!", 4, CFG)
    engine = SGLangEngine([server["url"]], model_config=CFG, request_timeout_s=120)
    result = engine.parse_sample({"meta_info": {
        "finish_reason": {"type": "length"}, "output_token_logprobs": [[-1.0, 3, None]],
        "prompt_tokens": 2}})
    with pytest.raises(RolloutError, match="--enable-return-routed-experts"):
        engine._read_routing(result, "http://sglang")


def test_a_dense_server_refuses_the_flag():
    cfg = tiny.tiny_config("qwen2", vocab_size=320)
    service = RolloutService(JaxSampler(cfg, tiny.random_params(cfg), prefix_cache_tokens=0),
                             "", None)
    http = serve(service, "127.0.0.1", 0)
    http.start()
    try:
        engine = SGLangEngine([http.url], model_config=cfg, request_timeout_s=120)
        with pytest.raises(RolloutError, match="not a mixture of experts"):
            engine.generate([GenerateRequest(PROMPTS[0], greedy(True))])
    finally:
        http.shutdown()
        service.batcher.close()
