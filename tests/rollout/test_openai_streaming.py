"""Streaming pieces (rl_tpu/rollout/streaming.py and the batcher's on_tokens hook): text deltas
that never send what a stop string or an unfinished character would take back, and a
batcher that reports each row's output after its prefill and after every decode chunk."""

import pytest

from rl_tpu.core.engine import GenerateRequest, SamplingParams
from rl_tpu.models import hf, tiny
from rl_tpu.rollout.continuous import ContinuousBatcher
from rl_tpu.rollout.sampler import JaxSampler
from rl_tpu.rollout.streaming import IncrementalText, TextStream

PIECES = {1: "ab", 2: "<", 3: "/e", 4: "nd>", 5: "x", 6: "\ufffd", 7: "é", 8: "<"}


def decode(ids):
    return "".join(PIECES[i] for i in ids)


def test_text_stream_holds_back_what_may_start_a_stop_string():
    stream = TextStream(decode, stops=["</end>"])
    assert stream.advance([1]) == "ab"
    assert stream.advance([1, 2]) == ""  # "<" may open "</end>"
    assert stream.advance([1, 2, 3]) == ""  # "</e" still may
    assert stream.advance([1, 2, 3, 5]) == "</ex"  # "</ex" cannot: all of it goes
    assert stream.sent == "ab</ex"
    # the stop string itself never goes out, nor anything after it
    stream = TextStream(decode, stops=["</end>"])
    assert stream.advance([1, 2, 3, 4, 5]) == "ab"
    assert stream.advance([1, 2, 3, 4, 5, 1]) == ""
    assert stream.finish("ab") == ""  # the final reply is cut there too


def test_text_stream_waits_for_an_unfinished_character_and_finishes_the_rest():
    stream = TextStream(decode)
    assert stream.advance([1, 6]) == "ab"  # U+FFFD at the end: bytes of a character to come
    assert stream.advance([1, 7]) == "é"  # (a tokenizer decodes the finished one)
    assert stream.finish("abé!") == "!"
    assert stream.sent == "abé!"


def test_released_tokens_follow_the_text_sent():
    stream = TextStream(decode, stops=["</end>"])
    stream.advance([1, 2])  # sent "ab": token 1 only (token 2's "<" is held)
    assert stream.released([1, 2]) == (0, 1)
    stream.advance([1, 2, 5])
    assert stream.released([1, 2, 5]) == (1, 3)
    assert stream.released([1, 2, 5]) == (3, 3)


def test_incremental_text_is_the_whole_decode_at_every_length():
    """Against a real byte-level BPE tokenizer, on random ids (byte tokens that split a
    character, specials skipped): after each id the text is what decoding every id gives."""
    import random

    from rl_tpu.models.tiny_tokenizer import build_tokenizer
    from rl_tpu.models.tokenizer import ChatTokenizer
    tok = ChatTokenizer(build_tokenizer(512))
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    rng = random.Random(0)
    text = "héllo wörld 🙂 ünïcode, tabs\tand  spaces 数字 " * 4
    for ids in (tok.encode(text), [rng.randrange(512) for _ in range(300)]):
        incremental = IncrementalText(decode)
        for k in range(1, len(ids) + 1):
            assert incremental.update(ids[:k]) == decode(ids[:k]), k
        assert incremental.ends[-1] == len(decode(ids))
    assert incremental.update([5, 6]) == decode([5, 6])  # ids that do not extend: anew


def test_streaming_a_long_reply_with_logprobs_decodes_linearly():
    """Each chunk's text and released log-probs cost the new ids, not the whole reply again
    (before: released() decoded ids[:k] for every token k, n^2/2 ids for a reply of n)."""
    calls = [0]

    def counting(ids):
        calls[0] += len(ids)
        return decode(ids)

    ids = [(1, 5, 7, 2, 3)[k % 5] for k in range(4000)]
    stream = TextStream(counting, stops=["</end>"])
    for end in range(4, len(ids) + 1, 4):  # a decode chunk of 4 tokens
        stream.advance(ids[:end])
        stream.released(ids[:end])
    assert stream.sent == decode(ids)[:len(stream.sent)] and len(stream.sent) > 5500
    assert stream.tokens_sent > 3990
    assert calls[0] < 20 * len(ids), calls[0]  # was ~8,000,000


@pytest.fixture(scope="module")
def batcher(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("stream") / "m")
    tiny.write_tiny_model(root, "qwen2", vocab_size=320, seed=0)
    cfg, params = hf.load(root)
    b = ContinuousBatcher(JaxSampler(cfg, params), slots=8, slot_tokens=256, decode_chunk=4)
    yield b
    b.close()


def test_batcher_reports_each_row_after_prefill_and_every_chunk(batcher):
    reports = []
    requests = [GenerateRequest([5, 6, 7], SamplingParams(max_new_tokens=13, temperature=1.0,
                                                          seed=3, ignore_eos=True, n=2))]
    ticket = batcher.submit(requests, on_tokens=lambda i, ids, lps: reports.append(
        (i, ids, lps)))
    results = ticket.wait(120)
    plain = batcher.generate(requests, timeout=120)  # no hook: the same samples
    assert [r.output_ids for r in results] == [r.output_ids for r in plain]
    for row, result in enumerate(results):
        seen = [(ids, lps) for i, ids, lps in reports if i == row]
        # the first report is the prefill's one token; then a chunk of 4 at most each time,
        # every report a prefix of the final output, with its log-probs
        assert len(seen[0][0]) == 1
        lengths = [len(ids) for ids, _ in seen]
        assert lengths == sorted(set(lengths)) and lengths[-1] < 13
        assert all(b - a <= 4 for a, b in zip(lengths, lengths[1:]))
        assert len(seen) >= 13 // 4
        for ids, lps in seen:
            assert ids == result.output_ids[:len(ids)]
            assert lps == pytest.approx(result.logprobs[:len(ids)], abs=1e-6)
