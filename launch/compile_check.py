"""Will a config fit a TPU slice? `python -m launch.compile_check --config configs/X.py[:variant]
--topology v5p:4x4x4 [--model qwen2.5-7b]`.

Compiles the run's device programs ahead of time for the topology (the learner's update and
score pass, the critic's, the embedded sampler's prefill and decode: rl_tpu/aot.py) on this
machine, which needs libtpu but no TPU, and prints each one's memory per chip against the
chip's HBM and its compile time. The shapes are the trainer's, by the same functions
(`aot.plan`): a step's rows with its replayed groups and self-play's solver rows
(recipes/shapes.py), and the chips the trainer gives the learner and the embedded sampler
(placement.split_devices: an asynchronous run's sampler has part of each host). Several
topologies: `--topology v5p:4x4x4,v5e:4x4`. The policy is `--model` (a preset of
rl_tpu/models/presets.py), else `model.path`'s config.json, else the config's tiny model;
with `--config.model.lora.rank=8` it is a LoRA run's (adapters trained on the frozen base,
the sampler per `model.lora.sampler`). Each program's peak adds what its chip holds for the
rest of the run meanwhile (the learner's state, a synchronous run's sampler weights); the
report says what that is and what a weight sync moves. Config overrides work as in
launch.train (`--config.mesh.fsdp=64`). Exit status 1 when a program does not fit, naming it
and the config keys that would shrink it.
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the host runs nothing; libtpu only compiles
# libtpu takes a machine-wide lock when a process loads it; another JAX process on this
# machine (a run that found libtpu installed) would otherwise make the compile fail.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

import launch  # noqa: E402

config_flags.DEFINE_config_file("config", None, "Experiment config file (configs/*.py).",
                                lock_config=True)
flags.DEFINE_string("topology", "v5p:2x2x4", "TPU slice(s) to compile for, comma-separated: "
                    "<chip>:<shape> with chip v4, v5e, v5p or v6e.")
flags.DEFINE_string("model", "", "A model preset (qwen2.5-0.5b/1.5b/3b/7b, qwen3-1.7b, "
                    "qwen3-8b, llama-3.1-8b); empty: model.path, else the tiny model.")
flags.DEFINE_string("programs", "", "Only these programs, comma-separated (policy_update, "
                    "score, critic_update, values, sampler_prefill, sampler_decode).")
flags.mark_flags_as_required(["config"])


def main(argv):
    del argv  # launch.run has checked it
    import jax

    from rl_tpu import aot

    # No persistent compilation cache (whatever JAX_COMPILATION_CACHE_DIR says): a program
    # compiled for an abstract TPU topology cannot be loaded back without a TPU client (every
    # rerun warned `PjRtCompiler must be constructed with a Client`), and that cache is the
    # one this machine's own runs read.
    jax.config.update("jax_enable_compilation_cache", False)

    f = flags.FLAGS
    programs = {p.strip() for p in f.programs.split(",") if p.strip()} or None
    misfit = False
    for topology in [t.strip() for t in f.topology.split(",") if t.strip()]:
        report = aot.check(f.config, topology, f.model, programs)
        print(report.table())
        for line in aot.advice(report, f.config):
            print("does not fit: " + line)
            misfit = True
        print()
    sys.exit(1 if misfit else 0)


if __name__ == "__main__":
    launch.run(main)
