"""HF directory handling: sharded files, dtypes, tokenizer export, and clear errors."""

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from rl_tpu.models import hf, tiny
from rl_tpu.models.tokenizer import load_tokenizer
from rl_tpu.models.transformer import Transformer


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tiny") / "qwen2")
    tiny.write_tiny_model(out, "qwen2", vocab_size=320)
    return out


def copy_dir(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def edit_tensors(path, edit):
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def test_many_shards_and_bf16_round_trip(tiny_dir, tmp_path):
    cfg, params = hf.load(tiny_dir)
    out = str(tmp_path / "sharded")
    hf.save(out, cfg, params, dtype="bfloat16", max_shard_bytes=40_000)
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and all(os.path.exists(os.path.join(out, f)) for f in files)
    assert json.load(open(os.path.join(out, "config.json")))["torch_dtype"] == "bfloat16"
    cfg16, params16 = hf.load(out, dtype="bfloat16")
    leaf = params16["layers_0"]["attn"]["q_proj"]["kernel"]
    assert str(leaf.dtype) == "bfloat16"
    np.testing.assert_allclose(np.asarray(leaf, np.float32),
                               np.asarray(params["layers_0"]["attn"]["q_proj"]["kernel"]),
                               rtol=1e-2, atol=1e-2)
    # bf16 on disk, read back into fp32 params
    _, params32 = hf.load(out, dtype="float32")
    assert str(params32["embed"]["embedding"].dtype) == "float32"


def test_saved_tokenizer_is_portable(tiny_dir):
    config = json.load(open(os.path.join(tiny_dir, "tokenizer_config.json")))
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert "chat_template" in config  # inline, for transformers 4.x readers
    tok = load_tokenizer(tiny_dir)
    assert tok.vocab_size == 320
    assert tok.decode(tok.apply_chat_template([{"role": "user", "content": "hi"}])).startswith(
        "<|im_start|>user\nhi<|im_end|>")


def test_missing_tensor_is_named(tiny_dir, tmp_path):
    path = copy_dir(tiny_dir, tmp_path / "m")
    edit_tensors(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(hf.CheckpointError, match=r"missing tensors 'model\.layers\.1\.mlp\.up_proj"):
        hf.load(path)


def test_extra_tensor_is_named(tiny_dir, tmp_path):
    path = copy_dir(tiny_dir, tmp_path / "m")
    edit_tensors(path, lambda t: t.update({"model.layers.0.mlp.extra.weight": np.zeros(3, "f4")}))
    with pytest.raises(hf.CheckpointError, match=r"unexpected tensors 'model\.layers\.0\.mlp\.extra"):
        hf.load(path)


def test_wrong_shape_names_tensor_and_shapes(tiny_dir, tmp_path):
    path = copy_dir(tiny_dir, tmp_path / "m")
    edit_tensors(path, lambda t: t.update(
        {"model.layers.0.self_attn.k_proj.weight": np.zeros((16, 64), "f4")}))
    with pytest.raises(hf.CheckpointError,
                       match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \[16, 64\], "
                             r"config\.json implies \[32, 64\]"):
        hf.load(path)


def test_unknown_architecture(tiny_dir, tmp_path):
    path = copy_dir(tiny_dir, tmp_path / "m")
    config = json.load(open(os.path.join(path, "config.json")))
    config.update(architectures=["MistralForCausalLM"], model_type="mistral")
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(hf.CheckpointError, match=r"unsupported architecture \['MistralForCausalLM'\]"):
        hf.load(path)


def test_unsupported_features_are_refused():
    base = json.load(open(os.path.join(os.path.dirname(__file__), "data_qwen2_config.json")))
    with pytest.raises(hf.CheckpointError, match="use_sliding_window"):
        hf.config_from_hf({**base, "use_sliding_window": True})
    old_style = {k: v for k, v in base.items() if k != "rope_parameters"}  # transformers 4.x
    old_style.update(rope_theta=1e6, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(hf.CheckpointError, match="rope_type 'yarn' is not supported"):
        hf.config_from_hf(old_style)
    old_style["rope_scaling"] = {"type": "linear", "factor": 4.0}
    cfg = hf.config_from_hf(old_style)
    assert (cfg.rope_theta, cfg.rope_scaling.rope_type, cfg.rope_scaling.factor) == (
        1e6, "linear", 4.0)


def test_unreadable_files(tiny_dir, tmp_path):
    path = copy_dir(tiny_dir, tmp_path / "m")
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(hf.CheckpointError, match=r"model\.safetensors: not a readable safetensors"):
        hf.load(path)
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(hf.CheckpointError, match=r"no \*\.safetensors files"):
        hf.load(path)
    with pytest.raises(hf.CheckpointError, match="no config.json"):
        hf.load(str(tmp_path))
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(hf.CheckpointError, match=r"config\.json: unreadable"):
        hf.load(path)


def test_failed_save_keeps_the_previous_checkpoint(tiny_dir, tmp_path):
    cfg, params = hf.load(tiny_dir)
    out = copy_dir(tiny_dir, tmp_path / "keep")
    broken = dict(params)
    del broken["final_norm"]
    with pytest.raises(ValueError, match="missing 'final_norm/scale'"):
        hf.save(out, cfg, broken)
    hf.load(out)  # still whole


def test_make_tiny_model_cli(tmp_path):
    import subprocess
    import sys

    out = str(tmp_path / "llama")
    done = subprocess.run([sys.executable, "-m", "launch.make_tiny_model", "--arch", "llama",
                           "--out", out, "--vocab_size", "384"], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert done.returncode == 0, done.stderr
    assert "llama: 2 layers" in done.stdout
    cfg, params = hf.load(out)
    assert cfg.vocab_size == 384 and cfg.rope_scaling.rope_type == "llama3"
    logits = Transformer(cfg).apply({"params": params}, np.array([[1, 2, 3]], np.int32))
    assert logits.shape == (1, 3, 384)
