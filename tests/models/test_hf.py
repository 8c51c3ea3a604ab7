"""HF directory handling: sharded files, dtypes, tokenizer export, clear errors, and loading
scanned layers one device slice at a time."""

import json
import os
import shutil
import tracemalloc

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

from rl_tpu import parallel
from rl_tpu.models import hf, tiny
from rl_tpu.models.moe import MoeConfig
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


def test_non_finite_weights_are_never_exported(tiny_dir, tmp_path):
    cfg, params = hf.load(tiny_dir)
    kernel = np.asarray(params["layers_0"]["mlp"]["up_proj"]["kernel"]).copy()
    kernel[0, 0], kernel[1, 2] = np.nan, np.inf
    poked = jax.tree.map(lambda x: x, params)
    poked["layers_0"]["mlp"]["up_proj"]["kernel"] = jnp.asarray(kernel)
    out = tmp_path / "final_hf"
    with pytest.raises(ValueError, match=r"param layers_0/mlp/up_proj/kernel holds 2 NaN or inf "
                                         r"value\(s\) \(as float32\); non-finite weights are "
                                         "never exported"):
        hf.save(str(out), cfg, poked)
    assert sorted(os.listdir(tmp_path)) == []  # neither the dir nor its partial copy
    # A finite fp32 value past bfloat16's range is one too, once cast
    kernel = np.asarray(params["layers_0"]["mlp"]["up_proj"]["kernel"]).copy()
    kernel[0, 0] = 3.4e38  # < float32 max 3.4028e38, > bfloat16 max 3.3895e38
    poked["layers_0"]["mlp"]["up_proj"]["kernel"] = jnp.asarray(kernel)
    with pytest.raises(ValueError, match=r"holds 1 NaN or inf value\(s\) \(as bfloat16\)"):
        hf.save(str(out), cfg, poked, dtype="bfloat16")
    assert not out.exists()


@pytest.mark.slow  # two CLI subprocesses
def test_make_tiny_model_and_generate_clis(tmp_path):
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
    # ... and launch.generate loads it and decodes greedily from it
    done = subprocess.run([sys.executable, "-m", "launch.generate", "--model_path", out,
                           "--batch", "2", "--max_new_tokens", "4"], capture_output=True,
                          text=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "forward: logits (1, " in done.stdout and "finite=True" in done.stdout
    assert "greedy: " in done.stdout and "(finish: " in done.stdout
    assert "tokens/s (" in done.stdout and "batch 2, up to 4 new tokens" in done.stdout


# --- dtypes ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,name", [
    ("float32", "float32"), (np.float32, "float32"), (jnp.float32, "float32"),
    (np.dtype("float32"), "float32"), ("bfloat16", "bfloat16"), (jnp.bfloat16, "bfloat16"),
    (ml_dtypes.bfloat16, "bfloat16"), ("bf16", "bfloat16"),
], ids=["str", "np", "jnp", "np.dtype", "bf16-str", "bf16-jnp", "bf16-ml_dtypes", "bf16-alias"])
def test_load_dtype_spellings(tiny_dir, dtype, name):
    cfg, params = hf.load(tiny_dir, dtype=dtype)
    assert cfg.dtype == cfg.param_dtype == name  # the config holds names, whatever came in
    assert {str(x.dtype) for x in jax.tree.leaves(params)} == {name}


def test_load_param_dtype_apart_and_save_dtype_spellings(tiny_dir, tmp_path):
    cfg, params = hf.load(tiny_dir, dtype=jnp.bfloat16, param_dtype=np.float32)
    assert (cfg.dtype, cfg.param_dtype) == ("bfloat16", "float32")
    assert str(params["embed"]["embedding"].dtype) == "float32"
    out = str(tmp_path / "bf16")
    hf.save(out, cfg, params, dtype=jnp.bfloat16)
    assert json.load(open(os.path.join(out, "config.json")))["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize("dtype", ["floaty", "int32", jnp.float64, None, 3])
def test_nonsense_dtype_is_named(tiny_dir, dtype):
    # The argument is to blame, not the model dir: the message names it and what would do.
    with pytest.raises(ValueError, match=r"hf\.load\(dtype\)=.* use one of float32, bfloat16, "
                                         r"float16") as err:
        hf.load(tiny_dir, dtype=dtype)
    assert not isinstance(err.value, hf.CheckpointError) and "config.json" not in str(err.value)


# --- views and scanned layers ------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_hf_view_is_hf_to_ours_without_a_copy(arch):
    # Distinct sizes for every letter, so a wrong split or order cannot pass by symmetry.
    cfg = tiny.tiny_config("qwen3" if arch == "qwen3_moe" else arch, vocab_size=40,
                           hidden_size=12, intermediate_size=20, num_heads=6, num_kv_heads=2,
                           head_dim=8)
    if arch == "qwen3_moe":  # 7 experts of width 9: letters X and M
        cfg = cfg.replace(arch=arch, moe=MoeConfig(num_experts=7, top_k=2, intermediate_size=9))
    rng = np.random.default_rng(0)
    for rule in hf.active_rules(cfg):
        x = rng.standard_normal(hf.table_dims(rule.hf_dims, cfg)).astype(np.float32)
        view = hf.hf_view(x, rule, cfg)
        np.testing.assert_array_equal(view, hf.hf_to_ours(x, rule, cfg), err_msg=rule.hf)
        assert np.shares_memory(view, x), rule.hf


LAYERS_ON_DATA = parallel.logical_rules([("layers", "data")])


@pytest.mark.parametrize("rules", [parallel.DEFAULT_RULES, LAYERS_ON_DATA],
                         ids=["layers_replicated", "layers_sharded"])
def test_scanned_load_on_a_mesh_equals_stacked_unscanned(tiny_dir, rules):
    cfg, flat = hf.load(tiny_dir)
    mesh = parallel.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    cfg_s, scanned = hf.load(tiny_dir, mesh=mesh, rules=rules, scan_layers=True)
    assert cfg_s.scan_layers and cfg.num_layers == 2
    expected = {k: v for k, v in flat.items() if not k.startswith("layers_")}
    expected["layers"] = jax.tree.map(lambda *xs: np.stack(xs),
                                      *[flat[f"layers_{i}"] for i in range(cfg.num_layers)])
    assert jax.tree.structure(scanned) == jax.tree.structure(expected)
    jax.tree.map(lambda got, want: np.testing.assert_array_equal(np.asarray(got), want),
                 scanned, expected)
    up = scanned["layers"]["mlp"]["up_proj"]["kernel"]  # [L, D, F] = [2, 64, 128]
    layers_axis = "data" if rules is LAYERS_ON_DATA else None
    assert up.sharding.spec == P(layers_axis, "fsdp", "tensor")
    assert up.addressable_shards[0].data.shape == ((1 if layers_axis else 2), 32, 64)


def test_scanned_load_reads_only_each_devices_layers_and_slice(tiny_dir, monkeypatch):
    """Every tensor read happens inside a device's callback, which reads one tensor per layer
    of its slice of the [L, ...] stack, and allocates only its own shard."""
    calls, active = [], []
    real_read, real_make = hf.SafetensorsDir.read, jax.make_array_from_callback

    def read(self, name):
        assert active, f"{name} read outside a device's callback"
        active[-1]["names"].append(name)
        return real_read(self, name)

    def make(shape, sharding, callback):
        def spied(index):
            record = {"shape": shape, "index": index, "names": []}
            active.append(record)
            tracemalloc.start()
            try:
                out = callback(index)
                record["peak"] = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
                active.pop()
            record["nbytes"] = out.nbytes
            calls.append(record)
            return out
        return real_make(shape, sharding, spied)

    monkeypatch.setattr(hf.SafetensorsDir, "read", read)
    monkeypatch.setattr(jax, "make_array_from_callback", make)
    mesh = parallel.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    cfg, _ = hf.load(tiny_dir, mesh=mesh, rules=LAYERS_ON_DATA, scan_layers=True)

    stacked = [c for c in calls if any(".layers." in n for n in c["names"])]
    assert stacked and len(stacked) + sum(1 for c in calls if c not in stacked) == len(calls)
    for c in stacked:
        layers = list(range(cfg.num_layers)[c["index"][0]])
        assert layers == [int(n.split(".")[2]) for n in c["names"]], c
        assert len(layers) == 1  # the layer axis is split over data=2: one layer a device
    # One device's piece of mlp.up_proj (HF [F, D] = [128, 64] a layer): layer 1, D/2 x F/2.
    (up,) = [c for c in stacked if c["names"] == ["model.layers.1.mlp.up_proj.weight"]
             and c["index"][1:] == (slice(0, 32), slice(0, 64))]
    assert up["nbytes"] == 1 * 32 * 64 * 4
    # It allocated its shard (8 KiB), not the layer's tensor (32 KiB) nor the stack (64 KiB).
    assert up["peak"] < 2 * up["nbytes"], up["peak"]


def test_a_truncated_safetensors_file_is_named_by_check_and_load(tiny_dir, tmp_path):
    path = copy_dir(tiny_dir, tmp_path / "m")
    file = os.path.join(path, "model.safetensors")
    size = os.path.getsize(file)
    with open(file, "r+b") as f:  # a copy cut short: the header whole, the last tensor not
        f.truncate(size - 10)
    for check in (hf.check_model_dir, hf.load):
        with pytest.raises(hf.CheckpointError, match=rf"model\.safetensors: truncated: tensor "
                                                     rf".* ends at byte {size} but the file "
                                                     rf"has {size - 10}; copy or download"):
            check(path)
    with open(file, "r+b") as f:  # cut inside the header
        f.truncate(20)
    with pytest.raises(hf.CheckpointError, match=r"model\.safetensors: truncated \(20 bytes"):
        hf.check_model_dir(path)


def test_a_header_whose_offsets_do_not_hold_the_tensor_is_refused(tiny_dir, tmp_path):
    path = copy_dir(tiny_dir, tmp_path / "m")
    file = os.path.join(path, "model.safetensors")
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header, data = json.loads(f.read(size)), f.read()
    name = "model.norm.weight"  # hidden 64 floats: 256 bytes
    begin, end = header[name]["data_offsets"]
    assert end - begin == 256
    header[name]["data_offsets"] = [begin, begin + 4]
    raw = json.dumps(header).encode()
    with open(file, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + data)
    with pytest.raises(hf.CheckpointError, match=rf"'model\.norm\.weight' of shape \[64\] and "
                                                 rf"dtype F32 has data_offsets \[{begin}, "
                                                 rf"{begin + 4}\], which do not hold it"):
        hf.check_model_dir(path)


@pytest.mark.parametrize("text,named", [
    ("{broken", r"config\.json: unreadable JSON"),
    ("[1, 2]", r"config\.json: holds a list, not an HF config object"),
    ('{"architectures": ["Qwen2ForCausalLM"], "vocab_size": 320}',
     r"config\.json: no 'num_attention_heads'"),
])
def test_a_broken_config_json_is_one_named_error(tiny_dir, tmp_path, text, named):
    path = copy_dir(tiny_dir, tmp_path / "m")
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write(text)
    with pytest.raises(hf.CheckpointError, match=named) as err:
        hf.check_model_dir(path)
    e = err.value  # one traceback, not a chain of two
    assert e.__cause__ is None and (e.__context__ is None or e.__suppress_context__)


def test_check_model_dir_accepts_a_good_dir_and_names_a_missing_one(tiny_dir, tmp_path):
    assert hf.check_model_dir(tiny_dir) == hf.read_config(tiny_dir)
    with pytest.raises(hf.CheckpointError, match="no such model directory"):
        hf.check_model_dir(str(tmp_path / "nope"))


def test_config_json_is_remembered_per_transformers_version_and_fields(tmp_path, monkeypatch):
    """config_to_hf builds config.json with transformers' own class once per argument set and
    version (building one imports torch), then reads it back: the same dict either way; a
    corrupt or unwritable memo is skipped, never trusted."""
    memo = tmp_path / "memo"
    monkeypatch.setenv("RL_TPU_HF_CONFIG_CACHE", str(memo))
    cfg = tiny.tiny_config("llama")
    built = hf.config_to_hf(cfg, "float32")
    (file,) = memo.iterdir()
    assert built["rope_scaling"]["rope_type"] == "llama3" and built["num_hidden_layers"] == 2
    assert hf.config_to_hf(cfg, "float32") == built  # read back
    record = json.loads(file.read_text())
    record["hidden_size"] = 12345  # what the memo holds is what a second call returns
    file.write_text(json.dumps(record))
    assert hf.config_to_hf(cfg, "float32")["hidden_size"] == 12345
    file.write_text('{"half a')  # corrupt: rebuilt and rewritten
    assert hf.config_to_hf(cfg, "float32") == built
    assert json.loads(file.read_text())["hidden_size"] == cfg.hidden_size
    other = hf.config_to_hf(tiny.tiny_config("llama", vocab_size=256), "float32")
    assert other["vocab_size"] == 256 and len(list(memo.iterdir())) == 2  # its own entry
    monkeypatch.setenv("RL_TPU_HF_CONFIG_CACHE", str(file))  # a file, not a dir: unwritable
    assert hf.config_to_hf(cfg, "float32") == built
