"""Real SGLang 0.5.23 (CPU, `--is-embedding`) serving a reward model that rl_tpu exported, its
scores against rl_tpu's own RewardScorer on the same token ids.

Where SGLang puts a reward model's score: `/classify` and `/encode` (native, same handler) and
`/v1/embeddings` answer each sequence's raw head output, [C] floats, as its "embedding".
`/v1/classify` answers only softmax(scores) and the argmax label, so for one label it is
always probs [1.0] and carries no reward.

What SGLang does with the score head: its Qwen2ForSequenceClassification
(sglang/srt/models/qwen2_classification.py, line 46; Qwen3's alike) builds
`nn.Linear(hidden_size, num_labels)`, a bias included, where transformers' head has none;
a checkpoint without `score.bias` (as transformers writes them) leaves that bias at torch's
random init, uniform in +-1/sqrt(hidden_size), drawn from the server's seed (random unless
--random-seed), and qwen2.py's `_legacy_load_weights` says nothing of it. So rl_tpu's `save`
writes a zero `score.bias` for these families (transformers ignores it, rl_tpu's `load`
accepts it when zero): the exported dir as it is scores as rl_tpu does, and a dir without the
tensor scores off by one constant a server start.
"""

import math
import os
import shutil
import sys

import httpx
import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "rollout"))

from rl_tpu.models import reward_model as rm  # noqa: E402
from rl_tpu.models import tiny  # noqa: E402
from rl_tpu.models.tiny_tokenizer import build_tokenizer  # noqa: E402
from rl_tpu.rewards.scorer import RewardScorer  # noqa: E402

from sglang_server import start_sglang_server  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("rollout_servers"), pytest.mark.sglang_venv]

V, D = 320, 32
# Both sides float32 (SGLang started with --dtype float32); they differ only in kernel order
# (torch's SDPA and matmuls against XLA's). Scores here are a few units, so float32 rounding
# (eps 1.2e-7) gives ~1e-6 (measured: at most 9.5e-7, a ulp or two); 1e-4 leaves room for
# other CPUs' kernels and still catches a wrong pooled token (these scores differ by > 0.05)
# or a head bias (SGLang's unloaded one is ~0.06 at this seed).
SCORE_ATOL = 1e-4
# lengths 1 (the pooled token is the only one), short, mid, and near max_position_embeddings
LENGTHS = (1, 7, 30, 100)
SEED = 0  # SGLang's --random-seed: its unloaded bias is then the same every run


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny random Qwen2ForSequenceClassification (1 label) as rl_tpu.models.reward_model
    .save writes it, the sequences to score, and rl_tpu's scores of them."""
    path = str(tmp_path_factory.mktemp("rm") / "exported")
    cfg = tiny.tiny_config("qwen2", vocab_size=V, hidden_size=D, intermediate_size=64,
                           num_layers=1, head_dim=8, max_position_embeddings=128)
    params = rm.reward_params_from(tiny.random_params(cfg, seed=0, scale=0.2), cfg, 1,
                                   stddev=0.5)
    rm.save(path, cfg, params, rm.RewardHead(1), tokenizer=build_tokenizer(V))
    rng = np.random.RandomState(0)
    seqs = [rng.randint(3, V, n).tolist() for n in LENGTHS]
    local = RewardScorer.from_dir(path, jax.local_devices()[:1]).score(seqs)  # [N, 1]
    assert local.shape == (len(LENGTHS), 1)
    # distinct scores, so matching them means each sequence's own last token was pooled
    assert np.min(np.diff(np.sort(local[:, 0]))) > 0.05, local
    return dict(path=path, seqs=seqs, local=local)


def without_score_bias(src: str, dst: str) -> str:
    """A copy of the exported dir without its zero score.bias: a transformers-written dir."""
    from safetensors.numpy import load_file, save_file
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    assert not tensors.pop(rm.SCORE_BIAS).any()  # rl_tpu's export: zero
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def classify(url, seqs):
    """SGLang's native /classify on token ids -> [N, C] raw scores."""
    reply = httpx.post(url + "/classify", json={"input_ids": seqs}, timeout=120)
    assert reply.status_code == 200, reply.text
    return np.asarray([item["embedding"] for item in reply.json()], np.float64)


def test_sglang_scores_the_exported_dir_as_rl_tpu_does(exported):
    seqs, local = exported["seqs"], exported["local"]
    with start_sglang_server(exported["path"], "--is-embedding",
                             "--random-seed", str(SEED)) as server:
        native = classify(server.url, seqs)
        np.testing.assert_allclose(native, local, rtol=0, atol=SCORE_ATOL)
        # the OpenAI-style embeddings route answers the same raw score
        reply = httpx.post(server.url + "/v1/embeddings", json={"model": "rm", "input": seqs},
                           timeout=120)
        assert reply.status_code == 200, reply.text
        data = sorted(reply.json()["data"], key=lambda item: item["index"])
        np.testing.assert_allclose([item["embedding"] for item in data], native, atol=1e-6)
        # ... and /v1/classify only the softmax over one label: 1.0, whatever the score
        reply = httpx.post(server.url + "/v1/classify", json={"model": "rm", "input": seqs[2]},
                           timeout=120)
        assert reply.status_code == 200, reply.text
        item = reply.json()["data"][0]
        assert item["probs"] == [1.0] and item["label"] == "LABEL_0"
        assert "scores" not in item and "embedding" not in item


def test_sglang_adds_its_unloaded_random_bias_to_a_dir_without_one(exported, tmp_path):
    if not os.path.exists(os.path.join(exported["path"], "model.safetensors")):
        pytest.fail("rl_tpu's save wrote no single model.safetensors; adapt the copy above")
    served = without_score_bias(exported["path"], str(tmp_path / "no_bias"))
    seqs, local = exported["seqs"], exported["local"]
    with start_sglang_server(served, "--is-embedding", "--random-seed", str(SEED)) as server:
        offset = classify(server.url, seqs) - local
    # one constant for every sequence: a bias on the head, not a different trunk
    assert np.ptp(offset) < 2 * SCORE_ATOL, offset
    # not zero, and inside torch's nn.Linear bias init, uniform(-1/sqrt(D), 1/sqrt(D))
    assert 1e-3 < abs(offset.mean()) <= 1 / math.sqrt(D), offset
