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

LoRA (`model_config.lora` set): only the adapters move. `update` writes them as a PEFT dir
(`peft_format.save_adapter`: adapter_config.json + adapter_model.safetensors) to
`weights_dir/adapter_<version>` and has each server load it under the name
`<run id>-<version>` with `POST /load_lora_adapter {lora_name, lora_path}`; the base the servers
launched with stays. Requests then pick an adapter per request (`lora_path` of `/generate`, the
engine's job), so several versions serve side by side: `AdapterVersions` keeps at most
`keep_adapters` of them, and unloads (`POST /unload_lora_adapter`) and deletes the oldest beyond
that once no request of the engine's, nor of another host's, may still use it. `params` may be
the whole model or the adapters alone (what the trainer sends once the base is frozen); the
base is never read. On several hosts process 0 alone writes, loads and unloads; the others
name a version once process 0 has loaded it. adapter_versions.py has the names (a resumed run
unloads what its earlier life left on a server that stayed up) and the hosts' agreement.

What SGLang 0.5.23 needs for that, read in its source (sglang/srt/...): the launch flags
`--enable-lora --max-lora-rank R --lora-target-modules all` (or the modules), and on a CPU
server `--lora-backend torch_native`, the one backend in plain torch (lora/backend/
lora_registry.py: csgmv, the default, triton and triton_v2 run triton kernels; ascend needs an
NPU), and pinned host memory turned off (tests/rollout/test_sglang_lora.py: SGLang pins it
unconditionally, which torch refuses without a GPU). Its scaling is `lora_alpha / r` whatever
`use_rslora` says (lora/lora.py l. 71), so an rsLoRA adapter is exported with `lora_alpha`
multiplied by sqrt(r) and `use_rslora` false, the same scale. It stacks q/k/v into one adapter
from q_proj's and v_proj's (k_proj may be missing: zeros) and gate/up from gate_proj's (zeros
for a missing up_proj): lora/lora.py `normalize_qkv_proj`, `normalize_gate_up_proj`; other
target sets are refused here. It unloads an adapter only after its running requests end
(`lora_registry.wait_for_unload`), and a request naming an unloaded adapter it once loaded
reloads it from its path (`TokenizerManager._resolve_lora_path`): hence the engine never
unloads a version a request of its own still carries, and deletes a dir only once unloaded.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import logging
import math
import os
import re
import shutil
from typing import Optional

import jax
import numpy as np

from rl_tpu import parallel
from rl_tpu.models import hf, lora, peft_format
from rl_tpu.models.transformer import ModelConfig, Transformer
from rl_tpu.rollout.adapter_versions import (AdapterVersions, adapter_name, earlier_life,
                                             run_id_of)
from rl_tpu.core.engine import RolloutError
from rl_tpu.rollout.http_transport import HttpTransport, error_message

log = logging.getLogger(__name__)

EXPORT_MARKER = ".rl_tpu_weight_export"  # marks dirs update wrote (and may delete)
ADAPTER_PREFIX = "adapter_"  # weights_dir/adapter_<version>: an adapter-only export
_VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# SGLang's LoRA module of each projection rl_tpu adapts: it fuses q/k/v and gate/up
# (sglang/srt/lora/utils.py, get_normalized_target_modules).
SGLANG_LORA_MODULES = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                       "o_proj": "o_proj", "gate_proj": "gate_up_proj",
                       "up_proj": "gate_up_proj", "down_proj": "down_proj"}


def tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for every tensor a checkpoint of `cfg` holds."""
    return {name: hf.table_dims(rule.hf_dims, cfg)
            for name, (rule, _) in hf.expected_tensors(cfg).items()}


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
        shape = hf.our_shape(rule, cfg)
        parts = tuple(rule.path.split("/"))
        if not rule.per_layer:
            expected[parts] = shape
        elif cfg.scan_layers:
            expected[("layers",) + parts] = (cfg.num_layers,) + shape
        else:
            for i in hf.rule_layers(rule, cfg):
                expected[(f"layers_{i}",) + parts] = shape
    return [f"{'/'.join(k)} is {list(shapes[k]) if k in shapes else 'missing'}, the config "
            f"implies {list(v)}" for k, v in expected.items() if shapes.get(k) != v]


def dir_bytes(path: str) -> int:
    """Bytes of the files directly in `path` (what one export wrote)."""
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
               if os.path.isfile(os.path.join(path, f)))


# ----------------------------------------------------------------------------- LoRA


def lora_launch_flags(rank: int) -> str:
    """The SGLang launch flags that serve adapters of `rank` (module doc)."""
    return (f"--enable-lora --max-lora-rank {rank} --lora-target-modules all (and "
            "--lora-backend torch_native on a CPU server)")


def sglang_target_problems(targets) -> list[str]:
    """Why SGLang 0.5.23 would not serve adapters on `targets` as rl_tpu computes them (empty
    when it would): it builds its fused q/k/v adapter from q_proj's and v_proj's, and its
    gate/up one from gate_proj's (module doc)."""
    targets, problems = set(targets), []
    if targets & {"q_proj", "k_proj", "v_proj"} and not {"q_proj", "v_proj"} <= targets:
        problems.append("SGLang reads a q/k/v adapter only with both q_proj and v_proj "
                        "targeted (k_proj may be left out)")
    if "up_proj" in targets and "gate_proj" not in targets:
        problems.append("SGLang reads an up_proj adapter only beside a gate_proj one")
    return problems


def lora_server_problem(info: dict, cfg: lora.LoraConfig, keep: int) -> Optional[str]:
    """What in a server's `/server_info` keeps it from serving these adapters (None when
    nothing does, or when the reply does not say: a load then tells)."""
    if "enable_lora" not in info:
        return None
    if not info["enable_lora"]:
        return "it was launched without LoRA"
    max_rank = info.get("max_lora_rank")
    if max_rank is not None and int(max_rank) < cfg.rank:
        return f"it was launched with --max-lora-rank {max_rank}, below the adapters' {cfg.rank}"
    modules = info.get("lora_target_modules") or []
    if modules and "all" not in modules:
        served = {SGLANG_LORA_MODULES.get(m, m) for m in modules}
        missing = sorted({SGLANG_LORA_MODULES[t] for t in cfg.targets} - served)
        if missing:
            return (f"its --lora-target-modules {sorted(modules)} leave out {missing} (the "
                    f"adapters target {list(cfg.targets)})")
    most = info.get("max_loaded_loras")
    # a new version loads before the oldest unloads: keep + 1 at once
    if most is not None and int(most) < keep + 1:
        return (f"it holds at most {most} adapters (--max-loaded-loras) but the engine keeps "
                f"{keep} loaded (keep_adapters) and loads the next before it unloads the "
                f"oldest: launch it with --max-loaded-loras >= {keep + 1} or without that flag")
    return None


@functools.lru_cache(maxsize=8)
def _abstract_params(cfg: ModelConfig) -> dict:
    """Param path -> shape of `Transformer(cfg)` (traced, never allocated)."""
    abstract, _ = parallel.logical_axes_of(Transformer(cfg), np.zeros((1, 1), np.int32))
    return {tuple(k.key for k in kp): tuple(v.shape)
            for kp, v in jax.tree_util.tree_flatten_with_path(abstract)[0]}


def adapter_mismatches(cfg: ModelConfig, params) -> list[str]:
    """Where the adapters of `params` disagree with those `cfg.lora` implies (empty when
    they agree; the base is not looked at)."""
    want = {p: s for p, s in _abstract_params(cfg).items() if lora.is_adapter_path(p)}
    got = {tuple(getattr(k, "key", k) for k in kp): tuple(np.shape(v))
           for kp, v in jax.tree_util.tree_flatten_with_path(params)[0]
           if lora.is_adapter_path(tuple(getattr(k, "key", k) for k in kp))}
    return [f"{'/'.join(p)} is {list(got[p]) if p in got else 'missing'}, the config implies "
            f"{list(s)}" for p, s in want.items() if got.get(p) != s] + [
        f"{'/'.join(p)} is not an adapter of the config" for p in got if p not in want]


def sglang_scale_config(path: str, cfg: lora.LoraConfig) -> None:
    """Rewrites an rsLoRA adapter's adapter_config.json for SGLang, which scales by
    lora_alpha / r and ignores use_rslora: lora_alpha * sqrt(r) / r = lora_alpha / sqrt(r)."""
    if not cfg.rslora:
        return
    file = os.path.join(path, peft_format.CONFIG_FILE)
    with open(file) as f:
        config = json.load(f)
    config.update(lora_alpha=cfg.alpha * math.sqrt(cfg.rank), use_rslora=False)
    with open(file, "w") as f:
        json.dump(config, f, indent=2)


class DiskWeightSync:
    """Exports params to `weights_dir/<version>` and has every server of `transport` load them
    (with LoRA, the adapters to `weights_dir/adapter_<version>`: module doc).

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
      keep_adapters: with LoRA, how many adapter versions stay loaded (an async run passes
        max_staleness + 1, the versions its requests may still carry).
      run_id: with LoRA, the run's id in its adapters' names (default: `weights_dir`'s,
        `adapter_versions.run_id_of`); every host of a job must pass the same.
    """

    def __init__(self, transport: HttpTransport, *, weights_dir: Optional[str] = None,
                 model_config: Optional[ModelConfig] = None, tokenizer=None,
                 served_model_path: Optional[str] = None, export_dtype: Optional[str] = None,
                 update_timeout_s: float = 600.0, keep_adapters: int = 2,
                 run_id: Optional[str] = None):
        self.transport = transport
        self.weights_dir = weights_dir
        # names the adapters on the servers (adapter_versions.py): the same on every host
        self.run_id = run_id or (run_id_of(weights_dir) if weights_dir else "")
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.served_model_path = served_model_path
        self.export_dtype = export_dtype
        self.update_timeout_s = float(update_timeout_s)
        self._served: dict[str, tuple[str, dict]] = {}  # url -> (model_path, name -> shape)
        self.adapters = AdapterVersions(keep_adapters)
        self._lora_ready: set[str] = set()  # servers whose launch flags serve the adapters
        self._cleared: set[str] = set()  # servers an earlier life's adapters were unloaded from
        self.last_sync_bytes = 0  # bytes of the files the last update wrote
        self.total_sync_bytes = 0
        self.syncs = 0

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
        """Exports `params` as `version` and has every server load them: the whole model, or
        with `model_config.lora` the adapters alone (`_update_adapters`). Sets
        `last_sync_bytes` to the bytes of the files written (0 on other hosts).

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
        self.last_sync_bytes = 0
        if lora.is_on(self.model_config):
            return self._update_adapters(params, version)
        cfg = self.model_config
        _refuse_mismatches("params do not match model_config", params_mismatches(cfg, params))
        writer = jax.process_index() == 0
        if writer:
            self._check_served_shapes(version)
        if not writer and _host_copy(params):
            return  # this host's own copy (parallel.host_copies): process 0 exports its own
        path = os.path.abspath(os.path.join(self.weights_dir, version))
        os.makedirs(self.weights_dir, exist_ok=True)
        hf.save(path, cfg, params, tokenizer=self.tokenizer, dtype=self.export_dtype)
        if not writer:  # global params: every process gathers, process 0 writes and talks
            return
        open(os.path.join(path, EXPORT_MARKER), "w").close()
        self._count(dir_bytes(path))
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

        failed = self._on_every_server(push)
        if failed:
            raise _one_error(failed, "update_weights")
        self._delete_old_exports(keep={path})

    def _count(self, nbytes: int) -> None:
        self.last_sync_bytes = int(nbytes)
        self.total_sync_bytes += int(nbytes)
        self.syncs += 1

    def _check_served_shapes(self, version: str) -> None:
        """RolloutError unless every server serves a model of `model_config`'s shapes."""
        ours = tensor_shapes(self.model_config)
        for url in self.transport.urls:
            model_path, served = self.served_shapes(url)
            problems = shape_mismatches(ours, served)
            if problems:
                raise RolloutError(
                    f"refusing to update {url} to weight version {version!r}: the exported "
                    f"tensors do not match the served model ({model_path}): "
                    + "; ".join(problems) + ". Loading them would crash the server; "
                    "restart it with a model of the new shapes instead.", url)

    def _on_every_server(self, fn, urls=None) -> dict[str, Exception]:
        """Runs fn(url) for every server at once; url -> the exception of those that failed."""
        urls = list(self.transport.urls if urls is None else urls)
        if not urls:
            return {}
        with concurrent.futures.ThreadPoolExecutor(len(urls)) as pool:
            futures = {u: pool.submit(fn, u) for u in urls}
        return {u: f.exception() for u, f in futures.items() if f.exception() is not None}

    def _delete_old_exports(self, keep: set) -> None:
        for name in os.listdir(self.weights_dir):
            old = os.path.join(self.weights_dir, name)
            if old not in keep and os.path.isfile(os.path.join(old, EXPORT_MARKER)):
                shutil.rmtree(old, ignore_errors=True)

    # -- LoRA: adapters alone ---------------------------------------------------------------

    def adapter_path(self, version: str) -> str:
        return os.path.abspath(os.path.join(self.weights_dir, ADAPTER_PREFIX + version))

    def adapter_name(self, version: str) -> str:
        """The name the servers hold `version` under (adapter_versions.py)."""
        return adapter_name(self.run_id, version)

    def served_adapters(self, url: str) -> dict[str, str]:
        """{name: path} of the adapters `url` holds: rl_tpu's server says in `/server_info`
        (`loaded_adapters`), SGLang lists them in `GET /v1/models` (the entries with a parent:
        id the name, root the path)."""
        info = self.server_info(url)
        if isinstance(info.get("loaded_adapters"), dict):
            return dict(info["loaded_adapters"])
        try:
            reply = self.transport.call("GET", "/v1/models", urls=[url])[1]
        except RolloutError as e:
            if e.status != 404:
                raise
            log.warning("%s lists no adapters (GET /v1/models: 404): adapters an earlier life "
                        "of this run left there stay loaded", url)
            return {}
        models = reply.get("data", []) if isinstance(reply, dict) else []
        return {m["id"]: m.get("root", "") for m in models
                if isinstance(m, dict) and m.get("parent") and "id" in m}

    def _unload_earlier_life(self, url: str) -> None:
        """At first contact with `url`: unloads the adapters an earlier life of this run
        loaded there (its names carry this run's id; a resumed run would load the same names
        again, which SGLang refuses), before this life loads any."""
        if url in self._cleared:
            return
        left = earlier_life(self.run_id, self.served_adapters(url))
        if left:
            log.info("unloading %d adapter(s) an earlier life of this run left on %s: %s",
                     len(left), url, left)
        for name in left:
            self._unload(url, name)
        self._cleared.add(url)

    def _update_adapters(self, params, version: str) -> None:
        """Writes the adapters of `params` as `version` and has every server load them
        (module doc); the versions past `keep_adapters` that no request carries are then
        unloaded. A load that fails on some server is undone on the others, so the servers
        keep serving the same versions."""
        cfg = self.model_config
        problems = sglang_target_problems(cfg.lora.targets)
        if problems:
            raise ValueError(f"lora targets {list(cfg.lora.targets)}: " + "; ".join(problems)
                             + ". Train with targets SGLang reads (e.g. all seven, or q_proj and "
                             "v_proj), or sync full weights (a ModelConfig without lora, merged "
                             "params: lora.merge)")
        if version in self.adapters.loaded():
            raise ValueError(f"adapter version {version!r} is loaded on the servers already; "
                             "give every update a new version")
        if not lora.has_adapters(params):
            raise RolloutError("update_weights: model_config.lora is set but the params hold no "
                               "adapters (lora_a / lora_b): pass the trainer's params or its "
                               "adapters (lora.adapters(params))")
        _refuse_mismatches("adapters do not match model_config.lora",
                           adapter_mismatches(cfg, params))
        writer = jax.process_index() == 0
        if writer:
            self._check_served_shapes(version)  # the adapters fit only the base they trained on
            for url in self.transport.urls:
                self.check_lora_server(url)
        if not writer and _host_copy(params):
            # Process 0 loads it; this host's requests name it once the barrier after the load
            # says it is there (`confirm_loaded`, from core/shared_weights.py).
            self.adapters.announce(version)
            return
        path = self.adapter_path(version)
        os.makedirs(self.weights_dir, exist_ok=True)
        base = self.served_shapes(self.transport.urls[0])[0] if writer else ""
        peft_format.save_adapter(path, cfg, params, base_model_path=base)
        if not writer:
            self.adapters.announce(version)
            return
        failed = self._on_every_server(self._unload_earlier_life)
        if failed:
            raise _one_error(failed, "update_weights (unloading an earlier life's adapters)")
        sglang_scale_config(path, cfg.lora)
        open(os.path.join(path, EXPORT_MARKER), "w").close()
        nbytes = dir_bytes(path)
        name = self.adapter_name(version)
        body = {"lora_name": name, "lora_path": path}
        failed = self._on_every_server(lambda url: self._load_adapter(url, body))
        if failed:
            loaded = [u for u in self.transport.urls if u not in failed]
            stuck = self._on_every_server(lambda url: self._unload(url, name), urls=loaded)
            if stuck:  # harmless but for memory: requests never name this version
                log.warning("adapter version %r stays loaded on %s after a failed update: %s",
                            version, sorted(stuck), "; ".join(map(str, stuck.values())))
            shutil.rmtree(path, ignore_errors=True)
            raise _one_error(failed, "update_weights (adapter load)")
        self._count(nbytes)
        self.retire(self.adapters.add(version))
        self._delete_old_exports(keep={self.adapter_path(v) for v in self.adapters.loaded()})

    def server_info(self, url: str) -> dict:
        """`GET /server_info` of one server (its launch arguments); {} when it has none."""
        for route in ("/server_info", "/get_server_info"):  # the second: older SGLang
            try:
                reply = self.transport.call("GET", route, urls=[url])[1]
                return reply if isinstance(reply, dict) else {}
            except RolloutError as e:
                if e.status != 404:
                    raise
        return {}

    def check_lora_server(self, url: str) -> None:
        """RolloutError naming the launch flags to add when `url` cannot serve the adapters
        (read once per server: launch arguments do not change)."""
        if url in self._lora_ready:
            return
        cfg = self.model_config.lora
        problem = lora_server_problem(self.server_info(url), cfg, self.adapters.keep)
        if problem:
            raise RolloutError(
                f"{url} cannot serve LoRA adapters: {problem}. Adapter-only weight sync needs "
                f"SGLang launched with {lora_launch_flags(cfg.rank)}; or sync full weights "
                "(a ModelConfig without lora, merged params: lora.merge).", url)
        self._lora_ready.add(url)

    def _load_adapter(self, url: str, body: dict) -> None:
        what = f"POST {url}/load_lora_adapter ({body['lora_path']} as {body['lora_name']!r})"
        try:
            reply = self.transport.call("POST", "/load_lora_adapter", body, urls=[url],
                                        timeout=self.update_timeout_s)[1]
        except RolloutError as e:
            if e.status == 404 or "not enabled" in str(e):
                raise RolloutError(
                    f"{e}. {url} does not load LoRA adapters: launch SGLang with "
                    f"{lora_launch_flags(self.model_config.lora.rank)}", url, e.status) from e
            raise
        if not (isinstance(reply, dict) and reply.get("success")):
            raise RolloutError(f"{what} did not succeed: "
                               f"{(reply or {}).get('error_message') or error_message(reply, b'')}",
                               url)

    def _unload(self, url: str, name: str) -> None:
        """Unloads the adapter `name` (as the server holds it: `adapter_name`) from `url`."""
        reply = self.transport.call("POST", "/unload_lora_adapter", {"lora_name": name},
                                    urls=[url], timeout=self.update_timeout_s)[1]
        if not (isinstance(reply, dict) and reply.get("success")):
            raise RolloutError(f"POST {url}/unload_lora_adapter ({name!r}) did not succeed: "
                               f"{(reply or {}).get('error_message') or error_message(reply, b'')}",
                               url)

    def confirm_loaded(self, version: str) -> None:
        """After the barrier every host passes once process 0's load of `version` returned
        (core.shared_weights.wait_for_shared_weights): other hosts' requests may name it now."""
        self.retire(self.adapters.confirm(str(version)))

    def hold_for_other_hosts(self, oldest: list) -> None:
        """Process 0, given the oldest version each other host may name until the next
        barrier (their `adapters.oldest_named()`): keeps those loaded, unloads what is free."""
        self.retire(self.adapters.hold(oldest))

    def retire(self, versions: list[str]) -> None:
        """Unloads `versions` (as AdapterVersions handed them out) from every server and
        deletes their dirs; one that fails stays loaded, tried again at the next retire. On
        other hosts than process 0 (which alone loads and unloads) only forgets them; process
        0 hands out none another host may still name (`hold_for_other_hosts`)."""
        if jax.process_index() != 0:
            for version in versions:
                self.adapters.unloaded(version)
            return
        for version in versions:
            name = self.adapter_name(version)
            failed = self._on_every_server(lambda url, n=name: self._unload(url, n))
            if failed:
                log.warning("adapter version %r stays loaded (tried again later): %s", version,
                            "; ".join(map(str, failed.values())))
                self.adapters.unload_failed(version)
                continue
            self.adapters.unloaded(version)
            shutil.rmtree(self.adapter_path(version), ignore_errors=True)


def _refuse_mismatches(what: str, bad: list[str]) -> None:
    """RolloutError naming the first six mismatches (and how many more), if there are any."""
    if bad:
        more = f" and {len(bad) - 6} more" if len(bad) > 6 else ""
        raise RolloutError(f"update_weights: {what}: " + "; ".join(bad[:6]) + more)


def _host_copy(params) -> bool:
    """True for arrays this process holds whole (parallel.host_copies, numpy)."""
    return all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(params))


def _one_error(failed: dict[str, Exception], what: str) -> Exception:
    errors = list(failed.values())
    return errors[0] if len(errors) == 1 else RolloutError(
        f"{what} failed on {len(errors)} servers: " + "; ".join(map(str, errors)))
