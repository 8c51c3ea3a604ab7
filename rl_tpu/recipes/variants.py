"""The one parser of a config file's variant string: `get_config("clip_higher,s4,smoke")`.

Every experiment file in configs/ takes `arg`, comma-separated names: at most one from each of
its groups of choices (the loss, the setting, the env...) and optionally `smoke`, which
shrinks any variant to a CI-sized run. `parse_variant` turns the string into {group: name}
(a group not named takes its default) and whether `smoke` was given, and refuses anything
else with the choices spelled out, so a typo in a sweep fails at once instead of running the
default.

Each file also describes its variants for `--list_variants` (`describe`): a `VARIANT_HELP`
dict, one line for each name its groups take (`smoke` and numbered names have standard lines),
and a docstring paragraph starting "Smoke runs" with the literal smoke commands, e.g.
`python -m launch.train --config configs/rlhf_largest.py:gold,smoke --workdir /tmp/x`, and
what they need first (a reward model, a server), so no one has to guess a combination.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import re
import shlex
from typing import Iterator, Mapping, Optional, Sequence

SMOKE = "smoke"
STANDARD_HELP = {SMOKE: "shrinks any variant to a CI-sized run of seconds on a CPU"}
NUMBERED_HELP = {"seed": "the seed (RL's sampling and data order)"}
# The groups parse_variant was given while `recording()` is active (else None).
_recorded: Optional[list] = None


def parse_variant(arg: str, groups: Mapping[str, Sequence[str]],
                  defaults: Optional[Mapping[str, str]] = None,
                  numbered: Optional[Mapping[str, int]] = None) -> tuple[dict, bool]:
    """('a,b,smoke', {group: names}) -> ({group: the name given, else defaults[group], else the
    group's first name}, whether 'smoke' was given). `numbered` ({"seed": 0}) also takes
    names like 'seed3': chosen["seed"] is then 3 (else the default given). A name that is no
    group's, a second name of one group, or 'smoke' twice is a ValueError naming it and the
    choices."""
    defaults = dict(defaults or {})
    numbered = dict(numbered or {})
    if _recorded is not None:
        _recorded.append((dict(groups), defaults, numbered))
    for group, name in defaults.items():
        if name not in groups.get(group, ()):
            raise ValueError(f"default {name!r} of group {group!r} is not among its choices "
                             f"{tuple(groups.get(group, ()))}")
    chosen: dict[str, str] = {}
    smoke = False
    for part in (p.strip() for p in arg.split(",")):
        if not part:
            continue
        if part == SMOKE and not smoke:
            smoke = True
            continue
        group = next((g for g, names in groups.items() if part in names), None)
        number = next((n for n in numbered if part.startswith(n) and part[len(n):].isdigit()),
                      None)
        if number is not None and number not in chosen:
            chosen[number] = int(part[len(number):])
            continue
        if group is None or group in chosen or part == SMOKE:
            why = (f"is a second {number} (after {chosen[number]})" if number is not None else
                   "is not a choice" if group is None and part != SMOKE else
                   "is given twice" if part == SMOKE else
                   f"is a second {group} (after {chosen[group]!r})")
            if not groups and not numbered:
                raise ValueError(f"variant {arg!r}: {part!r} {why}; this config takes '' (the "
                                 f"experiment) or {SMOKE!r}")
            choices = "; ".join([f"{g}: {', '.join(names)}" for g, names in groups.items()]
                                + [f"{n}: {n}<N>" for n in numbered])
            raise ValueError(f"variant {arg!r}: {part!r} {why}. Give at most one of each group "
                             f"({choices}) and optionally {SMOKE!r}, comma-separated")
        chosen[group] = part
    picked = {g: chosen.get(g, defaults.get(g, names[0])) for g, names in groups.items()}
    picked.update({n: chosen.get(n, default) for n, default in numbered.items()})
    return picked, smoke


@contextlib.contextmanager
def recording() -> Iterator[list]:
    """Collects (groups, defaults, numbered) of each parse_variant call made inside: how
    `describe` learns a config file's variants from the file's own get_config."""
    global _recorded
    outer, _recorded = _recorded, []
    try:
        yield _recorded
    finally:
        _recorded = outer


def load_config_file(path: str):
    """The module of a config file (configs/X.py), loaded from its path."""
    spec = importlib.util.spec_from_file_location("config_file", path)
    if spec is None:
        raise OSError(f"--config={path}: no such config file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def variants_of(module) -> tuple[dict, dict, dict]:
    """(groups, defaults, numbered) of a config module, as its get_config("") passes them."""
    with recording() as calls:
        module.get_config("")
    if not calls:
        raise ValueError(f"{module.__file__}: get_config does not call parse_variant")
    groups, defaults, numbered = calls[0]
    return groups, defaults, numbered


SMOKE_SECTION = "Smoke runs"


def smoke_section(module) -> list[str]:
    """The docstring's paragraph that starts with "Smoke runs": the literal commands of the
    file's smoke runs (and of what they need first, such as a reward model or a server)."""
    lines = (inspect.getdoc(module) or "").splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(SMOKE_SECTION)), None)
    if start is None:
        return []
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].strip()), len(lines))
    return lines[start:end]


def smoke_commands(module) -> list[list[str]]:
    """The launcher commands of the smoke section, split into words (a trailing backslash
    joins lines; a `# comment` and an `&` are dropped): those whose `--config` names `smoke`."""
    text = re.sub(r"\\\n\s*", " ", "\n".join(smoke_section(module)[1:]))
    commands = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        words = [w for w in words if w != "&"]
        at = next((i for i, w in enumerate(words) if w == "-m"), None)
        if at is None or not words[at + 1].startswith("launch."):
            continue
        config = next((w.split("=", 1)[1] if w.startswith("--config=") else words[i + 1]
                       for i, w in enumerate(words[:-1])
                       if w.startswith("--config=") or w == "--config"), "")
        if SMOKE in config.partition(":")[2].split(","):
            commands.append(words[at + 1:])
    return commands


def describe(path: str) -> str:
    """What `--list_variants` prints: the config's first docstring paragraph, each group's
    names with one line each (the default marked), the numbered names, `smoke`, and the
    docstring's smoke runs."""
    module = load_config_file(path)
    groups, defaults, numbered = variants_of(module)
    helps = {**STANDARD_HELP, **getattr(module, "VARIANT_HELP", {})}
    doc = (inspect.getdoc(module) or "").strip()
    lines = [f"{path}: {' '.join(doc.split(chr(10) + chr(10))[0].split())}",
             f"Variants (`--config {path}:name,name,...`: at most one name of each group, "
             "comma-separated; a group not named takes its default):"]
    names = [n for g in groups.values() for n in g] + [f"{n}<N>" for n in numbered] + [SMOKE]
    width = max(len(n) for n in names) + 2
    for group, choices in groups.items():
        default = defaults.get(group, choices[0])
        lines.append(f"  {group}:")
        for name in choices:
            mark = "(default) " if name == default else ""
            lines.append(f"    {name:<{width}}{mark}{helps.get(name, '')}")
    for name, default in numbered.items():
        text = helps.get(name, NUMBERED_HELP.get(name, name))
        lines.append(f"  {name + '<N>':<{width + 2}}{text} (default {name}{default})")
    lines.append(f"  {SMOKE:<{width + 2}}{helps[SMOKE]}")
    lines += smoke_section(module) or [f"{SMOKE_SECTION}: none in the docstring"]
    return "\n".join(lines)
