"""The RL algorithms a config can name: one registered `Algorithm` record each.

Each algorithm is a choice of advantage estimator, policy loss (ratio clipping, aggregation)
and rollout-side extras. Its record (`register_algorithm` below) names the estimator and the
loss kind and lists the `algo`-block defaults that differ from the shared ones
(`shared_algo_block`); what follows from the estimator (its options, whether it compares the
samples of a task, a critic, a KL-shaped reward, how its episodes are played and which arrays
its batch needs) is the estimator's `EstimatorUse` record, looked up by `algo.advantage`, so
an experiment that overrides `algo.advantage` gets that estimator's needs.
`algo_config(name)` returns the `algo` config block with that algorithm's defaults filled in,
so an experiment file shows every knob it can sweep; the functions below turn the (possibly
overridden) block into the objects the learner and the loop take, with no branch per name.

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
| cispo        | grpo         | cispo: sg(clip(r, 0, 1.28)) A   | every token keeps its gradient  |
|              |              | log pi, token mean              |                                 |

tl_grpo plays each task once up to a fork turn (`algo.branch_turn`, fixed or drawn per task
with `algo.branch_sample="uniform"`), forks it into G branches (rl_tpu/agent/branching.py) and
normalises the branches' rewards in their group; the turns before the fork carry no loss.
DAPO's dynamic sampling and overlong shaping are switches of the block
(`algo.dynamic_sampling`, `algo.overlong_buffer`) that any algorithm may turn on; DAPO's record
turns dynamic sampling on by default.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, Optional, Sequence

import ml_collections
import numpy as np

from rl_tpu import agent

from rl_tpu.agent import branching
from rl_tpu.core.batch import FIELDS, LEARNER, REQUIRED, ROLLOUT, ROUTING_INPUT
from rl_tpu.rl.advantages import ADVANTAGES, estimator_inputs
from rl_tpu.rl.bapo import BapoConfig
from rl_tpu.rl.importance import LOGPROB_GAP_THRESHOLD
from rl_tpu.rl.losses import POLICY_LOSSES, PolicyLossConfig
from rl_tpu.rl.registry import Registry
from rl_tpu.train import steps
from rl_tpu.train.learner import UpdateConfig
from rl_tpu.train.rollout_batch import NO_LOSS
from rl_tpu.core.trajectory import Trajectory, groups_of

# The keys a record sets itself (name, estimator, loss kind); its `defaults` may not.
_RECORD_KEYS = ("name", "advantage", "loss")


def shared_algo_block() -> ml_collections.ConfigDict:
    """The `algo` block every algorithm starts from; a record's `defaults` change some keys."""
    c = ml_collections.ConfigDict()
    c.name = ""
    c.advantage = ""
    c.gamma = 1.0  # gae / reinforce_pp discount (over the agent's tokens)
    c.lam = 1.0  # gae lambda
    c.std_ddof = 1  # grpo std: 1 = unbiased (TRL, verl, DeepSeekMath)
    c.loss = "ppo"
    c.clip_low = 0.2
    c.clip_high = 0.2
    c.dual_clip = 0.0  # 0 = off (bapo.variant="verl" turns on its own 3.0)
    c.aggregation = "token_mean"
    c.entropy_coef = 0.0
    c.kl_coef = 0.0  # KL(pi || ref) as a loss term; > 0 keeps a frozen reference policy
    c.kl_estimator = "k3"
    # Keep the reference and log train/kl (KL(pi || ref), kl_estimator) even at kl_coef 0: the
    # x axis of reward over-optimisation curves (docs/rewards.md), for one more forward a step
    c.log_kl = False
    c.reward_kl_coef = 0.0  # KL folded into the reward (estimators with reward_kl: REINFORCE++)
    c.behaviour_is = "none"  # none | truncate | mask: engine/trainer mismatch correction
    c.behaviour_is_cap = 2.0
    # ...one weight a token, or ("sequence") exp(sum of the row's log-ratios) on all its tokens
    c.behaviour_is_level = "token"
    # train/logprob_gap_frac: the share of tokens whose |proximal - behaviour| log-prob gap is
    # above this many nats (0.1: a ratio of 1.105, half PPO's clip range; rl/importance.py)
    c.logprob_gap_threshold = LOGPROB_GAP_THRESHOLD
    c.dynamic_sampling = False  # drop groups whose rewards are all equal, refill
    c.max_refill_rounds = 3
    # Branching rollouts (advantage tl_grpo): the turn each task's episode forks into G
    # branches at (at most H - 1): branch_turn for every task ("fixed"), or drawn per task
    # from 0..branch_turn ("uniform", so early turns are trained too: docs/architecture.md).
    c.branch_turn = 0
    c.branch_sample = "fixed"
    c.overlong_buffer = 0  # DAPO overlong shaping: the last N tokens of the budget are penalised
    c.overlong_penalty = 1.0  # ... linearly up to this much at the full budget (DAPO: set
    # the buffer per experiment, below the generation budget)
    c.bapo = ml_collections.ConfigDict(vars(BapoConfig()))
    c.value_clip = 0.2
    c.value_lr = 1e-5
    c.whiten_advantages = False  # GAE advantages whitened over the batch (as verl)
    # The three policies (docs/architecture.md): the ratio divides by the proximal policy
    # (recomputed at the start of the update) or by the behaviour policy (the engine's
    # log-probs; BAPO's r = pi_theta / pi_rollout, which sees the staleness).
    c.ratio_against = "proximal"
    # log where the policy gradient comes from: train/pg_weight_{pos,neg}, and the clip rate by
    # advantage sign and probability bucket (losses.clip_mechanism_metrics; the BAPO testbed)
    c.mechanism_metrics = False
    # False: no proximal forward; the behaviour log-probs stand in for it. Exact on-policy
    # with full-distribution log-probs, and whenever the ratio is against behaviour.
    c.recompute_proximal = True
    # A mixture-of-experts policy (docs/models.md): "rollout" replays the experts the embedded
    # sampler chose for each token in the learner's forward passes (R3, arXiv 2510.11370),
    # "none" lets the learner's router choose. log_routing_mismatch: carry the sampler's
    # choice to the learner and log train/routing_mismatch (the share of token-layer routings
    # where the learner's own top-k differs) even without replaying it.
    c.routing_replay = "none"
    c.log_routing_mismatch = False
    return c


ROUTING_REPLAY = ("none", "rollout")


def records_routing(algo: ml_collections.ConfigDict) -> bool:
    """Whether the run's rollouts must record a mixture of experts' routing."""
    if algo.routing_replay not in ROUTING_REPLAY:
        raise ValueError(f"algo.routing_replay={algo.routing_replay!r}; choose one of "
                         f"{ROUTING_REPLAY}")
    return algo.routing_replay == "rollout" or bool(algo.log_routing_mismatch)


# ----------------------------------------------------------------------------- records

@dataclasses.dataclass(frozen=True)
class EstimatorUse:
    """What the loop needs around one advantage estimator (registered by its ADVANTAGES name).

    options(algo) -> {name: value}: what `compute_advantages` passes it from the block.
    group_based: it compares the samples of one task (needs train.samples_per_task >= 2).
    critic: it reads a learned value (a value step follows the policy step).
    reward_kl: `algo.reward_kl_coef` folds a KL to the reference into its rewards.
    episode_player(algo, seed) -> player, or None for `agent.run_episodes`: how a step's
        episodes are played (same arguments as agent.run_episodes).
    batch_arrays(host, trajectories, algo) -> {name: array}, or None: host arrays it adds to
        (or replaces in) the batch built from `trajectories` (rollout batch fields).
    partial_rollouts: whether its episodes can be paused and resumed (rollout.
        partial_token_budget); a player of its own (branching) cannot be.
    """

    options: Callable[[Any], dict] = lambda algo: {}
    group_based: bool = False
    critic: bool = False
    reward_kl: bool = False
    episode_player: Optional[Callable[[Any, int], Callable[..., list[Trajectory]]]] = None
    batch_arrays: Optional[Callable[[Any, Sequence[Trajectory], Any], dict]] = None
    partial_rollouts: bool = True


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """One nameable algorithm: its estimator (an ESTIMATOR_USES / ADVANTAGES name), its policy
    loss kind (a POLICY_LOSSES name) and the `algo`-block keys whose default differs from
    `shared_algo_block` (same type as the shared value)."""

    name: str
    advantage: str
    loss: str = "ppo"
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)


ESTIMATOR_USES: Registry = Registry("advantage estimator")
ALGORITHM_RECORDS: Registry = Registry("algorithm")
_REGISTERED: list[str] = []  # registration order: ALGORITHMS' order


def register_estimator_use(name: str, use: EstimatorUse) -> EstimatorUse:
    ADVANTAGES.get(name)  # the math must exist under the same name
    return ESTIMATOR_USES.register(name)(use)


def register_algorithm(record: Algorithm) -> Algorithm:
    """Adds `record` (checked against the registries and the shared block) by its name."""
    ESTIMATOR_USES.get(record.advantage)
    POLICY_LOSSES.get(record.loss)
    shared = shared_algo_block()
    for key, value in record.defaults.items():
        if (key in _RECORD_KEYS or key not in shared
                or isinstance(shared[key], ml_collections.ConfigDict)):
            raise ValueError(f"algorithm {record.name!r}: defaults[{key!r}] is not a plain key "
                             f"of the algo block (nor one of {_RECORD_KEYS}, the record's own)")
        if type(value) is not type(shared[key]):
            raise ValueError(f"algorithm {record.name!r}: defaults[{key!r}]={value!r} is a "
                             f"{type(value).__name__}; the block's {key} is a "
                             f"{type(shared[key]).__name__}")
        if value == shared[key]:
            raise ValueError(f"algorithm {record.name!r}: defaults[{key!r}]={value!r} is the "
                             "shared default already; list only the keys it changes")
    ALGORITHM_RECORDS.register(record.name)(record)
    _REGISTERED.append(record.name)
    return record


def estimator_use(name: str) -> EstimatorUse:
    if name not in ESTIMATOR_USES:
        raise ValueError(f"algo.advantage={name!r}; choose one of {ESTIMATOR_USES.names()}")
    return ESTIMATOR_USES.get(name)


def _tl_grpo_player(algo, seed: int):
    # `seed` (the run's) draws sampled fork turns, per task, the same on a rerun.
    plan = branching.BranchPlan(algo.branch_turn, algo.branch_sample, seed)
    return functools.partial(branching.run_branching_episodes, plan=plan)


def _tl_grpo_arrays(host, trajectories: Sequence[Trajectory], algo) -> dict:
    # The branch groups' turn slots and the loss mask without the shared prefix.
    return branching.turn_arrays(trajectories, host["loss_mask"], host["group_ids"],
                                 num_slots=algo.branch_turn + 1)


register_estimator_use("gae", EstimatorUse(
    options=lambda a: {"gamma": a.gamma, "lam": a.lam, "whiten": bool(a.whiten_advantages)},
    critic=True))
register_estimator_use("reinforce_pp", EstimatorUse(
    options=lambda a: {"gamma": a.gamma}, reward_kl=True))
register_estimator_use("grpo", EstimatorUse(
    options=lambda a: {"ddof": a.std_ddof}, group_based=True))
register_estimator_use("dr_grpo", EstimatorUse(group_based=True))
register_estimator_use("rloo", EstimatorUse(group_based=True))
register_estimator_use("tl_grpo", EstimatorUse(
    options=lambda a: {"ddof": a.std_ddof, "carry_forward": True}, group_based=True,
    episode_player=_tl_grpo_player, batch_arrays=_tl_grpo_arrays, partial_rollouts=False))

_SEQ_MEAN = {"aggregation": "seq_mean_token_mean"}
register_algorithm(Algorithm("ppo", "gae", defaults={"lam": 0.95, "whiten_advantages": True}))
register_algorithm(Algorithm("grpo", "grpo", defaults=_SEQ_MEAN))
register_algorithm(Algorithm("dr_grpo", "dr_grpo",
                             defaults={"aggregation": "fixed_normalizer"}))
register_algorithm(Algorithm("dapo", "grpo",
                             defaults={"clip_high": 0.28, "dynamic_sampling": True}))
register_algorithm(Algorithm("gspo", "grpo", "gspo",
                             defaults={"clip_low": 3e-4, "clip_high": 4e-4, **_SEQ_MEAN}))
register_algorithm(Algorithm("rloo", "rloo"))
register_algorithm(Algorithm("reinforce_pp", "reinforce_pp", defaults={"reward_kl_coef": 0.01}))
register_algorithm(Algorithm("bapo", "grpo", "bapo", defaults={"ratio_against": "behaviour"}))
register_algorithm(Algorithm("tl_grpo", "tl_grpo", defaults={"branch_turn": 2, **_SEQ_MEAN}))
# CISPO (MiniMax-M1, 2025): the weight clip(r, 1 - clip_low, 1 + clip_high) is a stopped
# scale on every token's log pi gradient. clip_low = 1.0 puts the lower bound at 0, i.e. no
# lower clip (MiniMax-M1 sets eps_low large; verl's recipe uses 10): a falling token's weight
# shrinks on its own. clip_high = 0.28 (DAPO's clip-higher bound; verl's example uses 0.2)
# caps one token's weight at 1.28 while still letting a rising rare token train.
register_algorithm(Algorithm("cispo", "grpo", "cispo",
                             defaults={"clip_low": 1.0, "clip_high": 0.28}))

ALGORITHMS = tuple(_REGISTERED)


def algorithm(name: str) -> Algorithm:
    if name not in ALGORITHM_RECORDS:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {ALGORITHMS}")
    return ALGORITHM_RECORDS.get(name)


def algo_config(name: str) -> ml_collections.ConfigDict:
    """The `algo` block with `name`'s defaults (every key a sweep may override)."""
    record = algorithm(name)
    c = shared_algo_block()
    c.name, c.advantage, c.loss = record.name, record.advantage, record.loss
    for key, value in record.defaults.items():
        c[key] = value
    return c


def loss_config(algo: ml_collections.ConfigDict, max_new_tokens: int) -> PolicyLossConfig:
    if algo.name not in ALGORITHMS:
        raise ValueError(f"algo.name={algo.name!r}; choose one of {ALGORITHMS}")
    return PolicyLossConfig(
        kind=algo.loss, clip_low=algo.clip_low, clip_high=algo.clip_high,
        dual_clip=algo.dual_clip or None, aggregation=algo.aggregation,
        fixed_normalizer=(max_new_tokens if algo.aggregation == "fixed_normalizer" else None),
        behaviour_is=algo.behaviour_is, behaviour_is_cap=algo.behaviour_is_cap,
        behaviour_is_level=algo.behaviour_is_level,
        logprob_gap_threshold=algo.logprob_gap_threshold,
        entropy_coef=algo.entropy_coef, kl_coef=algo.kl_coef, kl_estimator=algo.kl_estimator,
        bapo=BapoConfig(**algo.bapo.to_dict()), ratio_against=algo.ratio_against,
        mechanism_metrics=algo.mechanism_metrics)


def advantage_options(algo: ml_collections.ConfigDict) -> tuple:
    """(name, value) options compute_advantages passes to the estimator."""
    return tuple(sorted(estimator_use(algo.advantage).options(algo).items()))


def update_config(config: ml_collections.ConfigDict) -> UpdateConfig:
    """The learner's settings: epochs x minibatches, the estimator, the reference and the
    proximal pass, as the algorithm needs them (REINFORCE++'s KL-shaped reward included)."""
    algo, t = config.algo, config.train
    return UpdateConfig(
        epochs=t.epochs, minibatches=t.minibatches,
        score_micro_batches=t.score_micro_batches or t.minibatches * t.micro_batches,
        tokens_per_device=t.tokens_per_device, score_tokens_per_device=t.score_tokens_per_device,
        step=steps.StepConfig(micro_batches=t.micro_batches, logprob_chunk=t.logprob_chunk,
                              temperature=config.rollout.temperature,
                              routing_replay=algo.routing_replay == "rollout"),
        advantage=algo.advantage, advantage_options=advantage_options(algo),
        value_clip=algo.value_clip or None, use_reference=uses_reference(algo),
        reward_kl_coef=algo.reward_kl_coef if estimator_use(algo.advantage).reward_kl else 0.0,
        recompute_proximal=algo.recompute_proximal, shuffle_seed=config.seed)


def uses_critic(algo: ml_collections.ConfigDict) -> bool:
    return estimator_use(algo.advantage).critic


def uses_reference(algo: ml_collections.ConfigDict) -> bool:
    return bool(algo.kl_coef) or algo.log_kl or bool(
        algo.reward_kl_coef and estimator_use(algo.advantage).reward_kl)


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
    """How the step's episodes are played: `agent.run_episodes`, or the estimator's own player
    (TL-GRPO: `branching.run_branching_episodes` with the algo block's fork turn; same
    arguments). `seed` (the run's) draws what the player samples, the same on a rerun."""
    make = estimator_use(algo.advantage).episode_player
    return agent.run_episodes if make is None else make(algo, seed)


def batch_arrays(host, trajectories: Sequence[Trajectory], algo) -> dict:
    """Host arrays the estimator adds to (or replaces in) the batch built from
    `trajectories`: for TL-GRPO the branch groups' turn slots and the loss mask without the
    shared prefix (`branching.turn_arrays`); nothing for the others."""
    arrays = estimator_use(algo.advantage).batch_arrays
    return {} if arrays is None else arrays(host, trajectories, algo)


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
    """The rollout batch fields the learner gets: those every batch carries (core.batch
    REQUIRED), those the advantage estimator reads (its arguments, less what the learner
    makes), and those of trajectories_to_batch an update reads (FIELDS' read_by), the
    engine's behaviour log-probs among them only when they are of the full distribution
    (docs/architecture.md, logprob conventions). The one place the log-prob convention is
    checked: renormalised top-p / top-k log-probs differ by -log(kept mass) per token and
    would bias IS weights, BAPO's Eq. 8 weights, a ratio against behaviour and the proximal
    they stand in for: needed but truncated is a clear error; not needed, they are left out
    (and the learner refuses a batch that lacks them where it needs them)."""
    estimator_use(algo.advantage)  # an unknown estimator: the error that lists them
    reads = [k for k in estimator_inputs(algo.advantage)
             if k in FIELDS and FIELDS[k].made_by != LEARNER]
    updates = [k for k, spec in FIELDS.items() if spec.made_by == ROLLOUT and spec.read_by
               and (k != ROUTING_INPUT or records_routing(algo))]
    keys = list(dict.fromkeys([*REQUIRED, *reads, *updates]))
    truncated = any(t.logprob_convention != "full" for t in trajectories)
    if not truncated:
        return keys
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
    return [k for k in keys if k != "behaviour_logprobs"]
