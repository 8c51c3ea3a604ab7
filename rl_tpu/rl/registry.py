"""Name -> entry tables, so configs pick RL math by name (`algo.advantage='grpo'`).

An entry is usually a function; it may be a small spec object when a name carries more than
one function (a policy loss's ratio, defaults and batch statistics: `losses.PolicyLossKind`).
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

F = TypeVar("F")


class Registry(Generic[F]):
    """A named table of functions (or specs); unknown names fail with the list of known ones."""

    def __init__(self, kind: str):
        self.kind = kind
        self._table: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def add(fn: F) -> F:
            if name in self._table:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._table[name] = fn
            return fn
        return add

    def get(self, name: str) -> F:
        try:
            return self._table[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} {name!r}; choose one of {sorted(self._table)}") from None

    def names(self) -> list[str]:
        return sorted(self._table)

    def __contains__(self, name: str) -> bool:
        return name in self._table
