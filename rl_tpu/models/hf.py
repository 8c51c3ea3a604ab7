"""HF checkpoints (config.json + safetensors) <-> rl_tpu params, both ways, from one table.

`load` maps every tensor file into memory and builds each param with
`jax.make_array_from_callback`, whose callback copies out of the map only the slice one device
holds (and, for scanned layers stacked `[L, ...]`, only that device's layers): a model never
sits whole on one device, and on a multi-host pod each host reads only what its devices hold.
`save` writes a directory that `transformers.AutoModelForCausalLM.from_pretrained` and SGLang
load.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import math
import os
import re
import shutil
import struct
import tempfile
from typing import Any, Optional

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from rl_tpu import parallel
from rl_tpu.models.moe import MoeConfig
from rl_tpu.models.transformer import ARCHITECTURES, ModelConfig, RopeScaling, Transformer

HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
# The same trunks under a bias-free `score` head [num_labels, D], no lm_head: reward models.
HF_SEQUENCE_CLASSIFIERS = {a.replace("CausalLM", "SequenceClassification"): arch
                           for a, arch in HF_ARCHITECTURES.items()}
CAUSAL_LM, SEQUENCE_CLASSIFICATION = "causal_lm", "sequence_classification"
_HEADS = {  # head -> (HF classes, class suffix, what it is, what to do when the other is asked)
    CAUSAL_LM: (HF_ARCHITECTURES, "ForCausalLM", "a causal LM (a policy)",
                "load it with rl_tpu.models.hf.load (a reward model can start from its trunk: "
                "reward_model.reward_params_from), or give a *ForSequenceClassification dir"),
    SEQUENCE_CLASSIFICATION: (HF_SEQUENCE_CLASSIFIERS, "ForSequenceClassification",
                              "a sequence classifier (a reward model)", "load it with "
                              "rl_tpu.models.reward_model.load, or give a *ForCausalLM dir"),
}


class CheckpointError(ValueError):
    """A model directory that cannot be loaded as asked; the message says what and where."""


@dataclasses.dataclass(frozen=True)
class WeightRule:
    """One HF tensor <-> one rl_tpu param.

    Dims are comma-separated products of shape letters (D model, N heads, K kv heads, H head
    dim, F mlp, V vocab, X experts, M an expert's mlp): "NH,D" is a [N*H, D] matrix. `transpose`
    flips HF's [out, in] matrices to our [in, ...out] kernels before reshaping. `{i}` in `hf`
    marks a per-layer rule whose `path` is relative to the layer; `{e}` a per-expert one, whose
    HF tensors (one per expert) are our param's rows [X, ...]. `layers`: which layers hold it
    (all; the dense ones; the sparse ones of a mixture of experts, cfg.moe).
    """

    hf: str
    path: str
    hf_dims: str
    our_dims: str
    transpose: bool = False
    when: str = "always"
    layers: str = "all"

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf

    @property
    def per_expert(self) -> bool:
        return "{e}" in self.hf


_CONDITIONS = {
    "always": lambda cfg: True,
    "untied": lambda cfg: not cfg.tie_word_embeddings,
    "qkv_bias": lambda cfg: cfg.qkv_bias,
    "qk_norm": lambda cfg: cfg.qk_norm,
    "moe": lambda cfg: cfg.moe is not None,
}

_L = "model.layers.{i}."
WEIGHT_TABLE = (
    WeightRule("model.embed_tokens.weight", "embed/embedding", "V,D", "V,D"),
    WeightRule("model.norm.weight", "final_norm/scale", "D", "D"),
    WeightRule("lm_head.weight", "lm_head/kernel", "V,D", "D,V", True, "untied"),
    WeightRule(_L + "input_layernorm.weight", "input_norm/scale", "D", "D"),
    WeightRule(_L + "post_attention_layernorm.weight", "post_attn_norm/scale", "D", "D"),
    WeightRule(_L + "self_attn.q_proj.weight", "attn/q_proj/kernel", "NH,D", "D,N,H", True),
    WeightRule(_L + "self_attn.k_proj.weight", "attn/k_proj/kernel", "KH,D", "D,K,H", True),
    WeightRule(_L + "self_attn.v_proj.weight", "attn/v_proj/kernel", "KH,D", "D,K,H", True),
    WeightRule(_L + "self_attn.o_proj.weight", "attn/o_proj/kernel", "D,NH", "N,H,D", True),
    WeightRule(_L + "self_attn.q_proj.bias", "attn/q_proj/bias", "NH", "N,H", False, "qkv_bias"),
    WeightRule(_L + "self_attn.k_proj.bias", "attn/k_proj/bias", "KH", "K,H", False, "qkv_bias"),
    WeightRule(_L + "self_attn.v_proj.bias", "attn/v_proj/bias", "KH", "K,H", False, "qkv_bias"),
    WeightRule(_L + "self_attn.q_norm.weight", "attn/q_norm/scale", "H", "H", False, "qk_norm"),
    WeightRule(_L + "self_attn.k_norm.weight", "attn/k_norm/scale", "H", "H", False, "qk_norm"),
    WeightRule(_L + "mlp.gate_proj.weight", "mlp/gate_proj/kernel", "F,D", "D,F", True,
               layers="dense"),
    WeightRule(_L + "mlp.up_proj.weight", "mlp/up_proj/kernel", "F,D", "D,F", True,
               layers="dense"),
    WeightRule(_L + "mlp.down_proj.weight", "mlp/down_proj/kernel", "D,F", "F,D", True,
               layers="dense"),
    # Qwen3-MoE's sparse layers (moe.py): the router, and each expert's SwiGLU stacked [X, ...]
    WeightRule(_L + "mlp.gate.weight", "mlp/router", "X,D", "D,X", True, "moe", "sparse"),
    WeightRule(_L + "mlp.experts.{e}.gate_proj.weight", "mlp/gate_proj", "M,D", "D,M", True,
               "moe", "sparse"),
    WeightRule(_L + "mlp.experts.{e}.up_proj.weight", "mlp/up_proj", "M,D", "D,M", True, "moe",
               "sparse"),
    WeightRule(_L + "mlp.experts.{e}.down_proj.weight", "mlp/down_proj", "D,M", "M,D", True,
               "moe", "sparse"),
)
# Present in some checkpoints, never needed: buffers HF recomputes, or a tied head saved anyway.
_IGNORED = re.compile(r"(.*rotary_emb\.inv_freq$)")


def table_dims(spec: str, cfg: ModelConfig) -> tuple[int, ...]:
    """A WeightRule dims spec ("NH,D") as the shape it names for `cfg`."""
    size = {"D": cfg.hidden_size, "N": cfg.num_heads, "K": cfg.num_kv_heads,
            "H": cfg.head_dim, "F": cfg.intermediate_size, "V": cfg.vocab_size}
    if cfg.moe is not None:
        size.update(X=cfg.moe.num_experts, M=cfg.moe.intermediate_size)
    return tuple(math.prod(size[letter] for letter in part) for part in spec.split(","))


def rule_layers(rule: WeightRule, cfg: ModelConfig) -> list[int]:
    """The layers holding a per-layer rule's tensor (a mixture of experts' dense layers hold
    the dense MLP, its sparse ones the router and experts)."""
    if rule.layers == "all":
        return list(range(cfg.num_layers))
    sparse = set(cfg.moe.sparse_layers(cfg.num_layers)) if cfg.moe is not None else set()
    return [i for i in range(cfg.num_layers) if (i in sparse) == (rule.layers == "sparse")]


def our_shape(rule: WeightRule, cfg: ModelConfig) -> tuple[int, ...]:
    """Our param's shape for one layer: a per-expert rule's tensors stacked [X, ...]."""
    dims = table_dims(rule.our_dims, cfg)
    return (cfg.moe.num_experts,) + dims if rule.per_expert else dims


def active_rules(cfg: ModelConfig, head: str = CAUSAL_LM) -> list[WeightRule]:
    """The table's rules this config uses; a sequence classifier's trunk has no lm_head."""
    if head not in _HEADS:
        raise ValueError(f"head={head!r}; choose one of {sorted(_HEADS)}")
    return [r for r in WEIGHT_TABLE if _CONDITIONS[r.when](cfg)
            and not (head == SEQUENCE_CLASSIFICATION and r.path.startswith("lm_head/"))]


def expected_tensors(cfg: ModelConfig, head: str = CAUSAL_LM
                     ) -> dict[str, tuple[WeightRule, Optional[int]]]:
    """HF tensor name -> (rule, layer index or None) for every table tensor a dir must hold."""
    out = {}
    for rule in active_rules(cfg, head):
        for i in (rule_layers(rule, cfg) if rule.per_layer else (None,)):
            for e in range(cfg.moe.num_experts) if rule.per_expert else (None,):
                out[rule.hf.format(i=i, e=e)] = (rule, i)
    return out


def hf_to_ours(x: np.ndarray, rule: WeightRule, cfg: ModelConfig) -> np.ndarray:
    return (x.T if rule.transpose else x).reshape(table_dims(rule.our_dims, cfg))


def ours_to_hf(x: np.ndarray, rule: WeightRule, cfg: ModelConfig) -> np.ndarray:
    hf_shape = table_dims(rule.hf_dims, cfg)
    if rule.transpose:
        return np.ascontiguousarray(x.reshape(hf_shape[::-1]).T)
    return x.reshape(hf_shape)


def hf_view(x: np.ndarray, rule: WeightRule, cfg: ModelConfig) -> np.ndarray:
    """`hf_to_ours(x)` as a view of `x`, without copying, so that indexing it copies only the
    indexed slice out of a memory-mapped file.

    HF's dims are split into one dim per letter ("NH,D" -> [N, H, D], a reshape of a
    contiguous array, hence a view) and transposed into our order. That is the same array as
    transpose-then-reshape whenever our dims are single letters in the order HF's (reversed,
    for a transposed rule) spell them, true of every rule in WEIGHT_TABLE; any other rule gets
    the copying `hf_to_ours`.
    """
    parts = rule.hf_dims.split(",")
    letters = "".join(parts)
    ours = rule.our_dims.split(",")
    spelled = "".join(parts[::-1] if rule.transpose else parts)
    distinct = len(set(letters)) == len(letters)
    if any(len(d) != 1 for d in ours) or "".join(ours) != spelled or not distinct:
        return hf_to_ours(x, rule, cfg)
    split = x.reshape(table_dims(",".join(letters), cfg))
    return split.transpose([letters.index(d) for d in ours])


DTYPES = ("float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def dtype_name(dtype, what: str = "dtype") -> str:
    """The name of a float dtype given in any of the usual spellings: "bfloat16", "bf16",
    jnp.bfloat16, ml_dtypes.bfloat16, np.float32, np.dtype("float16")...

    Raises:
      ValueError: naming `what` (the argument) when `dtype` is no dtype, or not one of DTYPES.
    """
    spelled = _DTYPE_ALIASES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    name = None
    if spelled is not None:  # jnp.dtype(None) would be the default dtype, not an error
        try:
            name = jnp.dtype(spelled).name
        except (TypeError, ValueError):
            pass
    if name not in DTYPES:
        got = f"{dtype!r}" if name is None else f"{dtype!r} ({name})"
        raise ValueError(f"{what}={got} is not a supported param/compute dtype; use one of "
                         f"{', '.join(DTYPES)} (as a string, or jnp./np. dtypes such as "
                         "jnp.bfloat16)")
    return name


# ----------------------------------------------------------------------------- config.json


def config_from_hf(hf: dict[str, Any], source: str = "config.json", **overrides) -> ModelConfig:
    """ModelConfig from an HF config dict (old `rope_theta/rope_scaling` or new `rope_parameters`)."""
    archs = hf.get("architectures") or []
    classes = {**HF_ARCHITECTURES, **HF_SEQUENCE_CLASSIFIERS}
    arch = next((classes[a] for a in archs if a in classes), None)
    if arch is None and hf.get("model_type") in ARCHITECTURES:  # our arch names are HF's types
        arch = hf["model_type"]
    if arch is None:
        raise CheckpointError(
            f"{source}: unsupported architecture {archs or hf.get('model_type')!r}; "
            f"rl_tpu supports {sorted(HF_ARCHITECTURES)}")
    for key, bad, what in (("hidden_act", lambda v: v not in (None, "silu"), "only silu"),
                           ("mlp_bias", bool, "no MLP bias"),
                           ("use_sliding_window", bool, "no sliding-window attention")):
        if bad(hf.get(key)):
            raise CheckpointError(f"{source}: {key}={hf.get(key)!r} is not supported ({what})")
    if arch != "qwen2" and hf.get("attention_bias"):
        raise CheckpointError(f"{source}: attention_bias=true is not supported for {arch}")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = RopeScaling(rope_type=rope_type, **{
        f.name: rope[f.name] for f in dataclasses.fields(RopeScaling)
        if f.name != "rope_type" and rope.get(f.name) is not None})
    eos = hf.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    heads = hf["num_attention_heads"]
    kwargs = dict(
        arch=arch, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
        num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 10000.0))),
        rope_scaling=scaling, rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2", qk_norm=arch in ("qwen3", "qwen3_moe"),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        bos_token_id=hf.get("bos_token_id"), eos_token_ids=eos,
    )
    if arch == "qwen3_moe":
        kwargs["moe"] = MoeConfig(
            # the hub's configs say num_experts; transformers 5 writes num_local_experts
            num_experts=hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"],
            top_k=hf["num_experts_per_tok"],
            intermediate_size=hf["moe_intermediate_size"],
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            decoder_sparse_step=hf.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
            router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001))
    kwargs.update(overrides)
    try:
        return ModelConfig(**kwargs)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{source}: {err}") from err


def config_to_hf(cfg: ModelConfig, torch_dtype: str, head: str = CAUSAL_LM,
                 **hf_fields) -> dict[str, Any]:
    """config.json for transformers (built by its own config class, so the format matches the
    installed version) plus the pre-v5 rope keys, so older readers (e.g. SGLang's) agree.
    `hf_fields`: more config-class arguments (a classifier's id2label, pad_token_id)."""
    rope = {"rope_type": cfg.rope_scaling.rope_type, "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling.rope_type != "default":
        rope.update({f.name: getattr(cfg.rope_scaling, f.name)
                     for f in dataclasses.fields(RopeScaling) if f.name != "rope_type"})
        if cfg.rope_scaling.rope_type == "linear":
            rope = {k: rope[k] for k in ("rope_type", "rope_theta", "factor")}
    eos = list(cfg.eos_token_ids)
    out = _config_class_dict(cfg.arch, dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        max_position_embeddings=cfg.max_position_embeddings, rope_parameters=rope,
        bos_token_id=cfg.bos_token_id, eos_token_id=eos[0] if len(eos) == 1 else (eos or None),
        **_moe_fields(cfg), **hf_fields))
    out["architectures"] = [a for a, name in _HEADS[head][0].items() if name == cfg.arch]
    out["torch_dtype"] = out["dtype"] = torch_dtype
    out.setdefault("rope_theta", cfg.rope_theta)
    if cfg.rope_scaling.rope_type != "default":
        out.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
    return out


def _moe_fields(cfg: ModelConfig) -> dict[str, Any]:
    m = cfg.moe
    if m is None:
        return {}
    return dict(num_experts=m.num_experts, num_experts_per_tok=m.top_k,
                moe_intermediate_size=m.intermediate_size, norm_topk_prob=m.norm_topk_prob,
                decoder_sparse_step=m.decoder_sparse_step, mlp_only_layers=list(m.mlp_only_layers),
                router_aux_loss_coef=m.router_aux_loss_coef)


def cache_root() -> str:
    """rl_tpu's cache on this machine: $RL_TPU_CACHE, else ~/.cache/rl_tpu (fetched models
    under models/, remembered config.json records under hf_configs/)."""
    return os.environ.get("RL_TPU_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                           "rl_tpu")


def config_memo_dir() -> str:
    """Where `_config_class_dict` keeps what transformers' config classes returned:
    $RL_TPU_HF_CONFIG_CACHE (the tests' fresh one), else <cache_root()>/hf_configs."""
    return os.environ.get("RL_TPU_HF_CONFIG_CACHE") or os.path.join(cache_root(), "hf_configs")


def _config_class_dict(arch: str, fields: dict[str, Any]) -> dict[str, Any]:
    """`AutoConfig.for_model(arch, **fields).to_dict()` as JSON reads it back, remembered on
    disk per transformers version and arguments. Building a config class imports
    transformers' rope utilities, which import torch: seconds at the start of every run that
    writes a model (a tiny model, an export), for a pure function of these arguments. A memo
    that cannot be read or written is skipped: the result is the same."""
    key = json.dumps([importlib.metadata.version("transformers"), arch, fields], sort_keys=True,
                     default=str)
    path = os.path.join(config_memo_dir(), hashlib.sha256(key.encode()).hexdigest() + ".json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        pass
    from transformers import AutoConfig  # import cost: transformers' config classes load torch

    text = json.dumps(AutoConfig.for_model(arch, **fields).to_dict())
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)  # whole or absent: a concurrent reader never sees half a file
    except OSError:
        pass
    return json.loads(text)


# ----------------------------------------------------------------------------- safetensors

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "F64": np.float64, "I64": np.int64, "I32": np.int32}


class SafetensorsDir:
    """Name -> memory-mapped numpy view over every *.safetensors file of a directory.

    safetensors' own numpy reader cannot return bf16, the common checkpoint dtype; the format
    (8-byte header size, JSON header of dtype/shape/offsets, raw bytes) is simple to map.
    """

    def __init__(self, path: str):
        self.path = path
        self.entries: dict[str, tuple[str, dict]] = {}
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise CheckpointError(f"{path}: no *.safetensors files (is this an HF model dir?)")
        for name in files:
            file = os.path.join(path, name)
            for tensor, meta in self._read_header(file).items():
                if tensor in self.entries:
                    raise CheckpointError(f"{path}: tensor {tensor!r} is in both "
                                          f"{self.entries[tensor][0]} and {file}")
                self.entries[tensor] = (file, meta)
        self._maps: dict[str, np.memmap] = {}

    @staticmethod
    def _read_header(file: str) -> dict[str, dict]:
        """The file's tensors (name -> dtype, shape, data_offsets, data_start), each checked to
        lie whole inside the file: a truncated copy fails here, naming the file, not later as
        a reshape of too few bytes."""
        again = "copy or download it again"
        try:
            length = os.path.getsize(file)
            with open(file, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                if size > length - 8:
                    raise CheckpointError(f"{file}: truncated ({length} bytes, but its header "
                                          f"alone says {8 + size}); {again}")
                header = json.loads(f.read(size))
        except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{file}: not a readable safetensors file ({err}); "
                                  f"{again}") from err
        if not isinstance(header, dict):
            raise CheckpointError(f"{file}: not a safetensors file (its header is not a JSON "
                                  f"object); {again}")
        header.pop("__metadata__", None)
        for name, meta in header.items():
            try:
                begin, end = (int(x) for x in meta["data_offsets"])
                shape = [int(n) for n in meta["shape"]]
                itemsize = np.dtype(_ST_DTYPES[meta["dtype"]]).itemsize \
                    if meta["dtype"] in _ST_DTYPES else None
            except (KeyError, TypeError, ValueError) as err:
                raise CheckpointError(f"{file}: tensor {name!r} has a malformed header entry "
                                      f"({err!r}); {again}") from None
            if itemsize is not None and not 0 <= begin <= end == begin + itemsize * int(
                    np.prod(shape, dtype=np.int64)):
                raise CheckpointError(f"{file}: tensor {name!r} of shape {shape} and dtype "
                                      f"{meta['dtype']} has data_offsets {[begin, end]}, which "
                                      f"do not hold it; {again}")
            if 8 + size + end > length:
                raise CheckpointError(f"{file}: truncated: tensor {name!r} ends at byte "
                                      f"{8 + size + end} but the file has {length}; {again}")
            meta["data_start"] = 8 + size
        return header

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name][1]["shape"])

    def read(self, name: str) -> np.ndarray:
        file, meta = self.entries[name]
        if meta["dtype"] not in _ST_DTYPES:
            raise CheckpointError(f"{file}: tensor {name!r} has unsupported dtype {meta['dtype']}")
        if file not in self._maps:
            self._maps[file] = np.memmap(file, dtype=np.uint8, mode="r")
        begin, end = meta["data_offsets"]
        raw = self._maps[file][meta["data_start"] + begin: meta["data_start"] + end]
        return raw.view(_ST_DTYPES[meta["dtype"]]).reshape(meta["shape"])


# ----------------------------------------------------------------------------- load / save


def read_hf_config(path: str) -> dict[str, Any]:
    """A model dir's config.json as a dict; CheckpointError naming the file if unreadable."""
    file = os.path.join(path, "config.json")
    try:
        with open(file) as f:
            hf = json.load(f)
    except FileNotFoundError as err:
        raise CheckpointError(f"{path}: no config.json (is this an HF model dir?)") from err
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{file}: unreadable JSON ({err}); fix or replace the "
                              "file") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{file}: holds a {type(hf).__name__}, not an HF config object")
    return hf


def read_config(path: str, head: str = CAUSAL_LM, **overrides) -> ModelConfig:
    """ModelConfig of a model dir; one whose `architectures` name the other `head` than asked
    for (a causal LM by default) is a CheckpointError saying which loader reads it."""
    hf, file = read_hf_config(path), os.path.join(path, "config.json")
    found = next((h for a in hf.get("architectures") or [] for h, (_, suffix, _, _)
                  in _HEADS.items() if str(a).endswith(suffix)), head)
    if found != head:
        raise CheckpointError(f"{file}: architectures {hf['architectures']} is "
                              f"{_HEADS[found][2]}, not {_HEADS[head][2]} as asked; "
                              f"{_HEADS[found][3]}")
    try:
        return config_from_hf(hf, source=file, **overrides)
    except KeyError as err:  # a key every supported architecture's config.json has
        raise CheckpointError(f"{file}: no {err.args[0]!r} (an HF model config has it); fix "
                              "or replace the file") from None
    except (TypeError, AttributeError) as err:  # a value of the wrong kind
        raise CheckpointError(f"{file}: {err}") from None


def check_model_dir(path: str) -> ModelConfig:
    """What `load` needs of an HF model dir, read from its small parts only (config.json and
    each safetensors header; no tensor data): a config.json of a supported architecture, and
    safetensors files, none truncated, holding exactly the tensors of that config in their
    shapes. Returns the config; raises CheckpointError naming the file and what is wrong. Run
    it before writing anything (the trainer's start-up), and `load` runs the same checks."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such model directory" if not os.path.exists(path)
                              else f"{path}: not a directory (an HF model dir is one)")
    cfg = read_config(path)
    check_tensors(SafetensorsDir(path), cfg, path)
    return cfg


def check_tensors(files: SafetensorsDir, cfg: ModelConfig, path: str, head: str = CAUSAL_LM,
                  head_shapes: Optional[dict[str, tuple[int, ...]]] = None):
    """CheckpointError unless `files` hold exactly, each in its shape, the table's tensors for
    `cfg` and `head` and `head_shapes` (name -> shape: a head outside the table)."""
    expected, head_shapes = expected_tensors(cfg, head), dict(head_shapes or {})
    wanted = set(expected) | set(head_shapes)
    missing = sorted(wanted - set(files.entries))
    tied_head = head == CAUSAL_LM and cfg.tie_word_embeddings  # a tied lm_head saved anyway
    extra = sorted(n for n in set(files.entries) - wanted
                   if not _IGNORED.match(n) and not (n == "lm_head.weight" and tied_head))
    problems = []
    if missing:
        problems.append(f"missing tensors {_few(missing)}")
    if extra:
        problems.append(f"unexpected tensors {_few(extra)} (not a {cfg.arch} checkpoint?)")
    shapes = {**{n: table_dims(r.hf_dims, cfg) for n, (r, _) in expected.items()}, **head_shapes}
    for name in sorted(wanted & set(files.entries)):
        want, got = tuple(shapes[name]), files.shape(name)
        if want != got:
            problems.append(f"tensor {name!r} has shape {list(got)}, config.json implies {list(want)}")
    if problems:
        raise CheckpointError(f"{path}: " + "; ".join(problems))


def _few(names, limit=6):
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _locate(cfg: ModelConfig, head: str = CAUSAL_LM):
    """Our param path (tuple) -> (rule, layer) where layer is an int, None, or 'stacked'."""
    out = {}
    for rule in active_rules(cfg, head):
        parts = tuple(rule.path.split("/"))
        if not rule.per_layer:
            out[parts] = (rule, None)
        elif cfg.scan_layers:  # every layer holds it, or (a dense MLP in all-sparse) none
            if rule_layers(rule, cfg):
                out[("layers",) + parts] = (rule, "stacked")
        else:
            for i in rule_layers(rule, cfg):
                out[(f"layers_{i}",) + parts] = (rule, i)
    return out


def load(path: str, mesh=None, dtype="float32", rules=parallel.DEFAULT_RULES,
         **config_overrides):
    """Reads an HF model dir into (ModelConfig, params), each param in its mesh sharding.

    `dtype` is the dtype of params and compute, in any spelling `dtype_name` reads ("bfloat16",
    jnp.bfloat16, np.float32...); `param_dtype=` in config_overrides gives the params a different
    one (other ModelConfig fields go there too, e.g. scan_layers=True, remat="dots"). Without a
    mesh, one device.

    Each device's callback copies its own slice straight out of the memory-mapped files and
    casts it while copying, so host memory holds a device's shard at a time, never a whole
    tensor; with scan_layers=True it reads only the layers of its slice of the `[L, ...]`
    stack, never stacking all L layers on the host.
    """
    dtype = dtype_name(dtype, "hf.load(dtype)")
    config_overrides["param_dtype"] = dtype_name(config_overrides.get("param_dtype", dtype),
                                                 "hf.load(param_dtype)")
    cfg = read_config(path, dtype=dtype, **config_overrides)
    files = SafetensorsDir(path)
    check_tensors(files, cfg, path)
    if mesh is None:
        mesh = parallel.make_mesh({}, devices=jax.devices()[:1])
    model = Transformer(cfg)
    abstract, names = parallel.logical_axes_of(model, np.zeros((1, 1), np.int32))
    shardings = parallel.param_shardings(abstract, names, mesh, rules)
    return cfg, read_params(files, cfg, abstract, shardings)


def read_params(files: SafetensorsDir, cfg: ModelConfig, abstract, shardings,
                head: str = CAUSAL_LM):
    """`abstract` (a Transformer's params, or a classifier's trunk) read from checked `files`,
    each param in its sharding by a callback that reads only its device's slice."""
    located = _locate(cfg, head)
    np_dtype = np.dtype(cfg.params_dtype)

    def make(key_path, leaf, sharding):
        key = tuple(k.key for k in key_path)
        rule, layer = located[key]
        want = our_shape(rule, cfg)
        if layer == "stacked":
            want = (cfg.num_layers,) + want
        if want != leaf.shape:  # table and model disagree: a bug here, not in the dir
            raise AssertionError(f"{key}: table gives {want}, model wants {leaf.shape}")

        def read_slice(index):
            index = tuple(index) + (slice(None),) * (len(leaf.shape) - len(index))
            out = np.empty([len(range(n)[i]) for n, i in zip(leaf.shape, index)], np_dtype)
            if rule.per_expert and layer == "stacked":  # [L, X, ...]: this slice's alone
                for j, i in enumerate(range(cfg.num_layers)[index[0]]):
                    for m, e in enumerate(range(cfg.moe.num_experts)[index[1]]):
                        out[j, m] = hf_view(files.read(rule.hf.format(i=i, e=e)), rule,
                                            cfg)[index[2:]]
            elif rule.per_expert:  # one HF tensor per expert: only this slice's experts read
                for j, e in enumerate(range(cfg.moe.num_experts)[index[0]]):
                    out[j] = hf_view(files.read(rule.hf.format(i=layer, e=e)), rule,
                                     cfg)[index[1:]]
            elif layer != "stacked":
                out[...] = hf_view(files.read(rule.hf.format(i=layer)), rule, cfg)[index]
            else:
                for j, i in enumerate(range(cfg.num_layers)[index[0]]):
                    out[j] = hf_view(files.read(rule.hf.format(i=i)), rule, cfg)[index[1:]]
            return out

        return jax.make_array_from_callback(leaf.shape, sharding, read_slice)

    return jax.tree_util.tree_map_with_path(make, abstract, shardings)


def save(path: str, cfg: ModelConfig, params, tokenizer=None, dtype: Optional[str] = None,
         max_shard_bytes: int = 4 << 30, head: str = CAUSAL_LM, head_tensors=None,
         hf_fields=None):
    """Writes an HF model dir (config.json, safetensors shards [+ index], tokenizer files).

    Sharded and multi-host params are gathered one param at a time and written one shard at a
    time, so host memory holds at most a shard. Every process must call this (the gathers are
    collective); process 0 writes. The directory is written beside the target and renamed into
    place, so a crash never leaves a half-written checkpoint where a loader (or an SGLang
    server) would read it. Params with NaN or inf are refused (ValueError naming the param),
    and nothing is written. head=SEQUENCE_CLASSIFICATION (reward_model.save): `params` are the
    trunk, `head_tensors` HF name -> tensor in HF layout, `hf_fields` more config fields.
    """
    dtype = dtype_name(cfg.param_dtype if dtype is None else dtype, "hf.save(dtype)")
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    located, head_tensors = _locate(cfg, head), dict(head_tensors or {})
    flat = {tuple(k.key for k in kp): v
            for kp, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    missing = sorted("/".join(k) for k in set(located) - set(flat))
    if missing:
        raise ValueError(f"params do not match the config: missing {_few(missing)}")

    # Plan shards from the config alone, so each shard is gathered, written and dropped in turn.
    itemsize = np.dtype(np_dtype).itemsize
    shards, size = [[]], 0
    for key in list(located) + list(head_tensors):  # param paths (tuples), then HF names
        nbytes = (head_tensors[key] if isinstance(key, str) else flat[key]).size * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    writer = jax.process_index() == 0
    tmp = path.rstrip("/") + ".tmp"
    if writer:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    weight_map, total = {}, 0
    for k, keys in enumerate(shards, start=1):
        tensors = {}
        for key in keys:
            named = isinstance(key, str)
            value = parallel.gather_to_host(head_tensors[key] if named else flat[key])
            value = value.astype(np_dtype)
            bad = value.size - int(np.count_nonzero(np.isfinite(value)))
            if bad:  # a diverged run, or values past dtype's range: never exported
                if writer:
                    shutil.rmtree(tmp, ignore_errors=True)
                raise ValueError(
                    f"hf.save({path}): {'tensor ' + key if named else 'param ' + '/'.join(key)}"
                    f" holds {bad} NaN or inf value(s) "
                    f"(as {dtype}); non-finite weights are never exported. A run that "
                    "diverged: train again (a new --workdir) with a lower learning rate or with "
                    "gradient clipping")
            if named:
                tensors[key] = value
                continue
            rule, layer = located[key]
            for i in range(cfg.num_layers) if layer == "stacked" else (layer,):
                one = value[i] if layer == "stacked" else value
                for e in range(cfg.moe.num_experts) if rule.per_expert else (None,):
                    tensors[rule.hf.format(i=i, e=e)] = ours_to_hf(
                        one if e is None else one[e], rule, cfg)
        file = ("model.safetensors" if len(shards) == 1
                else f"model-{k:05d}-of-{len(shards):05d}.safetensors")
        if writer:
            save_file(tensors, os.path.join(tmp, file), metadata={"format": "pt"})
        weight_map.update({name: file for name in tensors})
        total += sum(v.nbytes for v in tensors.values())
    if not writer:
        return
    if len(shards) > 1:
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config_to_hf(cfg, dtype, head, **(hf_fields or {})), f, indent=2)
    if tokenizer is not None:
        save_tokenizer(getattr(tokenizer, "hf", tokenizer), tmp)
    if os.path.exists(path):
        shutil.rmtree(path)
    os.replace(tmp, path)


def save_tokenizer(tokenizer, out_dir: str):
    """Tokenizer files that transformers 4.x readers (SGLang's) load too: transformers 5 writes
    the chat template to a separate .jinja file and names its fast class `TokenizersBackend`,
    both unknown to 4.x, so keep the template inline and name the portable fast class."""
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    file = os.path.join(out_dir, "tokenizer_config.json")
    with open(file) as f:
        config = json.load(f)
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        with open(file, "w") as f:
            json.dump(config, f, indent=2)
