"""RLoop: RL explores, rejection-sampling fine-tuning of the round's *starting* policy
consolidates what it found (RLoop, arXiv 2511.04285).

    python -m launch.train --config configs/rloop_largest.py --workdir /tmp/rloop

P_0 is the initial model after its SFT warm start (sft.steps, when > 0). Round r, from P_r:
  explore   an RL run of train.steps steps starting at P_r (recipes/rl.py's Trainer, its phases
            called one step at a time, in W/round_r/rl with its own checkpoints, metrics and
            curves), on the task stream's next train.steps chunks (rounds see new tasks, as
            one long RL run would)
  collect   after every RL step, that step's trajectories with reward >= loop.reward_threshold,
            each distinct one once (recipes/experience.py): each host writes its own share to
            W/round_r/experience/step_K.process<i>.json before the step's checkpoint, and the
            hosts' shares are gathered, so every host holds the whole set
  consolidate  fine-tune P_r (loop.rft_from = "start": RLoop) or the RL run's final policy
            ("end": RL and SFT alternating with a period of train.steps) for loop.sft_steps
            steps on the collected set, hardest tasks first under loop.max_per_task /
            loop.max_examples; checkpointed in W/round_r/rft
  P_{r+1}   written to W/round_r/policy_hf, evaluated, logged at step r+1 of W/metrics.jsonl
The RL runs sample every token the loop learns from: loop/total_sampled_tokens is the axis to
compare against plain RL (configs/rloop_largest.py's `plain_rl` variant runs the same
RL steps in one run). A loop killed anywhere resumes: a finished round is skipped, the RL run
resumes from its checkpoint (and the experience of its steps up to it), the fine-tune from its
own (recipes/policy_chain.py).
"""

from __future__ import annotations

import glob
import os

import jax
import ml_collections

from rl_tpu.recipes.experience import ExpertSet, read_json, write_json
from rl_tpu.recipes.policy_chain import PolicyChain
from rl_tpu.recipes.rl import Trainer


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
    """loop.rounds rounds of RL exploration and fine-tuning; returns the last eval."""
    chain = PolicyChain(config, workdir)
    loop = config.loop
    try:
        for r in range(chain.rounds_done, loop.rounds):
            start = chain.load(r)                                                # P_r
            expert, end, rl_eval = explore(chain, r)                             # explore, collect
            base = start if loop.rft_from == "start" else end
            examples = expert.examples(loop.max_per_task, loop.max_examples)
            params, sft_metrics = chain.fine_tune(r, base, examples)             # consolidate
            chain.finish_round(r, params,                                        # P_{r+1}
                               {**expert.metrics(), **sft_metrics, **rl_eval})
            del start, end
    finally:
        chain.close()
    return {k: v for k, v in chain.final_eval().items() if k.startswith("eval/")}


def round_config(config: ml_collections.ConfigDict, start_path: str) -> ml_collections.ConfigDict:
    """The RL run of a round: the loop's config, starting from `start_path` (no warm start:
    P_r already had it), its final policy kept in memory rather than exported."""
    c = config.copy_and_resolve_references()
    c.recipe = "rl"
    c.model.path = start_path
    c.model.lora.path = ""  # a starting adapter is merged into P_0 already: fresh ones on P_r
    c.sft.steps = 0
    c.checkpoint.export_hf = False
    c.lock()
    return c


def explore(chain: PolicyChain, r: int) -> tuple[ExpertSet, object, dict]:
    """Round r's RL run from P_r: (the successes of every step, the final params, the run's
    last eval as loop/rl_*)."""
    config = chain.config
    rl_dir = os.path.join(chain.round_dir(r), "rl")
    trainer = Trainer(round_config(config, chain.policy_path(r)), rl_dir)
    expert = ExpertSet(config.loop.reward_threshold)
    try:
        if trainer.start == 0:  # this round's tasks follow the previous rounds'
            stream = trainer.stream
            stream.set_state(dict(stream.get_state(), step=r * config.train.steps))
        # this host's experience of the steps the RL run resumes after (later steps are
        # played again), then every host's: each holds the same set
        mine = ExpertSet(config.loop.reward_threshold)
        for path in _experience_files(chain, r):
            if _step_of(path) <= trainer.start:
                mine.merge(ExpertSet.from_state(read_json(path)))
        _merge_every_host(chain, expert, mine)
        trainer.start_producer()
        for step in range(trainer.start + 1, config.train.steps + 1):
            trajectories, record = trainer.train_step(step)
            found = ExpertSet(config.loop.reward_threshold)
            found.add(trajectories)  # this host's share of the step's tasks
            # every host its own file, before the step's checkpoint: a resume finds it
            write_json(_experience_path(chain, r, step), found.state())
            _merge_every_host(chain, expert, found)
            trainer.end_step(step, record)
            trainer.stop_if_signalled(step)
        trainer.finish()
        end = trainer.learner.policy.params
        rl_eval = {f"loop/rl_{k[len('eval/'):]}": v for k, v in trainer.last_eval.items()
                   if k.startswith("eval/")}
    finally:
        trainer.close()
    return expert, end, rl_eval


def _merge_every_host(chain: PolicyChain, expert: ExpertSet, found: ExpertSet) -> None:
    """Adds every host's `found` (gathered, in host order) to `expert`."""
    for state in chain.gather_records(found.state()):
        expert.merge(ExpertSet.from_state(state))


def _experience_path(chain: PolicyChain, r: int, step: int) -> str:
    return os.path.join(chain.round_dir(r), "experience",
                        f"step_{step:06d}.process{jax.process_index()}.json")


def _experience_files(chain: PolicyChain, r: int) -> list[str]:
    """This host's experience files of round r."""
    return sorted(glob.glob(os.path.join(chain.round_dir(r), "experience",
                                         f"step_*.process{jax.process_index()}.json")))


def _step_of(path: str) -> int:
    return int(os.path.basename(path)[len("step_"):].split(".")[0])
