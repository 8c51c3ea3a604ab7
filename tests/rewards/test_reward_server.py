"""The reward server (rl_tpu/rewards/server.py) over loopback HTTP, and its client
(remote.py): token-exact scores, SGLang's classify format, coalesced concurrent requests that
each get their own rows, limits and bad input named in 400s, and an RL config whose reward.urls
pays what the local scorer pays."""

import concurrent.futures
import dataclasses
import json
import math
import socket
import threading
import time

import httpx
import jax
import numpy as np
import pytest

from rl_tpu.models import reward_model as rm
from rl_tpu.models import tiny
from rl_tpu.models.tiny_tokenizer import build_tokenizer
from rl_tpu.models.tokenizer import load_tokenizer
from rl_tpu.recipes import config_checks, input_checks
from rl_tpu.recipes.config import base_config
from rl_tpu.rewards import remote
from rl_tpu.rewards.mix import RewardMix
from rl_tpu.rewards.scorer import RewardScorer
from rl_tpu.rewards.server import CoalescingScorer, RewardLimits, RewardService, serve
from test_scoring import trajectory, unreplied

from rl_tpu.train.rollout_batch import NO_LOSS

V = 320
LIMITS = RewardLimits(max_sequences=8, max_sequence_tokens=64, max_request_tokens=200)


def write_reward_model(path, num_labels=1, labels=()):
    cfg = tiny.tiny_config("qwen2", vocab_size=V, hidden_size=32, intermediate_size=64,
                           num_layers=1, head_dim=8, max_position_embeddings=128)
    params = rm.reward_params_from(tiny.random_params(cfg, seed=0, scale=0.2), cfg, num_labels,
                                   stddev=0.5)
    rm.save(str(path), cfg, params, rm.RewardHead(num_labels, 0, tuple(labels)),
            tokenizer=build_tokenizer(V))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("rm") / "model"
    write_reward_model(path)
    scorer = RewardScorer.from_dir(str(path), jax.local_devices()[:1], tokens_per_batch=1024)
    service = RewardService(scorer, str(path), load_tokenizer(str(path)), LIMITS)
    http = serve(service, "127.0.0.1", 0)
    url = http.start()
    # the reference: the same directory loaded again, scored in this process
    local = RewardScorer.from_dir(str(path), jax.local_devices()[:1])
    yield dict(url=url, path=str(path), local=local, service=service, tok=service.tokenizer)
    http.shutdown()


def post(server, path, body):
    reply = httpx.post(server["url"] + path, json=body, timeout=60)
    return reply.status_code, reply.json()


def sequences(lengths, seed=0):
    rng = np.random.RandomState(seed)
    return [rng.randint(3, V, n).tolist() for n in lengths]


def test_score_is_the_local_scorers_of_the_same_ids(server):
    seqs = sequences([5, 40, 17, 1, 64])
    status, reply = post(server, "/score", {"input_ids": seqs})
    assert status == 200 and reply["num_labels"] == 1 and reply["model"] == server["path"]
    np.testing.assert_allclose(np.asarray(reply["scores"]), server["local"].score(seqs),
                               atol=1e-5)


def test_classify_of_text_scores_the_tokenizers_ids_in_sglangs_format(server):
    texts = ["The answer is 4.", "a longer reply, with more words in it than the first"]
    status, reply = post(server, "/v1/classify", {"model": "rm", "input": texts})
    assert status == 200
    ids = [server["tok"].encode(t) for t in texts]
    expected = server["local"].score(ids)
    assert reply["object"] == "list" and reply["id"].startswith("classify-")
    assert isinstance(reply["created"], int) and reply["model"] == server["path"]
    assert reply["usage"] == {"prompt_tokens": sum(map(len, ids)),
                              "total_tokens": sum(map(len, ids)), "completion_tokens": 0,
                              "prompt_tokens_details": None}
    for i, item in enumerate(reply["data"]):
        # one label: softmax over one score is 1, as SGLang answers; the score rides beside
        assert item == {"index": i, "label": "LABEL_0", "probs": [1.0], "num_classes": 1,
                        "scores": pytest.approx(expected[i].tolist(), abs=1e-5)}
    status, one = post(server, "/v1/classify", {"input": texts[0]})  # a string: one item
    assert status == 200 and len(one["data"]) == 1
    # alone, the text runs in a batch of another shape than beside the longer one: XLA's
    # kernels for it round in other last bits (1.4e-6 on an AVX-512 CPU)
    assert one["data"][0]["scores"] == pytest.approx(reply["data"][0]["scores"], abs=1e-5)
    status, by_ids = post(server, "/v1/classify", {"input": ids[1]})  # token ids, as SGLang
    assert status == 200 and by_ids["data"][0]["scores"] == pytest.approx(
        reply["data"][1]["scores"], abs=1e-5)


def test_classify_probs_are_the_softmax_of_the_labels_scores(tmp_path):
    write_reward_model(tmp_path, 3, ("bad", "ok", "good"))
    scorer = RewardScorer.from_dir(str(tmp_path), jax.local_devices()[:1])
    service = RewardService(scorer, str(tmp_path))
    try:
        # scores 0, ln 2, ln 5: exp gives 1, 2, 5 -> probs 1/8, 2/8, 5/8, argmax "good"
        reply = service.classify_reply([[4, 5]], np.asarray([[0.0, math.log(2), math.log(5)]]))
        item = reply["data"][0]
        assert item["probs"] == pytest.approx([0.125, 0.25, 0.625], abs=1e-12)
        assert item["label"] == "good" and item["num_classes"] == 3
        assert reply["usage"]["prompt_tokens"] == 2
        assert service.model_info()["labels"] == ["bad", "ok", "good"]
        assert service.model_info()["is_generation"] is False
    finally:
        service.close()


class BlockingScorer:
    """Scores a sequence as the sum of its ids; the first call waits for `release`."""

    def __init__(self):
        self.calls, self.release, self.entered = [], threading.Event(), threading.Event()

    def score(self, seqs):
        self.calls.append(len(seqs))
        self.entered.set()
        self.release.wait(10)
        return np.asarray([[float(sum(s))] for s in seqs], np.float32)


def test_requests_waiting_together_are_scored_in_one_call_each_getting_its_rows():
    scorer = BlockingScorer()
    batcher = CoalescingScorer(scorer)
    try:
        first = batcher.submit([[1, 2]])
        assert scorer.entered.wait(10)  # the first call runs and holds the thread
        later = [batcher.submit([[i], [i, 100]]) for i in range(15)]
        scorer.release.set()
        assert first.result(10).tolist() == [[3.0]]
        for i, future in enumerate(later):
            assert future.result(10).tolist() == [[float(i)], [float(i + 100)]]
        assert scorer.calls == [1, 30]  # 15 requests of 2 sequences: one call
        assert (batcher.batches, batcher.sequences) == (2, 31)
    finally:
        batcher.close()
    assert not batcher.alive()


def test_concurrent_clients_each_get_their_own_rows(server):
    seqs = sequences(list(range(2, 34, 2)), seed=1)  # 16 distinct sequences
    expected = server["local"].score(seqs)
    before = server["service"].load()
    start = threading.Barrier(len(seqs))

    def client(i):
        start.wait()
        return post(server, "/score", {"input_ids": [seqs[i]]})

    with concurrent.futures.ThreadPoolExecutor(len(seqs)) as pool:
        replies = list(pool.map(client, range(len(seqs))))
    for i, (status, reply) in enumerate(replies):
        assert status == 200
        assert reply["scores"][0] == pytest.approx(expected[i].tolist(), abs=1e-5)
    after = server["service"].load()
    assert after["sequences_scored"] - before["sequences_scored"] == 16
    assert 1 <= after["batches"] - before["batches"] <= 16


@pytest.mark.parametrize("body, named", [
    ({"input_ids": sequences([2] * 9)},
     "'input_ids': 9 sequences are over this server's limit of 8 a request (--max_sequences)"),
    ({"input_ids": sequences([3, 65])},
     "'input_ids[1]': 65 tokens are over this server's limit of 64 a sequence "
     "(--max_sequence_tokens"),
    ({"input_ids": sequences([60, 60, 60, 60])},
     "'input_ids': 240 tokens are over this server's limit of 200 a request "
     "(--max_request_tokens)"),
    ({"input_ids": [[5], []]}, "'input_ids[1]' must be a non-empty list of token ids, got []"),
    ({"input_ids": [[5, 6, V]]},
     f"'input_ids[0][2]' must be a token id in [0, {V}) (the model's vocab), got {V}"),
    ({"input_ids": [[5, -1]]}, f"'input_ids[0][1]' must be a token id in [0, {V})"),
    ({"input_ids": [["a"]]}, "'input_ids[0][0]' must be a token id (an integer), got 'a'"),
    ({"input_ids": [[True]]}, "'input_ids[0][0]' must be a token id (an integer), got True"),
    ({"input_ids": [[1.5]]}, "'input_ids[0][0]' must be a token id (an integer), got 1.5"),
    ({"input_ids": 7}, "'input_ids' must be a non-empty list of token-id lists, got 7"),
    ({"input_ids": []}, "'input_ids' must be a non-empty list of token-id lists, got []"),
    ({}, "'input_ids' is missing"),
])
def test_score_over_a_limit_or_malformed_is_a_400_naming_it(server, body, named):
    status, reply = post(server, "/score", body)
    assert status == 400 and named in reply["error"]["message"], reply


@pytest.mark.parametrize("body, named", [
    ({"input": ""}, "'input' encodes to no tokens"),
    ({"input": ["fine", 5]}, "'input[1]' must be a string, got 5"),
    ({"input": 5}, "'input' must be a string, a non-empty list of strings or of token ids"),
    ({"input": []}, "'input' must be a string, a non-empty list of strings or of token ids"),
    ({"input": ["x"] * 9}, "'input': 9 sequences are over this server's limit of 8"),
    ({"input": "word " * 80}, "'input[0]': "),  # over 64 tokens
    ({"model": "rm"}, "'input' is missing"),
])
def test_classify_bad_input_is_a_400_naming_the_field(server, body, named):
    status, reply = post(server, "/v1/classify", body)
    assert status == 400 and named in reply["error"]["message"], reply


def test_the_server_answers_info_health_and_errors_in_its_shape(server):
    info = httpx.get(server["url"] + "/get_model_info").json()
    assert info["num_labels"] == 1 and info["labels"] == ["LABEL_0"]
    assert info["is_generation"] is False and info["model_path"] == server["path"]
    assert info["limits"] == {"max_sequences": 8, "max_sequence_tokens": 64,
                              "max_request_tokens": 200}
    assert httpx.get(server["url"] + "/health").status_code == 200
    bad = httpx.post(server["url"] + "/score", content=b"{nope")
    assert bad.status_code == 400 and "not JSON" in bad.json()["error"]["message"]
    missing = httpx.get(server["url"] + "/nowhere")
    assert missing.status_code == 404 and missing.json()["error"]["message"]


def test_shutdown_finishes_and_stops_the_scoring_thread(server):
    service = RewardService(server["service"].scorer, server["path"])
    http = serve(service, "127.0.0.1", 0)
    url = http.start()
    assert httpx.post(url + "/score", json={"input_ids": [[4, 5]]}).status_code == 200
    http.shutdown()
    assert not service.batcher.alive()
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=2)


def dead_url():
    import socket
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_remote_scorer_splits_by_the_servers_limits_and_fails_over(server):
    seqs = sequences([30] * 7 + [2] * 13, seed=2)  # 210 + 26 tokens, 20 sequences
    url = server["url"]
    twice = url.replace("127.0.0.1", "localhost")  # the same server under a second name
    scorer = remote.RemoteRewardScorer([dead_url(), url, twice], retries=2, backoff_s=0.01)
    try:
        assert scorer.num_labels == 1 and scorer.head.num_labels == 1
        # 6 x 30 = 180 tokens; the 7th would pass 200; then 8 sequences at most a request
        assert scorer.chunks([30] * 7 + [2] * 13) == [(0, 6), (6, 14), (14, 20)]
        np.testing.assert_allclose(scorer.score(seqs), server["local"].score(seqs), atol=1e-5)
        assert scorer.score([]).shape == (0, 1)
        with pytest.raises(remote.RewardServerError, match=r"HTTP 400: 'input_ids\[0\]': 65 "
                           "tokens .*--max_sequence_tokens") as err:
            scorer.score([[3] * 65])
        assert err.value.status == 400 and err.value.url in (url, twice)
        assert str(err.value).startswith(f"POST {err.value.url}/score failed with HTTP 400")
    finally:
        scorer.close()
    nobody = remote.RemoteRewardScorer([dead_url()], retries=1, backoff_s=0.01)
    with pytest.raises(remote.RewardServerError, match="after 2 attempts.*launch.serve_reward"):
        nobody.score([[1]])


def test_reward_urls_pay_what_the_local_scorer_pays(server, tmp_path):
    config = base_config()
    config.reward.urls = server["url"]
    config.reward.rule_weight, config.reward.model_weight = 0.5, 2.0
    config_checks.check(config)
    input_checks.check_inputs(config)  # probes the server: up, a reward model
    seqs = sequences([6, 20, 3], seed=3)
    remote_trajs = [trajectory(s, r) for s, r in zip(seqs, (1.0, 0.0, 1.0))]
    local_trajs = [trajectory(s, r) for s, r in zip(seqs, (1.0, 0.0, 1.0))]
    RewardMix.from_config(config, devices=None).apply(remote_trajs)
    RewardMix(server["local"], 0.5, 2.0).apply(local_trajs)
    scores = server["local"].score(seqs)[:, 0]
    for mine, theirs, rule, score in zip(remote_trajs, local_trajs, (1.0, 0.0, 1.0), scores):
        assert mine.reward == pytest.approx(0.5 * rule + 2.0 * float(score), abs=1e-5)
        assert mine.reward == pytest.approx(theirs.reward, abs=1e-5)
    config.reward.model_path = server["path"]
    with pytest.raises(ValueError, match="reward.model_path=.* and reward.urls=.*not both"):
        config_checks.check(config)
    config.reward.model_path, config.reward.urls = "", "garbage"
    with pytest.raises(ValueError, match="reward.urls: reward server url must look like"):
        config_checks.check(config)
    config.reward.urls = dead_url()
    with pytest.raises(ValueError, match="reward.urls: no reward server answers at"):
        input_checks.check_inputs(config)


class GatedScorer:
    """The real scorer behind a gate: the scoring thread blocks in score() until the test
    opens it, so requests queue behind it; `scored` keeps what each call scored."""

    def __init__(self, scorer):
        self.scorer, self.gate, self.entered, self.scored = (scorer, threading.Event(),
                                                             threading.Event(), [])

    def __getattr__(self, name):
        return getattr(self.scorer, name)

    def score(self, seqs):
        self.entered.set()
        assert self.gate.wait(60)
        self.scored.append([list(s) for s in seqs])
        return self.scorer.score(seqs)


def wait_for(condition, what, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture
def gated(server, request):
    """A server of its own whose scoring thread waits at a gate (`limits`: the param)."""
    scorer = GatedScorer(server["local"])
    service = RewardService(scorer, server["path"], None, request.param)
    http = serve(service, "127.0.0.1", 0)
    url = http.start()
    yield scorer, service, url
    scorer.gate.set()
    http.shutdown()


def hold_the_scoring_thread(scorer, url):
    """A request the thread takes and holds at the gate; its thread."""
    holder = threading.Thread(target=httpx.post, args=(url + "/score",),
                              kwargs=dict(json={"input_ids": [[7, 8]]}, timeout=60))
    holder.start()
    assert scorer.entered.wait(30)
    return holder


@pytest.mark.parametrize("gated", [LIMITS], indirect=True)
def test_a_request_whose_client_left_is_dropped_before_it_is_scored(gated):
    scorer, service, url = gated
    holder = hold_the_scoring_thread(scorer, url)
    host, port = url.removeprefix("http://").split(":")
    for i in range(5):  # each queued behind the holder, then its client leaves
        body = json.dumps({"input_ids": [[9, 10, 11 + i]]}).encode()
        before = service.load()["queued_requests"]
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                         % len(body) + body)
            wait_for(lambda: service.load()["queued_requests"] > before, "it to be queued")
        time.sleep(0.05)
    wait_for(lambda: service.load()["queued_requests"] == 1, "the departed to be let go")
    scorer.gate.set()
    holder.join(60)
    status, reply = post(dict(url=url), "/score", {"input_ids": [[5, 6]]})
    assert status == 200
    assert scorer.scored == [[[7, 8]], [[5, 6]]]  # the five left unscored


@pytest.mark.parametrize("gated", [dataclasses.replace(LIMITS, max_queued_requests=2)],
                         indirect=True)
def test_a_full_server_answers_503_with_retry_after_and_the_client_retries(gated, server):
    scorer, service, url = gated
    holder = hold_the_scoring_thread(scorer, url)
    queued = threading.Thread(target=httpx.post, args=(url + "/score",),
                              kwargs=dict(json={"input_ids": [[3, 4]]}, timeout=60))
    queued.start()
    wait_for(lambda: service.load()["queued_requests"] == 2, "two requests held")
    start = time.monotonic()
    refused = httpx.post(url + "/score", json={"input_ids": [[5, 6]]}, timeout=60)
    assert time.monotonic() - start < 5  # at once, not after the queue
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert "--max_queued_requests=2" in refused.json()["error"]["message"]
    # the trainer's client waits as asked and sends again
    client = remote.RemoteRewardScorer(url, retries=5)
    try:
        client.info()
        later = concurrent.futures.ThreadPoolExecutor(1).submit(client.score, [[5, 6]])
        time.sleep(0.5)
        scorer.gate.set()
        np.testing.assert_allclose(later.result(60), server["local"].score([[5, 6]]),
                                   atol=1e-5)
    finally:
        client.close()
    holder.join(60)
    queued.join(60)


def test_the_remote_scorer_is_never_sent_an_episode_without_a_reply(server):
    scorer = remote.RemoteRewardScorer(server["url"])
    seqs = sequences([5, 9], seed=4)
    failed = unreplied([], "env_error")
    trajs = [trajectory(seqs[0], 1.0), failed, trajectory(seqs[1], 0.0)]
    try:
        RewardMix(scorer, 0.5, 2.0).apply(trajs)  # the server would answer the empty one 400
    finally:
        scorer.close()
    scores = server["local"].score(seqs)[:, 0]
    assert [trajs[0].reward, trajs[2].reward] == pytest.approx(
        [0.5 + 2.0 * scores[0], 2.0 * scores[1]], abs=1e-5)
    assert failed.info[NO_LOSS] and failed.reward == 0.0


def test_a_reward_model_of_another_tokenizer_is_refused_at_start(server, tmp_path):
    """Two real tokenizers (the tiny BPE at two vocab sizes: other merges, other ids): a
    reward model, local or served, whose tokenizer is not the policy's is refused by the
    config key that names it; the policy's own passes; one that only adds tokens passes."""
    from rl_tpu.models.tokenizer import ChatTokenizer
    same, other = ChatTokenizer(build_tokenizer(V)), ChatTokenizer(build_tokenizer(512))
    for key, value in (("model_path", server["path"]), ("urls", server["url"])):
        config = base_config()
        config.reward[key] = value
        config.reward.model_weight = 1.0
        with pytest.raises(ValueError, match=rf"reward.{key}=.*the reward model's tokenizer is "
                                             r"not the policy's \(a probe text encodes to"):
            RewardMix.from_config(config, jax.local_devices()[:1], policy_tokenizer=other)
        mix = RewardMix.from_config(config, jax.local_devices()[:1], policy_tokenizer=same)
        assert mix is not None and mix.scorer is not None
    from rl_tpu.rewards.tokenizer_match import fingerprint, mismatch
    policy = fingerprint(same)
    padded = dict(policy, vocab_size=V + 1, special_ids=dict(policy["special_ids"], x=V))
    assert mismatch(policy, padded) is None
    renumbered = dict(policy, special_ids={t: i + 1 for t, i in policy["special_ids"].items()})
    assert "special token" in mismatch(policy, renumbered)
    assert "fewer than" in mismatch(policy, dict(policy, vocab_size=V - 1))


def test_a_few_rows_pad_to_their_own_power_of_two_not_a_full_batch(server):
    scorer = RewardScorer.from_dir(server["path"], jax.local_devices()[:2], tokens_per_batch=256)
    # rows_for(16) = min(64, 256 // 16) = 16; rows_for(128) = 2; at least a row a device
    assert [scorer.padded_rows(n, 16) for n in (1, 2, 3, 5, 16)] == [2, 2, 4, 8, 16]
    assert [scorer.padded_rows(n, 128) for n in (1, 2)] == [2, 2]
    seqs = sequences([3, 9, 100, 17, 5])  # batches of 1 (bucket 128), 1 (32), 3 (16) rows
    np.testing.assert_allclose(scorer.score(seqs), server["local"].score(seqs), atol=1e-5)
    service = RewardService(scorer, server["path"],
                            limits=RewardLimits(max_sequence_tokens=64))
    try:
        # buckets 16, 32, 64 (rows_for 16, 8, 4): 1, 2, 4.. rows padded to >= 2 devices,
        # rows 2, 4, 8, 16 + 2, 4, 8 + 2, 4
        assert service.warmup()["programs"] == 4 + 3 + 2
    finally:
        service.close()


def test_a_server_with_a_key_scores_for_the_client_that_sends_it(server, monkeypatch):
    service = RewardService(server["service"].scorer, server["path"])
    http = serve(service, "127.0.0.1", 0, api_key="secret")
    url = http.start()
    try:
        with pytest.raises(remote.RewardServerError, match="HTTP 401: missing API key"):
            remote.RemoteRewardScorer(url).score([[4, 5]])
        monkeypatch.setenv(remote.API_KEY_ENV, "secret")  # as an RL run's client reads it
        keyed = remote.RemoteRewardScorer(url)
        np.testing.assert_allclose(keyed.score([[4, 5]]), server["local"].score([[4, 5]]),
                                   atol=1e-5)
        keyed.close()
    finally:
        http.shutdown()
