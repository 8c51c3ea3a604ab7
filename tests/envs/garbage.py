"""Hostile action text for the env robustness tests (a helper module, not a test file).

Every env must turn any action text into an observation, never an exception (see
`rl_tpu.core.env.Env.step`). `garbage_actions` mixes the generic hostile kinds below, the same
for every env, with the env's own kinds: valid-looking-but-illegal actions, legal ones that keep
episodes going, inputs aimed at its parser. `step_through` plays such actions and checks every
result; each test then checks the env still plays a valid episode.
"""

from __future__ import annotations

import random
import string
from typing import Callable, Collection, Iterable, Sequence, Union

from rl_tpu.core.env import Env, StepResult, Task

Maker = Callable[[random.Random], str]
Kind = Union[str, Maker]  # a string is fed as is; a maker is called with the rng


def text(rng: random.Random, alphabet: str, lo: int, hi: int | None = None) -> str:
    """`lo` characters from `alphabet`, or between `lo` and `hi` (inclusive) when `hi` is given."""
    n = lo if hi is None else rng.randint(lo, hi)
    return "".join(rng.choice(alphabet) for _ in range(n))


def code_points(rng: random.Random, first: int, last: int, lo: int, hi: int) -> str:
    """Between `lo` and `hi` characters with code points in [first, last]."""
    return "".join(chr(rng.randint(first, last)) for _ in range(rng.randint(lo, hi)))


def one_of(*options: str) -> Maker:
    """A kind that picks one of `options`."""
    return lambda rng: rng.choice(options)


GENERIC: dict[str, Maker] = {
    "empty": lambda rng: "",
    "spaces": lambda rng: " " * rng.randint(1, 50),
    "newline flood": lambda rng: "\n" * rng.randint(50, 500),
    "10 KB of one letter": lambda rng: "x" * 10_240,
    "10 KB of words": lambda rng: text(rng, "abc xyz", 10_240),
    "lowercase gibberish": lambda rng: text(rng, string.ascii_lowercase + " ", 1, 300),
    # Controls, lone surrogates, private use and astral planes: anything `chr` makes.
    "any code points": lambda rng: code_points(rng, 0, 0x2FFFF, 1, 64),
    "non-ASCII text": lambda rng: code_points(rng, 0x20, 0x2FFF, 1, 300),
    "control characters": lambda rng: code_points(rng, 0, 31, 1, 50),  # NUL, ESC, \r, ...
    "lone surrogates": lambda rng: code_points(rng, 0xD800, 0xDFFF, 1, 16),
}


def garbage_actions(rng: random.Random, n: int, env_specific: Sequence[Kind] | Maker = (), *,
                    skip: Collection[str] = (), specific_share: float = 0.5) -> list[str]:
    """`n` hostile actions: each of the env's own kinds with probability `specific_share` (split
    evenly between them), else one of the GENERIC kinds (likewise) not named in `skip`."""
    assert set(skip) <= set(GENERIC), f"unknown generic kinds {set(skip) - set(GENERIC)}"
    if callable(env_specific):
        env_specific = [env_specific]
    specific = [kind if callable(kind) else (lambda rng, kind=kind: kind) for kind in env_specific]
    generic = [make for name, make in GENERIC.items() if name not in skip]
    actions = []
    for _ in range(n):
        kinds = specific if specific and rng.random() < specific_share else generic
        actions.append(rng.choice(kinds)(rng))
    return actions


def step_through(env: Env, actions: Iterable[str], tasks: Sequence[Task]) -> list[StepResult]:
    """Plays `actions` from a reset to `tasks[0]`, resetting to the next task of `tasks` (cycled)
    whenever an episode ends, so single-turn envs get a fresh episode for every action. Checks
    each step returns a str observation and a float reward in [0, 1]; returns the results."""
    resets = 0
    env.reset(tasks[0])
    results = []
    for action in actions:
        result = env.step(action)
        assert isinstance(result, StepResult), (action[:200], result)
        assert isinstance(result.observation, str), (action[:200], result)
        assert isinstance(result.reward, float) and 0.0 <= result.reward <= 1.0, (action[:200], result)
        results.append(result)
        if result.done:
            resets += 1
            env.reset(tasks[resets % len(tasks)])
    return results
