"""Schedules: the horizon stages and SIRI's generation budget, values worked out by hand."""

import pytest

from rl_tpu import schedules
from rl_tpu.schedules import budget_phase, generation_budget, horizon


def budgets(kind, low, high, period, start="long", stairs=4, steps=None):
    return [generation_budget(t, kind, low, high, period, start, stairs)
            for t in range(steps or period)]


def test_horizon_stages():
    # turns (6, 13, 20) every 100: steps 0-99 -> 6, 100-199 -> 13, 200 on -> 20
    assert [horizon(s, (6, 13, 20), 100, 1) for s in (0, 99, 100, 199, 200, 10_000)] == [
        6, 6, 13, 13, 20, 20]
    assert horizon(5, (), 100, 7) == 7  # no stages: the env's fixed limit
    with pytest.raises(ValueError, match="horizon_every"):
        horizon(0, (6,), 0, 1)


def test_off_is_the_fixed_budget_whatever_the_other_keys():
    # budget "" ignores budget_min / period / start (they are unread then)
    assert budgets("", 0, 64, 1, "sideways", 0, steps=3) == [64, 64, 64]


def test_stair_halves():
    # P = 4: steps 0, 1 in the first half (2t < 4), 2, 3 in the second; long first = 64 then 8
    assert budgets("stair", 8, 64, 4, steps=6) == [64, 64, 8, 8, 64, 64]
    assert budgets("stair", 8, 64, 4, "short", steps=6) == [8, 8, 64, 64, 8, 8]
    # odd P = 5: 2t < 5 for t = 0, 1, 2, so the first half is the longer (3 steps)
    assert budgets("stair", 8, 64, 5) == [64, 64, 64, 8, 8]


def test_cosine_values():
    # L = 8 + 56 (1 + cos(2 pi t / 8)) / 2:
    #   t=0: 8 + 56 = 64; t=1: cos = 0.70711 -> 8 + 56 * 0.85355 = 55.80 -> 56
    #   t=2: cos = 0 -> 8 + 28 = 36; t=3: cos = -0.70711 -> 8 + 56 * 0.14645 = 16.20 -> 16
    #   t=4: cos = -1 -> 8; then back up symmetrically
    assert budgets("cosine", 8, 64, 8) == [64, 56, 36, 16, 8, 16, 36, 56]
    # short first: the cosine flipped, (1 - cos) / 2
    assert budgets("cosine", 8, 64, 8, "short") == [8, 16, 36, 56, 64, 56, 36, 16]
    # rounding is half up: L = 2 + (1 + cos(pi / 2)) / 2 = 2.5 -> 3 (round() would give 2)
    assert generation_budget(1, "cosine", 2, 3, 4) == 3


def test_stair_cosine_holds_the_cosine_at_each_stairs_first_step():
    # P = 8, 4 stairs of 2 steps starting at t = 0, 2, 4, 6: cosine there is 64, 36, 8, 36
    assert budgets("stair_cosine", 8, 64, 8) == [64, 64, 36, 36, 8, 8, 36, 36]
    # 3 stairs over P = 8: stair k holds t with floor(3t / 8) = k -> t 0-2, 3-5, 6-7; their
    # first steps ceil(8k / 3) = 0, 3, 6 read the cosine 64, 16.20 -> 16, 36
    assert budgets("stair_cosine", 8, 64, 8, stairs=3) == [64, 64, 64, 16, 16, 16, 36, 36]


@pytest.mark.parametrize("kind", schedules.BUDGET_KINDS)
@pytest.mark.parametrize("start", schedules.BUDGET_STARTS)
def test_every_schedule_is_periodic_and_within_bounds(kind, start):
    # a pure function of the step: a resumed run at step t + P sees what step t saw
    values = budgets(kind, 12, 100, 10, start, 2, steps=30)
    assert values[:10] == values[10:20] == values[20:]
    # 2 stairs of 5 steps start at t = 0 and 5, where the cosine is at one end or the other
    assert min(values) == 12 and max(values) == 100


def test_phases():
    # a long-first stair sits at the long budget first (expansion), then at the short one
    assert [budget_phase(t, "stair", 4)[0] for t in range(4)] == list("eecc")
    assert [budget_phase(t, "stair", 4, "short")[0] for t in range(4)] == list("ccee")
    # a long-first cosine falls from the long budget first (compression), then rises
    assert [budget_phase(t, "cosine", 4)[0] for t in range(4)] == list("ccee")
    assert [budget_phase(t, "stair_cosine", 4, "short")[0] for t in range(4)] == list("eecc")
    assert budget_phase(3, "", 4) == "fixed"


@pytest.mark.parametrize("args, key", [
    (("stairs", 8, 64, 10), "schedules.budget="),
    (("stair", 0, 64, 10), "budget_min=0"),
    (("stair", 65, 64, 10), "budget_min=65"),
    (("cosine", 8, 64, 1), "budget_period=1"),
    (("cosine", 8, 64, 10, "middle"), "budget_start"),
    (("stair_cosine", 8, 64, 10, "long", 1), "budget_stairs=1"),
    (("stair_cosine", 8, 64, 10, "long", 11), "budget_stairs=11"),
])
def test_bad_settings_name_the_key(args, key):
    with pytest.raises(ValueError, match=key):
        generation_budget(0, *args)


def test_config_check_refuses_a_bad_schedule_before_anything_runs():
    from rl_tpu.recipes.config import base_config, check

    c = base_config("dr_grpo")
    c.schedules.budget = "stair"  # budget_min left at 0
    with pytest.raises(ValueError, match="budget_min"):
        check(c)
    c.schedules.budget_min = 8
    check(c)
    c.algo.overlong_buffer = 8  # DAPO's buffer must fit inside the shortest budget
    with pytest.raises(ValueError, match="overlong_buffer"):
        check(c)
