"""Supervised fine-tuning: `python -m launch.sft --config configs/X.py --workdir W`.

Demonstrations from the env's teacher (`sft.teacher_skill`) or a JSONL of chats
(`--config.sft.data_path=chats.jsonl`, one {"messages": [...]} per line); `sft.steps` steps,
then a greedy eval and an HF export to W/final_hf.
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from rl_tpu.recipes import sft

config_flags.DEFINE_config_file("config", None, "Experiment config file (configs/*.py).",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Metrics and the exported model go here.", required=True)
flags.mark_flags_as_required(["config"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not any(arg.startswith(("--verbosity", "-v")) for arg in sys.argv):
        logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
    result = sft.run(flags.FLAGS.config, flags.FLAGS.workdir)
    print(" ".join(f"{k}={v:.4f}" for k, v in sorted(result.items())))


if __name__ == "__main__":
    app.run(main)
