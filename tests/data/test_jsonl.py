"""JSONL -> TFDS array_record dataset -> JsonlTaskSource, without TensorFlow; the math env on it."""

import json
import sys

import pytest

from rl_tpu.core import env as env_lib
from rl_tpu.data.jsonl import JsonlTaskSource, build_jsonl_dataset
from rl_tpu.data.tasks import TaskStream

ROWS = [
    {"prompt": "What is 1 + 1?", "answer": "2", "level": 1},
    {"prompt": "Simplify $\\frac{18}{24}$.", "answer": "\\frac{3}{4}", "id": "frac",
     "tags": ["fractions", "ünïcode ✓"]},
    {"prompt": "Solve $2x + 5 = 17$.", "answer": "6", "split": "eval", "meta": {"src": "x"}},
    {"prompt": "What is 3 * 4?", "answer": "12", "id": 41},
    {"prompt": "What is 10 - 7?", "answer": "3", "split": "train"},
]


def write_jsonl(path, rows, blank_lines=False):
    lines = [json.dumps(r, ensure_ascii=False) if not isinstance(r, str) else r for r in rows]
    path.write_text(("\n\n" if blank_lines else "\n").join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ds")
    path = build_jsonl_dataset(str(write_jsonl(tmp / "tasks.jsonl", ROWS, blank_lines=True)),
                               str(tmp / "out"))
    return tmp, path


def all_tasks(source):
    return {s: [source.get(s, i) for i in range(source.size(s))] for s in source.splits}


def test_layout_is_tfds(built):
    tmp, path = built
    assert path == str(tmp / "out" / "user_tasks" / "1.0.0")
    import tensorflow_datasets as tfds

    builder = tfds.builder_from_directory(path)
    assert {k: v.num_examples for k, v in builder.info.splits.items()} == {"train": 4, "eval": 1}
    assert builder.info.file_format.value == "array_record"
    assert len(tfds.data_source("user_tasks", data_dir=str(tmp / "out"), split="train")) == 4


def test_every_task_reads_back(built):
    _, path = built
    tasks = all_tasks(JsonlTaskSource(path))
    train = [r for r in ROWS if r.get("split") != "eval"]  # eval_fraction 0: the rest is train
    assert [t.task_id for t in tasks["train"]] == ["train_0", "frac", "41", "train_3"]
    assert [t.task_id for t in tasks["eval"]] == ["eval_0"]
    for task, row in zip(tasks["train"] + tasks["eval"], train + [ROWS[2]]):
        extra = {k: v for k, v in row.items() if k not in ("prompt", "answer", "split", "id")}
        assert task.data == {"question": row["prompt"], "answer": row["answer"],
                             "split": row.get("split", "train"), **extra}
    assert "tensorflow" not in sys.modules


def test_source_accepts_the_out_dir_and_checks_indices(built):
    tmp, path = built
    source = JsonlTaskSource(str(tmp / "out"))  # the one dataset below it
    assert source.dataset_dir == JsonlTaskSource(path).dataset_dir
    with pytest.raises(IndexError, match="has 1 tasks; index 1"):
        source.get("eval", 1)
    with pytest.raises(ValueError, match="unknown split"):
        source.size("test")
    with pytest.raises(FileNotFoundError, match="make_dataset"):
        JsonlTaskSource(str(tmp / "nowhere"))


def test_eval_fraction_is_seeded_and_exact(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(40)] + \
           [{"prompt": "pinned", "answer": "x", "split": "train"}]
    jsonl = str(write_jsonl(tmp_path / "t.jsonl", rows))

    def eval_prompts(seed, out):
        source = JsonlTaskSource(build_jsonl_dataset(jsonl, str(tmp_path / out),
                                                     eval_fraction=0.25, seed=seed))
        assert source.size("train") + source.size("eval") == 41
        train = [t.data["question"] for t in all_tasks(source)["train"]]
        assert "pinned" in train  # an explicit split is kept
        # File order within each split, so index i is stable.
        assert train == [r["prompt"] for r in rows if r["prompt"] in train]
        return [t.data["question"] for t in all_tasks(source)["eval"]]

    first = eval_prompts(0, "a")
    assert len(first) == 10  # round(0.25 * 40) of the rows without a split
    assert eval_prompts(0, "b") == first
    assert eval_prompts(1, "c") != first


def test_order_kept_over_many_rows(tmp_path):
    rows = [{"prompt": f"question {i}", "answer": str(i)} for i in range(500)]
    source = JsonlTaskSource(build_jsonl_dataset(str(write_jsonl(tmp_path / "t.jsonl", rows)),
                                                 str(tmp_path / "out")))
    assert source.size("eval") == 0
    assert [source.get("train", i).data["answer"] for i in range(500)] == [str(i) for i in range(500)]


def test_existing_dataset_needs_overwrite(tmp_path):
    jsonl = str(write_jsonl(tmp_path / "t.jsonl", ROWS[:2]))
    build_jsonl_dataset(jsonl, str(tmp_path / "out"), name="mine")
    with pytest.raises(FileExistsError, match="overwrite"):
        build_jsonl_dataset(jsonl, str(tmp_path / "out"), name="mine")
    write_jsonl(tmp_path / "t.jsonl", ROWS[:1])
    path = build_jsonl_dataset(jsonl, str(tmp_path / "out"), name="mine", overwrite=True)
    assert JsonlTaskSource(path).size("train") == 1
    with pytest.raises(ValueError, match="snake_case"):
        build_jsonl_dataset(jsonl, str(tmp_path / "out"), name="My Tasks")


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "q", "answer": "a"', r"t.jsonl:2 is not valid JSON"),
    ('["q", "a"]', r"t.jsonl:2 is a JSON list, not an object"),
    ('{"answer": "a"}', r"t.jsonl:2 has no 'prompt' field \(it has \['answer'\]\)"),
    ('{"prompt": "q"}', r"t.jsonl:2 has no 'answer' field"),
    ('{"prompt": "q", "answer": 4}', r"t.jsonl:2: 'answer' must be a string, got int 4; write it as a string: \"4\""),
    ('{"prompt": ["q"], "answer": "a"}', r"t.jsonl:2: 'prompt' must be a string, got list"),
    ('{"prompt": " ", "answer": "a"}', r"t.jsonl:2: 'prompt' is empty"),
    ('{"prompt": "q", "answer": "a", "split": "test"}', r"t.jsonl:2: 'split' must be one of"),
    ('{"prompt": "q", "answer": "a", "id": 1.5}', r"t.jsonl:2: 'id' must be a string or an integer"),
    ('{"prompt": "q", "answer": "a", "question": "x"}', r"t.jsonl:2: field\(s\) \['question'\]"),
    ('{"prompt": "q", "answer": "a", "id": "train_0"}', r"t.jsonl:2: task id 'train_0' is already used by .*t.jsonl:1"),
])
def test_bad_lines_name_the_line_and_problem(tmp_path, line, message):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"prompt": "fine", "answer": "1"}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=message):
        build_jsonl_dataset(str(path), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_missing_or_empty_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_jsonl_dataset(str(tmp_path / "missing.jsonl"), str(tmp_path / "out"))
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="has no tasks"):
        build_jsonl_dataset(str(tmp_path / "empty.jsonl"), str(tmp_path / "out"))
    with pytest.raises(ValueError, match="eval_fraction"):
        build_jsonl_dataset(str(write_jsonl(tmp_path / "t.jsonl", ROWS)), str(tmp_path / "out"),
                            eval_fraction=1.5)


def test_task_stream_over_the_source(built):
    _, path = built
    stream = TaskStream(JsonlTaskSource(path), tasks_per_step=4, seed=0, process_index=0,
                        process_count=1)
    ids = sorted(task.task_id for _, task in stream.next())
    assert ids == sorted(["train_0", "frac", "41", "train_3"])  # one step = one epoch here


def test_math_env_scores_source_tasks(built, tmp_path):
    pytest.importorskip("math_verify")
    _, path = built
    source = JsonlTaskSource(path)
    task = source.get("train", 1)  # answer \frac{3}{4}
    # The math env reads data["question"] / data["answer"], which the source provides; its
    # constructor still wants a JSONL path of its own (any valid one).
    env = env_lib.make("math", path=write_jsonl(tmp_path / "any.jsonl", [
        {"question": "unused", "answer": "0"}]), isolate=False)
    assert env.reset(task) == task.data["question"]
    right = env.step("18/24 = 3/4, so <answer>\\frac{3}{4}</answer>")
    assert right.done and right.reward == 1.0
    env.reset(task)
    wrong = env.step("<answer>4/3</answer>")
    assert wrong.done and wrong.reward == 0.0


def test_launcher(tmp_path):
    import subprocess

    jsonl = write_jsonl(tmp_path / "t.jsonl", [{"prompt": f"q{i}", "answer": str(i)} for i in range(10)])
    cmd = [sys.executable, "-m", "launch.make_dataset", "--jsonl", str(jsonl),
           "--out", str(tmp_path / "out"), "--eval_fraction", "0.2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[-3:] == ["train: 8 tasks", "eval: 2 tasks",
                          f"dataset: {tmp_path / 'out' / 'user_tasks' / '1.0.0'}"]
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert again.returncode != 0 and "overwrite" in again.stderr
