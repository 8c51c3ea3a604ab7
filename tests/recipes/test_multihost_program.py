"""An agent program on two processes (jax.distributed on loopback, fake CPU devices): each
host runs its own episodes' programs against a recording endpoint of its own, and the run must
give what one process of as many devices gives (rewards, turns and evals equal: they come from
the sampled tokens, whose seeds are keyed by task and sample, not by host or batch; losses and
params to test_multihost's bounds)."""

import pytest

from rl_tpu.metrics import read_metrics
from test_multihost import _run_like_one

pytestmark = pytest.mark.slow


def test_agent_program_trains_like_one_process(tmp_path):
    _run_like_one(tmp_path, "agent_program.py:smoke")
    records = [r for r in read_metrics(str(tmp_path / "many")) if "rollout/reward" in r]
    assert len(records) == 2 and all(r["rollout/turns"] == 2.0 for r in records)
