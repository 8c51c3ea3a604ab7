"""GGUF files (llama.cpp's format) -> HF model directories that rl_tpu, transformers and SGLang
load: config.json, safetensors, tokenizer.json with the chat template, generation_config.json.

    cfg = convert_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "/tmp/smollm2", dtype="float32")

Weights are dequantised by the `gguf` package (llama.cpp's own Python reader, numpy only), one
tensor at a time, and renamed by one table (GGUF_NAMES). transformers can load a GGUF too, but
its loader builds a torch model first (85 s for a 135M model on 2 cores, and torch is not a
run-time dependency of rl_tpu) and `save_pretrained` refuses a model loaded that way; reading
the file directly takes seconds and needs nothing but numpy. llama.cpp stores a Llama's q/k
projections with the rows of each head interleaved for its rotary layout (its converter's
`permute`); `_unpermute_rows` undoes that, as transformers does. Qwen2/Qwen3 files are stored
in HF's order.

The tokenizer is transformers' own GGUF tokenizer builder (`convert_gguf_tokenizer`, the code
behind `AutoTokenizer.from_pretrained(dir, gguf_file=...)`), fed from the same metadata: the
vocabulary, merges, pre-tokenizer and special tokens as llama.cpp recorded them.

Architectures other than GGUF_ARCHITECTURES are refused by name, as are files whose tensors
the table does not know (a quantised MoE, a vision tower), so no weight is silently dropped.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any, Optional

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from rl_tpu.models import hf

# GGUF `general.architecture` -> the HF class it is written as.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "qwen3": "Qwen3ForCausalLM"}

# GGUF tensor name -> HF tensor name ({i}: the layer). Which appear depends on the architecture
# (biases: Qwen2; q/k norms: Qwen3; `output.weight` only when the head is untied).
GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")


class GgufError(ValueError):
    """A GGUF file that cannot be converted; the message says what and what to do."""


def _require_gguf():
    try:
        import gguf  # noqa: F401  (an optional dependency: only conversion needs it)
    except ImportError as err:
        raise GgufError("converting a GGUF file needs the `gguf` package (an rl_tpu "
                        "dependency): pip install gguf") from err
    return gguf


def read_metadata(reader) -> dict[str, Any]:
    """Every metadata field of a `gguf.GGUFReader` as plain Python values (strings decoded,
    arrays as lists)."""
    return {name: field.contents() for name, field in reader.fields.items()}


def hf_config_from_gguf(meta: dict[str, Any], tensor_names: set[str], source: str) -> dict:
    """An HF config.json dict for the model the metadata describes."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise GgufError(f"{source}: GGUF architecture {arch!r} is not supported; rl_tpu "
                        f"converts {sorted(GGUF_ARCHITECTURES)} (Llama, Qwen2, Qwen3)")
    if "rope_freqs.weight" in tensor_names:
        raise GgufError(f"{source}: holds rope_freqs.weight (llama.cpp's form of Llama 3.1 rope "
                        "scaling), which this converter does not map back; use the model's HF "
                        "checkpoint instead")
    key = lambda name, default=None: meta.get(f"{arch}.{name}", default)  # noqa: E731
    heads = int(key("attention.head_count"))
    eos = eos_token_ids(meta)
    hidden = int(key("embedding_length"))
    # GGUF stores eps as float32; 9.999999747e-06 is config.json's 1e-05
    eps = float(f"{float(key('attention.layer_norm_rms_epsilon', 1e-6)):.7g}")
    config = {
        "architectures": [GGUF_ARCHITECTURES[arch]], "model_type": arch, "hidden_act": "silu",
        "vocab_size": int(key("vocab_size", len(meta.get("tokenizer.ggml.tokens", ())))),
        "hidden_size": hidden, "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(key("attention.key_length", hidden // heads)),
        "rms_norm_eps": eps, "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
    }
    scaling = key("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise GgufError(f"{source}: rope scaling {scaling!r} is not supported from GGUF "
                            "(linear is); use the model's HF checkpoint instead")
        config["rope_scaling"] = {"rope_type": "linear",
                                  "factor": float(key("rope.scaling.factor"))}
    return config


def eos_token_ids(meta: dict[str, Any]) -> list[int]:
    """The ids that end a reply: the file's EOS and its end-of-turn token (llama.cpp's EOT),
    e.g. <|im_end|> for a ChatML model whose EOS is <|endoftext|>."""
    ids = [meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def _unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Llama q/k row order: within each head it stores the rows as pairs
    (r, r + H/2) interleaved; HF keeps the two rotary halves apart."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensor_name(name: str, source: str) -> str:
    """GGUF tensor name -> HF tensor name, or GgufError naming the tensor it does not know."""
    layer = _LAYER.match(name)
    pattern = f"blk.{{i}}.{layer.group(2)}" if layer else name
    if pattern not in GGUF_NAMES:
        raise GgufError(f"{source}: tensor {name!r} has no HF counterpart in rl_tpu's table "
                        "(an architecture feature rl_tpu does not model); nothing was written")
    return GGUF_NAMES[pattern].format(i=layer.group(1) if layer else "")


def hf_tensors(reader, config: dict, source: str):
    """Yields (HF name, float32 array in HF layout) for every tensor, dequantised one at a
    time."""
    gguf = _require_gguf()
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name, source)
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as err:
            raise GgufError(f"{source}: tensor {tensor.name!r} is quantised as "
                            f"{tensor.tensor_type.name}, which the installed gguf cannot "
                            f"dequantise ({err}); use a file quantised otherwise") from None
        values = np.asarray(values, np.float32).reshape(
            [int(n) for n in reversed(tensor.shape)])  # GGUF lists dims innermost first
        if config["model_type"] == "llama" and tensor.name.endswith((".attn_q.weight",
                                                                     ".attn_k.weight")):
            values = _unpermute_rows(values, heads if ".attn_q." in tensor.name else kv_heads)
        yield name, values


def build_tokenizer(meta: dict[str, Any], source: str):
    """The file's tokenizer as a transformers fast tokenizer, built by transformers' GGUF
    tokenizer code from the file's metadata, with its chat template and special tokens."""
    from transformers import PreTrainedTokenizerFast
    try:  # transformers >= 5.2 moved the GGUF code into a package
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer)
    except ImportError:
        from transformers.integrations.ggml import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    if "tokenizer.ggml.tokens" not in meta:
        raise GgufError(f"{source}: holds no tokenizer (no tokenizer.ggml.tokens); convert "
                        "it with a tokenizer dir of your own, or use the HF checkpoint")
    grouped = {group: {ours: meta[f"tokenizer.{key}"] for key, ours in renames.items()
                       if f"tokenizer.{key}" in meta}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokens = meta["tokenizer.ggml.tokens"]
    special = {name: tokens[meta[f"tokenizer.ggml.{key}"]]
               for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                                 ("unk_token", "unknown_token_id"),
                                 ("pad_token", "padding_token_id"))
               if meta.get(f"tokenizer.ggml.{key}") is not None}
    backend, extra = convert_gguf_tokenizer(meta["general.architecture"], grouped["tokenizer"])
    context = meta.get(f"{meta['general.architecture']}.context_length")
    return PreTrainedTokenizerFast(tokenizer_object=backend, model_max_length=context,
                                   **{**grouped["tokenizer_config"], **special, **extra})


def convert_gguf(gguf_path: str, out_dir: str, dtype: str = "float32",
                 max_shard_bytes: int = 2 << 30) -> dict:
    """Writes `out_dir`, an HF model directory of the GGUF file's model; returns its config.

    dtype: of the safetensors ("float32": the dequantised values exactly; "bfloat16": half the
    size, rounded). Written beside `out_dir` and renamed into place, so a crash never leaves a
    half-written directory where a loader would read it; the result passes
    `hf.check_model_dir`.
    """
    gguf = _require_gguf()
    dtype = hf.dtype_name(dtype, "convert_gguf(dtype)")
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    try:
        reader = gguf.GGUFReader(gguf_path)
    except (OSError, ValueError) as err:
        raise GgufError(f"{gguf_path}: not a readable GGUF file ({err})") from err
    meta = read_metadata(reader)
    config = hf_config_from_gguf(meta, {t.name for t in reader.tensors}, gguf_path)
    config["torch_dtype"] = config["dtype"] = dtype
    tokenizer = build_tokenizer(meta, gguf_path)

    tmp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    shards, shard, size = [], {}, 0
    for name, values in hf_tensors(reader, config, gguf_path):
        if shard and size + values.size * np.dtype(np_dtype).itemsize > max_shard_bytes:
            shards.append(_write_shard(tmp, len(shards), shard))
            shard, size = {}, 0
        shard[name] = values.astype(np_dtype)
        size += shard[name].nbytes
    shards.append(_write_shard(tmp, len(shards), shard))
    _name_shards(tmp, shards)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
                  "pad_token_id": meta.get("tokenizer.ggml.padding_token_id")}
    with open(os.path.join(tmp, "generation_config.json"), "w") as f:
        json.dump({k: v for k, v in generation.items() if v is not None}, f, indent=2)
    hf.save_tokenizer(tokenizer, tmp)
    hf.check_model_dir(tmp)  # every tensor of the config, in its shape, or nothing is moved
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return config


def _write_shard(directory: str, index: int, tensors: dict[str, np.ndarray]
                 ) -> tuple[str, list[str], int]:
    file = f"part-{index:05d}.safetensors"
    save_file(tensors, os.path.join(directory, file), metadata={"format": "pt"})
    return file, list(tensors), sum(v.nbytes for v in tensors.values())


def _name_shards(directory: str, shards: list[tuple[str, list[str], int]]) -> None:
    """HF's file names: model.safetensors alone, or model-0000k-of-0000n + an index."""
    if len(shards) == 1:
        os.replace(os.path.join(directory, shards[0][0]),
                   os.path.join(directory, "model.safetensors"))
        return
    weight_map = {}
    for k, (file, names, _) in enumerate(shards, start=1):
        final = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        os.replace(os.path.join(directory, file), os.path.join(directory, final))
        weight_map.update({name: final for name in names})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(s[2] for s in shards)},
                   "weight_map": weight_map}, f, indent=2)


def gguf_summary(config: dict, out_dir: Optional[str] = None) -> str:
    """One line on a converted model, for the command line."""
    params = sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir)
                 if f.endswith(".safetensors")) if out_dir else 0
    return (f"{config['architectures'][0]}: {config['num_hidden_layers']} layers, hidden "
            f"{config['hidden_size']}, {config['num_attention_heads']} heads / "
            f"{config['num_key_value_heads']} kv, vocab {config['vocab_size']}, "
            f"tied={config['tie_word_embeddings']}, {config['torch_dtype']}"
            + (f", {params / 2**20:,.0f} MiB" if out_dir else ""))
