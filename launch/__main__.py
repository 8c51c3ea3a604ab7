"""`python -m launch` lists the entry points, one line each (the first line of each docstring)."""

import importlib
import pkgutil

import launch


def main() -> None:
    names = sorted(m.name for m in pkgutil.iter_modules(launch.__path__) if m.name != "__main__")
    width = max(len(n) for n in names)
    print("Entry points (python -m launch.<name> --help for flags):")
    for name in names:
        spec = importlib.util.find_spec(f"launch.{name}")
        doc = _first_docstring_line(spec.origin)
        print(f"  {name:<{width}}  {doc}")


def _first_docstring_line(path: str) -> str:
    """Read the module docstring without importing it (imports pull in JAX and envs)."""
    import ast
    with open(path) as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


if __name__ == "__main__":
    main()
