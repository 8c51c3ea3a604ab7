"""Tests for rl_tpu.agent.branching: forking episodes into branches, replay, and TL-GRPO's batch.

A counter env (state: a running total) and an engine that answers by (sample, turn) make every
branch's actions known, so which branch saw what can be checked exactly.
"""

import re
import threading

import numpy as np
import pytest

from rl_tpu.agent import branching
from rl_tpu.core import env as envs
from rl_tpu.core.env import Env, StepResult, Task
from rl_tpu.models.tiny_tokenizer import build_tokenizer
from rl_tpu.models.tokenizer import ChatTokenizer
from rl_tpu.recipes import algorithms
from rl_tpu.rl.advantages import compute_advantages
from rl_tpu.core.engine import GenerateResult, RolloutEngine
from rl_tpu.train.rollout_batch import trajectories_to_batch
from rl_tpu.core.trajectory import Trajectory


class CounterEnv(Env):
    """"add <n>" adds n to a running total; the observation is the total; reward n / 10; done
    (success) once the total reaches the task's target. Deterministic given task and actions."""

    name = "counter"
    replayable = True

    def __init__(self):
        self.total, self.actions, self.task = 0, [], None

    def reset(self, task):
        self.task, self.total, self.actions = task, 0, []
        return f"Task {task.task_id}: the total is 0."

    def step(self, action):
        self.actions.append(action)
        m = re.fullmatch(r"add (\d)", action)
        if not m:
            return envs.invalid_action("expected 'add <n>'")
        self.total += int(m.group(1))
        done = self.total >= self.task.data.get("target", 99)
        return StepResult(f"The total is {self.total}.", int(m.group(1)) / 10, done,
                          {"success": done})


class DiceEnv(CounterEnv):
    """Does not declare itself replayable (Env's default)."""

    name = "dice"
    replayable = False


class DriftEnv(CounterEnv):
    """Declares itself replayable but is not: every reset starts from a new total."""

    name = "drift"
    resets = 0

    def reset(self, task):
        super().reset(task)
        DriftEnv.resets += 1
        self.total = DriftEnv.resets
        return f"Task {task.task_id}: the total is {self.total}."


class BySampleEngine(RolloutEngine):
    """Answers request "g<gid>s<sample>-turn<k>" with script[sample][k] (the last entry
    repeats), so branches that share a history still act differently after the fork."""

    def __init__(self, tok, scripts):
        self.tok, self.scripts, self.calls = tok, scripts, []

    def generate(self, requests):
        self.calls.append(list(requests))
        out = []
        for r in requests:
            sample, turn = map(int, re.fullmatch(r"g\d+s(\d+)-turn(\d+)", r.request_id).groups())
            script = self.scripts[sample]
            ids = self.tok.encode(script[min(turn, len(script) - 1)]) + [self.tok.eos_token_id]
            out.append(GenerateResult(ids, [-0.1] * len(ids), "stop", weight_version="0"))
        return out

    def update_weights(self, params, version):
        pass

    def health(self):
        return True


@pytest.fixture(scope="module")
def tok():
    return ChatTokenizer(build_tokenizer(512))


class Factory:
    def __init__(self, cls=CounterEnv):
        self.cls, self.envs, self.lock = cls, [], threading.Lock()

    def __call__(self):
        env = self.cls()
        with self.lock:
            self.envs.append(env)
        return env


def play(tok, scripts, tasks, turn, g=3, cls=CounterEnv, sample="fixed", **kw):
    engine, factory = BySampleEngine(tok, scripts), Factory(cls)
    kw = {"max_turns": 3, "max_new_tokens_per_turn": 16, "max_context_tokens": 1024,
          "step_timeout_s": 5.0, **kw}
    trajs = branching.run_branching_episodes(
        engine, factory, tasks, plan=branching.BranchPlan(turn, sample), samples_per_task=g,
        tokenizer=tok, **kw)
    return trajs, engine, factory


def test_fork_shares_the_history_and_replay_restores_the_state(tok):
    # Trunk (sample 0) adds 1 each turn; branch 1 repeats the trunk's turn-1 action, branch 2
    # adds 3 then 2. Fork at turn 1: every branch's turn 0 is the trunk's.
    scripts = {0: ["add 1"], 1: ["add 1", "add 1", "add 2"], 2: ["add 1", "add 3", "add 2"]}
    trajs, engine, factory = play(tok, scripts, [Task("a")], turn=1)
    assert [t.info["sample_index"] for t in trajs] == [0, 1, 2]
    assert all(t.info["branch_turn"] == 1 and t.group_id == 0 for t in trajs)
    trunk = trajs[0]
    prefix = trunk.turn_ids < 1  # prompt + turn 0's action, observation, generation prompt
    for t in trajs[1:]:
        assert t.info["replay_steps"] == 1
        n = int(prefix.sum())
        np.testing.assert_array_equal(t.tokens[:n], trunk.tokens[:n])
        np.testing.assert_array_equal(t.loss_mask[:n], trunk.loss_mask[:n])
        np.testing.assert_array_equal(t.behaviour_logprobs[:n], trunk.behaviour_logprobs[:n])
        assert t.messages[:3] == trunk.messages[:3]  # first user, assistant, observation
        assert t.rewards[0] == trunk.rewards[0] == 0.1
        # the trunk sampled turn 0 once: the copy inherits it, counted apart for throughput
        assert t.info["inherited_tokens"] == int(trunk.loss_mask[prefix].sum()) > 0
    assert "inherited_tokens" not in trunk.info
    # Replay restored the state: branch 1's turn-1 action "add 1" gives what the trunk's gave
    # ("The total is 2.", from a total of 1), though its own env only saw the replayed step.
    observations = [[m["content"] for m in t.messages if m["role"] == "user"] for t in trajs]
    assert observations[1][2] == observations[0][2] == "The total is 2."
    assert observations[2][2] == "The total is 4."
    assert [t.rewards for t in trajs] == [[0.1, 0.1, 0.1], [0.1, 0.1, 0.2], [0.1, 0.3, 0.2]]
    # branch reward: "sum" over the branch's own turns 1..
    assert [round(t.info["branch_reward"], 6) for t in trajs] == [0.2, 0.3, 0.5]
    # one env a branch: the trunk's took all its actions, each copy's replayed "add 1" first
    assert sorted(e.actions for e in factory.envs) == sorted(
        [["add 1"] * 3, ["add 1", "add 1", "add 2"], ["add 1", "add 3", "add 2"]])
    # one batched generate a round; the fork happens before the second round
    assert [len(c) for c in engine.calls] == [1, 3, 3]


def test_replay_checks_every_step(tok):
    # The branches' restored envs replay the trunk's steps, and here reach its total exactly.
    env = CounterEnv()
    trunk_env = CounterEnv()
    first = trunk_env.reset(Task("a"))
    trace = []
    for action in ("add 2", "add 5"):
        r = trunk_env.step(action)
        trace.append((action, r.observation, r.reward, r.done))

    class Ep:
        pass
    trunk, branch = Ep(), Ep()
    trunk.task, trunk.first_observation, trunk.env_trace = Task("a"), first, trace
    assert branching._replay_call(branch, trunk, lambda: env)() == 2
    assert branch.env is env and env.total == trunk_env.total == 7
    trunk.env_trace = trace[:1] + [("add 5", "The total is 8.", 0.5, False)]
    with pytest.raises(branching.ReplayDivergedError, match="step 1 .*not deterministic"):
        branching._replay_call(branch, trunk, CounterEnv)()


def test_non_replayable_env_is_refused_before_generating(tok):
    with pytest.raises(branching.NotReplayableError,
                       match=r"'dice' \(DiceEnv\) does not declare `replayable = True`.*turn 1"
                             r".*algo.branch_turn=0"):
        play(tok, {0: ["add 1"], 1: ["add 2"], 2: ["add 3"]}, [Task("a")], turn=1, cls=DiceEnv)
    # fork at the start: a fresh reset, no replay, so any env branches there (GRPO's group)
    trajs, engine, _ = play(tok, {0: ["add 1"], 1: ["add 2"], 2: ["add 3"]}, [Task("a")],
                            turn=0, cls=DiceEnv)
    assert [t.info["branch_turn"] for t in trajs] == [0, 0, 0]
    assert [t.rewards for t in trajs] == [[0.1] * 3, [0.2] * 3, [0.3] * 3]


def test_env_that_diverges_on_replay_ends_only_that_branch(tok):
    trajs, _, _ = play(tok, {0: ["add 1"], 1: ["add 2"], 2: ["add 3"]}, [Task("a")], turn=1,
                       cls=DriftEnv)
    assert trajs[0].finish == "turn_limit"
    for t in trajs[1:]:
        assert t.finish == "env_error"
        assert "replaying the trunk's actions" in t.info["error"]
        assert "not deterministic given the task" in t.info["error"]


def test_trunk_that_ends_before_its_fork_turn_forks_at_the_start(tok):
    # Task "short" is done at turn 0 (target 1), before fork turn 2: its group is the trunk
    # plus G - 1 fresh episodes from the start. Task "long" forks at turn 2 as planned.
    scripts = {0: ["add 1"], 1: ["add 2"], 2: ["add 3"]}
    tasks = [Task("short", {"target": 1}), Task("long")]
    trajs, _, _ = play(tok, scripts, tasks, turn=2, max_turns=4)
    assert [t.task_id for t in trajs] == ["short"] * 3 + ["long"] * 3
    assert [t.info["branch_turn"] for t in trajs] == [0, 0, 0, 2, 2, 2]
    assert [t.num_turns for t in trajs[:3]] == [1, 1, 1] and trajs[0].finish == "done"
    assert "replay_steps" not in trajs[1].info and trajs[4].info["replay_steps"] == 2
    # the fork turn is at most H - 1: with H = 2, "long" forks at turn 1
    trajs, _, _ = play(tok, scripts, [Task("long")], turn=5, max_turns=2)
    assert [t.info["branch_turn"] for t in trajs] == [1, 1, 1]


def test_uniform_fork_turns_are_per_task_and_reproducible():
    plan = branching.BranchPlan(3, "uniform", seed=7)
    turns = [plan.turn_for(gid, max_turns=10) for gid in range(200)]
    assert set(turns) == {0, 1, 2, 3}
    assert turns == [plan.turn_for(gid, max_turns=10) for gid in range(200)]
    assert {plan.turn_for(gid, max_turns=2) for gid in range(50)} == {0, 1}
    assert branching.BranchPlan(3).turn_for(5, max_turns=10) == 3
    with pytest.raises(ValueError, match="branch_sample"):
        branching.BranchPlan(3, "normal")
    with pytest.raises(ValueError, match="branch_turn=-1"):
        branching.BranchPlan(-1)


def test_branching_needs_two_branches(tok):
    with pytest.raises(ValueError, match="samples_per_task >= 2"):
        play(tok, {0: ["add 1"]}, [Task("a")], turn=1, g=1)


# --------------------------------------------------------------------- the TL-GRPO batch --


def traj(tokens, turn_ids, mask, rewards, group_id, sample, branch_turn):
    return Trajectory(
        tokens=np.asarray(tokens, np.int32), loss_mask=np.asarray(mask, bool),
        behaviour_logprobs=np.where(mask, -0.5, 0.0).astype(np.float32),
        turn_ids=np.asarray(turn_ids, np.int32), rewards=list(rewards), reward=sum(rewards),
        success=False, num_turns=len(rewards), weight_versions=[0] * len(rewards),
        task_id=f"t{group_id}", group_id=group_id, finish="done", messages=[],
        info={"sample_index": sample, "branch_turn": branch_turn,
              "branch_reward": float(sum(rewards[branch_turn:]))})


def test_branching_batch_and_advantages_by_hand():
    # Task 10 forked at turn 1 into 3 branches. Positions 0-4 are the shared prefix: prompt
    # (0, 1), turn 0's action (2, 3: sampled by the trunk, copied into the others), its
    # observation (4). Rewards per turn; the branch reward sums turns 1.. ("sum" reduce):
    #   A0 rewards (0.5, 0, 1) -> 1     A1 (0.5, 0) -> 0     A2 (0.5, 1, 1) -> 2
    # Task 11 forked at turn 0 (its trunk ended before turn 1): B0 reward 3, B1 reward 1.
    rows = [
        traj([1, 2, 5, 6, 3, 7, 8, 3, 9], [-1, -1, 0, 0, 0, 1, 1, 1, 2],
             [0, 0, 1, 1, 0, 1, 1, 0, 1], [0.5, 0, 1], 10, 0, 1),
        traj([1, 2, 5, 6, 3, 7, 9], [-1, -1, 0, 0, 0, 1, 1],
             [0, 0, 1, 1, 0, 1, 1], [0.5, 0], 10, 1, 1),
        traj([1, 2, 5, 6, 3, 8, 8, 3, 9, 9], [-1, -1, 0, 0, 0, 1, 1, 1, 2, 2],
             [0, 0, 1, 1, 0, 1, 1, 0, 1, 1], [0.5, 1, 1], 10, 2, 1),
        traj([1, 4, 5], [-1, -1, 0], [0, 0, 1], [3], 11, 0, 0),
        traj([1, 4, 6], [-1, -1, 0], [0, 0, 1], [1], 11, 1, 0),
    ]
    algo = algorithms.algo_config("tl_grpo")
    algo.branch_turn = 1  # turn slots 0 and 1
    host = trajectories_to_batch(rows, length_buckets=(10,), row_multiple=2)  # 5 rows + 1 pad
    host = host.replace(**algorithms.batch_arrays(host, rows, algo))
    # Slot f of each row holds (branch reward, group id); every other slot is unused (-1).
    np.testing.assert_array_equal(host["turn_group_ids"],
                                  [[-1, 10], [-1, 10], [-1, 10], [11, -1], [11, -1], [-1, -1]])
    np.testing.assert_allclose(host["turn_rewards"],
                               [[0, 1], [0, 0], [0, 2], [3, 0], [1, 0], [0, 0]])
    # The shared prefix carries no loss in ANY copy: turn 0's tokens 2, 3 are masked in A0 (the
    # trunk, which sampled them) as in A1 and A2. Task 11 forked at 0: nothing is shared.
    np.testing.assert_array_equal(host["loss_mask"].astype(int), [
        [0, 0, 0, 0, 0, 1, 1, 0, 1, 0],
        [0, 0, 0, 0, 0, 1, 1, 0, 0, 0],
        [0, 0, 0, 0, 0, 1, 1, 0, 1, 1],
        [0, 0, 1, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0, 0, 0, 0, 0],
        [0] * 10])
    keys = algorithms.batch_keys(rows, algo)
    assert {"turn_rewards", "turn_group_ids", "turn_ids"} <= set(keys)
    adv, ret = compute_advantages(algo.advantage, {k: host[k] for k in keys},
                                  **dict(algorithms.advantage_options(algo)))
    # Group 10: rewards (1, 0, 2), mean 1, std (ddof 1) sqrt((0 + 1 + 1) / 2) = 1
    #   -> A = 0, -1, +1 (/ (1 + 1e-6)). Every token of turns >= 1 carries its branch's A:
    #   A2's turn-2 tokens (8, 9) take turn 1's slot (carry_forward).
    # Group 11: rewards (3, 1), mean 2, std sqrt((1 + 1) / 1) = 1.4142136 -> A = +-0.7071065.
    a, c = 1 / (1 + 1e-6), 1 / (np.sqrt(2) + 1e-6)
    np.testing.assert_allclose(np.asarray(adv), [
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, -a, -a, 0, 0, 0],
        [0, 0, 0, 0, 0, a, a, 0, a, a],
        [0, 0, c, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, -c, 0, 0, 0, 0, 0, 0, 0],
        [0] * 10], rtol=1e-6, atol=1e-7)
    # returns: the branch reward on its tokens
    np.testing.assert_allclose(np.asarray(ret), [
        [0, 0, 0, 0, 0, 1, 1, 0, 1, 0],
        [0] * 10,
        [0, 0, 0, 0, 0, 2, 2, 0, 2, 2],
        [0, 0, 3, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0, 0, 0, 0, 0],
        [0] * 10])


def test_batch_refuses_trajectories_without_a_branch():
    row = traj([1, 2, 5], [-1, -1, 0], [0, 0, 1], [1], 3, 0, 0)
    del row.info["branch_turn"]
    algo = algorithms.algo_config("tl_grpo")
    host = trajectories_to_batch([row], length_buckets=(4,))
    with pytest.raises(ValueError, match="no branch turn.*branching rollouts"):
        algorithms.batch_arrays(host, [row], algo)


# ------------------------------------------------------------- the shipped envs replay --


def _env_names():
    from rl_tpu.envs import ENV_MODULES
    return sorted(ENV_MODULES)


@pytest.mark.parametrize("name", _env_names())
def test_envs_that_declare_replayable_replay_to_the_same_observations(name):
    # Two fresh envs of the same task, the same actions (valid or not, the env answers
    # deterministically either way): the same observations, rewards and done.
    try:
        first = envs.make(name)
    except Exception as e:  # noqa: BLE001 - a missing optional dependency (a package, a JVM)
        pytest.skip(f"{name} cannot be built here: {e}")
    if not branching.replayable(first):
        first.close()
        pytest.skip(f"{name} does not declare replayable = True")
    second = envs.make(name)
    task = first.tasks().get("train", 3)
    actions = ["turn left", "move forward", "check available actions", "get 1 oak planks",
               "inventory", "go to red ball 1", "craft 1 stick using 1 oak planks"]
    seen = []
    for env in (first, second):
        trace = [env.reset(task)]
        for action in actions:
            result = env.step(action)
            trace.append((result.observation, result.reward, result.done))
            if result.done:
                break
        seen.append(trace)
        env.close()
    assert seen[0] == seen[1]


@pytest.mark.parametrize("name", ["babyai", "textcraft"])
def test_the_multi_turn_envs_tl_grpo_branches_on_declare_replayable(name):
    env = envs.make(name)
    assert branching.replayable(env)
    assert branching.replayable(envs.DelayedEnv(env, 0.0))  # wrappers keep the flag
    env.close()


# ------------------------------------------------------------------ the algorithm's hooks --


def test_tl_grpo_plays_branching_rollouts_and_the_others_do_not():
    from rl_tpu import agent
    assert algorithms.episode_player(algorithms.algo_config("grpo"), 0) is agent.run_episodes
    algo = algorithms.algo_config("tl_grpo")
    algo.branch_turn, algo.branch_sample = 4, "uniform"
    play = algorithms.episode_player(algo, 9)
    assert play.func is branching.run_branching_episodes
    assert play.keywords["plan"] == branching.BranchPlan(4, "uniform", 9)
    assert algorithms.batch_arrays({}, [], algorithms.algo_config("grpo")) == {}


@pytest.mark.parametrize("override,match", [
    ({"algo.branch_sample": "gauss"}, "algo.branch_sample='gauss'"),
    ({"algo.branch_turn": -2}, "algo.branch_turn=-2"),
    ({"train.samples_per_task": 1}, "samples_per_task >= 2"),
    ({"rollout.max_staleness": 1, "rollout.partial_token_budget": 64}, "partial_token_budget=0"),
])
def test_config_check_names_the_branching_keys(override, match):
    from rl_tpu.recipes import config as config_lib
    c = config_lib.base_config("tl_grpo")
    for key, value in override.items():
        block, leaf = key.split(".")
        c[block][leaf] = value
    with pytest.raises(ValueError, match=re.escape(match)):
        config_lib.check(c)
