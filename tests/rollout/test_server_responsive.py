"""The rollout server stays responsive under one client's huge or slow prompt: prompt text
too long for the context is refused by its length before any templating or tokenizing, and
what templating and tokenizing a prompt costs runs off the event loop, so /health and a
running stream go on meanwhile."""

import threading
import time

import httpx
import pytest

from rl_tpu.models import hf, tiny
from rl_tpu.models.tokenizer import load_tokenizer
from rl_tpu.rollout.sampler import JaxSampler
from rl_tpu.rollout.server import RolloutService, serve

# A real chat template that takes a while for one message (about 1 s here: what a template
# and tokenizer spend on megabytes of text), and no time for any other.
SLOW_TEMPLATE = ("{% if messages[0]['content'] == 'slow' %}{% for i in range(10000) %}"
                 "{% for j in range(1000) %}{% endfor %}{% endfor %}{% endif %}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("responsive") / "m")
    tiny.write_tiny_model(path, "qwen2", vocab_size=320, seed=0)
    cfg, params = hf.load(path)
    tok = load_tokenizer(path)
    tok.hf.chat_template = SLOW_TEMPLATE + tok.hf.chat_template
    service = RolloutService(JaxSampler(cfg, params, tokenizer=tok), path, tok)
    http = serve(service, "127.0.0.1", 0)
    http.start()
    yield dict(url=http.url, service=service)
    http.shutdown()
    service.batcher.close()


def test_prompt_text_too_long_for_the_context_is_refused_by_its_length_at_once(server):
    """8 MB of chat, 20 MB of completion prompt, 8 MB of /generate text: each a 400 naming
    the bound in well under a second (before: seconds of templating and tokenizing each)."""
    url, service = server["url"], server["service"]
    huge = "word " * ((8 << 20) // 5)
    cases = [("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]},
              "'messages'"),
             ("/v1/completions", {"prompt": ["hi", "x" * (20 << 20)]}, "'prompt[1]'"),
             ("/generate", {"text": huge}, "'text'")]
    for path, body, where in cases:
        start = time.monotonic()
        reply = httpx.post(url + path, json=body, timeout=120)
        took = time.monotonic() - start
        message = reply.json()["error"]["message"]
        assert reply.status_code == 400, message
        assert f"{where}: " in message and "characters of text cannot fit" in message
        assert f"context of {service.context_tokens} tokens" in message
        assert took < 3.0, (path, took)  # the body's transfer and JSON parse, nothing more
    # a prompt within the bound is served as before
    reply = httpx.post(url + "/v1/completions", json={"prompt": "word " * 20, "max_tokens": 2},
                       timeout=120)
    assert reply.status_code == 200, reply.text


def stream_chunk_times(url, times, stop):
    """Streams a long completion, noting when each chunk comes, until `stop` is set (closing
    the stream then aborts its row)."""
    body = {"prompt": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: "):
                times.append(time.monotonic())
            if stop.is_set():
                break


def test_a_slow_template_pauses_neither_health_nor_a_running_stream(server):
    url = server["url"]
    # not timed: compiles what a stream runs, and a chat prompt joining it (a new shape)
    warmed, warm_times = threading.Event(), []
    warm = threading.Thread(target=stream_chunk_times, args=(url, warm_times, warmed))
    warm.start()
    while not warm_times:
        time.sleep(0.01)
    for content in ("fast", "quick"):
        assert httpx.post(url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": content}], "max_tokens": 1},
            timeout=120).status_code == 200
    warmed.set()
    warm.join(120)
    times, stop = [], threading.Event()
    streamer = threading.Thread(target=stream_chunk_times, args=(url, times, stop))
    streamer.start()
    while len(times) < 3:
        assert streamer.is_alive(), "the stream ended before it started"
        time.sleep(0.01)
    slow_reply = {}

    def slow_chat():
        start = time.monotonic()
        slow_reply["reply"] = httpx.post(url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "slow"}], "max_tokens": 1}, timeout=120)
        slow_reply["span"] = (start, time.monotonic())

    slow = threading.Thread(target=slow_chat)
    slow.start()
    health = []
    while slow.is_alive():
        start = time.monotonic()
        assert httpx.get(url + "/health", timeout=120).status_code == 200
        health.append((start, time.monotonic() - start))
        time.sleep(0.02)
    stop.set()
    streamer.join(120)
    start, end = slow_reply["span"]
    assert slow_reply["reply"].status_code == 200, slow_reply["reply"].text
    took = end - start
    assert took > 0.4  # the template was slow: what follows measures something
    # on the event loop (before) each would wait out the whole template
    during = [latency for at, latency in health if at < end]
    assert len(during) >= 5 and max(during) < took / 2, (health, took)
    gaps = [b - a for a, b in zip(times, times[1:]) if start < b < end]
    assert gaps and max(gaps) < took / 2, (max(gaps, default=None), took)
    assert len(times) > 10
