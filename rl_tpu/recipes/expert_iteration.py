"""Expert iteration: rounds of rejection-sampling fine-tuning (RFT) from the current policy.

    python -m launch.train --config configs/expert_iteration_largest.py --workdir /tmp/ei

P_0 is the initial model after its SFT warm start (sft.steps, when > 0). Round r, from P_r:
  sample    loop.samples_per_task replies to each of loop.tasks_per_round training tasks (the
            task stream's r-th chunk: new tasks every round), at the rollout temperature
  filter    keep those with reward >= loop.reward_threshold, each distinct reply once
            (recipes/experience.py: ExpertSet), hardest tasks first under the caps
            loop.max_per_task / loop.max_examples
  fine-tune P_r for loop.sft_steps SFT steps on the kept samples (token-exact: the policy's own
            ids) at loop.sft_lr, checkpointed (a killed round resumes mid-fine-tune)
  P_{r+1}   written to W/round_r/policy_hf, evaluated on the held-out tasks, logged at step r+1
One round of this with loop.rounds = 1 is plain rejection-sampling fine-tuning. The samples
of a round are written to W/round_r/samples.process<i>.json before the fine-tune (each host
samples its share of the round's tasks; the hosts' samples are then gathered, so every host
fine-tunes on the same set), so a resumed round trains on exactly what it sampled. Layout and resume: recipes/policy_chain.py.
"""

from __future__ import annotations

import ml_collections

from rl_tpu.recipes import rollout_settings
from rl_tpu.recipes.experience import ExpertSet, read_json, sample, write_json
from rl_tpu.recipes.policy_chain import PolicyChain


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
    """Runs loop.rounds rounds of sample -> filter -> fine-tune; returns the last eval."""
    chain = PolicyChain(config, workdir)
    loop = config.loop
    try:
        params = chain.load(chain.rounds_done)  # P_0 is built (warm start, eval) on first use
        for r in range(chain.rounds_done, loop.rounds):
            expert = sample_round(chain, r, params)                                # sample
            examples = expert.examples(loop.max_per_task, loop.max_examples)       # filter
            params, sft_metrics = chain.fine_tune(r, params, examples)             # fine-tune
            chain.finish_round(r, params, {**expert.metrics(), **sft_metrics})     # P_{r+1}
            params = chain.next_start(r, params)
    finally:
        chain.close()
    return {k: v for k, v in chain.final_eval().items() if k.startswith("eval/")}


def sample_round(chain: PolicyChain, r: int, params) -> ExpertSet:
    """Round r's samples from `params`, over every host: each host samples its share of the
    round's tasks into W/round_r/samples.process<i>.json (read back on resume), then the
    hosts' sets are gathered, so every host holds the same ExpertSet."""
    config, loop = chain.config, chain.config.loop
    engine = chain.engine(params, f"round{r}")  # on every host: its weight sync is collective
    path = chain.host_file(r, "samples")
    mine = read_json(path)
    if mine is None:
        offset, tasks = chain.host_tasks(r, loop.tasks_per_round)
        trajectories = sample(config, engine, chain.make_env, tasks, chain.tokenizer,
                              loop.samples_per_task, rollout_settings.step_seed(config.seed, r, 20),
                              first_position=offset)
        found = ExpertSet(loop.reward_threshold)
        found.add(trajectories)
        mine = found.state()
        write_json(path, mine)
    expert = ExpertSet(loop.reward_threshold)
    for state in chain.gather_records(mine):
        expert.merge(ExpertSet.from_state(state))
    return expert
