"""Metric reductions (rl_tpu.rl.masked): parts of a batch combine by each metric's own tag."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_tpu.rl import masked


def close(actual, expected):
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=1e-6, atol=1e-7)


def parts():
    of = masked.Metric.of
    # Part a saw 3 tokens, part b 1 token, part c none (an empty micro-batch: its values are
    # garbage, NaN or 0 by the empty-mask convention, and must not count).
    return [
        {"clip_frac": of(0.5, "mean", 3.0), "ratio_max": of(1.5, "max", 3.0),
         "ratio_min": of(0.7, "min", 3.0), "skipped": of(0.0, "sum"), "lr": of(1e-3, "last")},
        {"clip_frac": of(1.0, "mean", 1.0), "ratio_max": of(1.2, "max", 1.0),
         "ratio_min": of(0.9, "min", 1.0), "skipped": of(1.0, "sum"), "lr": of(2e-3, "last")},
        {"clip_frac": of(np.nan, "mean", 0.0), "ratio_max": of(0.0, "max", 0.0),
         "ratio_min": of(0.0, "min", 0.0), "skipped": of(0.0, "sum"), "lr": of(3e-3, "last")},
    ]


def test_combine_metrics_by_tag():
    out = masked.combine_metrics(parts())
    # mean by weight: (0.5 * 3 + 1.0 * 1 + (part c: weight 0, skipped)) / 4 = 2.5 / 4 = 0.625
    close(out["clip_frac"].value, 0.625)
    close(out["clip_frac"].weight, 4.0)
    # extremes over the parts that saw tokens: max(1.5, 1.2) = 1.5; min(0.7, 0.9) = 0.7 (the
    # empty part's 0 would otherwise win the min)
    close(out["ratio_max"].value, 1.5)
    close(out["ratio_min"].value, 0.7)
    close(out["skipped"].value, 1.0)        # a count: 0 + 1 + 0
    close(out["lr"].value, 3e-3)            # the latest part's value
    assert out["skipped"].reduce == "sum"
    flat = masked.metric_values(out)
    assert set(flat) == {"clip_frac", "ratio_max", "ratio_min", "skipped", "lr"}
    close(flat["clip_frac"], 0.625)


def test_combined_results_combine_again_and_stacked_form_agrees():
    # (a, b) then c equals (a, b, c): weights carry over, so levels nest (micro-batches ->
    # minibatches -> epochs).
    a, b, c = parts()
    nested = masked.combine_metrics([masked.combine_metrics([a, b]), c])
    flat = masked.combine_metrics([a, b, c])
    for key in flat:
        close(nested[key].value, float(flat[key].value))
    # A scan's stacked output ([N] per leaf) reduces the same way, under jit too.
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), a, b, c)
    out = jax.jit(masked.combine_stacked)(stacked)
    for key in flat:
        close(out[key].value, float(flat[key].value))


def test_metric_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown metric reduction 'avg'"):
        masked.Metric.of(1.0, "avg")
    with pytest.raises(ValueError, match="metric 'x' has different reductions"):
        masked.combine_metrics([{"x": masked.Metric.of(1.0, "max")},
                                {"x": masked.Metric.of(1.0, "min")}])
