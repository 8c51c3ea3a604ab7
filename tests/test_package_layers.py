"""rl_tpu's packages form layers: no two packages reach each other, the contracts in
rl_tpu/core stand on no other package, and nothing of the project imports the old paths the
contracts and the persistence modules moved from (they re-export the new ones for one release,
for code outside rl_tpu).

Read from the source (ast), as tests/test_private_names.py does. A node is a package of
rl_tpu (rl_tpu/envs/) or a root module (rl_tpu/aot.py); every import counts, the ones inside
functions too: an import that only runs later is an arrow all the same.
"""

import ast
import importlib
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROJECT_DIRS = ("rl_tpu", "launch", "benchmarks")

# Where the contracts lived before rl_tpu/core; those modules now only re-export.
OLD_PATHS = {"rl_tpu.envs.base": "rl_tpu.core.env",
             "rl_tpu.envs.agentgym_parse": "rl_tpu.core.agentgym_parse",
             "rl_tpu.rollout.engine": "rl_tpu.core.engine",
             "rl_tpu.agent.trajectory": "rl_tpu.core.trajectory"}
# Where the persistence modules lived before rl_tpu/persistence; each old name is now an alias
# of the moved module.
OLD_PATHS.update({f"rl_tpu.{name}": f"rl_tpu.persistence.{name}" for name in (
    "checkpoint", "checkpoint_errors", "checkpoint_integrity", "host_state", "preemption",
    "workdir_lock")})


def _sources(root: str, top: str):
    """(path relative to root, module name, source) of every .py file under root/top."""
    for dirpath, _, files in os.walk(os.path.join(root, top)):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, root)
                parts = rel[:-len(".py")].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                with open(path, encoding="utf-8") as f:
                    yield rel, ".".join(parts), name == "__init__.py", f.read()


def imported_modules(source: str, module: str, is_package: bool) -> list[tuple[str, int]]:
    """(dotted module, line) for every import in `source`, wherever it stands; `from p import
    x` gives p.x (x may be a module), relative imports resolved against `module`."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            found += [(f"{origin}.{alias.name}", node.lineno) for alias in node.names]
    return found


def _node(dotted: str):
    """The layer node of an rl_tpu module: its package under rl_tpu, or the root module."""
    parts = dotted.split(".")
    return parts[1] if parts[0] == "rl_tpu" and len(parts) > 1 else None


def package_edges(root: str) -> dict[tuple[str, str], set[str]]:
    """(importing node, imported node) -> the files whose imports draw that arrow."""
    edges: dict[tuple[str, str], set[str]] = {}
    for rel, module, is_package, source in _sources(root, "rl_tpu"):
        src = _node(module)
        for dotted, _ in imported_modules(source, module, is_package):
            dst = _node(dotted)
            if src and dst and dst != src and (
                    os.path.isdir(os.path.join(root, "rl_tpu", dst))
                    or os.path.isfile(os.path.join(root, "rl_tpu", dst + ".py"))):
                edges.setdefault((src, dst), set()).add(rel)
    return edges


def cycles(edges) -> list[set[str]]:
    """The strongly connected sets of two or more nodes (Tarjan's algorithm)."""
    graph: dict[str, set[str]] = {}
    for src, dst in edges:
        graph.setdefault(src, set()).add(dst)
        graph.setdefault(dst, set())
    order, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        order[v] = low[v] = len(order)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            members = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                members.add(w)
                if w == v:
                    break
            if len(members) > 1:
                found.append(members)

    for v in sorted(graph):
        if v not in order:
            visit(v)
    return found


def cycle_report(root: str) -> list[str]:
    """One line per package cycle: its packages, then each arrow inside it with its files."""
    edges = package_edges(root)
    out = []
    for members in cycles(edges):
        arrows = "; ".join(f"{a} -> {b} ({', '.join(sorted(edges[a, b]))})"
                           for a, b in sorted(edges) if a in members and b in members)
        out.append(f"packages {sorted(members)} reach each other: {arrows}")
    return out


def old_path_imports(root: str) -> list[str]:
    """'file:line: module' for each import of a path the contracts moved away from."""
    found = []
    for top in PROJECT_DIRS:
        for rel, module, is_package, source in _sources(root, top):
            for dotted, line in imported_modules(source, module, is_package):
                old = next((p for p in OLD_PATHS if dotted == p or dotted.startswith(p + ".")),
                           None)
                entry = f"{rel}:{line}: imports {old}; import {OLD_PATHS.get(old)}"
                if old and entry not in found:  # one entry for `from old import a, b`
                    found.append(entry)
    return found


def core_reaching_out(root: str) -> list[str]:
    """'file:line: module' for each import in rl_tpu/core of another rl_tpu package. A root
    module is allowed where it imports nothing of rl_tpu itself (rl_tpu.optional,
    rl_tpu.parallel: utilities below every package)."""
    def leaf_root_module(node: str) -> bool:
        path = os.path.join(root, "rl_tpu", node + ".py")
        if not os.path.isfile(path):
            return False
        with open(path, encoding="utf-8") as f:
            imports = imported_modules(f.read(), f"rl_tpu.{node}", False)
        return not any(_node(dotted) for dotted, _ in imports)

    found = []
    for rel, module, is_package, source in _sources(root, os.path.join("rl_tpu", "core")):
        for dotted, line in imported_modules(source, module, is_package):
            node = _node(dotted)
            if node and node != "core" and not leaf_root_module(node):
                found.append(f"{rel}:{line}: imports {dotted}")
    return found


def unexplained_function_imports(root: str, exempt=frozenset()) -> list[str]:
    """'file:line: module' for each rl_tpu import inside a function without a comment saying
    why it is not at module level (an optional dependency, its import cost, a cycle inside a
    package): on the import itself, or right above it or above the group of imports it
    belongs to (a comment line, or a comment ending the line above)."""
    found = []
    for top in ("rl_tpu",):  # launch/ defers its imports until flags are read, by design
        for rel, module, is_package, source in _sources(root, top):
            if rel in exempt:
                continue
            tree, lines = ast.parse(source), source.splitlines()
            imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
            import_lines = {i for n in imports for i in range(n.lineno, n.end_lineno + 1)}
            inside = {id(n) for fn in ast.walk(tree)
                      if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                      for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))}
            for node in imports:
                named = imported_modules(ast.unparse(node), module, is_package)
                if id(node) not in inside or not any(d.startswith("rl_tpu.") for d, _ in named):
                    continue
                own = lines[node.lineno - 1:node.end_lineno]
                above = node.lineno - 1  # 1-based number of the line above
                while above in import_lines:
                    above -= 1
                if not (any("#" in line for line in own)
                        or (above >= 1 and "#" in lines[above - 1])):
                    found.append(f"{rel}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return found


def test_no_two_packages_reach_each_other():
    assert cycle_report(ROOT) == []


def test_nothing_in_the_project_imports_the_old_contract_paths():
    assert old_path_imports(ROOT) == []


def test_core_imports_no_other_package():
    assert core_reaching_out(ROOT) == []


def test_an_import_inside_a_function_says_why_it_is_there():
    assert unexplained_function_imports(ROOT) == []


def _public_definitions(module) -> list[str]:
    """The public classes, functions and constants `module`'s own source defines."""
    with open(module.__file__, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    names += [t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
              for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
              if isinstance(t, ast.Name)]
    return [n for n in names if not n.startswith("_")]


def test_the_old_paths_still_hand_out_every_core_definition():
    for old, new in OLD_PATHS.items():
        old_module, new_module = importlib.import_module(old), importlib.import_module(new)
        public = _public_definitions(new_module)
        missing = [n for n in public if getattr(old_module, n, None) is not getattr(new_module, n)]
        assert public and not missing, f"{old} does not re-export {missing} from {new}"


def _write(root, files: dict[str, str]):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_cycle_is_named_with_its_packages_and_files(tmp_path):
    # a -> b at module level, b -> a inside a function and relatively: both close the cycle
    _write(tmp_path, {
        "rl_tpu/__init__.py": "",
        "rl_tpu/a/__init__.py": "",
        "rl_tpu/a/x.py": "from rl_tpu.b.y import thing\n",
        "rl_tpu/b/__init__.py": "",
        "rl_tpu/b/y.py": "def thing():\n    from ..a import x\n    return x\n",
        "rl_tpu/c/__init__.py": "from rl_tpu import a\n",
        "rl_tpu/util.py": "",
    })
    [report] = cycle_report(str(tmp_path))
    assert report.startswith("packages ['a', 'b'] reach each other")
    assert "a -> b (rl_tpu/a/x.py)" in report and "b -> a (rl_tpu/b/y.py)" in report
    assert "c ->" not in report  # c reaches a, but nothing reaches back: no cycle


def test_old_paths_and_core_reaching_out_are_named(tmp_path):
    _write(tmp_path, {
        "rl_tpu/core/env.py": "from rl_tpu.envs import ENV_MODULES\nfrom rl_tpu import leaf\n",
        "rl_tpu/core/engine.py": "def f():\n    from rl_tpu import glue\n",
        "rl_tpu/leaf.py": "import os\n",
        "rl_tpu/glue.py": "from rl_tpu.envs import thing\n",
        "rl_tpu/envs/__init__.py": "",
        "launch/run.py": "from rl_tpu.envs import base\nfrom rl_tpu.agent.trajectory import a, b\n",
        "benchmarks/bench.py": "def f():\n    from rl_tpu.rollout.engine import SamplingParams\n",
    })
    assert core_reaching_out(str(tmp_path)) == [
        "rl_tpu/core/engine.py:2: imports rl_tpu.glue",
        "rl_tpu/core/env.py:1: imports rl_tpu.envs.ENV_MODULES"]
    assert old_path_imports(str(tmp_path)) == [
        "launch/run.py:1: imports rl_tpu.envs.base; import rl_tpu.core.env",
        "launch/run.py:2: imports rl_tpu.agent.trajectory; import rl_tpu.core.trajectory",
        "benchmarks/bench.py:2: imports rl_tpu.rollout.engine; import rl_tpu.core.engine"]


def test_an_import_inside_a_function_without_its_reason_is_named(tmp_path):
    _write(tmp_path, {
        "rl_tpu/a/x.py": ("import json\n\n\ndef bare():\n    from rl_tpu.b import y\n"
                          "    return y\n\n\ndef explained():\n"
                          "    # here: rl_tpu.b imports this module\n"
                          "    from rl_tpu.b import y\n    from rl_tpu.c import z\n"
                          "    import os  # not rl_tpu: no reason needed\n    return y, z\n\n\n"
                          "def trailing():\n    from rl_tpu import b  # here: its import cost\n"
                          "    import json\n    return b, json\n"),
        "rl_tpu/c.py": "def main():\n    import rl_tpu.b\n",
    })
    assert unexplained_function_imports(str(tmp_path)) == [
        "rl_tpu/c.py:2: import rl_tpu.b", "rl_tpu/a/x.py:5: from rl_tpu.b import y"]
    assert unexplained_function_imports(str(tmp_path), {"rl_tpu/c.py"}) == [
        "rl_tpu/a/x.py:5: from rl_tpu.b import y"]
