"""No module reaches into another's private names: the seams between rl_tpu's modules are
public methods and functions, so a change inside one module cannot break another silently.

Read from the source (ast), over rl_tpu/, launch/ and benchmarks/:
- `from m import _x` fails, whatever m is;
- `obj._x` fails unless this same module defines `_x` (a class's own privates used by its
  own module, e.g. a batcher setting its ticket's result), or the line says
  `# pylint: disable=protected-access`: reserved for a third-party object's internals
  (tensorboardX's writer thread), which no rl_tpu change can make public.
"""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("rl_tpu", "launch", "benchmarks")
# A namedtuple's public API starts with an underscore; os._exit and sys._getframe are documented.
PUBLIC_UNDERSCORED = {"_replace", "_asdict", "_fields", "_make", "_exit", "_getframe"}
EXEMPT_MARK = "pylint: disable=protected-access"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_names(tree: ast.AST) -> set[str]:
    """Every name this module defines: functions, classes, assigned names and attributes."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
    return out


def reach_throughs(source: str, path: str = "<source>") -> list[str]:
    """'path:line: what' for each private name `source` takes from another module."""
    tree = ast.parse(source)
    lines = source.splitlines()
    defined = _defined_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            found += [f"{path}:{node.lineno}: from {node.module} import {alias.name}"
                      for alias in node.names if _private(alias.name)]
        elif (isinstance(node, ast.Attribute) and _private(node.attr)
              and node.attr not in defined | PUBLIC_UNDERSCORED
              and EXEMPT_MARK not in lines[node.lineno - 1]):
            found.append(f"{path}:{node.lineno}: {ast.unparse(node.value)}.{node.attr}")
    return found


def _modules():
    for package in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, package)):
            yield from (os.path.join(dirpath, f) for f in sorted(files) if f.endswith(".py"))


def test_no_module_takes_another_modules_private_names():
    found = []
    for path in _modules():
        with open(path) as f:
            found += reach_throughs(f.read(), os.path.relpath(path, ROOT))
    assert not found, "private names used across modules:\n" + "\n".join(found)


@pytest.mark.parametrize("source, expected", [
    ("from a.b import _helper\n", ["<source>:1: from a.b import _helper"]),
    ("import m\nm._state.x = 1\n", ["<source>:2: m._state"]),
    ("def f(sampler):\n    return sampler._params\n", ["<source>:2: sampler._params"]),
    # its own privates, a namedtuple's API, a marked third-party reach, dunders: all allowed
    ("class T:\n    def _set(self):\n        pass\n\ndef g(t):\n    t._set()\n", []),
    ("def f(p):\n    return p._replace(x=1)\n", []),
    ("def f(w):\n    w._worker.stop()  # pylint: disable=protected-access\n", []),
    ("def f(x):\n    return x.__class__\n", []),
])
def test_the_check_finds_what_it_should(source, expected):
    assert reach_throughs(source) == expected
