"""Two-role self-play: one model proposes problems and solves them, both roles in one GRPO batch.

    python -m launch.train --config configs/selfplay_arithmetic.py --workdir /tmp/selfplay

The env is `selfplay_arithmetic` (rl_tpu/envs/selfplay.py): a task's role is `propose` (write
an expression of integers joined by + - *, checked and evaluated by the env) or `solve`
(compute one). The RL trainer (recipes/rl.py) runs as it is, but each step's rollout is a game:
  propose   each of the step's train.tasks_per_step slots is a proposer prompt, sampled
            train.samples_per_task times (one GRPO group a slot)
  solve     every valid proposal is a solver task, sampled selfplay.solver_samples times
            (one GRPO group a proposal); the solver's reward is correctness
  score     a valid proposal's reward from the solver's success p on it, by
            selfplay.proposer_reward: "peak" 1 - |p - t| / max(t, 1 - t), highest at
            p = selfplay.target_success (t); "learnability" 4 p (1 - p) (the variance of the
            solver's reward: what a problem can teach it); "band" 1 inside
            [selfplay.band_low, selfplay.band_high], else 0. An invalid proposal gets 0.
            A problem everyone solves, or no one does, teaches the solver nothing
  update    both roles' tokens train in one batch: each row's loss mask holds its own
            role's reply, and groups never mix roles (`info["role"]` tags the rows). An
            invalid proposal's solver slots are filler rows without loss, so every step's
            batch has the same shape (one compiled update)
The game is one step's rollout, so partial rollouts (rollout.partial_token_budget, which
pause episodes across steps and resume them as plain episodes) are refused by the config check.
The difficulty of what is proposed is logged every step: selfplay/proposal_terms (integers a
valid problem has), selfplay/proposal_abs_value (the size of its answer),
selfplay/solver_success (on this step's proposals),
selfplay/proposal_valid, selfplay/proposer_reward, and selfplay/solver_tokens (the solver's
sampled tokens this step: the budget a solver-only control matches); W/curves.png draws them
beside the eval (eval/success: the solver's greedy accuracy on held-out problems of 2-3 terms).
"""

from __future__ import annotations

import dataclasses

import ml_collections
import numpy as np

from rl_tpu.agent import run_episodes
from rl_tpu.core.env import Task
from rl_tpu.envs.selfplay import solve_task
from rl_tpu.recipes import rollout_settings, shapes
from rl_tpu.recipes.rl import Trainer, run as run_trainer
from rl_tpu.train.rollout_batch import NO_LOSS
from rl_tpu.core.trajectory import Trajectory

SOLVER_GROUPS = 1 << 30  # solver group ids start here, above every task position
CURVES = ("selfplay/solver_success", "selfplay/proposal_terms", "selfplay/proposal_abs_value",
          "selfplay/proposal_valid", "selfplay/proposer_reward", "eval/success")


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
    """The RL loop of recipes/rl.py with `SelfPlayTrainer`'s game as its rollout."""
    if config.env.name != "selfplay_arithmetic":
        raise ValueError(f"recipe='selfplay' plays env 'selfplay_arithmetic'; env.name is "
                         f"{config.env.name!r} (use rl_tpu.recipes.config.set_env)")
    return run_trainer(config, workdir, trainer_class=SelfPlayTrainer)


PROPOSER_REWARDS = ("peak", "learnability", "band")


def proposer_reward(solver_success: float, sp: ml_collections.ConfigDict) -> float:
    """The proposer's reward for a problem the solver solved with rate p (module docstring):
    "peak" 1 at p = target, falling linearly to 0 at whichever of p = 0 or 1 is farther;
    "learnability" 4 p (1 - p); "band" 1 for p in [band_low, band_high], else 0."""
    p = solver_success
    if sp.proposer_reward == "peak":
        return 1.0 - abs(p - sp.target_success) / max(sp.target_success, 1.0 - sp.target_success)
    if sp.proposer_reward == "learnability":
        return 4.0 * p * (1.0 - p)
    if sp.proposer_reward == "band":
        return float(sp.band_low <= p <= sp.band_high)
    raise ValueError(f"selfplay.proposer_reward={sp.proposer_reward!r}; choose one of "
                     f"{PROPOSER_REWARDS}")


class SelfPlayTrainer(Trainer):
    """The RL trainer whose rollout plays the proposer and the solver (module docstring)."""

    def _play(self, tasks: list, chunk: int, round_index: int) -> list[Trajectory]:
        config = self.config
        g, s = config.train.samples_per_task, config.selfplay.solver_samples
        args = self.episode_args(tasks, chunk, round_index)
        slots = [Task(f"propose/{pos}", {"role": "propose"}) for pos, _ in tasks]
        proposals = run_episodes(self.engine, self.make_env, slots, **args)
        for i, traj in enumerate(proposals):
            traj.info["role"] = "propose"
            traj.info["task"] = tasks[i // g]

        valid = [(i, t) for i, t in enumerate(proposals) if _proposal(t) is not None]
        kwargs = config.env.kwargs
        solver_tasks = [solve_task(f"solve/{t.group_id}/{i % g}", _proposal(t)["expression"],
                                   kwargs.max_terms, kwargs.max_number) for i, t in valid]
        solutions: list[Trajectory] = []
        if solver_tasks:
            solver_args = dict(args, samples_per_task=s,
                               # unique over hosts and steps: the slot's stream position
                               group_ids=[SOLVER_GROUPS + tasks[i // g][0] * g + i % g
                                          for i, _ in valid],
                               sampling=rollout_settings.sampling_params(
                                   config, rollout_settings.step_seed(config.seed, chunk,
                                                                      50 + round_index)))
            solutions = run_episodes(self.engine, self.make_env, solver_tasks, **solver_args)
        for traj in solutions:
            traj.info["role"] = "solve"

        for k, (i, traj) in enumerate(valid):
            p = float(np.mean([t.success for t in solutions[k * s:(k + 1) * s]]))
            traj.info["solver_success"] = p
            _set_reward(traj, proposer_reward(p, config.selfplay))
        fillers = []
        for traj in proposals:
            if _proposal(traj) is None:
                _set_reward(traj, 0.0)
                # the solver slots it did not get: rows without loss, so the batch keeps one
                # shape whatever share of proposals is valid
                for _ in range(s):
                    filler = dataclasses.replace(traj, info=dict(traj.info, **{NO_LOSS: True}))
                    fillers.append(filler)
        rows = proposals + solutions + fillers
        if len(rows) != len(tasks) * shapes.rows_per_task(config):  # what compile_check compiles
            raise RuntimeError(f"self-play played {len(rows)} rows for {len(tasks)} task slots, "
                               f"not {shapes.rows_per_task(config)} a slot")
        return rows

    def rollout(self, step: int):
        trajectories, metrics = super().rollout(step)
        return trajectories, {**metrics, **game_metrics(trajectories)}

    curve_keys = CURVES


def _proposal(traj: Trajectory):
    """The env's record of a valid proposal (its step info), or None."""
    infos = traj.info.get("step_infos") or [{}]
    return infos[-1] if infos[-1].get("valid") else None


def _set_reward(traj: Trajectory, reward: float) -> None:
    traj.reward = reward
    if traj.rewards:
        traj.rewards[-1] = reward


def game_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """The game's state this step (real rows only, fillers aside)."""
    real = [t for t in trajectories if not t.info.get(NO_LOSS)]
    proposals = [t for t in real if t.info.get("role") == "propose"]
    valid = [t for t in proposals if _proposal(t) is not None]
    solves = [t for t in real if t.info.get("role") == "solve"]
    mean = (lambda xs: float(np.mean(xs)) if xs else 0.0)
    return {"selfplay/proposal_valid": len(valid) / max(len(proposals), 1),
            "selfplay/proposal_terms": mean([_proposal(t)["terms"] for t in valid]),
            "selfplay/proposal_abs_value": mean([abs(_proposal(t)["value"]) for t in valid]),
            "selfplay/solver_success": mean([float(t.success) for t in solves]),
            "selfplay/solver_tokens": float(sum(t.num_generated for t in solves)),
            "selfplay/proposer_reward": mean([t.reward for t in proposals])}
