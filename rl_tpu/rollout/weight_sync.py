"""`DiskWeightSync`: serve the trainer's params on SGLang(-compatible) servers, through disk.

The only weight path open to a JAX trainer (SGLang's tensor and NCCL endpoints work only
between GPUs of one host): the params are exported with `hf.save` to `weights_dir/<version>`
(a directory every server can read), then each server loads it with
`POST /update_weights_from_disk {model_path, weight_version, flush_cache}`, and `GET
/model_info` must then report the version.

SGLang re-reads neither config nor tokenizer and crashes on a shape mismatch, so before any of
that two checks run: the params against the trainer's `ModelConfig` (a wrong pytree would
export a wrong checkpoint), and the exported tensor shapes against the ones each server serves,
read once, at first contact, from the config.json of the `model_path` that `GET /model_info`
names (or of `served_model_path` when that path is not readable here, e.g. a hub id). Older
exports (dirs that carry `EXPORT_MARKER`) are deleted after a successful update; anything else
in `weights_dir` is left alone.

Multi-host: every process calls `update`; process 0 alone writes, checks shapes and talks to
the servers. Given each host's own copy (`parallel.host_copies`, as the trainer passes), the
other processes return at once, touching neither disk nor host memory; given global arrays,
every process takes part in the export's gathers.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import re
import shutil
from typing import Optional

import jax

from rl_tpu.models import hf
from rl_tpu.models.transformer import ModelConfig
from rl_tpu.rollout.engine import RolloutError
from rl_tpu.rollout.http_transport import HttpTransport, error_message

EXPORT_MARKER = ".rl_tpu_weight_export"  # marks dirs update wrote (and may delete)
_VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def dims(spec: str, cfg: ModelConfig) -> tuple[int, ...]:
    """A WEIGHT_TABLE dims spec (comma-separated products of shape letters) as a shape."""
    size = {"D": cfg.hidden_size, "N": cfg.num_heads, "K": cfg.num_kv_heads,
            "H": cfg.head_dim, "F": cfg.intermediate_size, "V": cfg.vocab_size}
    return tuple(math.prod(size[c] for c in part) for part in spec.split(","))


def tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for every tensor a checkpoint of `cfg` holds."""
    return {name: dims(rule.hf_dims, cfg) for name, (rule, _) in hf.expected_tensors(cfg).items()}


def shape_mismatches(ours: dict, served: dict, limit: int = 6) -> list[str]:
    """Human-readable differences between two name -> shape maps (empty when they agree)."""
    problems = []
    for name in sorted(set(ours) | set(served)):
        if name not in served:
            problems.append(f"{name!r} is exported but not served")
        elif name not in ours:
            problems.append(f"{name!r} is served but not exported")
        elif tuple(ours[name]) != tuple(served[name]):
            problems.append(f"{name!r} is {list(ours[name])} here, {list(served[name])} served")
    if len(problems) > limit:
        problems = problems[:limit] + [f"and {len(problems) - limit} more"]
    return problems


def params_mismatches(cfg: ModelConfig, params) -> list[str]:
    """Where the params pytree disagrees with what `cfg` implies (empty when it agrees)."""
    shapes = {tuple(getattr(k, "key", k) for k in kp): tuple(v.shape)
              for kp, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    expected = {}
    for rule in hf.active_rules(cfg):
        shape = dims(rule.our_dims, cfg)
        parts = tuple(rule.path.split("/"))
        if not rule.per_layer:
            expected[parts] = shape
        elif cfg.scan_layers:
            expected[("layers",) + parts] = (cfg.num_layers,) + shape
        else:
            for i in range(cfg.num_layers):
                expected[(f"layers_{i}",) + parts] = shape
    return [f"{'/'.join(k)} is {list(shapes[k]) if k in shapes else 'missing'}, the config "
            f"implies {list(v)}" for k, v in expected.items() if shapes.get(k) != v]


class DiskWeightSync:
    """Exports params to `weights_dir/<version>` and has every server of `transport` load them.

    Args:
      transport: the servers.
      weights_dir: directory, readable by every server, for exports (one subdir per version).
      model_config: the trainer's `ModelConfig` of the params `update` receives (may be set
        later, as an attribute, before the first `update`).
      tokenizer: optional; exports then carry its files, so the latest export is a complete
        model dir a restarted server can launch from.
      served_model_path: a local copy of the served model dir, for the shape check when the
        servers' `model_path` is not a directory readable here.
      export_dtype: dtype of exported weights (default: the config's param dtype).
      update_timeout_s: seconds one server may take to load new weights.
    """

    def __init__(self, transport: HttpTransport, *, weights_dir: Optional[str] = None,
                 model_config: Optional[ModelConfig] = None, tokenizer=None,
                 served_model_path: Optional[str] = None, export_dtype: Optional[str] = None,
                 update_timeout_s: float = 600.0):
        self.transport = transport
        self.weights_dir = weights_dir
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.served_model_path = served_model_path
        self.export_dtype = export_dtype
        self.update_timeout_s = float(update_timeout_s)
        self._served: dict[str, tuple[str, dict]] = {}  # url -> (model_path, name -> shape)

    def model_info(self, url: str) -> dict:
        """`GET /model_info` of one server (`model_path`, `weight_version`, ...)."""
        return self.transport.call("GET", "/model_info", urls=[url])[1]

    def served_shapes(self, url: str, info: Optional[dict] = None) -> tuple[str, dict]:
        """(model_path, HF tensor name -> shape) of what `url` serves; read at first contact
        and kept (a weight update cannot change shapes)."""
        if url not in self._served:
            info = info if info is not None else self.model_info(url)
            model_path = info.get("model_path")
            readable = model_path and os.path.isdir(model_path)
            local = model_path if readable else self.served_model_path
            if not local:
                raise RolloutError(
                    f"cannot check weight shapes before updating {url}: it serves "
                    f"{model_path!r}, which is not a directory here; pass served_model_path= "
                    "(a local copy of that model dir's config.json)", url)
            try:
                shapes = tensor_shapes(hf.read_config(local))
            except hf.CheckpointError as e:
                raise RolloutError(f"cannot check weight shapes before updating {url}: {e}",
                                   url) from e
            self._served[url] = (model_path or local, shapes)
        return self._served[url]

    def served_vocab_size(self) -> Optional[int]:
        """Rows of the embedding table of a server whose shapes were read, else None."""
        for _, shapes in self._served.values():
            if "model.embed_tokens.weight" in shapes:
                return shapes["model.embed_tokens.weight"][0]
        return None

    def update(self, params, version: str) -> None:
        """Exports `params` as `version` and has every server load them.

        Refuses (ValueError or RolloutError, before any request that could change a server)
        when the version cannot name a directory, the params do not match the config, or the
        export would not match the shapes a server serves."""
        version = str(version)
        if not _VERSION_RE.match(version):
            raise ValueError(f"weight version {version!r}: use letters, digits, '.', '_', '-' "
                             "(it names a directory)")
        if self.model_config is None or self.weights_dir is None:
            raise ValueError("update_weights needs SGLangEngine(model_config=..., weights_dir=...)"
                             ": the trainer's ModelConfig and a directory every server can read")
        cfg = self.model_config
        bad = params_mismatches(cfg, params)
        if bad:
            raise RolloutError("update_weights: params do not match model_config: " +
                               "; ".join(bad[:6]) + (f" and {len(bad) - 6} more" if len(bad) > 6
                                                     else ""))
        ours = tensor_shapes(cfg)
        writer = jax.process_index() == 0
        if writer:
            for url in self.transport.urls:
                model_path, served = self.served_shapes(url)
                problems = shape_mismatches(ours, served)
                if problems:
                    raise RolloutError(
                        f"refusing to update {url} to weight version {version!r}: the exported "
                        f"tensors do not match the served model ({model_path}): "
                        + "; ".join(problems) + ". Loading them would crash the server; "
                        "restart it with a model of the new shapes instead.", url)
        if not writer and all(getattr(x, "is_fully_addressable", True)
                              for x in jax.tree.leaves(params)):
            return  # this host's own copy (parallel.host_copies): process 0 exports its own
        path = os.path.abspath(os.path.join(self.weights_dir, version))
        os.makedirs(self.weights_dir, exist_ok=True)
        hf.save(path, cfg, params, tokenizer=self.tokenizer, dtype=self.export_dtype)
        if not writer:  # global params: every process gathers, process 0 writes and talks
            return
        open(os.path.join(path, EXPORT_MARKER), "w").close()
        body = {"model_path": path, "weight_version": version, "flush_cache": True}

        def push(url):
            reply = self.transport.call("POST", "/update_weights_from_disk", body, urls=[url],
                                        timeout=self.update_timeout_s)[1]
            if not (isinstance(reply, dict) and reply.get("success")):
                raise RolloutError(f"POST {url}/update_weights_from_disk ({path}) did not "
                                   f"succeed: {error_message(reply, b'')}", url)
            served = self.model_info(url).get("weight_version")
            if str(served) != version:
                raise RolloutError(f"{url} loaded {path} but reports weight_version "
                                   f"{served!r}, not {version!r}", url)

        urls = self.transport.urls
        with concurrent.futures.ThreadPoolExecutor(len(urls)) as pool:
            errors = [f.exception() for f in [pool.submit(push, u) for u in urls]]
        errors = [e for e in errors if e is not None]
        if errors:
            raise errors[0] if len(errors) == 1 else RolloutError(
                "update_weights failed on several servers: " + "; ".join(map(str, errors)))
        self._delete_old_exports(keep=path)

    def _delete_old_exports(self, keep: str) -> None:
        for name in os.listdir(self.weights_dir):
            old = os.path.join(self.weights_dir, name)
            if old != keep and os.path.isfile(os.path.join(old, EXPORT_MARKER)):
                shutil.rmtree(old, ignore_errors=True)
