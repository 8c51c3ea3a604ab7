"""benchmarks/tipping_report.py's numbers, by hand: when the greedy policy tips, and the
sampled violation rate's drift per 10 steps."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "benchmarks"))

import tipping_report  # noqa: E402

# greedy evals at steps 0, 5, 10: 0, 0.6, 1; sampled at steps 1-4: 0.1, 0.2, 0.3, 0.4 (a
# slope of 0.1 a step: +1.0 per 10 steps); valid replies 0.5 then 1 in the last two evals
RECORDS = ([{"step": 0, "eval/violation_rate": 0.0, "eval/format_valid_rate": 0.5}]
           + [{"step": s, "rollout/violation_rate": s / 10} for s in (1, 2, 3, 4)]
           + [{"step": 5, "eval/violation_rate": 0.6, "eval/format_valid_rate": 1.0},
              {"step": 10, "eval/violation_rate": 1.0, "eval/format_valid_rate": 1.0}])


def test_a_runs_row_by_hand():
    row = tipping_report.seed_row(RECORDS, threshold=0.5, last=2)
    assert row["start"] == 0.0 and row["end"] == 0.8 and row["tipped"] == 5
    assert abs(row["first"] - 0.25) < 1e-12 and abs(row["last"] - 0.25) < 1e-12
    assert abs(row["drift"] - 1.0) < 1e-12 and row["valid"] == 1.0
    assert tipping_report.seed_row(RECORDS, threshold=1.1, last=2)["tipped"] is None


def test_the_table_marks_a_seed_that_never_tipped():
    never = [{"step": 0, "eval/violation_rate": 0.0}, {"step": 1, "rollout/violation_rate": 0.1},
             {"step": 5, "eval/violation_rate": 0.2}]
    lines = tipping_report.table({"plain": [RECORDS, never]}, threshold=0.5, last=1)
    assert lines[2].startswith("| plain | 2 | 0.00 -> 0.60 (1.00, 0.20) | step 5, - |")
