"""benchmarks/sandbox.py runs its rounds and counts right: every run of the trivial program is
correct, and the rate is runs over the round's seconds."""

import os
import sys

from sandbox_host_view import needs_bubblewrap

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks import sandbox as sandbox_benchmark  # noqa: E402
from rl_tpu.sandbox import make_sandbox  # noqa: E402


@needs_bubblewrap
def test_a_short_round_of_two_callers_has_no_failures():
    with make_sandbox("bubblewrap", pool_size=2) as sandbox:
        rate, durations, failures = sandbox_benchmark.one_round(sandbox, callers=2, seconds=0.5)
    assert failures == 0 and len(durations) >= 2  # each caller finishes at least its first run
    # The rate is the runs over the round: at least the 0.5 s asked, and no more than the
    # slowest run past it (plus 0.5 s for threads to be scheduled on a loaded machine).
    assert len(durations) / (0.5 + max(durations) + 0.5) <= rate <= len(durations) / 0.5
