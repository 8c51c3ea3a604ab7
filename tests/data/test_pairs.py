"""Preference-pair JSONL reader, pairs_from_scores and SSRM selection, checked by hand."""

import json
import math
import os

import numpy as np
import pytest

from rl_tpu.data.pairs import (PreferencePair, pairs_from_scores, read_preference_pairs,
                               write_preference_pairs)
from rl_tpu.rl.reward_losses import select_pseudo_labels

GOOD = {"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "5"}


def write_lines(path, lines):
    path.write_text("\n".join(l if isinstance(l, str) else json.dumps(l, ensure_ascii=False)
                              for l in lines) + "\n", encoding="utf-8")
    return str(path)


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


# ----------------------------------------------------------------------------- reader


def test_reader_happy_path(tmp_path):
    chat_prompt = [{"role": "system", "content": "Be brief."}, user("Capital of France?")]
    multi_turn = [assistant("<tool>search</tool>"), {"role": "tool", "content": "Paris"},
                  assistant("Paris ✓")]
    path = write_lines(tmp_path / "p.jsonl", [
        GOOD,
        "",  # blank lines are skipped and still counted in line numbers
        {"prompt": chat_prompt, "chosen": multi_turn, "rejected": "", "margin": 2,
         "split": "eval", "source": "hh", "margin_note": None},
        {**GOOD, "margin": None, "split": None},
    ])
    pairs = read_preference_pairs(path)
    assert len(pairs) == 3
    a, b, c = pairs
    assert a.prompt == [user("What is 2 + 2?")]
    assert a.chosen == [assistant("4")] and a.rejected == [assistant("5")]
    assert (a.margin, a.split, a.extra, a.where) == (None, None, {}, f"{path}:1")
    assert a.chosen_conversation == [user("What is 2 + 2?"), assistant("4")]
    assert b.prompt == chat_prompt and b.chosen == multi_turn
    assert b.rejected == [assistant("")]  # an empty reply is a legitimate (bad) reply
    assert b.margin == 2.0 and isinstance(b.margin, float) and b.split == "eval"
    assert b.extra == {"source": "hh", "margin_note": None}
    assert b.where == f"{path}:3"
    assert b.rejected_conversation == chat_prompt + [assistant("")]
    assert (c.margin, c.split) == (None, None)
    assert [p.where for p in read_preference_pairs(path, split="eval")] == [f"{path}:3"]


def test_write_reads_back_equal(tmp_path):
    first = read_preference_pairs(write_lines(tmp_path / "a.jsonl", [
        GOOD, {**GOOD, "margin": 0.5, "split": "train", "id": 7}]))
    write_preference_pairs(str(tmp_path / "b.jsonl"), first)
    again = read_preference_pairs(str(tmp_path / "b.jsonl"))
    strip = [PreferencePair(**{**vars(p), "where": ""}) for p in first]
    assert [PreferencePair(**{**vars(p), "where": ""}) for p in again] == strip


@pytest.mark.parametrize("line, match", [
    ('{"prompt": "x"', "is not valid JSON"),
    ("[1, 2]", "is a JSON list, not an object"),
    ({"prompt": "x", "chosen": "a"}, r"has no 'rejected' field \(it has \['chosen', 'prompt'\]\)"),
    ({**GOOD, "prompt": 3}, "'prompt' must be a string or a list of chat messages .*, got int 3"),
    ({**GOOD, "prompt": "  "}, "'prompt' is empty"),
    ({**GOOD, "prompt": []}, "'prompt' is an empty message list"),
    ({**GOOD, "prompt": ["hi"]}, r"prompt\[0\] must be an object"),
    ({**GOOD, "prompt": [{"role": "", "content": "x"}]}, r"prompt\[0\] has an empty 'role'"),
    ({**GOOD, "chosen": [{"role": "assistant"}]}, r"chosen\[0\] needs a string 'content', "
                                                  "got nothing"),
    ({**GOOD, "chosen": [{"role": "assistant", "content": 4}]}, r"chosen\[0\] needs a string "
                                                                "'content', got int"),
    ({**GOOD, "chosen": [user("x")]}, "'chosen' must start with the assistant's message"),
    ({**GOOD, "rejected": 5}, "'rejected' must be a string or a list"),
    ({**GOOD, "rejected": None}, "'rejected' must be a string or a list .* got null"),
    ({**GOOD, "margin": "big"}, "'margin' must be a number"),
    ({**GOOD, "margin": True}, "'margin' must be a number"),
    ('{"prompt": "x", "chosen": "a", "rejected": "b", "margin": NaN}', "'margin' must be finite"),
    ({**GOOD, "split": "test"}, "'split' must be one of"),
    ({**GOOD, "rejected": [assistant("4")]}, "'chosen' and 'rejected' are the same reply"),
])
def test_reader_errors_name_line_and_field(tmp_path, line, match):
    path = write_lines(tmp_path / "bad.jsonl", [GOOD, line])  # the bad line is line 2
    with pytest.raises(ValueError, match=match) as e:
        read_preference_pairs(path)
    assert str(e.value).startswith(f"{path}:2")


def test_reader_file_level_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_preference_pairs(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="holds no preference pairs"):
        read_preference_pairs(write_lines(tmp_path / "blank.jsonl", ["", "  "]))
    path = write_lines(tmp_path / "train.jsonl", [GOOD])
    with pytest.raises(ValueError, match="no preference pairs with split 'eval'"):
        read_preference_pairs(path, split="eval")
    with pytest.raises(ValueError, match="split must be one of"):
        read_preference_pairs(path, split="dev")


def test_identical_sides_can_be_skipped(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [{**GOOD, "rejected": "4"}, GOOD])
    assert [p.where for p in read_preference_pairs(path, skip_identical=True)] == [f"{path}:2"]


# ----------------------------------------------------------------------------- pairs_from_scores


def test_pairs_from_scores_by_hand():
    system_prompt = [{"role": "system", "content": "s"}, user("q1")]
    prompts = ["q0", system_prompt, "q2", "q3", "q4"]
    replies = [["a", "b", "c"], ["x", "y"], ["t1", "t2"], ["u", "v", "w", "z"],
               ["crash", "good", [assistant("bad")]]]
    scores = [[0.5, 1.0, 0.0],          # best b (1.0), worst c (0.0)
              [1, 1],                    # all tie: no pair
              [0.2, None],               # one scored reply: no pair
              [0.0, 1.0, 1.0, 0.0],      # first of equals: best v (index 1), worst u (index 0)
              np.array([np.nan, 2.0, 1.0], np.float32)]  # NaN is unscored: good vs bad
    pairs = pairs_from_scores(prompts, replies, scores)
    assert [(p.where, p.chosen[0]["content"], p.rejected[0]["content"]) for p in pairs] == [
        ("prompt 0", "b", "c"), ("prompt 3", "v", "u"), ("prompt 4", "good", "bad")]
    assert pairs[0].prompt == [user("q0")]
    assert pairs[0].extra == {"chosen_score": 1.0, "rejected_score": 0.0}
    assert pairs[2].extra == {"chosen_score": 2.0, "rejected_score": 1.0}
    assert all(p.margin is None for p in pairs)


def test_pairs_from_scores_errors():
    with pytest.raises(ValueError, match="2 prompts, 1 reply lists, 1 score lists"):
        pairs_from_scores(["a", "b"], [["x"]], [[1.0]])
    with pytest.raises(ValueError, match="prompt 0 has 2 replies but 1 scores"):
        pairs_from_scores(["a"], [["x", "y"]], [[1.0]])
    with pytest.raises(ValueError, match="prompt 0 reply 1 has score 'high'"):
        pairs_from_scores(["a"], [["x", "y"]], [[1.0, "high"]])
    with pytest.raises(ValueError, match="reply 0 has score inf"):
        pairs_from_scores(["a"], [["x", "y"]], [[math.inf, 1.0]])


# ----------------------------------------------------------------------------- SSRM selection

# Five unlabelled pairs (a, b), d = r_a - r_b:
#   0: d = ln 3  -> a chosen, confidence 1 / (1 + 1/3) = 0.75 exactly
#   1: d = -ln 4 -> b chosen, confidence 1 / (1 + 1/4) = 0.8
#   2: d = 0     -> tie: a reported, confidence 0.5, never kept
#   3: d = -3    -> b chosen, confidence sigmoid(3) = 0.9525741
#   4: d = 0.5   -> a chosen, confidence sigmoid(0.5) = 0.6224593
SCORE_A = np.array([math.log(3.0), 0.0, 1.0, 0.0, 0.5])
SCORE_B = np.array([0.0, math.log(4.0), 1.0, 3.0, 0.0])
TRUTH = np.array([0, 0, 1, 1, 0])


def test_ssrm_threshold_keeps_equality():
    sel = select_pseudo_labels(SCORE_A, SCORE_B, threshold=0.75, true_chosen_index=TRUTH)
    np.testing.assert_array_equal(sel.chosen_index, [0, 1, 0, 1, 0])
    np.testing.assert_array_equal(sel.rejected_index, [1, 0, 1, 0, 1])
    np.testing.assert_allclose(sel.confidence, [0.75, 0.8, 0.5, 0.9525741, 0.6224593], atol=1e-7)
    np.testing.assert_array_equal(sel.kept, [True, True, False, True, False])  # 0.75 >= 0.75
    s = sel.summary
    assert (s["pool"], s["kept"], s["ties"]) == (5.0, 3.0, 1.0)
    assert s["kept_fraction"] == pytest.approx(0.6)
    assert s["mean_confidence"] == pytest.approx((0.75 + 0.8 + 0.9525741) / 3)  # 0.8341914
    # kept pairs 0, 1, 3: pseudo (0, 1, 1) vs truth (0, 0, 1) -> 2 of 3
    assert s["pseudo_label_accuracy"] == pytest.approx(2 / 3)
    # just above 0.75 drops pair 0; 0.5 keeps every pair but the tie
    above = select_pseudo_labels(SCORE_A, SCORE_B, threshold=0.75 + 1e-9)
    np.testing.assert_array_equal(above.kept, [False, True, False, True, False])
    assert "pseudo_label_accuracy" not in above.summary
    np.testing.assert_array_equal(select_pseudo_labels(SCORE_A, SCORE_B, threshold=0.5).kept,
                                  [True, True, False, True, True])


def test_ssrm_top_fraction():
    # floor(0.4 * 5) = 2 most confident: pair 3 (0.95), pair 1 (0.8)
    sel = select_pseudo_labels(SCORE_A, SCORE_B, top_fraction=0.4)
    np.testing.assert_array_equal(sel.kept, [False, True, False, True, False])
    # both options: top 2 and confidence >= 0.85 -> pair 3 only
    both = select_pseudo_labels(SCORE_A, SCORE_B, top_fraction=0.4, threshold=0.85)
    np.testing.assert_array_equal(both.kept, [False, False, False, True, False])
    # equal confidences: the earlier pair wins; floor(1/3 * 3) = 1
    even = select_pseudo_labels([1.0, 0.0, 1.0], [0.0, 1.0, 0.0], top_fraction=1 / 3)
    np.testing.assert_array_equal(even.kept, [True, False, False])
    # floor(0.3 * 10) is 3 although 0.3 * 10 = 2.9999999999999996 in floats
    assert select_pseudo_labels(np.arange(10.0), np.zeros(10), top_fraction=0.3).summary[
        "kept"] == 3.0


def test_ssrm_nothing_kept_gives_nan_summaries():
    sel = select_pseudo_labels(SCORE_A, SCORE_B, top_fraction=0.0, true_chosen_index=TRUTH)
    assert not sel.kept.any() and sel.summary["kept"] == 0.0
    assert math.isnan(sel.summary["mean_confidence"])
    assert math.isnan(sel.summary["pseudo_label_accuracy"])


def test_ssrm_is_deterministic():
    one = select_pseudo_labels(SCORE_A, SCORE_B, threshold=0.6, top_fraction=0.8)
    two = select_pseudo_labels(SCORE_A, SCORE_B, threshold=0.6, top_fraction=0.8)
    for x, y in zip(one[:4], two[:4]):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("kwargs, match", [
    ({}, "needs threshold"),
    ({"threshold": 0.4}, r"threshold must be in \[0.5, 1\]"),
    ({"top_fraction": 1.5}, r"top_fraction must be in \[0, 1\]"),
    ({"threshold": 0.5, "score_b": np.zeros(4)}, r"score_b must be 1-D \[N\]=5"),
    ({"threshold": 0.5, "score_a": [0.0, np.nan, 0.0, 0.0, np.inf]},
     r"score_a is not finite at pair\(s\) \[1, 4\]"),
    ({"threshold": 0.5, "true_chosen_index": [0, 1, 2, 0, 0]}, "true_chosen_index must be"),
])
def test_ssrm_bad_input(kwargs, match):
    args = {"score_a": SCORE_A, "score_b": SCORE_B, **kwargs}
    with pytest.raises(ValueError, match=match):
        select_pseudo_labels(args.pop("score_a"), args.pop("score_b"), **args)


def test_make_dataset_checks_pairs_and_fills_in_their_splits(tmp_path):
    import subprocess
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    lines = [{"prompt": f"q{i}", "chosen": "good", "rejected": "bad"} for i in range(5)]
    lines[3]["split"] = "eval"
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run = subprocess.run([sys.executable, "-m", "launch.make_dataset", f"--jsonl={src}",
                          "--pairs", f"--out={tmp_path / 'out'}", "--eval_fraction=0.5"],
                         cwd=repo, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    # line 3's own split, plus round(0.5 * 4) = 2 of the other four
    assert "train: 2 pairs" in run.stdout and "eval: 3 pairs" in run.stdout
    written = read_preference_pairs(str(tmp_path / "out" / "user_tasks.jsonl"))
    assert sorted(p.split for p in written) == ["eval"] * 3 + ["train"] * 2
    assert any(p.split == "eval" and p.prompt[0]["content"] == "q3" for p in written)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "q", "chosen": "a"}\n')
    run = subprocess.run([sys.executable, "-m", "launch.make_dataset", f"--jsonl={bad}",
                          "--pairs", f"--out={tmp_path / 'out2'}"], cwd=repo,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "bad.jsonl:1" in run.stderr
