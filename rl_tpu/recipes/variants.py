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
                  defaults: Optional[Mapping[str, str]] = None) -> tuple[dict[str, str], bool]:
    """('a,b,smoke', {group: names}) -> ({group: the name given, else defaults[group], else the
    group's first name}, whether 'smoke' was given). A name that is no group's, a second name
    of one group, or 'smoke' twice is a ValueError naming it and the choices."""
    defaults = dict(defaults or {})
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
        if group is None or group in chosen or part == SMOKE:
            why = ("is not a choice" if group is None and part != SMOKE else
                   "is given twice" if part == SMOKE else
                   f"is a second {group} (after {chosen[group]!r})")
            choices = "; ".join(f"{g}: {', '.join(names)}" for g, names in groups.items())
            raise ValueError(f"variant {arg!r}: {part!r} {why}. Give at most one of each group "
                             f"({choices}) and optionally {SMOKE!r}, comma-separated")
        chosen[group] = part
    return {g: chosen.get(g, defaults.get(g, names[0])) for g, names in groups.items()}, smoke
