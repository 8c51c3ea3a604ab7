"""Experience for the loops around the update: sample from a policy, keep what succeeded, and
turn it into fine-tuning examples (rejection sampling).

A kept sample is its trajectory's own (tokens, loss_mask): the ids the policy generated, in
the context it generated them in, so fine-tuning on it is token-exact with the RL rollouts
(multi-turn episodes included: every action of the episode carries loss, observations none).

`ExpertSet` collects samples by task: how often each task was tried and solved (its success
rate says how hard it is) and its distinct kept samples. `examples()` returns them hardest
task first, at most `max_per_task` a task and `max_examples` in all, so a cap keeps the tasks
the policy rarely solves (RLoop's "hard problems first"). It is a plain JSON-able record
(`state` / `from_state`), written next to the checkpoints so a resumed loop finds what an
uninterrupted one had collected.
"""

from __future__ import annotations

import json
import os
from typing import Optional, Sequence

import ml_collections

from rl_tpu.agent import run_episodes
from rl_tpu.agent.program import player_for
from rl_tpu.core.env import Task
from rl_tpu.recipes import rollout_settings
from rl_tpu.core.trajectory import Trajectory

Example = tuple[list[int], list[bool]]  # (ids, loss mask), as recipes/sft.py trains on


class ExpertSet:
    """Samples with reward >= the threshold by task, deduplicated, with each task's tries and
    passes (`solved`)."""

    def __init__(self, reward_threshold: float):
        self.reward_threshold = float(reward_threshold)
        self.tried: dict[str, int] = {}
        self.solved: dict[str, int] = {}
        self.kept: dict[str, list[Example]] = {}
        self._seen: set[tuple[int, ...]] = set()
        self.sampled_tokens = 0  # generated tokens of every sample added (kept or not)
        self.successes = 0  # samples whose episode succeeded (the env's own verdict)

    def add(self, trajectories: Sequence[Trajectory]) -> int:
        """Counts every trajectory; keeps those with reward >= the threshold whose tokens are
        new. Returns how many were kept."""
        kept = 0
        for traj in trajectories:
            task = traj.task_id
            self.tried[task] = self.tried.get(task, 0) + 1
            self.sampled_tokens += traj.num_generated
            self.successes += bool(traj.success)
            if traj.reward < self.reward_threshold:
                continue
            self.solved[task] = self.solved.get(task, 0) + 1
            key = tuple(int(t) for t in traj.tokens)
            if key in self._seen or traj.finish == "env_error":
                continue
            self._seen.add(key)
            self.kept.setdefault(task, []).append(
                ([int(t) for t in traj.tokens], [bool(m) for m in traj.loss_mask]))
            kept += 1
        return kept

    def success_rate(self, task: str) -> float:
        return self.solved.get(task, 0) / max(self.tried.get(task, 0), 1)

    def examples(self, max_per_task: int = 0, max_examples: int = 0) -> list[Example]:
        """The kept samples, hardest task first (lowest success rate; ties by task id), at
        most `max_per_task` a task and `max_examples` in all (0 = no cap)."""
        order = sorted(self.kept, key=lambda t: (self.success_rate(t), t))
        out: list[Example] = []
        for task in order:
            samples = self.kept[task][:max_per_task or None]
            out += samples
        return out[:max_examples or None]

    def metrics(self) -> dict[str, float]:
        tries = sum(self.tried.values())
        return {"loop/sampled": float(tries),
                "loop/sample_success": self.successes / max(tries, 1),
                "loop/pass_rate": sum(self.solved.values()) / max(tries, 1),
                "loop/kept": float(sum(len(v) for v in self.kept.values())),
                "loop/tasks_solved": float(len(self.kept)),
                "loop/tasks_tried": float(len(self.tried)),
                "loop/sampled_tokens": float(self.sampled_tokens)}

    # -- persistence ---------------------------------------------------------------------

    def state(self) -> dict:
        return {"reward_threshold": self.reward_threshold, "tried": self.tried,
                "solved": self.solved, "sampled_tokens": self.sampled_tokens,
                "successes": self.successes,
                "kept": {t: [[ids, [int(m) for m in mask]] for ids, mask in v]
                         for t, v in self.kept.items()}}

    @classmethod
    def from_state(cls, state: dict) -> "ExpertSet":
        out = cls(state["reward_threshold"])
        out.tried, out.solved = dict(state["tried"]), dict(state["solved"])
        out.sampled_tokens, out.successes = int(state["sampled_tokens"]), int(state["successes"])
        for task, samples in state["kept"].items():
            out.kept[task] = [(list(ids), [bool(m) for m in mask]) for ids, mask in samples]
            out._seen.update(tuple(ids) for ids, _ in samples)
        return out

    def merge(self, other: "ExpertSet") -> None:
        """Adds `other`'s counts and its samples this set has not seen."""
        for task, n in other.tried.items():
            self.tried[task] = self.tried.get(task, 0) + n
        for task, n in other.solved.items():
            self.solved[task] = self.solved.get(task, 0) + n
        self.sampled_tokens += other.sampled_tokens
        self.successes += other.successes
        for task, samples in other.kept.items():
            for ids, mask in samples:
                if tuple(ids) not in self._seen:
                    self._seen.add(tuple(ids))
                    self.kept.setdefault(task, []).append((ids, mask))


def write_json(path: str, record: dict) -> None:
    """Atomically: a kill leaves the old file or the new one, never half of one."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def read_json(path: str) -> Optional[dict]:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def sample(config: ml_collections.ConfigDict, engine, make_env, tasks: Sequence[Task],
           tokenizer, samples_per_task: int, seed: int, first_position: int = 0
           ) -> list[Trajectory]:
    """`samples_per_task` episodes of each task from `engine` at the rollout temperature (the
    env's horizon and generation budget), task-major. `first_position`: the first task's
    position in the round's list (its group id, which keys its sampling seeds: a host playing
    a share of the round samples what one host playing all of it would)."""
    env = config.env
    play = player_for(config, run_episodes)  # env agent_program: the user's program
    return play(engine, make_env, list(tasks), tokenizer=tokenizer,
                max_turns=env.max_turns, max_new_tokens_per_turn=env.max_new_tokens,
                max_context_tokens=env.max_context_tokens,
                sampling=rollout_settings.sampling_params(config, seed),
                samples_per_task=samples_per_task, step_timeout_s=env.step_timeout_s,
                reward_reduce=env.reward_reduce, group_id_offset=first_position)
