"""PEFT adapter dirs both ways: rl_tpu's adapters give PEFT's logits in transformers, a PEFT
LoRA made in torch gives its logits in rl_tpu, merged exports agree with PEFT's merge, scanned
and unscanned layouts write the same file, and every unsupported dir is refused by name."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from rl_tpu import parallel
from rl_tpu.models import hf, lora, peft_format, tiny
from rl_tpu.models.tokenizer import load_tokenizer
from rl_tpu.models.transformer import Transformer

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

TOL = 1e-5
V = 320
QV = ("q_proj", "v_proj")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("base") / "qwen2")  # qwen2: q/k/v carry biases too
    tiny.write_tiny_model(out, "qwen2", vocab_size=V, init_scale=0.1)
    return out


@pytest.fixture(scope="module")
def base(base_dir):
    return hf.load(base_dir)


@pytest.fixture(scope="module")
def ids():
    return np.random.RandomState(0).randint(0, V, (2, 12)).astype(np.int32)


def random_adapters(cfg, params, lora_cfg, seed=0):
    """(cfg with lora, params with adapters whose A and B are both random and nonzero)."""
    cfg = cfg.replace(lora=lora_cfg)
    abstract, _ = parallel.logical_axes_of(Transformer(cfg), np.zeros((1, 1), np.int32))
    rng = np.random.RandomState(seed)
    fresh = jax.tree.map(lambda x: (0.1 * rng.randn(*x.shape)).astype(np.float32),
                         lora.adapters(abstract))
    return cfg, lora.with_adapters(lora.without_adapters(params), fresh)


def logits(cfg, params, ids):
    return np.asarray(Transformer(cfg).apply({"params": params}, ids))


def torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits.numpy()


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def peft_model(base_dir, adapter_dir):
    return peft.PeftModel.from_pretrained(hf_model(base_dir), adapter_dir).eval()


def assert_moved(with_adapter, without):  # else a parity check could pass with the adapter lost
    assert np.abs(with_adapter - without).max() > 1e-2


@pytest.mark.parametrize("targets,rslora", [(lora.TARGETS, False), (QV, True)],
                         ids=["all-targets", "q_v-rslora"])
def test_saved_adapter_gives_rl_tpu_logits_in_peft(base_dir, base, ids, tmp_path, targets,
                                                   rslora):
    cfg, params = base
    lora_cfg = lora.LoraConfig(rank=4, alpha=12.0, targets=targets, rslora=rslora)
    cfg_l, params_l = random_adapters(cfg, params, lora_cfg)
    ours = logits(cfg_l, params_l, ids)
    assert_moved(ours, logits(cfg, params, ids))

    out = str(tmp_path / "adapter")
    written = peft_format.save_adapter(out, cfg_l, params_l, base_model_path=base_dir)
    tensors = load_file(os.path.join(out, peft_format.WEIGHTS_FILE))
    assert written == sum(t.nbytes for t in tensors.values()) == peft_format.adapter_bytes(
        params_l)
    assert len(tensors) == 2 * len(targets) * cfg.num_layers
    assert all(t.dtype == np.float32 for t in tensors.values())
    assert tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"].shape == (
        cfg.num_heads * cfg.head_dim, 4)
    assert not os.path.exists(out + ".tmp")

    model = peft_model(base_dir, out)
    assert model.peft_config["default"].use_rslora == rslora
    np.testing.assert_allclose(ours, torch_logits(model, ids), atol=TOL, rtol=0)


@pytest.mark.parametrize("target_modules,targets", [
    ("all-linear", lora.TARGETS),  # PEFT saves it expanded: every layer's qualified name
    (r".*\.(q_proj|v_proj)", QV),  # a regex, saved as given
], ids=["all-linear", "regex"])
def test_peft_adapter_loads_with_peft_logits(base_dir, base, ids, tmp_path, target_modules,
                                             targets):
    torch.manual_seed(0)
    model = peft.get_peft_model(hf_model(base_dir), peft.LoraConfig(
        r=4, lora_alpha=6, target_modules=target_modules, use_rslora=True))
    with torch.no_grad():  # PEFT's B starts at zero: make the adapter change the logits
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.1)
    model.eval()
    out = str(tmp_path / "peft")
    model.save_pretrained(out)

    cfg, params = base
    stale_cfg, stale = random_adapters(cfg, params, lora.LoraConfig(rank=2, targets=("up_proj",)))
    cfg_l, params_l = peft_format.load_adapter(out, stale_cfg, stale)  # adapters replaced
    assert cfg_l.lora == lora.LoraConfig(rank=4, alpha=6.0, targets=targets, rslora=True)
    assert cfg_l.replace(lora=None) == cfg
    ours = logits(cfg_l, params_l, ids)
    assert_moved(ours, logits(cfg, params, ids))
    np.testing.assert_allclose(ours, torch_logits(model, ids), atol=TOL, rtol=0)


def test_load_places_adapters_in_their_shardings(base_dir, tmp_path):
    mesh = parallel.make_mesh({"fsdp": 2, "tensor": 2}, devices=jax.devices()[:4])
    cfg, params = hf.load(base_dir, mesh=mesh)
    cfg_l, params_l = random_adapters(cfg, params, lora.LoraConfig(rank=4))
    out, again = str(tmp_path / "adapter"), str(tmp_path / "again")
    peft_format.save_adapter(out, cfg_l, params_l)
    cfg_l, loaded = peft_format.load_adapter(out, cfg, params)  # the mesh of `params`
    abstract, names = parallel.logical_axes_of(Transformer(cfg_l), np.zeros((1, 1), np.int32))
    want = [s.spec for s in jax.tree.leaves(
        lora.adapters(parallel.param_shardings(abstract, names, mesh)))]
    got = [x.sharding.spec for x in jax.tree.leaves(lora.adapters(loaded))]
    assert got == want and any(spec != jax.sharding.PartitionSpec() for spec in want)
    assert all(x.sharding.mesh == mesh for x in jax.tree.leaves(loaded))
    assert loaded["layers_0"]["attn"]["q_proj"]["kernel"] is params["layers_0"]["attn"][
        "q_proj"]["kernel"]  # the base is kept as it is
    peft_format.save_adapter(again, cfg_l, loaded)  # sharded adapters gathered to the same file
    first, second = (load_file(os.path.join(p, peft_format.WEIGHTS_FILE)) for p in (out, again))
    assert all(np.array_equal(first[n], second[n]) for n in first) and first.keys() == second.keys()


def test_merged_export_matches_peft_merge(base_dir, base, ids, tmp_path):
    from rl_tpu.recipes import policy_io

    cfg, params = base
    cfg_l, params_l = random_adapters(cfg, params, lora.LoraConfig(rank=4, alpha=12.0), seed=1)
    adapter = str(tmp_path / "adapter")
    peft_format.save_adapter(adapter, cfg_l, params_l)
    merged = peft_model(base_dir, adapter).merge_and_unload()
    exported = str(tmp_path / "merged")
    policy_io.export_hf(exported, cfg_l, params_l, load_tokenizer(base_dir))
    ours = torch_logits(hf_model(exported), ids)
    assert_moved(ours, logits(cfg, params, ids))
    np.testing.assert_allclose(ours, torch_logits(merged, ids), atol=TOL, rtol=0)


def test_scanned_and_unscanned_round_trip(base_dir, base, ids, tmp_path):
    cfg, params = base
    cfg_l, params_l = random_adapters(cfg, params, lora.LoraConfig(rank=4, alpha=2.0,
                                                                   targets=("o_proj", "up_proj")))
    flat_dir, stacked_dir = str(tmp_path / "flat"), str(tmp_path / "stacked")
    peft_format.save_adapter(flat_dir, cfg_l, params_l)
    cfg_s, params_s = hf.load(base_dir, scan_layers=True)
    cfg_sl, params_sl = peft_format.load_adapter(flat_dir, cfg_s, params_s)
    assert params_sl["layers"]["attn"]["o_proj"]["lora_a"].shape == (cfg.num_layers, 4, 16, 4)
    np.testing.assert_allclose(logits(cfg_sl, params_sl, ids), logits(cfg_l, params_l, ids),
                               atol=TOL, rtol=0)
    peft_format.save_adapter(stacked_dir, cfg_sl, params_sl)
    again = load_file(os.path.join(stacked_dir, peft_format.WEIGHTS_FILE))
    first = load_file(os.path.join(flat_dir, peft_format.WEIGHTS_FILE))
    assert sorted(again) == sorted(first)
    assert all(np.array_equal(again[n], first[n]) for n in first)
    _, back = peft_format.load_adapter(stacked_dir, cfg, params)
    for path, leaf in jax.tree_util.tree_flatten_with_path(lora.adapters(params_l))[0]:
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(_at(back, path)))


def _at(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


# ----------------------------------------------------------------------------- refusals


@pytest.fixture(scope="module")
def good_adapter(base, tmp_path_factory):
    cfg, params = base
    cfg_l, params_l = random_adapters(cfg, params, lora.LoraConfig(rank=4, targets=QV))
    out = str(tmp_path_factory.mktemp("good") / "adapter")
    peft_format.save_adapter(out, cfg_l, params_l)
    return out


def edit_config(**fields):
    def edit(path):
        file = os.path.join(path, peft_format.CONFIG_FILE)
        config = json.load(open(file))
        config.update(fields)
        json.dump(config, open(file, "w"))
    return edit


def edit_tensors(change):
    def edit(path):
        file = os.path.join(path, peft_format.WEIGHTS_FILE)
        tensors = load_file(file)
        change(tensors)
        save_file(tensors, file)
    return edit


def remove(name):
    return lambda path: os.remove(os.path.join(path, name))


Q0 = "base_model.model.model.layers.0.self_attn.q_proj"
REFUSALS = {
    "no-config": (remove(peft_format.CONFIG_FILE), r"no adapter_config\.json"),
    "no-weights": (remove(peft_format.WEIGHTS_FILE), r"no adapter_model\.safetensors"),
    "not-lora": (edit_config(peft_type="LOHA"), r"peft_type='LOHA'; only LoRA"),
    "bias": (edit_config(bias="lora_only"), r"bias='lora_only' \(trained biases\)"),
    "dora": (edit_config(use_dora=True), r"use_dora=True \(DoRA\)"),
    "modules-to-save": (edit_config(modules_to_save=["lm_head"]), r"modules_to_save=\['lm_head'\]"),
    "layers-to-transform": (edit_config(layers_to_transform=[0]), r"layers_to_transform=\[0\]"),
    "layers-pattern": (edit_config(layers_pattern="layers"), r"layers_pattern='layers'"),
    "rank-pattern": (edit_config(rank_pattern={"q_proj": 8}), r"rank_pattern=\{'q_proj': 8\}"),
    "alpha-pattern": (edit_config(alpha_pattern={"q_proj": 8}), r"alpha_pattern="),
    "fan-in-fan-out": (edit_config(fan_in_fan_out=True), r"fan_in_fan_out=True"),
    "pissa": (edit_config(init_lora_weights="pissa"), r"init_lora_weights='pissa' adapts a "
                                                       r"modified base"),
    "lm-head-target": (edit_config(target_modules=["q_proj", "lm_head"]),
                       r"adapts 'lm_head'; rl_tpu adapts only"),
    "regex-embed-target": (edit_config(target_modules=r".*embed_tokens"),
                           r"adapts 'model\.embed_tokens'"),
    "no-targets": (edit_config(target_modules=[]), r"target_modules=\[\]"),
    "missing-tensor": (edit_tensors(lambda t: t.pop(Q0 + ".lora_B.weight")),
                       r"missing tensors '" + Q0.replace(".", r"\.") + r"\.lora_B\.weight'"),
    "extra-tensor": (edit_tensors(lambda t: t.update({Q0 + ".lora_E.weight": np.zeros(2, "f4")})),
                     r"unexpected tensors '" + Q0.replace(".", r"\.") + r"\.lora_E"),
    "more-targets": (edit_config(target_modules=["q_proj", "v_proj", "k_proj"]),
                     r"missing tensors .*k_proj\.lora_A"),
    "wrong-rank": (edit_config(r=8), r"'" + Q0.replace(".", r"\.")
                   + r"\.lora_A\.weight' has shape \[4, 64\], the base and r imply \[8, 64\]"),
    "nan": (edit_tensors(lambda t: t[Q0 + ".lora_A.weight"].__setitem__((0, 0), np.nan)),
            r"'" + Q0.replace(".", r"\.") + r"\.lora_A\.weight' holds 1 NaN"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_unloadable_adapter_is_refused_by_name(base, good_adapter, tmp_path, case):
    edit, message = REFUSALS[case]
    path = shutil.copytree(good_adapter, tmp_path / "adapter")
    edit(str(path))
    cfg, params = base
    with pytest.raises(peft_format.AdapterError, match=message):
        peft_format.load_adapter(str(path), cfg, params)


def test_save_refuses_nan_and_missing_lora(base, tmp_path):
    cfg, params = base
    cfg_l, params_l = random_adapters(cfg, params, lora.LoraConfig(rank=2, targets=QV))
    params_l["layers_1"]["attn"]["v_proj"]["lora_b"][0, 0, 0] = np.inf
    out = str(tmp_path / "adapter")
    with pytest.raises(ValueError, match=r"layers_1/attn/v_proj/lora_b holds 1 NaN or inf"):
        peft_format.save_adapter(out, cfg_l, params_l)
    assert not os.path.exists(out) and not os.path.exists(out + ".tmp")
    with pytest.raises(ValueError, match=r"cfg\.lora is None"):
        peft_format.save_adapter(out, cfg, params)
    with pytest.raises(ValueError, match=r"missing 'layers_0/attn/k_proj/lora_a'"):
        peft_format.save_adapter(out, cfg_l.replace(lora=lora.LoraConfig(rank=2)), params_l)
