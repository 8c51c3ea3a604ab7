"""The `agent_program` env: a config's handle on an agent program (rl_tpu/agent/program.py),
and two example programs written only against the `openai` client.

    set_env(c, "agent_program", program="rl_tpu.envs.agent_programs:arithmetic_agent",
            tasks="rl_tpu.envs.agent_programs:arithmetic_tasks")

The env holds the program (`program`: "module:function", imported when the env is built, so a
wrong name fails at start-up), the tasks (`tasks`: "module:name" of a TaskSource or of a
function returning one; empty with `env.dataset_dir`, whose JSONL tasks are used instead) and
an episode's time limit (`timeout_s`). It is never stepped: the trainer sees
env.name == "agent_program" and plays the program (`agent.program.play_programs`); `reset`
and `step` say so if something tries.

The examples (`arithmetic_agent`, `guessing_agent`) are what a user brings: no rl_tpu import,
several chat-completion calls an episode, a reward returned at the end.
"""

from __future__ import annotations

import importlib
import random
import re
from typing import Any, Callable

from rl_tpu.core.env import Env, SeededTasks, StepResult, Task, TaskSource, register
from rl_tpu.optional import require


def load_object(spec: str, what: str) -> Any:
    """The object "package.module:attribute" names; ValueError saying what is wrong."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ValueError(f"{what}={spec!r}: name it as 'package.module:attribute'")
    module_name, attribute = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{what}={spec!r}: cannot import {module_name!r} ({err})") from err
    obj = module
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what}={spec!r}: {module_name!r} has no {attribute!r}")
        obj = getattr(obj, part)
    return obj


@register("agent_program")
class AgentProgramEnv(Env):
    """An agent program and its tasks (module doc). Not steppable: the trainer plays it."""

    name = "agent_program"

    def __init__(self, program: str, tasks: str = "", timeout_s: float = 600.0):
        # Programs reach the model through the `openai` client (rl_tpu/agent/program.py):
        # without it every episode would end in an env error, so the run stops here instead.
        require("openai", extra="envs", needed_by="env agent_program (its programs call the "
                                                  "model through the openai client)")
        self.program: Callable[[str, dict], Any] = load_object(program, "program")
        if not callable(self.program):
            raise ValueError(f"program={program!r} is a {type(self.program).__name__}, not a "
                             "function(base_url, task) -> reward")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0 seconds")
        self.program_spec, self.tasks_spec, self.timeout_s = program, tasks, float(timeout_s)

    def reset(self, task: Task) -> str:
        raise RuntimeError(self._not_an_env())

    def step(self, action: str) -> StepResult:
        raise RuntimeError(self._not_an_env())

    def _not_an_env(self) -> str:
        return (f"agent_program ({self.program_spec}) drives its own episodes: it is played by "
                "rl_tpu.agent.program.play_programs (the trainer's player for this env), never "
                "stepped by the agent loop")

    def tasks(self) -> TaskSource:
        if not self.tasks_spec:
            raise TypeError("env agent_program has no tasks: set env.kwargs.tasks to "
                            "'module:task_source' or env.dataset_dir to a JSONL dataset")
        source = load_object(self.tasks_spec, "tasks")
        if callable(source) and not isinstance(source, TaskSource):
            source = source()
        if not isinstance(source, TaskSource):
            raise ValueError(f"tasks={self.tasks_spec!r} gave a {type(source).__name__}, not a "
                             "TaskSource (rl_tpu.core.env)")
        return source


# --- example programs -----------------------------------------------------------------------

def _draw_arithmetic(rng: random.Random, split: str, index: int) -> dict:
    return {"a": rng.randint(0, 9), "b": rng.randint(0, 9), "c": rng.randint(2, 5)}


def arithmetic_tasks() -> TaskSource:
    """Tasks of `arithmetic_agent`: digits a, b and a factor c (train seeds 0.., eval 10**6..)."""
    return SeededTasks("agent_arithmetic", _draw_arithmetic, train_seed=0, eval_seed=10**6,
                       train_size=100_000, eval_size=1000)


def first_integer(text: Any) -> Any:
    """The first integer in a reply, or None."""
    match = re.search(r"-?\d+", text or "")
    return int(match.group()) if match else None


def arithmetic_agent(base_url: str, task: dict) -> dict:
    """Two chained questions in one conversation: a + b, then that times c. Half the reward
    for each right answer (the second is checked against the model's own first answer, so a
    wrong sum does not doom the product)."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": "Reply with a number only."},
                {"role": "user", "content": f"What is {task['a']} + {task['b']}?"}]
    reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    first = reply.choices[0].message.content
    messages += [{"role": "assistant", "content": first},
                 {"role": "user", "content": f"Multiply that by {task['c']}."}]
    reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    second = reply.choices[0].message.content
    total = first_integer(first)
    right_sum = total == task["a"] + task["b"]
    right_product = total is not None and first_integer(second) == total * task["c"]
    return {"reward": 0.5 * right_sum + 0.5 * right_product,
            "success": right_sum and right_product}


def guessing_tasks() -> TaskSource:
    """Tasks of `guessing_agent`: a secret number in [1, 16]."""
    return SeededTasks("agent_guessing", lambda rng, split, i: {"secret": rng.randint(1, 16)},
                       train_seed=0, eval_seed=10**6, train_size=100_000, eval_size=1000)


def guessing_agent(base_url: str, task: dict, max_guesses: int = 4) -> float:
    """Guess a number in [1, 16] with "higher" / "lower" hints, at most `max_guesses` calls;
    reward 1 for finding it (less for each extra guess), 0 otherwise."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Guess my number from 1 to 16. Reply with one "
                                            "number."}]
    for guess_index in range(max_guesses):
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
        text = reply.choices[0].message.content
        guess = first_integer(text)
        if guess == task["secret"]:
            return 1.0 - 0.2 * guess_index
        hint = ("Not a number." if guess is None else
                "Higher." if guess < task["secret"] else "Lower.")
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": hint}]
    return 0.0
