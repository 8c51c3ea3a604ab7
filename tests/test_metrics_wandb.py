"""The W&B writer in offline mode (WANDB_MODE=offline): its run files are written where
WANDB_DIR says, hold the scalars MetricsWriter logged, and a resumed run keeps its run id."""

import glob
import json
import os
import struct
import sys
import time

import pytest

from rl_tpu.metrics import MetricsWriter, read_metrics
from rl_tpu.metrics_wandb import RUN_ID_FILE

wandb = pytest.importorskip("wandb", reason="the W&B writer needs `pip install 'rl_tpu[wandb]'`")
from wandb.proto import wandb_internal_pb2  # noqa: E402  pylint: disable=wrong-import-position

PROJECT = "rl_tpu-tests"


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """W&B offline, its files under tmp_path/wandb_files, nothing sent anywhere."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_files"))
    (tmp_path / "wandb_files").mkdir()
    return tmp_path / "wandb_files"


def wandb_records(path):
    """The records of a run's .wandb file: a 7-byte header (":W&B", magic, version), then
    LevelDB-log framing in 32 KiB blocks (u32 crc, u16 length, u8 type: 1 full, 2 first,
    3 middle, 4 last), each record a wandb Record proto."""
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    block, pos, chunks = 32768, 7, []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunks.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            yield record


def finished_records(path, timeout_s=60.0):
    """The run file's records once its writer has written the run's `exit` record: wandb's
    service process writes the file, and on a loaded machine it may still be at it when
    `finish()` has returned."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = list(wandb_records(path))
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        assert time.monotonic() < deadline, f"{path} has no exit record after {timeout_s} s"
        time.sleep(0.2)


def run_files(offline, run_id):
    """The .wandb files of run `run_id`: a resumed run is a new directory, named
    by the second it started (with `-1`, `-2`... when two start in one second)."""
    return sorted(glob.glob(str(offline / "wandb" / f"offline-run-*-{run_id}*" /
                                f"run-{run_id}.wandb")))


def history_and_run(path):
    history, runs = [], []
    for record in finished_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in record.history.item}
            history.append({k: v for k, v in items.items() if not k.startswith("_")})
        elif kind == "run":
            runs.append((record.run.run_id, record.run.display_name, record.run.project))
    return history, runs


def test_offline_run_holds_the_scalars_and_a_resume_keeps_the_run_id(tmp_path, offline):
    workdir = tmp_path / "my_run"
    with MetricsWriter(str(workdir), tensorboard=False, wandb_project=PROJECT,
                       wandb_config={"seed": 3}) as writer:
        writer.write(-1, {"sft/loss": 1.5})  # the SFT warm start's negative steps
        writer.write(0, {"eval/success": 0.25})
        writer.write(1, {"rollout/reward": 0.5, "train/loss": float("nan")})
    run_id = (workdir / RUN_ID_FILE).read_text().strip()
    files = run_files(offline, run_id)
    assert len(files) == 1, os.listdir(offline / "wandb")
    history, runs = history_and_run(files[0])
    assert runs == [(run_id, "my_run", PROJECT)]
    # what metrics.jsonl holds, a NaN (null there) left out
    assert history == [{"step": -1, "sft/loss": 1.5}, {"step": 0, "eval/success": 0.25},
                       {"step": 1, "rollout/reward": 0.5}]
    assert read_metrics(workdir)[2] == {"step": 1, "rollout/reward": 0.5, "train/loss": None}

    # the rerun of the same command: the same W&B run, continued
    with MetricsWriter(str(workdir), resume_step=2, tensorboard=False,
                       wandb_project=PROJECT) as writer:
        writer.write(2, {"rollout/reward": 0.75})
    files = run_files(offline, run_id)
    assert len(files) == 2, os.listdir(offline / "wandb")
    history = [h for path in files for h in history_and_run(path)[0]]
    assert {"step": 2, "rollout/reward": 0.75} in history
    assert (workdir / RUN_ID_FILE).read_text().strip() == run_id


def test_without_wandb_installed_the_error_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'rl_tpu\[wandb\]'"):
        MetricsWriter(str(tmp_path), tensorboard=False, wandb_project=PROJECT)


def test_a_damaged_run_id_file_is_named(tmp_path, offline):
    (tmp_path / RUN_ID_FILE).write_text("not an id!\n")
    with pytest.raises(ValueError, match=f"{RUN_ID_FILE} holds 'not an id!'"):
        MetricsWriter(str(tmp_path), tensorboard=False, wandb_project=PROJECT)
