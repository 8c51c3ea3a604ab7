"""math env: JSONL loading and splits, math-verify verdicts, threads, hostile answers."""

import json
import random
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("math_verify")

from garbage import code_points, garbage_actions, one_of, step_through, text

from rl_tpu.core import env as env_lib
from rl_tpu.env_serving.isolated import IsolatedWorkers
from rl_tpu.envs.math import MathEnv, MathVerifier

SAMPLE = Path(__file__).parent / "data" / "math_sample.jsonl"
ROWS = [json.loads(line) for line in SAMPLE.read_text().splitlines()]


@pytest.fixture(scope="module")
def workers():
    pool = IsolatedWorkers(num_workers=2)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def env(workers):
    e = env_lib.make("math", path=SAMPLE, eval_fraction=0.5)
    e.verifier = MathVerifier(workers=workers)
    return e


def _all_tasks(env):
    ts = env.tasks()
    return [ts.get(s, i) for s in ("train", "eval") for i in range(ts.size(s))]


def _row_of(task):
    return next(r for r in ROWS if r["problem"] == task.data["question"])


def test_fields_and_splits(env):
    tasks = _all_tasks(env)
    assert len(tasks) == len(ROWS)
    ts = env.tasks()
    assert ts.size("train") > 0 and ts.size("eval") > 0  # 12 rows at 50%: both non-empty
    again = MathEnv(SAMPLE, eval_fraction=0.5).tasks()
    assert [again.get("eval", i).task_id for i in range(again.size("eval"))] == \
           [ts.get("eval", i).task_id for i in range(ts.size("eval"))]
    assert all(t.data["question"] == _row_of(t)["problem"] for t in tasks)


def test_right_and_wrong_answers(env):
    for task in _all_tasks(env):
        row = _row_of(task)
        assert env.reset(task) == row["problem"]
        r = env.step(f"Working... so <answer>{row['final']}</answer>")
        assert r.done and r.reward == 1.0 and r.info["success"], (row, r)
        env.reset(task)
        r = env.step(f"<answer>{row['wrong']}</answer>")
        assert r.done and r.reward == 0.0 and not r.info["success"], (row, r)
    assert env.step("<answer>1</answer>").done  # after the single turn: an observation


def test_boxed_without_tags_and_custom_fields(tmp_path, workers):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"q": "1+1?", "a": "2"}) + "\n" + json.dumps({"q": "2+2?", "a": "4"}) + "\n")
    env = MathEnv(path, eval_path=path, question_field="q", answer_field="a")
    env.verifier = MathVerifier(workers=workers)
    assert env.tasks().size("train") == 2 and env.tasks().size("eval") == 2
    env.reset(env.tasks().get("eval", 1))
    r = env.step("The total is \\boxed{4}.")
    assert r.reward == 1.0 and not r.info["format_ok"]
    with pytest.raises(ValueError, match="question_field"):
        MathEnv(path)  # neither question/problem nor answer/solution fields
    with pytest.raises(FileNotFoundError):
        MathEnv(tmp_path / "missing.jsonl")


def test_in_process_main_thread():
    env = MathEnv(SAMPLE, eval_fraction=0.5, isolate=False)
    task = env.tasks().get("train", 0)
    env.reset(task)
    assert env.step(f"<answer>{_row_of(task)['final']}</answer>").reward == 1.0


def test_threads_get_correct_verdicts(workers):
    """math-verify's signal timeouts fail outside the main thread; through the workers,
    8 threads checking at once all get the right verdicts."""
    verifier = MathVerifier(workers=workers)
    errors, done = [], []

    def check(thread: int):
        try:
            for k in range(12):
                row = ROWS[(thread + k) % len(ROWS)]
                ok = verifier.verify(row["solution"], row["final"])
                bad = verifier.verify(row["solution"], row["wrong"])
                if not ok or bad:
                    errors.append((row["final"], ok, bad))
                done.append(1)
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=check, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(done) == 96


def test_threads_with_env_per_thread(tmp_path):
    """One env per thread (how an env server runs), default shared worker pool."""
    results = []

    def play(thread: int):
        env = MathEnv(SAMPLE, eval_fraction=0.5)
        for task in _all_tasks(env)[thread::4]:
            env.reset(task)
            results.append(env.step(f"<answer>{_row_of(task)['final']}</answer>").reward)

    threads = [threading.Thread(target=play, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == [1.0] * len(ROWS)


def test_hanging_answer_is_cut_off(workers):
    env = MathEnv(SAMPLE, eval_fraction=0.5, timeout_s=1)
    env.verifier = MathVerifier(timeout_s=1, workers=workers)
    task = env.tasks().get("train", 0)
    env.reset(task)
    start = time.monotonic()
    r = env.step("<answer>9^{9^{9^{9}}}</answer>")  # never finishes without a timeout
    assert r.done and r.reward == 0.0
    assert time.monotonic() - start < 20


# math's own kinds: LaTeX soup, broken or unanswerable answers, huge expressions.
GARBAGE = [
    lambda rng: text(rng, "\\{}^_$0123456789+-", 10_240),
    lambda rng: "<answer>" + code_points(rng, 0x20, 0x2FFF, 1, 80) + "</answer>",
    one_of("<answer></answer>", "<answer>", "\\boxed{", "\\boxed{}", "<answer>\\frac{1}{0}</answer>",
           "<answer>x=</answer>", "<answer>\\sqrt{-1}</answer>", "<answer>1/0</answer>",
           "<answer>\\begin{pmatrix}1\\end{pmatrix}</answer>", "<answer>∞</answer>"),
    lambda rng: "<answer>" + "1+" * rng.randrange(1000, 3000) + "1</answer>",
    lambda rng: f"<answer>{rng.randrange(-10**6, 10**6)}</answer>",
    lambda rng: "<answer>" + text(rng, "xyz+-*/^()", 1, 40) + "</answer>",
]


def test_garbage_actions_never_raise(env):
    tasks = _all_tasks(env)
    results = step_through(env, garbage_actions(random.Random(2), 300, GARBAGE), tasks)
    assert all(r.done and r.reward in (0.0, 1.0) for r in results)  # single turn: a verdict
    task = tasks[0]
    env.reset(task)
    assert env.step(f"<answer>{_row_of(task)['final']}</answer>").reward == 1.0
