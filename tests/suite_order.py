"""The order tests/conftest.py gives the collected tests (a module of its own: every test
directory's conftest.py is a module named `conftest`, so a test cannot import from this one's)."""


def sglang_venv_tests_last(items) -> bool:
    """Moves the items marked sglang_venv to the end, in place, keeping each side's order;
    whether there were any."""
    needs_venv = [item for item in items if item.get_closest_marker("sglang_venv")]
    marked = {id(item) for item in needs_venv}
    items[:] = [item for item in items if id(item) not in marked] + needs_venv
    return bool(needs_venv)
