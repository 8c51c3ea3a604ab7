"""Judge verdict parsers and prompts (rl_tpu/rewards/judge.py), by hand: the exact formats,
case and spaces, reasoning around the verdict, two verdicts (refused), none, garbage."""

import pytest

from rl_tpu.rewards import judge
from rl_tpu.rewards.judge import Verdict, parse_pairwise, parse_pointwise


@pytest.mark.parametrize("text,value", [
    ("[[YES]]", True),
    ("[[NO]]", False),
    ("[[yes]]", True),  # case does not matter
    ("[[ No ]]", False),  # nor spaces inside the brackets
    ("  [[YES]]\n", True),
    ("The reply names 7, the largest of the list. [[YES]]", True),  # reasoning first
    ("[[NO]] because 5 < 7.", False),  # or after
    ("[[YES]] ... so again: [[yes]]", True),  # the same verdict twice is one verdict
    ("[[[NO]]]", False),  # extra brackets around the token
])
def test_pointwise_reads_the_bracketed_verdict(text, value):
    verdict = parse_pointwise(text)
    assert verdict == Verdict(text, value, "")
    assert verdict.ok


@pytest.mark.parametrize("text,error", [
    ("", "no verdict"),
    ("yes", "no verdict"),  # a bare word is not the format
    ("Verdict: yes", "no verdict"),
    ("[YES]", "no verdict"),  # single brackets
    ("[[YES]] [[NO]]", "ambiguous: the reply names 2 different verdicts ([[YES]], [[NO]])"),
    ("[[NO]]\n...on reflection [[YES]]", "ambiguous"),
    ("[[MAYBE]]", "[[MAYBE]] is not a verdict here"),
    ("[[YES]] [[MAYBE]]", "[[MAYBE]] is not a verdict here"),  # a hedge through a new word
    ("[[A]]", "[[A]] is not a verdict here"),  # the pairwise verdicts are not pointwise ones
    ("[[]]", "[[]] is not a verdict here"),
    ("[[Y E S]]", "no verdict"),
])
def test_pointwise_refuses_anything_else_and_says_why(text, error):
    verdict = parse_pointwise(text)
    assert verdict.value is None and not verdict.ok
    assert verdict.text == text and error in verdict.error


@pytest.mark.parametrize("not_text", [None, 1, b"[[YES]]", ["[[YES]]"]])
def test_a_reply_that_is_not_text_is_unparseable(not_text):
    verdict = parse_pointwise(not_text)
    assert verdict.value is None and "not text" in verdict.error
    assert parse_pairwise(not_text).value is None


@pytest.mark.parametrize("text,value", [
    ("[[A]]", "A"),
    ("[[B]]", "B"),
    ("[[b]]", "B"),
    ("[[ A ]]", "A"),
    ("Reply A says 5 but 7 is larger, so B is right. [[B]]", "B"),  # bare letters are reasoning
    ("[[A]]\n\n[[A]]", "A"),
])
def test_pairwise_reads_the_bracketed_letter(text, value):
    assert parse_pairwise(text) == Verdict(text, value, "")


@pytest.mark.parametrize("text,error", [
    ("A", "no verdict: the reply names none of [[A]] or [[B]]"),
    ("B.", "no verdict"),
    ("Answer: (B)", "no verdict"),
    ("[[A]] or [[B]]", "ambiguous: the reply names 2 different verdicts ([[A]], [[B]])"),
    ("[[B]] [[A]]", "ambiguous: the reply names 2 different verdicts ([[B]], [[A]])"),
    ("[[TIE]]", "[[TIE]] is not a verdict here (one of [[A]] or [[B]])"),  # ties not offered
    ("[[C]]", "[[C]] is not a verdict here"),
    ("[[YES]]", "[[YES]] is not a verdict here"),
    ("\x00\x1b[[\ud800]]", "[[\ud800]] is not a verdict here"),
    ("x" * 10_000, "no verdict"),
])
def test_pairwise_refuses_anything_else_and_says_why(text, error):
    verdict = parse_pairwise(text)
    assert verdict.value is None and error in verdict.error


def test_a_tie_is_a_verdict_only_where_offered():
    assert parse_pairwise("[[TIE]]", allow_tie=True).value == "TIE"
    assert parse_pairwise("[[tie]]", allow_tie=True).value == "TIE"
    assert parse_pairwise("[[A]] [[TIE]]", allow_tie=True).value is None  # still ambiguous
    assert parse_pairwise("[[TIE]]").value is None


def test_pairwise_messages_are_the_system_format_and_the_material():
    assert judge.pairwise_messages("Which number is largest? 3 7", "3", "7") == [
        {"role": "system", "content": "You are a judge. Read the question and the two replies, "
                                      "A and B, and decide which reply is better. Give your "
                                      "verdict as [[A]] or [[B]]."},
        {"role": "user", "content": "Question:\nWhich number is largest? 3 7\n\nReply A:\n3\n\n"
                                    "Reply B:\n7\n\nWhich reply is better? Answer [[A]] or "
                                    "[[B]]."}]
    tie = judge.pairwise_messages("q", "a", "b", allow_tie=True)
    assert "[[TIE]]" in tie[0]["content"] and tie[1]["content"].endswith(
        "Answer [[A]], [[B]] or [[TIE]].")


def test_pointwise_messages_are_the_system_format_and_the_material():
    system, user = judge.pointwise_messages("2 + 2?", "4")
    assert system == {"role": "system", "content": judge.POINTWISE_SYSTEM}
    assert "[[YES]] or [[NO]]" in system["content"]
    assert user == {"role": "user", "content": "Question:\n2 + 2?\n\nReply:\n4\n\nIs the reply "
                                               "correct? Answer [[YES]] or [[NO]]."}


def test_chat_messages_render_as_text():
    one = [{"role": "user", "content": "2 + 2?"}]
    turns = [{"role": "assistant", "content": "search[2+2]"}, {"role": "tool", "content": "4"},
             {"role": "assistant", "content": "4"}]
    assert judge.render(one) == "2 + 2?"
    assert judge.render(turns) == "assistant: search[2+2]\n\ntool: 4\n\nassistant: 4"
    for bad in ([], [{"role": "user"}], [{"content": "x"}], 3):
        with pytest.raises(ValueError, match="string or a non-empty list"):
            judge.render(bad)
