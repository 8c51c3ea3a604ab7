"""The notebooks in notebooks/: their shape (fast), and each one run top to bottom in a Jupyter
kernel at its smoke sizes, `RL_TPU_SMOKE=1` (slow).

The kernel is a subprocess with this process's environment (tests/conftest.py's compilation
cache, XLA flags and thread pool), except one CPU device instead of the 8 fake ones: the
notebooks' tiny programs compile and run fastest unsharded (about 30 s against 50 s for the
quickstart's), and they pin no mesh. The notebooks run in a temporary directory (their work
directories are relative, `runs/...`) and import this checkout's rl_tpu (PYTHONPATH).
"""

import json
import os
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
NAMES = ("quickstart", "custom_env", "agent_rl", "algorithms", "real_model")
WITH_OUTPUTS = ("quickstart",)  # saved executed (full size), so it reads well on GitHub
CELL_TIMEOUT_S = 300  # a smoke cell takes well under a minute; a hang fails with its cell


def _path(name: str) -> pathlib.Path:
    return NOTEBOOK_DIR / f"{name}.ipynb"


def _cells(name: str) -> list[dict]:
    with open(_path(name), encoding="utf-8") as f:
        return json.load(f)["cells"]


def _source(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def test_every_notebook_is_tested():
    assert sorted(p.stem for p in NOTEBOOK_DIR.glob("*.ipynb")) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_notebook_shape(name):
    with open(_path(name), encoding="utf-8") as f:
        nb = json.load(f)  # valid JSON
    assert nb["nbformat"] == 4
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    try:
        import nbformat
    except ImportError:
        pass
    else:
        nbformat.validate(nbformat.reads(json.dumps(nb), as_version=4))
    cells = nb["cells"]
    code = [i for i, c in enumerate(cells) if c["cell_type"] == "code"]
    assert code, f"{name} has no code"
    # The first code cell installs rl_tpu in Colab and nothing elsewhere.
    install = _source(cells[code[0]])
    assert re.search(r'^REPO_URL = "https://', install, re.M), install
    assert 'if "google.colab" in sys.modules:' in install
    assert '"pip", "install"' in install and "REPO_URL" in install.split("google.colab")[1]
    # Every code step is explained by the markdown cell before it.
    for i in code:
        assert i > 0 and cells[i - 1]["cell_type"] == "markdown" and _source(cells[i - 1]).strip(), (
            f"{name}: code cell {i} ({_source(cells[i])[:60]!r}) has no markdown cell before it")
    for i in code:  # plain Python (no IPython magics), so every cell also runs as a script
        compile(_source(cells[i]), f"{name}.ipynb cell {i}", "exec")
    assert "RL_TPU_SMOKE" in "".join(_source(cells[i]) for i in code)
    outputs = [o for i in code for o in cells[i].get("outputs", [])]
    if name not in WITH_OUTPUTS:
        assert not outputs and all(cells[i].get("execution_count") is None for i in code), (
            f"{name} is saved with outputs; clear them")
        return
    assert not [o for o in outputs if o["output_type"] == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{name}: no curves saved"
    text = json.dumps(outputs)
    assert len(text) < 500_000, f"{name}'s outputs are {len(text)} characters"
    for ugly in ("/tmp/", "/root/", "site-packages", "\\r"):
        assert ugly not in text, f"{name}'s saved outputs contain {ugly!r}"


@pytest.mark.parametrize("smoke", [False, True])
def test_quickstart_notebook_config_is_configs_quickstart(smoke, monkeypatch):
    """The notebook builds the quickstart's config in a cell (a pip-installed rl_tpu has no
    configs/); it must stay configs/quickstart.py's, full and smoke."""
    import importlib.util

    cell = next(_source(c) for c in _cells("quickstart")
                if c["cell_type"] == "code" and "config = largest_task(" in _source(c))
    namespace = {"SMOKE": smoke}
    exec(compile(cell, "quickstart.ipynb config cell", "exec"), namespace)
    spec = importlib.util.spec_from_file_location("quickstart_config",
                                                  ROOT / "configs" / "quickstart.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    expected = module.get_config("smoke" if smoke else "")
    assert namespace["config"].to_dict() == expected.to_dict()


def test_real_model_notebook_is_configs_real_gsm_at_its_own_sizes():
    """The real-model notebook builds its config in a cell (a pip-installed rl_tpu has no
    configs/): the task, prompt, sampling and algorithm must stay configs/real_gsm.py's; only
    the sizes (steps, problems a step, eval) and the learning rate are the notebook's."""
    import importlib.util

    cell = next(_source(c) for c in _cells("real_model")
                if c["cell_type"] == "code" and "config = base_config(" in _source(c))
    namespace = {"SMOKE": False, "model_path": "/models/smollm2"}
    exec(compile(cell, "real_model.ipynb config cell", "exec"), namespace)
    spec = importlib.util.spec_from_file_location("real_gsm_config",
                                                  ROOT / "configs" / "real_gsm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    expected, got = module.get_config(""), namespace["config"]
    for block in ("env", "rollout", "algo", "sft"):
        assert got[block].to_dict() == expected[block].to_dict(), block
    assert got.train.samples_per_task == expected.train.samples_per_task
    assert got.train.length_buckets == expected.train.length_buckets
    assert got.model.path == "/models/smollm2" and got.model.lora.rank == 0
    # micro-batches of the same 8 replies
    assert (got.train.tasks_per_step * got.train.samples_per_task // got.train.micro_batches
            == expected.train.tasks_per_step * expected.train.samples_per_task
            // expected.train.micro_batches)


def _kernel_env() -> dict:
    env = dict(os.environ)
    env["RL_TPU_SMOKE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                              env.get("XLA_FLAGS", "")).strip()
    env.pop("MPLBACKEND", None)  # the kernel's own inline backend
    return env


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_at_smoke_size(name, tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    if name == "agent_rl":
        pytest.importorskip("minigrid")
    nb = nbformat.read(_path(name), as_version=4)
    for cell in nb.cells:  # run it as a fresh notebook, whatever was saved
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=CELL_TIMEOUT_S,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute(env=_kernel_env())  # a failing cell raises CellExecutionError, quoting it
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)  # every one draws curves
    assert (tmp_path / "runs").is_dir()  # the work directories went to the kernel's cwd
