"""benchmarks/side_process.py: the run order of the rounds, each side's environment, the
median, and a child process's result (peak RSS and load added) read back by the parent."""

import os
import sys
import textwrap

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks import side_process  # noqa: E402


def test_rounds_alternate_which_side_goes_first():
    assert list(side_process.round_order(3)) == [
        (0, "jax"), (0, "torch"), (1, "torch"), (1, "jax"), (2, "jax"), (2, "torch")]
    assert list(side_process.round_order(2, ("jax",))) == [(0, "jax"), (1, "jax")]


def test_torch_waits_passively_on_every_core_and_jax_keeps_its_defaults(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    torch_env, jax_env = side_process.side_env("torch"), side_process.side_env("jax")
    assert torch_env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert torch_env["OMP_NUM_THREADS"] == str(side_process.cores())
    assert "OMP_WAIT_POLICY" not in jax_env


def test_median_of_odd_and_even_counts():
    assert side_process.median([3.0, 1.0, 2.0]) == 2.0
    assert side_process.median([4.0, 1.0, 3.0, 2.0]) == 2.5  # (2 + 3) / 2
    with pytest.raises(ValueError):
        side_process.median([])


def test_load_range_spans_every_childs_start_and_end():
    results = [{"load": [1.25, 2.0]}, {"load": [0.5, 3.0]}]
    assert side_process.load_range(results) == "0.5-3.0"


def _child_script(tmp_path, body: str) -> str:
    """A child in side_process's protocol: --side, --spec, --result."""
    path = tmp_path / "child.py"
    path.write_text(textwrap.dedent(f"""
        import json, os, sys
        sys.path.insert(0, {os.path.dirname(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__))))!r})
        from benchmarks import side_process
        args = dict(a.lstrip("-").split("=", 1) for a in sys.argv[1:])
        spec = side_process.read_spec(args["spec"])
    """) + textwrap.dedent(body))
    return str(path)


def test_a_child_result_comes_back_with_its_peak_rss_and_load(tmp_path):
    script = _child_script(tmp_path, """
        block = bytearray(64 << 20)  # 64 MiB touched, so the peak RSS is at least that
        side_process.write_result(args["result"], dict(
            twice=2 * spec["x"], side=args["side"],
            wait=os.environ.get("OMP_WAIT_POLICY"), extra=os.environ.get("EXTRA")), 0.5)
    """)
    out = side_process.run_side(script, "torch", {"x": 21}, timeout_s=60,
                                extra_env={"EXTRA": "yes"})
    assert (out["twice"], out["side"], out["wait"], out["extra"]) == (42, "torch", "PASSIVE",
                                                                      "yes")
    assert out["peak_rss_mib"] >= 64
    assert out["load"][0] == 0.5 and out["load"][1] >= 0


def test_a_failed_child_stops_the_benchmark(tmp_path):
    script = _child_script(tmp_path, "sys.exit(3)\n")
    with pytest.raises(SystemExit, match="jax side failed \\(exit 3\\)"):
        side_process.run_side(script, "jax", {}, timeout_s=60)
    with pytest.raises(ValueError, match="side 'numpy'"):
        side_process.run_side(script, "numpy", {})
