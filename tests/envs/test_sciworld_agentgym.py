"""The sciworld env's default: AgentGym's SciWorld protocol. Needs Java; one JVM for the module.

Expected values come from AgentGym's server as documented (flat list, first observation,
score as reward, -100 on failure, done past 100 moves) and from what scienceworld 1.2.3's
simulator says for the fixed tasks below (task texts, the scores of gold-path actions, the
move cost of `wait1`), checked by hand against the package.
"""

import shutil

import pytest

pytest.importorskip("scienceworld")

from rl_tpu.core import env as env_lib
from rl_tpu.envs import sciworld as sciworld_module
from rl_tpu.envs.sciworld import ACK, INSTRUCTION, SciWorldEnv, flat_task_list

NO_JAVA = ("ScienceWorld needs a Java runtime on PATH (e.g. apt-get install "
           "openjdk-17-jre-headless)")
needs_java = pytest.mark.skipif(shutil.which("java") is None, reason=NO_JAVA)

BOIL = ("Your task is to boil water. For compounds without a boiling point, combusting the "
        "substance is also acceptable. First, focus on the substance. Then, take actions that "
        "will cause it to change its state of matter.")
HALLWAY = "This room is called the hallway. In it, you see: \n\tthe agent\n"
NO_MATCH = "No known action matches that input."


@pytest.fixture(scope="module")
def env():
    if shutil.which("java") is None:
        pytest.skip(NO_JAVA)
    e = env_lib.make("sciworld_agentgym")  # the old name: an alias of "sciworld"
    yield e
    e.close()


def act(action: str) -> str:
    return f"Thought:\nI should do this.\n\nAction:\n{action}"


def test_missing_java_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(sciworld_module.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="openjdk"):
        SciWorldEnv()


@needs_java
def test_flat_list_matches_agentgym(env):
    games = env.games
    # 30 task families minus 7 left out; every variation: 4639 with scienceworld 1.2.3.
    assert len(games) == 4639
    names = {n for n, _ in games}
    assert len(names) == 23
    assert not names & {"grow-plant", "grow-fruit", "inclined-plane-determine-angle",
                        "mendelian-genetics-known-plant"}
    # boil (1-1) has 30 variations, melt (1-2) follows; the last is identify-life-stages-2 (8-2),
    # 10 variations. No modulo: 4639 is out of range.
    assert games[0] == ("boil", 0) and games[29] == ("boil", 29) and games[30] == ("melt", 0)
    assert games[120] == ("use-thermometer", 0) and games[4638] == ("identify-life-stages-2", 9)
    with pytest.raises(ValueError, match="out of range.*4639"):
        env.reset(env_lib.Task("sciworld_4639", {"data_idx": 4639}))
    assert flat_task_list(env.sim) is games  # computed once per process


@needs_java
def test_task_source_splits(env):
    ts = env.tasks()
    assert ts.get("all", 30) == env_lib.Task("sciworld_30", {"data_idx": 30})
    assert ts.get("all", 30).data == {"data_idx": 30}
    assert ts.size("all") == 4639
    sizes = {s: ts.size(s) for s in ("train", "eval", "test")}
    assert sum(sizes.values()) == 4639
    ids = {s: {ts.get(s, i).data["data_idx"] for i in range(n)} for s, n in sizes.items()}
    assert not ids["train"] & ids["eval"] and not ids["train"] & ids["test"]
    assert not ids["eval"] & ids["test"]
    # The package puts boil variations 0..13 in train (14 of 30), 14..20 in dev.
    assert ts.get("train", 0).data["data_idx"] == 0 and ts.get("eval", 0).data["data_idx"] == 14
    with pytest.raises(IndexError, match="out of range"):
        ts.get("eval", sizes["eval"])
    with pytest.raises(ValueError, match="unknown split"):
        ts.size("dev")


@needs_java
def test_first_observation_is_description_newline_look(env):
    obs = env.reset(env_lib.Task("sciworld_0", {"data_idx": 0}))
    assert obs.startswith(BOIL + "\n" + HALLWAY)
    assert obs.endswith("A door to the workshop (that is closed)")
    # AgentGym-RL's item ids carry data_idx after the last "_".
    obs30 = env.reset(env_lib.Task("sciworld_30"))
    assert obs30.startswith("Your task is to melt ")


@needs_java
def test_score_is_the_reward(env):
    env.reset(env_lib.Task("sciworld_0", {"data_idx": 0}))
    steps = [("open door to kitchen", "The door is now open.", 0),
             ("go to kitchen", "You move to the kitchen.", 0),
             ("pick up thermometer", "You move the thermometer to the inventory.", 0),
             ("open cupboard", "The cupboard is now open.", 0),
             ("pick up metal pot", "You move the metal pot to the inventory.", 0),
             ("move metal pot to sink", "You move the metal pot to the sink.", 0),
             ("activate sink", "The sink is now activated.", 3),
             ("deactivate sink", "The sink is now deactivated.", 3),  # the score, not its change
             ("pick up metal pot", "You move the metal pot to the inventory.", 3),
             ("focus on substance in metal pot", "You focus on the water.", 70)]
    for action, observation, score in steps:
        r = env.step(act(action))
        assert (r.observation, r.reward, r.done) == (observation, score, False), action
    assert r.info["delta"] == 67 and r.info["moves"] == 10


@needs_java
def test_failure_is_minus_100_and_done(env):
    env.reset(env_lib.Task("sciworld_0", {"data_idx": 0}))
    # Two markers: only the text after the last one is the action.
    r = env.step("Thought:\nfirst look.\nAction: look around\nActually no.\nAction: focus on agent")
    assert (r.observation, r.reward, r.done) == ("You focus on the agent.", -100.0, True)
    assert r.info["failed"] and not r.info["success"]
    after = env.step(act("look around"))
    assert after.done and after.reward == 0.0 and after.info["invalid_action"]


@needs_java
def test_unparsable_reply_sends_empty_action(env):
    env.reset(env_lib.Task("sciworld_0", {"data_idx": 0}))
    r = env.step("I will look around.")  # no `Action:`: "" goes to the simulator
    assert (r.observation, r.reward, r.done) == (NO_MATCH, 0.0, False)
    assert r.info["action"] == "" and r.info["moves"] == 0
    r = env.step("Action:\nfly to the moon")
    assert (r.observation, r.reward, r.done) == (NO_MATCH, 0.0, False)
    # Text py4j cannot send (an unpaired surrogate): in AgentGym the server answers
    # {"error"} and the episode ends with score 0.
    r = env.step("Action: look at \ud800")
    assert r.observation.startswith("Error: ScienceWorld could not process the action")
    assert (r.reward, r.done) == (0.0, True) and r.info["error"]


@needs_java
def test_done_past_100_moves(env):
    # find-animal variation 0 (data_idx 3836). `look around` is free; `wait1` costs 2 moves:
    # 50 of them make 100 (not past the limit), the 51st makes 102 and ends the episode.
    env.reset(env_lib.Task("sciworld_3836", {"data_idx": 3836}))
    assert env.step(act("look around")).info["moves"] == 0
    for n in range(1, 51):
        r = env.step(act("wait1"))
        assert not r.done and r.info["moves"] == 2 * n
    r = env.step(act("wait1"))
    assert (r.observation, r.reward, r.done) == ("You decide to wait for 1 iterations.", 0.0, True)
    assert r.info["moves"] == 102 and r.info["truncated"]


@needs_java
def test_same_as_the_packages_own_step(env):
    """AgentGym calls ScienceWorldEnv.step; this env reads the same server values directly."""
    from scienceworld import ScienceWorldEnv

    ref = ScienceWorldEnv("", envStepLimit=100)
    try:
        ref.load("boil", 0)
        ref.step("look around")
        env.reset(env_lib.Task("sciworld_0", {"data_idx": 0}))
        for action in ["open door to kitchen", "go to kitchen", "look around", "wait",
                       "pick up thermometer", "open cupboard", "pick up metal pot",
                       "move metal pot to sink", "activate sink", "focus on sink"]:
            ob, _, done, info = ref.step(action)
            r = env.step(act(action))
            assert (r.observation, r.reward, r.done) == (ob, info["score"], done), action
    finally:
        sciworld_module._release(ref)


def test_conversation_start():
    # No JVM needed: the env is built lazily, so construct it without calling __init__.
    e = SciWorldEnv.__new__(SciWorldEnv)
    user, assistant = e.conversation_start()
    assert user == {"role": "user", "content": INSTRUCTION}
    assert assistant == {"role": "assistant",
                         "content": "OK. I'll follow your instructions and try my best to "
                                    "solve the task."}
    assert assistant["content"] == ACK
    assert INSTRUCTION.endswith("Thought:\nyour reasoning\n\nAction:\nyour next action")
    for template in ("open OBJ", "connect OBJ to OBJ", "pour OBJ in OBJ", "use OBJ on OBJ", "focus on OBJ",
                     "wait1", "inventory", "go to LOC", "look in OBJ"):
        assert f"\n{template}:" in INSTRUCTION, template
    assert SciWorldEnv.system_prompt == "" and e.agentgym_name == "sciworld"


@needs_java
def test_instruction_lists_the_packages_templates(env):
    env.reset(env_lib.Task("sciworld_0", {"data_idx": 0}))
    templates = set(env.sim.get_possible_actions())
    # `go OBJ` is written `go to LOC` (what the simulator's own texts use); `reset task` only
    # undoes progress and is left out.
    assert {"go OBJ", "reset task"} <= templates
    for template in sorted(templates - {"go OBJ", "reset task"}):
        assert f"\n{template}:" in INSTRUCTION, template
