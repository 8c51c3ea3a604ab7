"""Supervised fine-tuning: `python -m launch.sft --config configs/X.py --workdir W`.

Demonstrations from the env's teacher (`sft.teacher_skill`) or a JSONL of chats
(`--config.sft.data_path=chats.jsonl`, one {"messages": [...]} per line); `sft.steps` steps,
then a greedy eval and an HF export to W/final_hf.
"""

from absl import flags
from ml_collections import config_flags

import launch
from rl_tpu.persistence import workdir_lock
from rl_tpu.recipes import sft

config_flags.DEFINE_config_file("config", None, "Experiment config file (configs/*.py).",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Metrics and the exported model go here.", required=True)
flags.mark_flags_as_required(["config"])


def main(argv):
    del argv  # launch.run has checked it
    with workdir_lock.hold(flags.FLAGS.workdir):  # one trainer per workdir
        result = sft.run(flags.FLAGS.config, flags.FLAGS.workdir)
    print(" ".join(f"{k}={v:.4f}" for k, v in sorted(result.items())))


if __name__ == "__main__":
    launch.run(main, check=launch.check_inputs)
