"""benchmarks/bapo_entropy.py's table: the mechanism numbers are ratios of the loss's per-token
means summed over steps, worked out by hand on two logged steps."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "benchmarks"))

import bapo_entropy  # noqa: E402


def test_a_runs_row_by_hand():
    """Two steps: gradient weights (pos, neg) (0.3, 0.1) and (0.1, 0.3): negative share
    0.4 / 0.8 = 0.5; positive p<0.1 tokens 0.2 + 0.2 of which clipped 0.1 + 0: 0.25; negative
    tokens 0.2 + 0.4 (two buckets) of which clipped 0.15: 0.25. Evals at steps 0 and 2; the
    last one alone (--last 1) is the row's."""
    step = lambda s, **kw: dict(step=s, **{f"train/{k}": v for k, v in kw.items()})  # noqa
    records = [
        {"step": 0, "eval/success": 0.1, "eval/pass@8": 0.5, "eval/mean@8": 0.2,
         "eval/distinct@8": 1.0},
        step(1, pg_weight_pos=0.3, pg_weight_neg=0.1, tokens_pos_plow=0.2, clipped_pos_plow=0.1,
             tokens_neg_pmid=0.2, clipped_neg_pmid=0.05, entropy=1.0, bapo_c_low=0.6,
             bapo_c_high=1.4),
        step(2, pg_weight_pos=0.1, pg_weight_neg=0.3, tokens_pos_plow=0.2, clipped_pos_plow=0.0,
             tokens_neg_phigh=0.4, clipped_neg_phigh=0.1, entropy=0.5, bapo_c_low=0.8,
             bapo_c_high=1.2),
        {"step": 2, "eval/success": 0.9, "eval/pass@8": 1.0, "eval/mean@8": 0.8,
         "eval/distinct@8": 2.5},
    ]
    row = bapo_entropy.row(records, last=1)
    assert row["success"] == 0.9 and row["pass"] == 1.0 and row["distinct"] == 2.5
    assert abs(row["neg_share"] - 0.5) < 1e-12
    assert abs(row["clip_pos_low"] - 0.25) < 1e-12
    assert abs(row["clip_neg"] - 0.25) < 1e-12
    assert row["entropy_first"] == 0.75 and abs(row["c_low"] - 0.7) < 1e-12
