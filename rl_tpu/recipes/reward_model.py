"""Reward-model training: Bradley-Terry on preference pairs, then semi-supervised rounds (SSRM).

    python -m launch.train --config configs/reward_model_largest.py --workdir /tmp/rm

Pairs. With reward_model.data_path, a JSONL of {"prompt", "chosen", "rejected"[, "margin",
"split"]} (rl_tpu/data/pairs.py): lines whose "split" is "eval" are held out, and
reward_model.eval_fraction of the lines that name no split (a seeded shuffle). Without it,
the env's own scorer ranks replies of P_0 (the initial policy after its SFT warm start,
sft.steps): it samples loop.samples_per_task replies to each of reward_model.prompts training
tasks and pairs the best against the worst of each task whose replies differ in reward
(dpo.online_pairs: episodes of a crashed env are never paired); the held-out pairs come the
same way from reward_model.eval_prompts tasks of the eval split. Replies are token-exact with
the rollouts a reward model later scores in RL (the trajectory's ids).

The reward model starts from P_0 (its trunk, a zero score head: every reply scores 0 and the
BT loss starts at log 2). Round 0 takes reward_model.steps BT steps (or reward_model.epochs
passes) on the labelled pairs. SSRM round r >= 1 scores a pool of unlabelled pairs (replies of
P_0 to reward_model.ssrm_pool further tasks, each pair's sides in a seeded random order),
labels each by the model's own preference, keeps those with confidence sigmoid(|r_a - r_b|)
>= reward_model.ssrm_threshold, and trains again on labelled + kept; the env's labels of the
pool are used only to report how many pseudo-labels were right (ssrm/pseudo_label_accuracy).

Held-out metrics each round (round r at step r + 1 of W/metrics.jsonl; step 0 is P_0's
eval): rm/eval_accuracy (ties count half), rm/eval_bt_loss, rm/eval_margin, rm/eval_ece
(expected calibration error of sigmoid(r_c - r_r) over reward_model.calibration_bins bins),
and the training pairs and last step's loss.

Layout, resumable like the loops around the update (policy_chain.py):
    W/start/policy_hf              P_0
    W/pairs/<name>.process<i>.json what this host sampled (labelled, eval, round r's pool)
    W/round_r/rm/checkpoints       round r's BT steps, with the data position
    W/round_r/reward_model_hf      the reward model after round r (HF *ForSequenceClassification)
    W/round_r/done.json            round r's metrics; its presence says the round is done
    W/reward_model_hf              the final reward model (the last round's)
"""

from __future__ import annotations

import math
import os
import shutil
from typing import Sequence

import jax
import ml_collections
import numpy as np

from rl_tpu import parallel
from rl_tpu.data.jsonl import split_rows
from rl_tpu.data.pairs import read_preference_pairs
from rl_tpu.data.tasks import eval_tasks
from rl_tpu.models import lora, reward_model
from rl_tpu.recipes import policy_io, rollout_settings, sft, train_states
from rl_tpu.recipes.dpo import Pair, PairBatches, online_pairs
from rl_tpu.recipes.experience import read_json, sample, write_json
from rl_tpu.recipes.policy_chain import PolicyChain
from rl_tpu.rewards.scorer import RewardScorer
from rl_tpu.rl.reward_losses import bradley_terry_loss, calibration, select_pseudo_labels
from rl_tpu.train import steps

RM_DIR = "reward_model_hf"


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
    """Round 0 on the labelled pairs, then reward_model.ssrm_rounds SSRM rounds; returns the
    last round's held-out metrics."""
    chain = PolicyChain(config, workdir)
    rm = config.reward_model
    try:
        loaded = []

        def initial_policy():  # P_0, made (warm-started, evaluated) on first use; every host
            if not loaded:     # reaches each use alike, as its loading is collective
                loaded.append(chain.load(0))
            return loaded[0]

        # a JSONL's pairs are read (and any bad line named) before P_0 is trained
        labelled, held_out = labelled_pairs(chain, initial_policy)
        head = reward_model.RewardHead(num_labels=1, pad_token_id=chain.tokenizer.pad_token_id)
        model = reward_model.RewardModel(chain.model_cfg, 1, chain.mesh, chain.model.rules)
        params = (reward_model.reward_params_from(initial_policy(), chain.model_cfg)
                  if chain.rounds_done == 0
                  else _adapted(chain, model, _load_rm(chain, chain.rounds_done - 1),
                                chain.rounds_done))
        record: dict = {}
        for r in range(chain.rounds_done, 1 + rm.ssrm_rounds):
            train, record = labelled, {"rm/labelled_pairs": float(len(labelled))}
            if r > 0:
                kept, ssrm = pseudo_labelled(chain, r, params, head, initial_policy)
                train, record = labelled + kept, record | ssrm
            params, trained = optimise(chain, r, model, params, train)
            record |= trained | held_out_metrics(chain, params, head, held_out)
            _finish_round(chain, r, params, head, record)
            if lora.is_on(chain.model_cfg):  # as a resume starts round r+1 (_load_rm)
                params = _adapted(chain, model, policy_io.merged(chain.model_cfg, params)[1],
                                  r + 1)
        if chain.rounds_done and not os.path.isdir(os.path.join(workdir, RM_DIR)):
            _publish_final(chain)
        return {k: v for k, v in (record or chain.final_eval()).items()
                if k.startswith("rm/eval")}
    finally:
        chain.close()


# ----------------------------------------------------------------------------- pairs


def labelled_pairs(chain: PolicyChain, policy) -> tuple[list[Pair], list[Pair]]:
    """(training pairs, held-out pairs): the JSONL's, else the env's ranking of the replies
    of P_0 (`policy()`: its params)."""
    rm = chain.config.reward_model
    if rm.data_path:
        return _jsonl_pairs(chain, rm.data_path)
    offset, tasks = chain.host_tasks(0, rm.prompts)
    train = sampled_pairs(chain, policy, "labelled", offset, tasks, 1)
    indexed = eval_tasks(chain.source, chain.config.env.eval_split, rm.eval_prompts)
    held_out = sampled_pairs(chain, policy, "eval", indexed[0][0] if indexed else 0,
                             [t for _, t in indexed], 2)
    return train, held_out


def _jsonl_pairs(chain: PolicyChain, path: str) -> tuple[list[Pair], list[Pair]]:
    rm = chain.config.reward_model
    pairs = read_preference_pairs(path)
    encoded = [(tuple(sft.chat_example(conversation, chain.tokenizer, p.where)
                      for conversation in (p.chosen_conversation, p.rejected_conversation)),
                p.margin or 0.0) for p in pairs]
    # a line's own "split", else eval for a seeded share of the rest (as launch.make_dataset)
    by_split = split_rows([{"split": p.split, "index": i} for i, p in enumerate(pairs)],
                          rm.eval_fraction, chain.config.seed)
    held = [row["index"] for row in by_split["eval"]]
    held_set = set(held)
    train = [_with_margin(*encoded[i]) for i in range(len(pairs)) if i not in held_set]
    if not train or not held:
        raise ValueError(f"{path}: {len(train)} training and {len(held)} held-out pairs; each "
                         "needs at least one (mark lines \"split\": \"eval\", or set "
                         "reward_model.eval_fraction in (0, 1))")
    return train, [_with_margin(*encoded[i]) for i in held]


def _with_margin(pair, margin: float):
    """A pair as (chosen, rejected, margin): the margin rides along to the batches."""
    return (pair[0], pair[1], float(margin))


def sampled_pairs(chain: PolicyChain, policy, name: str, offset: int, tasks: Sequence,
                  seed_slot: int) -> list:
    """Best-vs-worst pairs of P_0's loop.samples_per_task replies to this host's `tasks`,
    ranked by the env's reward; every host's, gathered in host order (saved per host, so a
    resumed run pairs exactly what it sampled)."""
    config = chain.config
    path = os.path.join(chain.workdir, "pairs", f"{name}.process{jax.process_index()}.json")
    engine = chain.engine(policy(), "start")  # on every host: its weight sync is collective
    mine = read_json(path)
    if mine is None:
        trajectories = sample(config, engine, chain.make_env, tasks, chain.tokenizer,
                              config.loop.samples_per_task,
                              rollout_settings.step_seed(config.seed, 0, 40 + seed_slot),
                              first_position=offset)
        pairs, unscored = online_pairs(trajectories)
        mine = {"pairs": pairs, "unscored": unscored}
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_json(path, mine)
    hosts = chain.gather_records(mine)
    return [_with_margin((tuple(p[0]), tuple(p[1])), 0.0)
            for h in hosts for p in h["pairs"]]


def pseudo_labelled(chain: PolicyChain, r: int, params, head, policy) -> tuple[list, dict]:
    """SSRM round r: the pool's pairs (replies of P_0, `policy()`) the current model labels
    with enough confidence, oriented as it prefers them, and the round's selection metrics."""
    rm = chain.config.reward_model
    offset, tasks = chain.host_tasks(1000 + r, rm.ssrm_pool)  # disjoint from round 0's tasks
    pool = sampled_pairs(chain, policy, f"pool_{r}", offset, tasks, 2 + r)
    if not pool:
        return [], {"ssrm/pool": 0.0, "ssrm/kept": 0.0}
    # sides in a seeded random order: the pool's "chosen" is the env's label, hidden from
    # the model and used only to score the pseudo-labels
    flip = np.random.RandomState(chain.config.seed * 7919 + r).rand(len(pool)) < 0.5
    a = [p[1] if f else p[0] for p, f in zip(pool, flip)]
    b = [p[0] if f else p[1] for p, f in zip(pool, flip)]
    scorer = _scorer(chain, params, head)
    score_a, score_b = (scorer.score([ids for ids, _ in side])[:, 0] for side in (a, b))
    chosen_truth = np.where(flip, 1, 0)  # the env's chosen side: b when flipped
    picked = select_pseudo_labels(score_a, score_b, threshold=rm.ssrm_threshold,
                                  true_chosen_index=chosen_truth)
    kept = [_with_margin(((a, b)[c][i], (a, b)[1 - c][i]), 0.0)
            for i, c in enumerate(picked.chosen_index) if picked.kept[i]]
    summary = picked.summary
    return kept, {f"ssrm/{k}": float(v) for k, v in summary.items()}


# ----------------------------------------------------------------------------- optimise


def optimise(chain: PolicyChain, r: int, model, params, pairs: Sequence) -> tuple:
    """reward_model.steps BT steps (or .epochs passes) on `pairs`, checkpointed in
    W/round_r/rm with the data position; (params, the last step's metrics)."""
    config, rm = chain.config, chain.config.reward_model
    if not pairs:
        raise ValueError("no preference pairs to train the reward model on: every task's "
                         "replies tied (raise loop.samples_per_task or reward_model.prompts, "
                         "or give reward_model.data_path)")
    if rm.batch_size % parallel.data_parallel_size(chain.mesh):
        raise ValueError(f"reward_model.batch_size={rm.batch_size} must divide by the "
                         f"data-parallel size {parallel.data_parallel_size(chain.mesh)}")
    num_steps = (max(1, math.ceil(rm.epochs * len(pairs) / rm.batch_size)) if rm.epochs > 0
                 else rm.steps)
    optim = train_states.optim_config(rm.lr, config, num_steps, warmup_steps=0)
    state = train_states.new_state(params, optim, heads=("score",))  # LoRA: adapters + head
    extras = {"margin": np.asarray([p[2] for p in pairs], np.float32),
              "weight": np.ones((len(pairs),), np.float32)}
    longest = max(max(len(p[0][0]), len(p[1][0])) for p in pairs)
    data = PairBatches([(p[0], p[1]) for p in pairs], extras, rm.batch_size,
                       sft.bucket_lengths(config, longest), config.seed + r,
                       host=(jax.process_index(), jax.process_count()))
    step_fn = steps.compile_step(steps.make_reward_model_step(model, rm.centring), state,
                                 chain.mesh)
    state, last = sft.checkpointed_steps(config, os.path.join(chain.round_dir(r), "rm",
                                                              "checkpoints"),
                                         state, data, step_fn, chain.mesh, num_steps, "rm")
    return state.params, last | {"rm/steps": float(num_steps), "rm/train_pairs": float(len(pairs))}


# ----------------------------------------------------------------------------- held out


def _scorer(chain: PolicyChain, params, head) -> RewardScorer:
    """The model as it is now, scoring on this host's devices (every host scores every pair:
    no collective after the copy)."""
    local = parallel.host_copies(params)
    mesh = parallel.make_mesh({"data": -1}, devices=jax.local_devices())
    return RewardScorer(chain.model_cfg, head, local, mesh,
                        tokens_per_batch=max(16384, chain.config.env.max_context_tokens))


def held_out_metrics(chain: PolicyChain, params, head, pairs: Sequence) -> dict[str, float]:
    """Pairwise accuracy, BT loss, margin and calibration of the model on the held-out pairs."""
    scorer = _scorer(chain, params, head)
    chosen = scorer.score([p[0][0] for p in pairs])[:, 0]
    rejected = scorer.score([p[1][0] for p in pairs])[:, 0]
    _, m = bradley_terry_loss(chosen, rejected)
    cal = calibration(chosen, rejected, chain.config.reward_model.calibration_bins)
    return {"rm/eval_accuracy": float(m["accuracy"]), "rm/eval_bt_loss": float(m["bt_loss"]),
            "rm/eval_margin": float(m["reward_margin"]), "rm/eval_ece": float(cal.ece),
            "rm/eval_pairs": float(len(pairs))}


# ----------------------------------------------------------------------------- rounds


def _rm_path(chain: PolicyChain, r: int) -> str:
    return os.path.join(chain.round_dir(r), RM_DIR)


def _adapted(chain: PolicyChain, model, params, r: int):
    """A merged reward model with round r's fresh adapters on its trunk (a LoRA run: each
    round trains new adapters on the last round's model, merged, as policy_chain.py's
    rounds do), or `params` as they are."""
    if not lora.is_on(chain.model_cfg):
        return params
    return policy_io.with_fresh_adapters(model, params, chain.mesh,
                                         rollout_settings.step_seed(chain.config.seed, r, 41))


def _load_rm(chain: PolicyChain, r: int):
    _, _, params = reward_model.load(_rm_path(chain, r), mesh=chain.mesh,
                                     dtype=chain.config.model.dtype)
    return params


def _finish_round(chain: PolicyChain, r: int, params, head, record: dict) -> None:
    """Writes round r's reward model, logs the round at step r, marks it done."""
    cfg, params = policy_io.merged(chain.model_cfg, params)  # a plain HF classifier
    reward_model.save(_rm_path(chain, r), cfg, params, head, tokenizer=chain.tokenizer.hf)
    parallel.sync_hosts(f"reward_model_{r}")
    chain.writer.write(r + 1, record)  # step 0 is P_0's eval
    if chain.is_chief:
        write_json(chain.done_path(r), record)
        print(f"reward model round {r}: held-out accuracy {record['rm/eval_accuracy']:.3f} "
              f"on {record['rm/eval_pairs']:.0f} pairs, ECE {record['rm/eval_ece']:.3f}",
              flush=True)
    chain.rounds_done = r + 1
    _publish_final(chain)


def _publish_final(chain: PolicyChain) -> None:
    """W/reward_model_hf: a copy of the newest round's model, where RL configs point."""
    if chain.is_chief:
        final = os.path.join(chain.workdir, RM_DIR)
        staging = final + ".tmp"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(_rm_path(chain, chain.rounds_done - 1), staging)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
    parallel.sync_hosts("reward_model_final")
