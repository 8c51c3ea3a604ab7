"""A user's JSONL of prompts and answers as a TFDS array_record dataset, and a TaskSource over it.

    path = build_jsonl_dataset("problems.jsonl", "/data/tasks", eval_fraction=0.1)
    source = JsonlTaskSource(path)            # random access, no TensorFlow
    source.get("train", 0).data   # {"question": ..., "answer": ..., "split": "train", ...}
    env = make("math", path="problems.jsonl") # scores <answer>...</answer> against data["answer"]

Each line is `{"prompt": str, "answer": str}` with optional `"split"` ("train" | "eval"), optional
`"id"` (str or int) and any other fields, which are kept (as one JSON string in the record) and
come back in `Task.data`. Lines that carry no split go to eval with probability `eval_fraction`
(an exact count: round(fraction * n), by a shuffle seeded with `seed`); file order is kept
within each split, so index i of a split is the i-th such line of the file.

Why TFDS and array_record: `tfds.builder_from_directory(path)` and `tfds.data_source` read the
result anywhere (random access per index, which grain's MapDataset needs), and the layout
(`<out>/<name>/1.0.0/{dataset_info.json, features.json, <name>-<split>.array_record-*}`) is the
one every TFDS tool understands.

What TFDS does without TensorFlow here (tensorflow-datasets 4.9.10): reading works
(`builder_from_directory`, `as_data_source`, `tfds.data_source`); writing works through a
`GeneratorBasedBuilder` with `file_format="array_record"` (its example serializer uses TFDS's
own protos). What needs TensorFlow: `tfds.dataset_builders.store_as_tfds_dataset` (the ad-hoc
builder checks `isinstance(x, tf.data.Dataset)`) and `as_dataset` (tf.data), so neither is used.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from rl_tpu.core.env import Task, TaskSource

SPLITS = ("train", "eval")
VERSION = "1.0.0"
# Fields of a line with a meaning of their own; all others go to Task.data as they are.
_OWN_FIELDS = ("prompt", "answer", "split", "id")
# Keys Task.data gets from the own fields, so an extra field of that name would be shadowed.
_DATA_KEYS = ("question", "answer", "split")
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


# ---------------------------------------------------------------------------------------------
# Reading and checking the JSONL
# ---------------------------------------------------------------------------------------------


def json_type_name(value: Any) -> str:
    """A JSON value's type as an error message names it: null, str, int, list, dict..."""
    return "null" if value is None else type(value).__name__


def _parse_line(where: str, line: str) -> dict:
    """One checked row: prompt, answer, split (or None), id (or None), extra fields."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not valid JSON ({e}); each line must be one JSON object "
                         'like {"prompt": "...", "answer": "..."}') from None
    if not isinstance(row, dict):
        raise ValueError(f"{where} is a JSON {json_type_name(row)}, not an object; each line must be "
                         'one object like {"prompt": "...", "answer": "..."}')
    for field in ("prompt", "answer"):
        if field not in row:
            raise ValueError(f"{where} has no {field!r} field (it has {sorted(row)}); every line "
                             "needs a string prompt and a string answer")
        value = row[field]
        if not isinstance(value, str):
            hint = f'; write it as a string: "{value}"' if isinstance(value, (int, float)) else ""
            raise ValueError(f"{where}: {field!r} must be a string, got {json_type_name(value)} "
                             f"{value!r}{hint}")
        if not value.strip():
            raise ValueError(f"{where}: {field!r} is empty; every task needs a prompt and the "
                             "answer it is scored against")
    split = row.get("split")
    if split is not None and split not in SPLITS:
        raise ValueError(f"{where}: 'split' must be one of {SPLITS} (or left out), got {split!r}")
    task_id = row.get("id")
    if task_id is not None:
        if isinstance(task_id, bool) or not isinstance(task_id, (str, int)):
            raise ValueError(f"{where}: 'id' must be a string or an integer, got "
                             f"{json_type_name(task_id)} {task_id!r}")
        task_id = str(task_id)
        if not task_id:
            raise ValueError(f"{where}: 'id' is empty; leave it out to get '<split>_<index>'")
    extra = {k: v for k, v in row.items() if k not in _OWN_FIELDS}
    clash = sorted(set(extra) & set(_DATA_KEYS))
    if clash:
        raise ValueError(f"{where}: field(s) {clash} would be overwritten in Task.data, where "
                         f"{list(_DATA_KEYS)} come from prompt/answer/split; rename them")
    return {"prompt": row["prompt"], "answer": row["answer"], "split": split, "id": task_id,
            "extra": extra, "where": where}


def read_jsonl_rows(jsonl_path: str) -> list[dict]:
    """Every non-blank line of the file, checked; the first bad line raises, naming itself."""
    path = Path(jsonl_path)
    if not path.is_file():
        raise FileNotFoundError(f"JSONL file {path} does not exist; pass a file with one "
                                '{"prompt": ..., "answer": ...} object per line')
    rows = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                rows.append(_parse_line(f"{path}:{line_no}", line))
    if not rows:
        raise ValueError(f"{path} has no tasks (every line is blank)")
    return rows


def split_rows(rows: list[dict], eval_fraction: float, seed: int) -> dict[str, list[dict]]:
    """Rows by split: a row's own "split" field, else eval for a seeded round(fraction * n) of
    the rest. File order is kept within each split."""
    if not 0.0 <= eval_fraction <= 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1], got {eval_fraction}")
    unassigned = [i for i, row in enumerate(rows) if row["split"] is None]
    num_eval = int(round(eval_fraction * len(unassigned)))
    # A permutation, not a per-row coin flip: the eval set has exactly the size asked for.
    chosen = np.random.default_rng(seed).permutation(len(unassigned))[:num_eval]
    to_eval = {unassigned[j] for j in chosen}
    out: dict[str, list[dict]] = {s: [] for s in SPLITS}
    for i, row in enumerate(rows):
        out[row["split"] or ("eval" if i in to_eval else "train")].append(row)
    return out


def _records(by_split: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """The stored records, with task ids checked unique over the whole dataset (a user id can
    collide with another line's id, or with the '<split>_<index>' a line without one gets)."""
    seen: dict[str, str] = {}
    out = {}
    for split, rows in by_split.items():
        out[split] = []
        for index, row in enumerate(rows):
            task_id = row["id"] or f"{split}_{index}"
            if task_id in seen:
                raise ValueError(f"{row['where']}: task id {task_id!r} is already used by "
                                 f"{seen[task_id]}; task ids must be unique (lines without an "
                                 "'id' get '<split>_<index>')")
            seen[task_id] = row["where"]
            out[split].append({"prompt": row["prompt"], "answer": row["answer"], "id": task_id,
                               "extra": json.dumps(row["extra"], ensure_ascii=False)})
    return out


# ---------------------------------------------------------------------------------------------
# Writing the TFDS dataset
# ---------------------------------------------------------------------------------------------


def _builder_class(name: str):
    """A GeneratorBasedBuilder named `name` that writes the given records (imports TFDS here,
    so reading JSONL tasks never pays for it unless a dataset is built)."""
    import tensorflow_datasets as tfds

    class _JsonlTasks(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        # The builder lives only for this call: skip_registration keeps it out of TFDS's global
        # registry (no clash with a catalogue dataset or a second build of the same name).
        VERSION = tfds.core.Version(VERSION)
        # TFDS looks for checksums and metadata files next to a builder's code; this one has
        # none, and the lookup imports importlib_resources, which a TF-free install may lack.
        code_path = None

        def __init__(self, *, records: dict[str, list[dict]], **kwargs):
            self._records = records
            super().__init__(**kwargs)

        def _info(self):
            text = tfds.features.Text()
            return tfds.core.DatasetInfo(
                builder=self, description="Tasks (prompt, answer) from a JSONL file.",
                features=tfds.features.FeaturesDict(
                    {"prompt": text, "answer": text, "id": text, "extra": text}),
                # Index i of a split must stay the i-th line of that split.
                disable_shuffling=True)

        def _split_generators(self, dl_manager):
            del dl_manager  # nothing to download
            return {split: self._generate_examples(records)
                    for split, records in self._records.items()}

        def _generate_examples(self, records):
            for index, record in enumerate(records):
                yield index, record

    _JsonlTasks.name = name
    return _JsonlTasks


def build_jsonl_dataset(jsonl_path: str, out_dir: str, *, name: str = "user_tasks",
                        eval_fraction: float = 0.0, seed: int = 0,
                        overwrite: bool = False) -> str:
    """Writes the JSONL's tasks as a TFDS array_record dataset under `out_dir`; returns the
    dataset directory (`<out_dir>/<name>/1.0.0`), which `JsonlTaskSource` and
    `tfds.builder_from_directory` take. An existing dataset there is an error unless
    `overwrite` (TFDS would otherwise silently keep the old data)."""
    if not _NAME.match(name):
        raise ValueError(f"dataset name {name!r} must be snake_case (lower-case letters, digits "
                         "and underscores, starting with a letter)")
    records = _records(split_rows(read_jsonl_rows(jsonl_path), eval_fraction, seed))
    dataset_dir = Path(out_dir) / name / VERSION
    if dataset_dir.exists():
        if not overwrite:
            raise FileExistsError(f"{dataset_dir} already exists; pass overwrite=True "
                                  "(--overwrite) to replace it, or choose another out dir or name")
        shutil.rmtree(dataset_dir)
    # A split with no tasks is not written (TFDS has nothing to shard); it reads as size 0.
    records = {split: recs for split, recs in records.items() if recs}
    builder = _builder_class(name)(records=records, data_dir=os.fspath(out_dir),
                                   file_format="array_record")
    import tensorflow_datasets as tfds

    # Downloads go to a scratch dir so the output holds the dataset only.
    with tempfile.TemporaryDirectory() as scratch:
        builder.download_and_prepare(
            download_dir=scratch,
            download_config=tfds.download.DownloadConfig(try_download_gcs=False))
    return os.fspath(dataset_dir)


# ---------------------------------------------------------------------------------------------
# Reading it back
# ---------------------------------------------------------------------------------------------


def _find_dataset_dir(dataset_dir: str) -> Path:
    """The directory holding dataset_info.json: `dataset_dir` itself, or the one dataset
    below it (so the `out_dir` given to build_jsonl_dataset works too)."""
    path = Path(dataset_dir)
    if (path / "dataset_info.json").is_file():
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"dataset dir {path} does not exist; build one with "
                                "`python -m launch.make_dataset --jsonl X --out DIR`")
    found = sorted({p.parent for pattern in ("*/dataset_info.json", "*/*/dataset_info.json")
                    for p in path.glob(pattern)})
    if len(found) == 1:
        return found[0]
    if not found:
        raise FileNotFoundError(f"{path} holds no TFDS dataset (no dataset_info.json in it or "
                                "two levels below); pass the directory build_jsonl_dataset "
                                "returned")
    raise ValueError(f"{path} holds several datasets ({[os.fspath(p) for p in found]}); pass one")


class JsonlTaskSource(TaskSource):
    """Tasks of a dataset written by `build_jsonl_dataset`, read by index from its array_record
    files (TFDS data sources: no TensorFlow, no loading of the whole file)."""

    splits = SPLITS

    def __init__(self, dataset_dir: str):
        import tensorflow_datasets as tfds

        self.dataset_dir = _find_dataset_dir(dataset_dir)
        builder = tfds.builder_from_directory(os.fspath(self.dataset_dir))
        features = set(builder.info.features.keys())
        if not {"prompt", "answer", "id", "extra"} <= features:
            raise ValueError(f"{self.dataset_dir} is a TFDS dataset with features "
                             f"{sorted(features)}, not one written by build_jsonl_dataset "
                             "(prompt, answer, id, extra)")
        self._sources = {split: builder.as_data_source(split)
                         for split in SPLITS if split in builder.info.splits}

    def size(self, split: str) -> int:
        self.check_split(split)
        source = self._sources.get(split)
        return 0 if source is None else len(source)

    def get(self, split: str, index: int) -> Task:
        size = self.size(split)
        if not isinstance(index, (int, np.integer)) or not 0 <= index < size:
            raise IndexError(f"split {split!r} has {size} tasks; index {index!r} is out of range")
        record = self._sources[split][int(index)]
        text = {k: v.decode("utf-8") if isinstance(v, bytes) else str(v)
                for k, v in record.items()}
        extra = json.loads(text["extra"]) if text["extra"] else {}
        return Task(task_id=text["id"],
                    data={**extra, "question": text["prompt"], "answer": text["answer"],
                          "split": split})
