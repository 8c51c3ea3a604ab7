"""LoRA adapters <-> PEFT adapter directories (adapter_config.json + adapter_model.safetensors).

The format is what `peft.PeftModel.save_pretrained` writes for a LoRA on a transformers causal
LM, and what `PeftModel.from_pretrained`, vLLM and SGLang read:

  * adapter_config.json: `peft_type: "LORA"`, `r`, `lora_alpha`, `lora_dropout`,
    `use_rslora`, `target_modules` (module names; PEFT writes `"all-linear"` expanded into the
    qualified name of every projection), `init_lora_weights`, plus feature switches
    (`use_dora`, `bias`, `modules_to_save`, `rank_pattern`...) this module refuses when set,
    since rl_tpu's LoRA (lora.py) computes none of them.
  * adapter_model.safetensors: per adapted module `base_model.model.<module>.lora_A.weight`
    [r, in] and `...lora_B.weight` [out, r] (torch.nn.Linear layout: [out, in]), e.g.
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`. No adapter name in the
    key: PEFT strips it on save and adds it back on load.

Layout mapping: our A is [in..., r] and B [r, out...] with the kernel's own split dims (q_proj
A [D, r], B [r, N, H]; o_proj A [N, H, r], B [r, D]). HF's flattened `in`/`out` are those dims
in the same row-major order (the same fact the kernel rules of hf.WEIGHT_TABLE rest on: o_proj
weight [D, N*H] <-> kernel [N, H, D]), so PEFT's A is ours flattened to [in, r] and
transposed, and PEFT's B ours flattened to [r, out] and transposed. The module names come from
hf.WEIGHT_TABLE (a kernel rule `attn/q_proj/kernel` <-> `model.layers.{i}.self_attn.q_proj.
weight`), so the two formats cannot disagree on where a projection lives. With
`scan_layers=True` one stacked leaf [L, ...] holds every layer's adapter: layer i is index i.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from safetensors.numpy import save_file

from rl_tpu import parallel
from rl_tpu.models import hf, lora
from rl_tpu.models.transformer import ModelConfig, Transformer

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PeftModel.base_model is PEFT's LoraModel, whose .model is the HF LM whose names follow.
PREFIX = "base_model.model."
PEFT_KEYS = {"lora_a": "lora_A", "lora_b": "lora_B"}


class AdapterError(hf.CheckpointError):
    """A PEFT adapter dir that cannot be loaded as asked; the message says what and where."""


# ----------------------------------------------------------------------------- names, layouts


def adapted_modules(cfg: ModelConfig) -> dict[tuple[str, ...], tuple[str, ...]]:
    """Our module path of every projection `cfg.lora` targets -> its HF module name per layer
    the path holds (one name; L names for a stacked `layers/...` path), from hf's table."""
    out = {}
    for rule in hf.active_rules(cfg):
        module = tuple(rule.path.split("/")[:-1])
        if not (rule.per_layer and rule.path.endswith("/kernel")
                and module[-1] in cfg.lora.targets):
            continue
        hf_module = rule.hf[:-len(".weight")]
        if cfg.scan_layers:
            out[("layers",) + module] = tuple(hf_module.format(i=i)
                                              for i in range(cfg.num_layers))
        else:
            for i in range(cfg.num_layers):
                out[(f"layers_{i}",) + module] = (hf_module.format(i=i),)
    return out


def peft_name(hf_module: str, key: str) -> str:
    """PEFT's tensor name of adapter `key` (lora_a | lora_b) of an HF module."""
    return f"{PREFIX}{hf_module}.{PEFT_KEYS[key]}.weight"


def to_peft(x: np.ndarray, key: str) -> np.ndarray:
    """One layer's A [in..., r] -> [r, in], or B [r, out...] -> [out, r]."""
    flat = x.reshape(-1, x.shape[-1]) if key == "lora_a" else x.reshape(x.shape[0], -1)
    return np.ascontiguousarray(flat.T)


def peft_shape(shape: tuple[int, ...], key: str) -> tuple[int, ...]:
    """The PEFT shape of one layer's adapter of our `shape`."""
    if key == "lora_a":
        return (shape[-1], math.prod(shape[:-1]))
    return (math.prod(shape[1:]), shape[0])


def from_peft(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """PEFT's [r, in] / [out, r] back to our A [in..., r] / B [r, out...]: both a transpose
    of the flat matrix and a split of the flat dim."""
    return np.asarray(x, np.float32).T.reshape(shape)


def adapter_bytes(params) -> int:
    """Bytes the adapters of `params` take as float32 (what save_adapter writes)."""
    return 4 * lora.adapter_count(params)


def _few(names, limit=6) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


# ----------------------------------------------------------------------------- save


def peft_config(cfg: lora.LoraConfig, base_model_path: str = "") -> dict[str, Any]:
    """adapter_config.json for `cfg`: the math fields, and every feature switch PEFT reads
    spelled out as off, so readers (PEFT, vLLM, SGLang) need no defaults of their own."""
    alpha = int(cfg.alpha) if float(cfg.alpha).is_integer() else cfg.alpha
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_path or None,
        "r": cfg.rank, "lora_alpha": alpha, "lora_dropout": cfg.dropout,
        "use_rslora": cfg.rslora,
        "target_modules": [t for t in lora.TARGETS if t in cfg.targets],
        "init_lora_weights": True if cfg.init == "default" else cfg.init,
        "bias": "none", "fan_in_fan_out": False, "use_dora": False, "lora_bias": False,
        "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {}, "inference_mode": True, "revision": None,
    }


def _check_params(cfg: ModelConfig, flat: dict, modules: dict) -> None:
    """ValueError unless `flat` holds A and B of exactly the modules cfg adapts (the kernels
    need not be there: a trainer's sync sends the adapters alone)."""
    wanted = {m + (k,) for m in modules for k in lora.ADAPTER_KEYS}
    missing = sorted("/".join(p) for p in wanted - set(flat))
    extra = sorted("/".join(p) for p in flat if lora.is_adapter_path(p) and p not in wanted)
    if missing or extra:
        raise ValueError(
            f"params do not match the config (lora targets {list(cfg.lora.targets)}, "
            f"scan_layers={cfg.scan_layers}): "
            + "; ".join(f"{what} {_few(n)}" for what, n in (("missing", missing),
                                                              ("adapters not targeted", extra))
                        if n))


def save_adapter(path: str, cfg: ModelConfig, params, base_model_path: str = "") -> int:
    """Writes the adapters of `params` as a PEFT LoRA dir at `path`; returns the bytes of
    tensor data written (float32), on every process.

    Every process must call this (sharded adapters are gathered collectively, one at a time);
    process 0 writes, into `path.tmp` renamed into place, so a reader never sees half an
    adapter. Non-finite adapters are refused (ValueError naming the param) and nothing is
    written. `base_model_path` goes to `base_model_name_or_path`.
    """
    if not lora.is_on(cfg):
        raise ValueError("save_adapter: cfg.lora is None (a model without adapters); export "
                         "it with hf.save, or set model.lora.rank > 0")
    modules, flat = adapted_modules(cfg), lora.flat_paths(params)
    _check_params(cfg, flat, modules)
    writer = jax.process_index() == 0
    tensors = {}
    for module, hf_modules in modules.items():
        for key in lora.ADAPTER_KEYS:
            value = np.asarray(parallel.gather_to_host(flat[module + (key,)]), np.float32)
            bad = value.size - int(np.count_nonzero(np.isfinite(value)))
            if bad:  # a diverged run: never exported, whatever the reader would do with it
                raise ValueError(
                    f"save_adapter({path}): param {'/'.join(module + (key,))} holds {bad} NaN "
                    "or inf value(s); non-finite adapters are never exported. A run that "
                    "diverged: train again with a lower learning rate or gradient clipping")
            layers = value if cfg.scan_layers else value[None]
            for name, layer in zip(hf_modules, layers):
                tensors[peft_name(name, key)] = to_peft(layer, key)
    nbytes = sum(t.nbytes for t in tensors.values())
    if writer:
        _write(path, tensors, peft_config(cfg.lora, base_model_path))
    return nbytes


def _write(path: str, tensors: dict[str, np.ndarray], config: dict) -> None:
    tmp = path.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(tensors, os.path.join(tmp, WEIGHTS_FILE), metadata={"format": "pt"})
    with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2)
    if os.path.exists(path):
        shutil.rmtree(path)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- load

# adapter_config.json fields whose PEFT meaning rl_tpu's LoRA does not compute: key ->
# (is the value a use of the feature?, what it is). Absent keys are PEFT's defaults (off).
_UNSUPPORTED = {
    "bias": (lambda v: v not in (None, "none"), "trained biases"),
    "lora_bias": (bool, "a bias on lora_B"),
    "use_dora": (bool, "DoRA"),
    "use_qalora": (bool, "QA-LoRA"),
    "fan_in_fan_out": (bool, "Conv1D-layout (GPT-2 style) weights"),
    "modules_to_save": (bool, "fully trained extra modules"),
    "layers_to_transform": (lambda v: v is not None, "adapters on some layers only"),
    "layers_pattern": (bool, "adapters on some layers only"),
    "rank_pattern": (bool, "per-module ranks"),
    "alpha_pattern": (bool, "per-module alphas"),
    "layer_replication": (bool, "replicated layers"),
    "target_parameters": (bool, "adapters on raw parameters"),
    "trainable_token_indices": (bool, "trained token embeddings"),
    "alora_invocation_tokens": (bool, "activated LoRA"),
}
# init_lora_weights values whose adapter applies to the unchanged base (the rest, e.g. PiSSA,
# OLoRA, LoftQ, CorDA, rewrite the base weights at init, so the adapter needs that base).
_PLAIN_BASE_INITS = {True: "default", False: "default", "gaussian": "gaussian",
                     "eva": "default", "orthogonal": "default"}


def read_peft_config(path: str, cfg: ModelConfig) -> lora.LoraConfig:
    """The LoraConfig of a PEFT dir's adapter_config.json, for a base of config `cfg`;
    AdapterError naming the file and the field for anything rl_tpu cannot compute."""
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise AdapterError(f"{path}: no {CONFIG_FILE} (is this a PEFT adapter dir? PEFT's "
                           "save_pretrained writes one)")
    try:
        with open(file) as f:
            peft = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise AdapterError(f"{file}: unreadable JSON ({err}); fix or replace the file") from None
    if not isinstance(peft, dict):
        raise AdapterError(f"{file}: holds a {type(peft).__name__}, not a PEFT config object")
    if peft.get("peft_type") != "LORA":
        raise AdapterError(f"{file}: peft_type={peft.get('peft_type')!r}; only LoRA adapters "
                           "(peft_type 'LORA') load into rl_tpu")
    for key, (used, what) in _UNSUPPORTED.items():
        if used(peft.get(key)):
            raise AdapterError(f"{file}: {key}={peft[key]!r} ({what}) is not supported; "
                               "train the adapter without it, or merge it into the base with "
                               "PEFT's merge_and_unload and load that as a plain model")
    init = peft.get("init_lora_weights", True)
    if not isinstance(init, (bool, str)) or init not in _PLAIN_BASE_INITS:
        raise AdapterError(f"{file}: init_lora_weights={init!r} adapts a modified base; convert "
                           "it with PEFT (save_pretrained's path_initial_model_for_weight_"
                           "conversion) or merge it with merge_and_unload")
    try:
        return lora.LoraConfig(
            rank=int(peft["r"]), alpha=float(peft["lora_alpha"]),
            dropout=float(peft.get("lora_dropout") or 0.0),
            targets=_targets(peft.get("target_modules"), cfg, file),
            init=_PLAIN_BASE_INITS[init], rslora=bool(peft.get("use_rslora", False)))
    except KeyError as err:
        raise AdapterError(f"{file}: no {err.args[0]!r} (a PEFT LoRA config has it)") from None
    except (TypeError, ValueError) as err:
        raise AdapterError(f"{file}: {err}") from None


def _targets(target_modules, cfg: ModelConfig, file: str) -> tuple[str, ...]:
    """rl_tpu's target names (a subset of lora.TARGETS) from PEFT's `target_modules`: a list of
    names, each matching a module whose name is it or ends in `.it` (`q_proj`, or the
    qualified `model.layers.0.self_attn.q_proj` that an expanded "all-linear" gives), or a
    string: "all-linear", or a regex PEFT full-matches against every module name."""
    if target_modules == "all-linear":  # every linear layer but the output head
        return lora.TARGETS
    if isinstance(target_modules, str):
        pattern = re.compile(target_modules)
        names = [n for n in _module_names(cfg) if pattern.fullmatch(n)]
    elif isinstance(target_modules, list) and target_modules:
        names = [str(n) for n in target_modules]
    else:
        raise AdapterError(f"{file}: target_modules={target_modules!r}; give a list of module "
                           f"names among {list(lora.TARGETS)}")
    unsupported = sorted({n for n in names if n.rsplit(".", 1)[-1] not in lora.TARGETS})
    if unsupported or not names:
        raise AdapterError(
            f"{file}: target_modules={target_modules!r} " + (
                f"adapts {_few(unsupported)}" if unsupported else "matches no module")
            + f"; rl_tpu adapts only {list(lora.TARGETS)}")
    found = {n.rsplit(".", 1)[-1] for n in names}
    return tuple(t for t in lora.TARGETS if t in found)


def _module_names(cfg: ModelConfig) -> list[str]:
    """The HF module names a regex target_modules is matched against: the projections of
    every layer, and the other modules holding weights, so matching one of those is seen."""
    every = cfg.replace(lora=lora.LoraConfig(), scan_layers=True)  # one name list per target
    names = [n for layers in adapted_modules(every).values() for n in layers]
    return names + ["model.embed_tokens", "lm_head"]


def _read_tensors(path: str, expected: dict[str, tuple[int, ...]]) -> hf.SafetensorsDir:
    """The adapter file of `path`, checked to hold exactly `expected` (name -> shape)."""
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        other = [f for f in ("adapter_model.bin",) if os.path.exists(os.path.join(path, f))]
        raise AdapterError(f"{path}: no {WEIGHTS_FILE}" + (
            f" (only {other[0]}, a pickle: save it again with PEFT's save_pretrained("
            "safe_serialization=True))" if other else " (PEFT's save_pretrained writes one)"))
    files = hf.SafetensorsDir(path)
    found = {n: meta for n, (f, meta) in files.entries.items() if os.path.basename(f)
             == WEIGHTS_FILE}  # an adapter saved beside a model: only its own file counts
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    problems = []
    if missing:
        problems.append(f"missing tensors {_few(missing)} (adapter_config.json's target_modules"
                        " names these modules, on every layer)")
    if extra:
        problems.append(f"unexpected tensors {_few(extra)} (not a LoRA of this base's "
                        "projections?)")
    for name in sorted(set(expected) & set(found)):
        if tuple(found[name]["shape"]) != expected[name]:
            problems.append(f"tensor {name!r} has shape {list(found[name]['shape'])}, the base "
                            f"and r imply {list(expected[name])} (an adapter of another model?)")
    if problems:
        raise AdapterError(f"{file}: " + "; ".join(problems))
    return files


def load_adapter(path: str, cfg: ModelConfig, params, mesh=None, rules=parallel.DEFAULT_RULES):
    """Reads the PEFT LoRA dir `path` onto the base `params` (of config `cfg`): returns
    (cfg with `lora` from adapter_config.json, params with those adapters in place of any
    they held), each adapter in the sharding `Transformer(cfg with lora)`'s logical axes give
    it on `mesh` (without one: the mesh `params` lie on, else one device). Raises
    AdapterError naming the file and the key for a dir rl_tpu cannot compute exactly as PEFT
    does (read_peft_config), or whose tensors are missing, extra, of the wrong shape or
    non-finite."""
    cfg = cfg.replace(lora=read_peft_config(path, cfg))
    mesh = mesh if mesh is not None else _mesh_of(params)
    abstract, names = parallel.logical_axes_of(Transformer(cfg), np.zeros((1, 1), np.int32))
    shardings = lora.flat_paths(lora.adapters(parallel.param_shardings(abstract, names, mesh, rules)))
    abstract = lora.flat_paths(abstract)
    modules = adapted_modules(cfg)

    def layer_shape(module, key):  # one layer's shape of the (maybe stacked) leaf
        shape = abstract[module + (key,)].shape
        return shape[1:] if cfg.scan_layers else shape

    expected = {peft_name(n, key): peft_shape(layer_shape(m, key), key)
                for m, hf_modules in modules.items() for n in hf_modules
                for key in lora.ADAPTER_KEYS}
    files = _read_tensors(path, expected)
    base = lora.without_adapters(params)
    kernels = lora.flat_paths(base)
    missing = sorted("/".join(m + ("kernel",)) for m in modules if m + ("kernel",) not in kernels)
    if missing:
        raise ValueError(f"params do not match the config (scan_layers={cfg.scan_layers}): "
                         f"missing {_few(missing)}")
    new = {}
    for module, hf_modules in modules.items():
        for key in lora.ADAPTER_KEYS:
            layers = [_read_finite(files, peft_name(n, key), layer_shape(module, key))
                      for n in hf_modules]
            value = np.stack(layers) if cfg.scan_layers else layers[0]
            # Every device's slice from the host copy (adapters are small): on a pod each
            # host builds its own devices' shards, as hf.read_params does for the base.
            new[module + (key,)] = jax.make_array_from_callback(
                value.shape, shardings[module + (key,)], lambda index, v=value: v[index])
    return cfg, lora.with_adapters(base, lora.nested(new))


def _read_finite(files: hf.SafetensorsDir, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Tensor `name` (any float dtype PEFT saved it in) as our float32 layout `shape`."""
    value = from_peft(files.read(name), shape)
    bad = value.size - int(np.count_nonzero(np.isfinite(value)))
    if bad:  # it would turn every logit NaN: refuse it here, by name, not at the first step
        raise AdapterError(f"{files.entries[name][0]}: tensor {name!r} holds {bad} NaN or inf "
                           "value(s); a diverged adapter cannot be loaded")
    return value


def _mesh_of(params) -> Mesh:
    """The mesh the base params lie on (adapters beside them need no mesh argument), else one
    device, as hf.load's default."""
    for leaf in jax.tree.leaves(params):
        if isinstance(getattr(leaf, "sharding", None), NamedSharding):
            return leaf.sharding.mesh
    return parallel.make_mesh({}, devices=jax.devices()[:1])
