"""Training: `python -m launch.train --config configs/X.py[:variant] --workdir W`.

Runs the config's recipe (`config.recipe`: rl, sft, expert_iteration, rloop, dpo, selfplay,
reward_model; each `rl_tpu/recipes/<recipe>.py`'s `run(config, workdir)`).

Overrides: any config leaf, e.g. `--config.algo.clip_high=0.28 --config.train.steps=10`; an
unknown key or a value of the wrong type stops the run before anything compiles, naming the
key. `--rollout_urls=http://h1:30000,http://h2:30000` switches rollouts to SGLang-compatible
servers (empty: the embedded JAX sampler); `--rollout_router_url=http://r:30000` adds an
sglang-router in front of them for generation. Rerunning the same command resumes from the last
checkpoint in W. Multi-host: run the same command on every host.
"""

import importlib

from absl import flags
from ml_collections import config_flags

import launch
from rl_tpu.persistence import workdir_lock

config_flags.DEFINE_config_file("config", None, "Experiment config file (configs/*.py).",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Checkpoints, metrics and exports go here.", required=True)
flags.DEFINE_string("rollout_urls", "", "Comma-separated SGLang-compatible servers; empty = "
                    "the embedded JAX sampler.")
flags.DEFINE_string("rollout_router_url", "", "An sglang-router in front of --rollout_urls: "
                    "generation goes through it, weight updates and aborts to each server.")
flags.mark_flags_as_required(["config"])


def use_rollout_urls(config):
    if flags.FLAGS.rollout_urls:
        config.rollout.engine = "sglang"
        config.rollout.urls = flags.FLAGS.rollout_urls
    if flags.FLAGS.rollout_router_url:
        config.rollout.router_url = flags.FLAGS.rollout_router_url


def main(argv):
    del argv  # launch.run has checked it
    config = flags.FLAGS.config
    recipe = importlib.import_module(f"rl_tpu.recipes.{config.recipe}")
    with workdir_lock.hold(flags.FLAGS.workdir):  # one trainer per workdir
        result = recipe.run(config, flags.FLAGS.workdir)
    print(" ".join(f"{k}={v:.4f}" for k, v in sorted(result.items())))


if __name__ == "__main__":
    launch.run(main, prepare=use_rollout_urls, check=launch.check_inputs)
