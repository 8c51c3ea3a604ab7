"""benchmarks/peers.py: the prompts every side shares, the summary table, and rl_tpu's child
running real GRPO steps on a tiny model and printing its JSON line."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks import peers  # noqa: E402


class ByteTokenizer:
    """Ids are bytes + 3 (0-2 special); "ab" merges into one id, so random ids can fail to
    round-trip (3+97, 3+98 encodes as the merged id) the way a BPE's do."""

    MERGED = 300

    def __len__(self):
        return 301

    def decode(self, ids):
        return "".join("ab" if i == self.MERGED else chr(i - 3) for i in ids)

    def __call__(self, text, add_special_tokens=False):
        ids, i = [], 0
        while i < len(text):
            if text[i:i + 2] == "ab":
                ids.append(self.MERGED)
                i += 2
            else:
                ids.append(ord(text[i]) + 3)
                i += 1
        return {"input_ids": ids}


def test_exact_prompts_round_trip_at_the_asked_length():
    tok = ByteTokenizer()
    prompts = peers.exact_prompts(tok, n=20, length=7, rng=np.random.default_rng(0))
    assert len(prompts) == 20
    for p in prompts:
        assert len(p["ids"]) == 7 and min(p["ids"]) >= 3
        assert tok(p["text"])["input_ids"] == p["ids"]
        assert tok.decode(p["ids"]) == p["text"]
    # the fixed point: "a" (100) then "b" (101) never stand side by side (they would merge)
    assert not any(a == 100 and b == 101 for p in prompts for a, b in zip(p["ids"], p["ids"][1:]))


def test_summary_rows_medians_ranges_and_ratio():
    def run(side, first, steady, sample, update, load):
        return {"side": side, "version": f"{side} 1.0", "first_s": first, "steady_s": steady,
                "sample_s": sample, "update_s": update, "load": load}

    results = [run("rl_tpu", 20.0, 3.0, 1.0, 2.0, 1.5), run("trl", 2.0, 1.5, 0.5, 1.0, 1.0),
               run("rl_tpu", 22.0, 2.0, 0.8, 1.2, 2.0), run("trl", 3.0, 1.5, 0.6, 0.9, 1.25),
               run("rl_tpu", 21.0, 4.0, 1.2, 2.8, 1.75),
               {"side": "tunix", "error": "exit 1: boom", "load": 1.0}]
    rows = peers.summary_rows(results)
    # rl_tpu: first 20-22, steady median of (3, 2, 4) = 3, sample 1.0, update 2.0
    assert rows[0] == ["rl_tpu", "rl_tpu 1.0", "20.00-22.00", "3.00", "1.00", "2.00", "-",
                       "1.50-2.00"]
    # trl: steady 1.5 both rounds; rl_tpu / trl = 3 / 1.5 = 2; sample median (0.5, 0.6) = 0.55
    assert rows[1] == ["trl", "trl 1.0", "2.00-3.00", "1.50", "0.55", "0.95", "2.00",
                       "1.00-1.25"]
    assert rows[2] == ["tunix", "-", "failed", "-", "-", "-", "-", "1.00"]


def test_unknown_side_is_refused():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "peers.py"),
                          "--sides", "rl_tpu,verl"], capture_output=True, text=True)
    assert out.returncode != 0 and "unknown --sides ['verl']" in out.stderr


@pytest.mark.slow
def test_rl_tpu_child_runs_grpo_steps_and_prints_its_json(tmp_path):
    from rl_tpu.models import tiny

    cfg = tiny.write_tiny_model(str(tmp_path / "model"), "qwen2", vocab_size=320,
                                init_scale=0.04)
    rng = np.random.default_rng(0)
    steps = [[{"text": "", "ids": rng.integers(3, 320, 8).tolist()} for _ in range(2)]
             for _ in range(2)]
    (tmp_path / "prompts.json").write_text(json.dumps({"steps": steps}))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one device, as run
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "peers", "rl_tpu_grpo.py"),
         "--model_dir", str(tmp_path / "model"), "--prompts_file", str(tmp_path / "prompts.json"),
         "--steps", "1", "--samples", "2", "--completion", "6"],
        capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [x for x in out.stdout.splitlines() if x.startswith("PEER_RESULT ")]
    assert len(lines) == 1
    result = json.loads(lines[0][len("PEER_RESULT "):])
    assert result["side"] == "rl_tpu" and result["params"] == cfg.num_params()
    assert result["completion_tokens"] == [6, 6]  # ignore_eos: every completion full length
    assert result["steps"] == 1 and result["cache_dir"] == ""
    for key in ("first_s", "steady_s", "sample_s", "update_s"):
        assert result[key] > 0
    # the step is its two phases; the update is scoring + the update and weight copy
    assert result["steady_s"] == pytest.approx(result["sample_s"] + result["update_s"])
    assert result["steady"]["update"] == pytest.approx(result["steady"]["score"]
                                                       + result["steady"]["train"])
    # the rule reward: a fraction of even ids, so within [0, 1]
    assert 0.0 <= result["steady"]["reward"] <= 1.0
