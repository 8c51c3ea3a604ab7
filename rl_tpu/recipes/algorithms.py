"""The RL algorithms a config can name, as settings of the same loop.

Each algorithm is a choice of advantage estimator, policy loss (ratio clipping, aggregation)
and rollout-side extras. `algo_config(name)` returns the `algo` config block with that
algorithm's defaults filled in, so an experiment file shows every knob it can sweep; the
functions below turn the (possibly overridden) block into the objects the learner takes.

| name         | advantage    | policy loss                     | extras                          |
|--------------|--------------|---------------------------------|---------------------------------|
| ppo          | gae (critic) | ppo clip [0.8, 1.2], token mean | value step after the policy step|
| grpo         | grpo         | ppo clip [0.8, 1.2], seq mean   |                                 |
| dr_grpo      | dr_grpo      | ppo clip, fixed normaliser      | normaliser = generation budget  |
| dapo         | grpo         | clip-higher [0.8, 1.28], token  | dynamic sampling, overlong shape|
| gspo         | grpo         | gspo (sequence ratio) 3e-4/4e-4 | the ratio per sequence          |
| rloo         | rloo         | ppo clip, token mean            |                                 |
| reinforce_pp | reinforce_pp | ppo clip, token mean            | KL to the reference, in reward  |
| bapo         | grpo         | bapo adaptive bounds (Eq. 8)    | variant=verl: dual clip 3.0     |
| tl_grpo      | tl_grpo      | ppo clip [0.8, 1.2], seq mean   | branching rollouts, fork turn   |

tl_grpo plays each task once up to a fork turn (`algo.branch_turn`, fixed or drawn per task
with `algo.branch_sample="uniform"`), forks it into G branches (rl_tpu/branching.py) and
normalises the branches' rewards in their group; the turns before the fork carry no loss.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import ml_collections
import numpy as np

from rl_tpu import agent, branching
from rl_tpu.rl.bapo import BapoConfig
from rl_tpu.rl.losses import PolicyLossConfig
from rl_tpu.train import steps
from rl_tpu.train.learner import UpdateConfig
from rl_tpu.train.rollout_batch import NO_LOSS
from rl_tpu.trajectory import Trajectory, groups_of

ALGORITHMS = ("ppo", "grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp", "bapo",
              "tl_grpo")

_ADVANTAGE = {"ppo": "gae", "grpo": "grpo", "dr_grpo": "dr_grpo", "dapo": "grpo",
              "gspo": "grpo", "rloo": "rloo", "reinforce_pp": "reinforce_pp", "bapo": "grpo",
              "tl_grpo": "tl_grpo"}
_LOSS_KIND = {"gspo": "gspo", "bapo": "bapo"}


def algo_config(name: str) -> ml_collections.ConfigDict:
    """The `algo` block with `name`'s defaults (every key a sweep may override)."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {ALGORITHMS}")
    c = ml_collections.ConfigDict()
    c.name = name
    c.advantage = _ADVANTAGE[name]
    c.gamma = 1.0  # gae / reinforce_pp discount (over the agent's tokens)
    c.lam = 0.95 if name == "ppo" else 1.0  # gae lambda
    c.std_ddof = 1  # grpo std: 1 = unbiased (TRL, verl, DeepSeekMath)
    c.loss = _LOSS_KIND.get(name, "ppo")
    c.clip_low = 3e-4 if name == "gspo" else 0.2
    c.clip_high = {"dapo": 0.28, "gspo": 4e-4}.get(name, 0.2)
    c.dual_clip = 0.0  # 0 = off (bapo.variant="verl" turns on its own 3.0)
    c.aggregation = {"grpo": "seq_mean_token_mean", "gspo": "seq_mean_token_mean",
                     "tl_grpo": "seq_mean_token_mean",
                     "dr_grpo": "fixed_normalizer"}.get(name, "token_mean")
    c.entropy_coef = 0.0
    c.kl_coef = 0.0  # KL(pi || ref) as a loss term; > 0 keeps a frozen reference policy
    c.kl_estimator = "k3"
    c.reward_kl_coef = 0.01 if name == "reinforce_pp" else 0.0  # KL folded into the reward
    c.behaviour_is = "none"  # none | truncate | mask: engine/trainer mismatch correction
    c.behaviour_is_cap = 2.0
    c.dynamic_sampling = name == "dapo"  # drop groups whose rewards are all equal, refill
    c.max_refill_rounds = 3
    # Branching rollouts (advantage tl_grpo): the turn each task's episode forks into G
    # branches at (at most H - 1): branch_turn for every task ("fixed"), or drawn per task
    # from 0..branch_turn ("uniform", so early turns are trained too: docs/architecture.md).
    c.branch_turn = 2 if name == "tl_grpo" else 0
    c.branch_sample = "fixed"
    c.overlong_buffer = 0  # DAPO overlong shaping: the last N tokens of the budget are penalised
    c.overlong_penalty = 1.0  # ... linearly up to this much at the full budget (DAPO: set
    # the buffer per experiment, below the generation budget)
    c.bapo = ml_collections.ConfigDict(vars(BapoConfig()))
    c.value_clip = 0.2
    c.value_lr = 1e-5
    c.whiten_advantages = name == "ppo"  # GAE advantages whitened over the batch (as verl)
    # The three policies (docs/architecture.md): the ratio divides by the proximal policy
    # (recomputed at the start of the update) or by the behaviour policy (the engine's
    # log-probs; BAPO's r = pi_theta / pi_rollout, which sees the staleness).
    c.ratio_against = "behaviour" if name == "bapo" else "proximal"
    # False: no proximal forward; the behaviour log-probs stand in for it. Exact on-policy
    # with full-distribution log-probs, and whenever the ratio is against behaviour.
    c.recompute_proximal = True
    return c


def loss_config(algo: ml_collections.ConfigDict, max_new_tokens: int) -> PolicyLossConfig:
    if algo.name not in ALGORITHMS:
        raise ValueError(f"algo.name={algo.name!r}; choose one of {ALGORITHMS}")
    return PolicyLossConfig(
        kind=algo.loss, clip_low=algo.clip_low, clip_high=algo.clip_high,
        dual_clip=algo.dual_clip or None, aggregation=algo.aggregation,
        fixed_normalizer=(max_new_tokens if algo.aggregation == "fixed_normalizer" else None),
        behaviour_is=algo.behaviour_is, behaviour_is_cap=algo.behaviour_is_cap,
        entropy_coef=algo.entropy_coef, kl_coef=algo.kl_coef, kl_estimator=algo.kl_estimator,
        bapo=BapoConfig(**algo.bapo.to_dict()), ratio_against=algo.ratio_against)


def advantage_options(algo: ml_collections.ConfigDict) -> tuple:
    """(name, value) options compute_advantages passes to the estimator."""
    by_estimator = {"gae": {"gamma": algo.gamma, "lam": algo.lam,
                            "whiten": bool(algo.whiten_advantages)},
                    "reinforce_pp": {"gamma": algo.gamma},
                    "grpo": {"ddof": algo.std_ddof},
                    "tl_grpo": {"ddof": algo.std_ddof, "carry_forward": True},
                    "rloo": {}, "dr_grpo": {}}
    if algo.advantage not in by_estimator:
        raise ValueError(f"algo.advantage={algo.advantage!r}; choose one of {sorted(by_estimator)}")
    return tuple(sorted(by_estimator[algo.advantage].items()))


def update_config(config: ml_collections.ConfigDict) -> UpdateConfig:
    """The learner's settings: epochs x minibatches, the estimator, the reference and the
    proximal pass, as the algorithm needs them (REINFORCE++'s KL-shaped reward included)."""
    algo, t = config.algo, config.train
    return UpdateConfig(
        epochs=t.epochs, minibatches=t.minibatches,
        score_micro_batches=t.score_micro_batches or t.minibatches * t.micro_batches,
        tokens_per_device=t.tokens_per_device, score_tokens_per_device=t.score_tokens_per_device,
        step=steps.StepConfig(micro_batches=t.micro_batches, logprob_chunk=t.logprob_chunk,
                              temperature=config.rollout.temperature),
        advantage=algo.advantage, advantage_options=advantage_options(algo),
        value_clip=algo.value_clip or None, use_reference=uses_reference(algo),
        reward_kl_coef=algo.reward_kl_coef if algo.advantage == "reinforce_pp" else 0.0,
        recompute_proximal=algo.recompute_proximal, shuffle_seed=config.seed)


def uses_critic(algo: ml_collections.ConfigDict) -> bool:
    return algo.advantage == "gae"


def uses_reference(algo: ml_collections.ConfigDict) -> bool:
    return bool(algo.kl_coef) or bool(algo.reward_kl_coef and algo.advantage == "reinforce_pp")


def shape_overlong(trajectories: Sequence[Trajectory], algo, max_new_tokens: int) -> None:
    """DAPO's soft overlong punishment, in place, per turn: a turn that generated more than
    budget - buffer tokens loses (len - (budget - buffer)) / buffer * penalty of its reward, up
    to `penalty` at the budget. The budget is per turn (`env.max_new_tokens`), so each turn is
    measured against it on its own: a 3-turn episode of 100 tokens a turn at budget 256 is
    not overlong. The episode's reward loses the sum of its turns' penalties."""
    buffer = int(algo.overlong_buffer)
    if buffer <= 0:
        return
    if buffer >= max_new_tokens:
        raise ValueError(f"algo.overlong_buffer={buffer} must be below the generation budget "
                         f"{max_new_tokens}")
    start = max_new_tokens - buffer
    for traj in trajectories:
        generated = np.asarray(traj.loss_mask, bool)
        per_turn = np.bincount(np.asarray(traj.turn_ids)[generated],
                               minlength=traj.num_turns)
        total = branch_total = 0.0
        for k in range(traj.num_turns):
            over = int(per_turn[k]) - start
            if over > 0:
                penalty = min(over / buffer, 1.0) * algo.overlong_penalty
                if k < len(traj.rewards):  # token-level rewards see it on turn k's tokens
                    traj.rewards[k] -= penalty
                total += penalty
                if k >= traj.info.get("branch_turn", traj.num_turns):
                    branch_total += penalty  # a branch's own turns: its TL-GRPO reward
        traj.reward -= total
        if "branch_reward" in traj.info:
            traj.info["branch_reward"] -= branch_total


def informative_groups(trajectories: Sequence[Trajectory]) -> list[list[Trajectory]]:
    """Groups (by group_id, in order) whose rewards are not all equal: DAPO's dynamic sampling
    keeps only these, since a group of equal rewards has zero advantage everywhere."""
    return [g for g in groups_of(trajectories) if len({round(t.reward, 9) for t in g}) > 1]


# ----------------------------------------------------------------------------- rollout hooks
# What the loop asks of the algorithm around a rollout, with no branch per algorithm there.


def episode_player(algo, seed: int) -> Callable[..., list[Trajectory]]:
    """How the step's episodes are played: `agent.run_episodes`, or for TL-GRPO
    `branching.run_branching_episodes` with the algo block's fork turn (same arguments).
    `seed` (the run's) draws sampled fork turns, per task, the same on a rerun."""
    if algo.advantage != "tl_grpo":
        return agent.run_episodes
    plan = branching.BranchPlan(algo.branch_turn, algo.branch_sample, seed)
    return functools.partial(branching.run_branching_episodes, plan=plan)


def batch_arrays(host: dict, trajectories: Sequence[Trajectory], algo) -> dict:
    """Host arrays the algorithm adds to (or replaces in) the batch built from
    `trajectories`: for TL-GRPO the branch groups' turn slots and the loss mask without the
    shared prefix (`branching.turn_arrays`); nothing for the others."""
    if algo.advantage != "tl_grpo":
        return {}
    return branching.turn_arrays(trajectories, host["loss_mask"], host["group_ids"],
                                 num_slots=algo.branch_turn + 1)


def select_groups(played: list[Trajectory], wanted: int, samples_per_task: int, algo,
                  play_more: Callable[[int], list[Trajectory]],
                  any_host: Callable[[bool], bool]) -> tuple[list[Trajectory], dict]:
    """The step's trajectories from what was played: all of them, or with DAPO's dynamic
    sampling the informative groups, refilled by `play_more(round)` while any host is short
    (`any_host(flag)` agrees across hosts so their task streams stay in step; a producer that
    must not run collectives passes a local one). Short of informative groups after the last
    round, equal-reward groups fill the batch flagged NO_LOSS: they keep the batch's shape but
    add nothing to a token mean's denominator. Metrics: rollout/played_tokens counts every
    generated token once, refills included (a branch copy's inherited prefix is the trunk's)."""
    metrics = {}
    if algo.dynamic_sampling:
        groups = informative_groups(played)
        rounds = 0
        for round_index in range(1, algo.max_refill_rounds + 1):
            if not any_host(len(groups) < wanted):
                break
            more = play_more(round_index)
            played = played + more
            groups += informative_groups(more)
            rounds = round_index
        kept = [t for g in groups[:wanted] for t in g]
        kept_ids = {t.group_id for t in kept}
        fillers = [t for t in played if t.group_id not in kept_ids]
        fillers = fillers[:wanted * samples_per_task - len(kept)]
        for t in fillers:
            t.info[NO_LOSS] = True
        metrics["rollout/informative_group_frac"] = len(groups) / max(
            len(played) // samples_per_task, 1)
        metrics["rollout/refill_rounds"] = float(rounds)
        metrics["rollout/filler_group_frac"] = len(fillers) / samples_per_task / max(wanted, 1)
        chosen = kept + fillers
    else:
        chosen = played
    metrics["rollout/played_tokens"] = float(sum(
        t.num_generated - t.info.get("inherited_tokens", 0) for t in played))
    forks = [t.info["branch_turn"] for t in chosen if "branch_turn" in t.info]
    if forks:
        metrics["rollout/branch_turn"] = float(np.mean(forks))
    return chosen, metrics


def batch_keys(trajectories: Sequence[Trajectory], algo) -> list[str]:
    """The rollout arrays the learner gets: always the tokens and rewards; the engine's
    behaviour log-probs when they are of the full distribution (docs/architecture.md,
    logprob conventions). Renormalised top-p / top-k log-probs differ by -log(kept mass) per
    token and would bias IS weights, BAPO's Eq. 8 weights and a ratio against behaviour:
    needed but truncated is a clear error; not needed, they are left out."""
    keys = ["tokens", "positions", "segment_ids", "loss_mask", "token_rewards", "rewards",
            "group_ids", "turn_ids"]
    if algo.advantage == "tl_grpo":
        keys += ["turn_rewards", "turn_group_ids"]
    truncated = any(t.logprob_convention != "full" for t in trajectories)
    if not truncated:
        return keys + ["behaviour_logprobs"]
    needs = [what for what, needed in (
        (f"algo.behaviour_is={algo.behaviour_is!r}", algo.behaviour_is != "none"),
        ("BAPO's Eq. 8 weights", algo.loss == "bapo" and algo.bapo.variant == "paper"),
        ("algo.ratio_against='behaviour'", algo.ratio_against == "behaviour"),
        ("algo.recompute_proximal=False", not algo.recompute_proximal)) if needed]
    if needs:
        raise ValueError(
            "the rollout engine reported truncated (top-p/top-k renormalised) log-probs, but "
            f"{', '.join(needs)} need log-probs of the full distribution. Sample without "
            "truncation (rollout.top_p=1, rollout.top_k=-1), use an engine that reports full "
            "log-probs, or turn those off")
    return keys
