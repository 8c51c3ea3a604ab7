"""The package as `pip install .` installs it (not `-e`): a wheel built from this checkout,
installed into a fresh virtual environment, must hold every module and data file of the
checkout, import every module from there, and run a smoke. The rest of the suite runs on the
editable install, which reads the checkout's directories and so cannot see a package that
`find_packages` leaves out (rl_tpu/rewards once had no `__init__.py`: the wheel lacked it and
`recipes/rl.py` failed to import).

The venv sees this environment's site-packages (`--system-site-packages`), so the heavy
dependencies are not installed again; that also brings in the editable install's import
finder, which serves any `rl_tpu.*` the venv's copy lacks from the checkout. So the checks
below are on files: every module must be imported from the venv, never the checkout."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("rl_tpu", "launch")
# Directories of data files inside a package (setup.py's package_data), not packages: their
# scripts (make_search_data.py) are run from a checkout and are not installed.
DATA_DIRS = {"rl_tpu/envs/data": "*.jsonl"}

# Run by the venv's interpreter, outside the checkout: imports every module of the installed
# packages and prints what it found as JSON. The launchers each define their absl flags at
# import (several share a name: --config, --out), so each one's flags are dropped after it.
IMPORT_ALL = """
import importlib, json, os, pkgutil, sys
from absl import flags
import rl_tpu, launch
from rl_tpu.optional import MissingDependency

site = sys.argv[1]
found = {"rl_tpu": rl_tpu.__file__, "modules": [], "failed": {}, "skipped": {}}
for package in (rl_tpu, launch):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".",
                                      onerror=lambda name: found["failed"].setdefault(name, "walk")):
        before = set(flags.FLAGS)
        try:
            importlib.import_module(info.name)
            found["modules"].append(info.name)
        except MissingDependency as err:  # an optional extra that is not installed here
            found["skipped"][info.name] = str(err)
        except BaseException as err:
            found["failed"][info.name] = f"{type(err).__name__}: {err}"
        if info.name.startswith("launch."):
            for name in set(flags.FLAGS) - before:
                delattr(flags.FLAGS, name)
found["outside"] = sorted(
    name for name, module in list(sys.modules.items())
    if name.partition(".")[0] in ("rl_tpu", "launch")
    and getattr(module, "__file__", None) and not module.__file__.startswith(site))
print(json.dumps(found))
"""


def _copy_of_the_checkout(dst: Path) -> Path:
    """setup.py and the packages, so the build's scratch files (build/, *.egg-info) land in
    a temporary directory rather than in the checkout other test processes read."""
    dst.mkdir()
    shutil.copy(REPO / "setup.py", dst)
    for package in PACKAGES:
        shutil.copytree(REPO / package, dst / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    return dst


def _env() -> dict:
    """The test environment without what would make the checkout importable (PYTHONPATH) or
    the run unlike a user's (the suite's 8 fake devices)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    return env


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A venv with the checkout's wheel installed (no dependencies: they come from here)."""
    root = tmp_path_factory.mktemp("packaging")
    source = _copy_of_the_checkout(root / "source")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(root / "dist"), str(source)],
                   cwd=root, env=_env(), check=True, capture_output=True, timeout=300)
    (wheel,) = (root / "dist").glob("rl_tpu-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                    str(root / "venv")], check=True, capture_output=True, timeout=120)
    python = root / "venv" / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                    "--no-deps", "-q", str(wheel)],
                   cwd=root, env=_env(), check=True, capture_output=True, timeout=300)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          cwd=root, env=_env(), check=True, capture_output=True, text=True)
    return {"python": str(python), "site": Path(site.stdout.strip()), "cwd": root}


def _source_files(package: str) -> set[str]:
    files = set()
    for path in (REPO / package).rglob("*"):
        rel = path.relative_to(REPO).as_posix()
        if "__pycache__" in rel or not path.is_file():
            continue
        data_dir = next((d for d in DATA_DIRS if rel.startswith(d + "/")), None)
        if data_dir:
            if path.match(DATA_DIRS[data_dir]):
                files.add(rel)
        elif path.suffix == ".py":
            files.add(rel)
    return files


def test_the_wheel_holds_every_module_and_data_file_of_the_checkout(venv):
    missing = {}
    for package in PACKAGES:
        source = _source_files(package)
        assert source, f"found no files of {package} in the checkout"
        installed = {p.relative_to(venv["site"]).as_posix()
                     for p in (venv["site"] / package).rglob("*") if p.is_file()}
        missing[package] = sorted(source - installed)
    assert missing == {p: [] for p in PACKAGES}, (
        "the wheel lacks these files of the checkout: a directory of modules without an "
        "__init__.py (find_packages skips it) or a data file setup.py's package_data misses")


def test_every_module_imports_from_the_installed_package(venv):
    run = subprocess.run([venv["python"], "-c", IMPORT_ALL, str(venv["site"])], cwd=venv["cwd"],
                         env=_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found["rl_tpu"].startswith(str(venv["site"])), (
        f"rl_tpu was imported from {found['rl_tpu']}, not the venv: the test checks the checkout")
    assert found["failed"] == {}
    assert found["outside"] == [], "imported from the checkout, not the installed package"
    modules = set(found["modules"])
    # The packages whose absence broke a plain install, and a launcher, are among them.
    assert {"rl_tpu.rewards.mix", "rl_tpu.recipes.rl", "launch.train"} <= modules
    assert len(modules) > 100


def test_a_smoke_run_from_the_installed_package(venv, tmp_path):
    """The quickstart's smoke cut to one GRPO step (rollouts, update, eval, checkpoint, HF
    export), launched from the venv: about 20 s of CPU, most of it compiling."""
    run = subprocess.run(
        [venv["python"], "-m", "launch.train",
         "--config", str(REPO / "configs" / "quickstart.py") + ":smoke",
         "--config.train.steps=1", "--config.sft.steps=0", "--config.log.plot=false",
         "--workdir", str(tmp_path / "run")],
        cwd=venv["cwd"], env=_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert any("eval/success" in m for m in metrics), metrics[-1]
    assert (tmp_path / "run" / "finished.json").is_file()
    assert (tmp_path / "run" / "final_hf" / "config.json").is_file()
