"""What `launch.eval` leaves behind and shows (rl_tpu/recipes/evaluate.py): a file of its own
for every eval, never overwritten, with W/eval.json the latest; the path printed; a labelled
table of the metrics. A real eval of a tiny model from its HF directory."""

import json
import os

from rl_tpu.recipes import evaluate, policy_io
from test_config import load


def test_each_eval_gets_its_own_file_and_eval_json_is_the_latest(tmp_path, capsys):
    config = load("quickstart", "smoke")
    config.eval.num_tasks = 4
    config.log.every_s = 0.01  # the eval's heartbeat: a line every 10 ms
    model = policy_io.model_path(config, str(tmp_path / "model"))  # a tiny HF dir
    workdir = str(tmp_path / "run")
    first = evaluate.run(config, workdir, model_path=model)
    again = evaluate.run(config, workdir, model_path=model, report=True)  # as launch.eval
    out = capsys.readouterr().out
    evals = tmp_path / "run" / "evals"
    assert sorted(os.listdir(evals)) == ["eval_init_model.json", "eval_init_model_2.json"]
    assert json.loads((evals / "eval_init_model.json").read_text()) == first
    assert json.loads((tmp_path / "run" / "eval.json").read_text()) == again
    for name in ("eval_init_model.json", "eval_init_model_2.json"):
        assert f"wrote {evals / name} ({tmp_path / 'run' / 'eval.json'}: a copy of the " \
               "latest eval)" in out
    assert "eval: 4 tasks, 0 s" in out  # a long eval is never silent
    # launch.eval's report: what was measured, the table, then where it was written
    header = f"eval of {model} on {config.env.name} ({config.env.eval_split} split):\n"
    report = out[out.index(header):]
    assert report.startswith(header + evaluate.table(again) + "\nwrote ")
    # an HF directory is no checkpoint: step -1, its weights played as version 0
    assert first["checkpoint_step"] == -1 and first["weight_version"] == 0


def test_the_table_labels_every_metric_and_says_what_it_means():
    result = {"success": 0.25, "num_tasks": 16.0, "pass@4": 0.5, "checkpoint_step": 3,
              "weight_version": 3.0, "new_metric": 1.5}
    lines = evaluate.table(result).splitlines()
    assert lines[0].split("|") == ["metric          ", "  value ", " meaning"]
    rows = {line.split("|")[0].strip(): [c.strip() for c in line.split("|")[1:]]
            for line in lines[2:]}
    assert rows["success"] == ["0.2500", evaluate.MEANINGS["success"]]
    assert rows["num_tasks"] == ["16", evaluate.MEANINGS["num_tasks"]]
    assert rows["checkpoint_step"][0] == rows["weight_version"][0] == "3"
    assert rows["pass@4"] == ["0.5000", "a task solved by any of 4 samples"]
    assert rows["new_metric"] == ["1.5000", ""]  # no meaning known: the row still shows
