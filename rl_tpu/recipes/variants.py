"""The one parser of a config file's variant string: `get_config("clip_higher,s4,smoke")`.

Every experiment file in configs/ takes `arg`, comma-separated names: at most one from each of
its groups of choices (the loss, the setting, the env...) and optionally `smoke`, which
shrinks any variant to a CI-sized run. `parse_variant` turns the string into {group: name}
(a group not named takes its default) and whether `smoke` was given, and refuses anything
else with the choices spelled out, so a typo in a sweep fails at once instead of running the
default.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

SMOKE = "smoke"


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
