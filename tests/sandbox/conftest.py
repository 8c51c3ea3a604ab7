import pytest

from rl_tpu.sandbox import make_sandbox, sandbox_unavailable_reason


@pytest.fixture(scope="module")
def sandbox():
    """One warm pool for a module's tests: each test also checks that it still serves."""
    reason = sandbox_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with make_sandbox("bubblewrap", pool_size=2) as pool:
        yield pool
