"""Evaluate a policy: `python -m launch.eval --config configs/X.py (--workdir W | --model_path D)`.

Greedy success, pass@k (`--config.eval.pass_k=4`), mean turns and tokens on the config's eval
split, from the latest checkpoint in W or from an HF directory D, printed as a table (metric |
value | meaning). With --workdir each eval is also written to a file of its own,
W/evals/eval_step<k>.json (never overwritten; W/eval.json is a copy of the latest), and the
path is printed. checkpoint_step: the checkpoint evaluated (-1 for --model_path);
weight_version: the version of the weights that played, here the same step (0 for an HF
directory).
"""

from absl import flags
from ml_collections import config_flags

import launch
from rl_tpu.recipes import evaluate

config_flags.DEFINE_config_file("config", None, "Experiment config file (configs/*.py).",
                                lock_config=True)
flags.DEFINE_string("workdir", "", "A training run's workdir (its latest checkpoint).")
flags.DEFINE_string("model_path", "", "An HF model directory (instead of a checkpoint).")
flags.mark_flags_as_required(["config"])


def check(config):
    """A policy to evaluate, named on the command line, and a model dir and env servers that
    are there; checked before anything is built."""
    f = flags.FLAGS
    if not f.workdir and not f.model_path:
        raise ValueError("launch.eval needs --workdir=W (a training run: its latest checkpoint) "
                         "or --model_path=D (an HF model directory, e.g. W/final_hf)")
    launch.check_inputs(config, f.model_path or None)


def main(argv):
    del argv  # launch.run has checked it
    f = flags.FLAGS
    evaluate.run(f.config, f.workdir or None, f.model_path or None, report=True)


if __name__ == "__main__":
    launch.run(main, check=check)
