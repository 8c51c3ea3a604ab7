"""Turn a JSONL of prompts and answers into a TFDS array_record dataset of tasks.

  python -m launch.make_dataset --jsonl problems.jsonl --out /data/tasks --eval_fraction 0.1
  python -m launch.make_dataset --jsonl pairs.jsonl --pairs --out /data/pairs --eval_fraction 0.1

Each line: {"prompt": str, "answer": str} with optional "split" ("train" | "eval"), "id" and
any other fields (kept in Task.data). Prints the dataset directory (the last line of stdout
is `dataset: <dir>`) and the split sizes; read it with
`rl_tpu.data.JsonlTaskSource(<dir>)`. TensorFlow is not needed.

With --pairs the lines are preference pairs ({"prompt", "chosen", "rejected"} with optional
"margin" and "split": rl_tpu/data/pairs.py, what reward models and DPO train on): every line is
checked (the first bad one named), and `<out>/<name>.jsonl` gets them in canonical form with
each pair's split filled in (the last line of stdout is `pairs: <file>`), for
`--config.reward_model.data_path` or `--config.dpo.data_path`.
"""

from absl import app, flags

from rl_tpu.data.jsonl import JsonlTaskSource, build_jsonl_dataset

flags.DEFINE_string("jsonl", None, "JSONL file, one {prompt, answer} object a line.", required=True)
flags.DEFINE_string("out", None, "Output directory; the dataset goes to <out>/<name>/1.0.0.",
                    required=True)
flags.DEFINE_string("name", "user_tasks", "Dataset name (snake_case).")
flags.DEFINE_float("eval_fraction", 0.0, "Fraction of lines without a 'split' field that go "
                   "to eval (a seeded shuffle, exact count).")
flags.DEFINE_integer("seed", 0, "Seed of the eval_fraction split.")
flags.DEFINE_bool("overwrite", False, "Replace an existing dataset of the same name under --out.")
flags.DEFINE_bool("pairs", False, "The lines are preference pairs: check them and write a "
                  "split pairs JSONL instead of a task dataset.")


def main(argv):
    del argv
    f = flags.FLAGS
    if f.pairs:
        return make_pairs(f)
    import tensorflow_datasets as tfds

    tfds.disable_progress_bar()  # a per-split bar per shard is noise for files of this size
    try:
        path = build_jsonl_dataset(f.jsonl, f.out, name=f.name, eval_fraction=f.eval_fraction,
                                   seed=f.seed, overwrite=f.overwrite)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        raise app.UsageError(str(e))
    source = JsonlTaskSource(path)
    for split in source.splits:
        print(f"{split}: {source.size(split)} tasks")
    print(f"dataset: {path}", flush=True)


def make_pairs(f) -> None:
    import os

    from rl_tpu.data.pairs import split_pairs_file
    out = os.path.join(f.out, f"{f.name}.jsonl")
    if os.path.exists(out) and not f.overwrite:
        raise app.UsageError(f"{out} already exists; pass --overwrite to replace it")
    os.makedirs(f.out, exist_ok=True)
    try:
        counts = split_pairs_file(f.jsonl, out, f.eval_fraction, f.seed)
    except (ValueError, FileNotFoundError) as e:
        raise app.UsageError(str(e))
    for split, n in counts.items():
        print(f"{split}: {n} pairs")
    print(f"pairs: {out}", flush=True)


if __name__ == "__main__":
    app.run(main)
