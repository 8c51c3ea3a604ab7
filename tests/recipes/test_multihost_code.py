"""The code env on two processes (jax.distributed on loopback, fake CPU devices): each host
runs its own rollouts' programs in its own sandbox pool, and the run must give what one
process of as many devices gives (rewards and evals equal: they come from the sampled programs
and the tests; losses and params to test_multihost's bounds)."""

import pytest

from rl_tpu.metrics import read_metrics
from test_multihost import _run_like_one

# With the rest of the per-recipe 2-process matrix (`-m multihost`): the code env adds no
# trainer mode, only a sandbox pool per host; its 1-process smoke is in test_rl's list.
pytestmark = [pytest.mark.slow, pytest.mark.multihost]


def test_code_rl_trains_like_one_process(tmp_path):
    _run_like_one(tmp_path, "code_grpo.py:smoke")
    records = [r for r in read_metrics(str(tmp_path / "many")) if "rollout/reward" in r]
    assert len(records) == 2  # the smoke's two steps, each scored by the sandbox
