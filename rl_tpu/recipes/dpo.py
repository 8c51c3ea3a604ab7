"""Preference optimisation: offline DPO / IPO from a preference JSONL, or online iterative DPO
with a verifier's reward (INPO as an option).

    python -m launch.train --config configs/dpo_largest.py --workdir /tmp/dpo
    python -m launch.train --config configs/dpo_largest.py:offline \\
        --config.dpo.data_path=pairs.jsonl --workdir /tmp/dpo_offline

P_0 is the initial model after its SFT warm start (sft.steps, when > 0). Round r, from P_r:
  pairs      offline: every line of dpo.data_path, {"prompt": text or a list of chat
             messages, "chosen": reply, "rejected": reply}. Online: loop.samples_per_task
             replies to each of loop.tasks_per_round new training tasks sampled from P_r, scored
             by the env's reward (or, with reward.model_path, by a reward model's: docs/
             rewards.md); a task whose best and worst replies differ in reward gives one pair
             (best, worst). Episodes that ended in env_error or abort are never
             chosen or rejected (loop/unscored_excluded counts them). Online pairs are the
             sampled trajectories themselves (multi-turn episodes too: every action carries
             loss), written to W/round_r/pairs.process<i>.json (each host samples its
             share of the round's tasks; the hosts' pairs are gathered) so a resumed round
             trains on exactly what it sampled
  reference  sequence log-probs of both sides under the reference, refreshed every round:
             P_r itself (dpo, ipo); for inpo the initial policy P_0 is the reference and P_r,
             which sampled the pairs, the previous iterate (prev_*), with eta = 1 / dpo.beta
             and tau = dpo.inpo_tau (rl_tpu/rl/preference.py has every formula)
  optimise   dpo.steps steps (or dpo.epochs passes over the pairs) of rl_tpu.train.steps'
             preference step on dpo.batch_size pairs at dpo.lr, checkpointed with the data
             position in W/round_r/dpo
  P_{r+1}    written to W/round_r/policy_hf, evaluated, logged at step r+1 (policy_chain.py)
Offline runs are usually one round (loop.rounds = 1); more rounds retrain on the same pairs
against each round's refreshed reference.
"""

from __future__ import annotations

import json
import math
import os
from typing import Sequence

import jax
import ml_collections
import numpy as np

from rl_tpu import parallel
from rl_tpu.recipes import rollout_settings, sft, train_states
from rl_tpu.recipes.experience import read_json, sample, write_json
from rl_tpu.recipes.policy_chain import PolicyChain
from rl_tpu.rewards.mix import RewardMix
from rl_tpu.train import steps
from rl_tpu.train.batching import bucket_length
from rl_tpu.train.rollout_batch import NO_LOSS, UNSCORED_FINISHES
from rl_tpu.core.trajectory import Trajectory, groups_of

Example = sft.Example
Pair = tuple[Example, Example]  # (chosen, rejected)


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
    """loop.rounds rounds of pairs -> reference -> preference steps; returns the last eval."""
    chain = PolicyChain(config, workdir)
    # online pairs ranked by a learned reward instead of (or beside) the env's: reward.*
    mix = RewardMix.from_config(config, jax.local_devices(), policy_tokenizer=chain.tokenizer)
    try:
        params = chain.load(chain.rounds_done)
        initial = chain.load(0) if config.dpo.loss == "inpo" else None
        for r in range(chain.rounds_done, config.loop.rounds):
            pairs, record = round_pairs(chain, r, params, mix)                     # pairs
            if not pairs:
                chain.finish_round(r, params, record)  # nothing to prefer: P_{r+1} = P_r
                params = chain.next_start(r, params)
                continue
            reference = reference_logps(chain, pairs, params, initial)             # reference
            params, metrics = optimise(chain, r, params, pairs, reference)         # optimise
            chain.finish_round(r, params, {**record, **metrics})                   # P_{r+1}
            params = chain.next_start(r, params)
    finally:
        chain.close()
    return {k: v for k, v in chain.final_eval().items() if k.startswith("eval/")}


# ----------------------------------------------------------------------------- pairs


def round_pairs(chain: PolicyChain, r: int, params, mix=None) -> tuple[list[Pair], dict]:
    """Round r's preference pairs and their metrics (offline: the JSONL's). With a RewardMix
    (reward.model_path), the sampled replies are ranked by its reward, as online iterative
    RLHF ranks them by a reward model; loop/sample_success stays the env's verdict."""
    config = chain.config
    if config.dpo.data_path:
        pairs = preference_pairs(config.dpo.data_path, chain.tokenizer)
        return pairs, {"loop/pairs": float(len(pairs))}
    loop = config.loop
    engine = chain.engine(params, f"round{r}")  # on every host: its weight sync is collective
    path = chain.host_file(r, "pairs")
    mine = read_json(path)
    if mine is None:  # this host's share of the round's tasks, saved for a resume
        offset, tasks = chain.host_tasks(r, loop.tasks_per_round)
        trajectories = sample(config, engine, chain.make_env, tasks, chain.tokenizer,
                              loop.samples_per_task, rollout_settings.step_seed(config.seed, r, 30),
                              first_position=offset)
        if mix is not None:
            mix.apply(trajectories)
        pairs, unscored = online_pairs(trajectories)
        mine = {"pairs": pairs, "sampled": len(trajectories), "unscored": unscored,
                "successes": sum(bool(t.success) for t in trajectories),
                "reward": float(sum(t.reward for t in trajectories)),
                "tokens": sum(t.num_generated for t in trajectories)}
        write_json(path, mine)
    hosts = chain.gather_records(mine)  # every host's pairs, in host order, on every host
    pairs = [tuple(tuple(side) for side in p) for h in hosts for p in h["pairs"]]
    n = sum(h["sampled"] for h in hosts)
    metrics = {"loop/pairs": float(len(pairs)), "loop/sampled": float(n),
               "loop/unscored_excluded": float(sum(h["unscored"] for h in hosts)),
               "loop/sample_success": sum(h["successes"] for h in hosts) / max(n, 1),
               "loop/sample_reward": sum(h["reward"] for h in hosts) / max(n, 1),
               "loop/sampled_tokens": float(sum(h["tokens"] for h in hosts))}
    return pairs, metrics


def online_pairs(trajectories: Sequence[Trajectory]) -> tuple[list[Pair], int]:
    """(pairs, episodes left out): one (best, worst) pair per group whose scored episodes
    differ in reward. An episode that ended in env_error or abort (UNSCORED_FINISHES) has a
    reward that says nothing about its reply (0 from a crashed env, not from a bad answer),
    and one the reward mix kept out of the loss (`NO_LOSS`: no reply to score, or a judge
    that gave no verdict) a reward without its model's or judge's part: it is neither chosen
    nor rejected, and the count of those left out is returned."""
    pairs, unscored = [], 0
    for group in groups_of(trajectories):
        scored = [t for t in group
                  if t.finish not in UNSCORED_FINISHES and not t.info.get(NO_LOSS)]
        unscored += len(group) - len(scored)
        if not scored:
            continue
        # first of equals: the earliest sample, so the choice does not depend on sort order
        best = max(scored, key=lambda t: t.reward)
        worst = min(scored, key=lambda t: t.reward)
        if best.reward > worst.reward:
            pairs.append(tuple(([int(x) for x in t.tokens], [bool(m) for m in t.loss_mask])
                               for t in (best, worst)))
    return pairs, unscored


def preference_pairs(path: str, tokenizer) -> list[Pair]:
    """A JSONL of {"prompt", "chosen", "rejected"} as token-exact pairs: the chat template's
    prompt (a string is one user message), then each reply and the eos, which carry loss."""
    pairs = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
                prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
                if isinstance(prompt, str):
                    prompt = [{"role": "user", "content": prompt}]
                assert isinstance(prompt, list) and prompt
                assert isinstance(chosen, str) and isinstance(rejected, str)
            except (ValueError, KeyError, TypeError, AssertionError):
                raise ValueError(f"{where}: expected a JSON object with 'prompt' (a string or "
                                 "a list of {role, content}), 'chosen' and 'rejected' (strings)"
                                 ) from None
            pairs.append(tuple(sft.chat_example(prompt + [{"role": "assistant", "content": reply}],
                                                tokenizer, where)
                               for reply in (chosen, rejected)))
    if not pairs:
        raise ValueError(f"{path} holds no preference pairs")
    return pairs


class PairBatches(sft.ExampleBatches):
    """Global batches of pairs, checkpointable like SFT's: chosen_* and rejected_* [B, T]
    arrays padded to one length bucket, with each pair's per-pair `extras` ([N] arrays: the
    reference log-probs) as [B] arrays."""

    def __init__(self, pairs: Sequence[Pair], extras: dict[str, np.ndarray], *args, **kwargs):
        super().__init__(pairs, *args, **kwargs)
        self.extras = extras

    def length(self, r: int) -> int:
        chosen, rejected = self.examples[r]
        return max(len(chosen[0]), len(rejected[0]))

    def collate(self, rows: Sequence[int], t: int) -> dict:
        out = {}
        for side, index in (("chosen", 0), ("rejected", 1)):
            arrays = sft.padded_rows([self.examples[r][index] for r in rows], t)
            out.update({f"{side}_{k}": v for k, v in arrays.items()})
        out.update({k: v[list(rows)] for k, v in self.extras.items()})
        return out


# ----------------------------------------------------------------------------- reference


def sequence_logps(chain: PolicyChain, params, examples: Sequence[Example]) -> np.ndarray:
    """[N] log-probability of each example's loss-masked tokens under `params` (every host
    computes all of them), in batches of dpo.batch_size rows."""
    config = chain.config
    fn = steps.compile_logprob_fn(
        steps.make_logprob_fn(chain.model, steps.StepConfig(
            logprob_chunk=config.train.logprob_chunk)), params, chain.mesh)
    dp = parallel.data_parallel_size(chain.mesh)
    size = -(-config.dpo.batch_size // dp) * dp
    buckets = sft.bucket_lengths(config, max(len(ids) for ids, _ in examples))
    out = []
    for start in range(0, len(examples), size):
        chunk = list(examples[start:start + size])
        n = len(chunk)
        chunk += [([0], [False])] * (size - n)  # pad rows: a whole batch every call
        t = bucket_length(max(len(ids) for ids, _ in chunk), buckets)
        batch = sft.padded_rows(chunk, t)
        mask = batch.pop("loss_mask")
        lp, _ = fn(params, parallel.host_to_global(_host_share(batch), chain.mesh))
        lp = np.asarray(jax.device_get(parallel.gather_to_host(lp)))
        out.append(np.where(mask, lp, 0.0).sum(axis=1)[:n])
    return np.concatenate(out).astype(np.float32)


def _host_share(batch: dict) -> dict:
    """This host's rows of a global batch every host holds whole."""
    index, count = jax.process_index(), jax.process_count()
    return {k: np.array_split(v, count)[index] for k, v in batch.items()}


def reference_logps(chain: PolicyChain, pairs: Sequence[Pair], params,
                    initial=None) -> dict[str, np.ndarray]:
    """The [N] arrays the loss needs beside the pairs: ref_* under the reference (P_r for
    dpo / ipo, the initial policy for inpo) and, for inpo, prev_* under P_r."""
    chosen = [p[0] for p in pairs]
    rejected = [p[1] for p in pairs]
    under = {"ref": params} if initial is None else {"ref": initial, "prev": params}
    return {f"{who}_{side}_logps": sequence_logps(chain, weights, examples)
            for who, weights in under.items()
            for side, examples in (("chosen", chosen), ("rejected", rejected))}


# ----------------------------------------------------------------------------- optimise


def loss_kwargs(dpo: ml_collections.ConfigDict) -> dict:
    if dpo.loss == "inpo":
        return {"eta": 1.0 / dpo.beta, "tau": dpo.inpo_tau}
    return {"beta": dpo.beta}


def optimise(chain: PolicyChain, r: int, params, pairs: Sequence[Pair],
             reference: dict[str, np.ndarray]) -> tuple[object, dict]:
    """dpo.steps preference steps from `params`, checkpointed in W/round_r/dpo; returns the
    new params and the last step's metrics (dpo/*)."""
    config, d = chain.config, chain.config.dpo
    if d.batch_size % parallel.data_parallel_size(chain.mesh):
        raise ValueError(f"dpo.batch_size={d.batch_size} must divide by the data-parallel size "
                         f"{parallel.data_parallel_size(chain.mesh)}")
    num_steps = preference_steps(d, len(pairs))
    optim = train_states.optim_config(d.lr, config, num_steps, warmup_steps=0)
    state = train_states.new_state(params, optim)
    longest = max(max(len(c[0]), len(rj[0])) for c, rj in pairs)
    data = PairBatches(pairs, reference, d.batch_size, sft.bucket_lengths(config, longest),
                       config.seed, host=(jax.process_index(), jax.process_count()))
    step_fn = steps.compile_step(steps.make_preference_step(
        chain.model, d.loss, steps.StepConfig(logprob_chunk=config.train.logprob_chunk),
        **loss_kwargs(d)), state, chain.mesh)
    state, last = sft.checkpointed_steps(config, os.path.join(chain.round_dir(r), "dpo",
                                                              "checkpoints"),
                                         state, data, step_fn, chain.mesh, num_steps, "dpo")
    return state.params, last | {"dpo/steps": float(num_steps)}


def preference_steps(dpo: ml_collections.ConfigDict, num_pairs: int) -> int:
    """dpo.steps, or with dpo.epochs > 0 enough steps for that many passes over the pairs
    (online rounds find fewer pairs as the policy improves: a fixed step count would pass
    over a late round's few pairs many times, which is where DPO overfits)."""
    if dpo.epochs > 0:
        return max(1, math.ceil(dpo.epochs * num_pairs / dpo.batch_size))
    return dpo.steps
