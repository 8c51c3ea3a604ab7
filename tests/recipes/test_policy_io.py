"""The run config's LoRA block into the policy and its sampler (rl_tpu/recipes/policy_io.py,
engines.py): `model.lora.*` becomes one LoraConfig, the sampler's mode included, which the
model config carries to whoever builds a sampler; a field the LoraConfig refuses fails the
config check, before anything is built. On the tiny model, no training."""

import pytest

from rl_tpu.models import lora, peft_format
from rl_tpu.recipes import engines, placement, policy_io
from rl_tpu.recipes.config import check
from test_config import load


def _lora_smoke(rank=4, sampler="merge"):
    c = load("quickstart", "smoke")
    c.model.lora.rank, c.model.lora.alpha, c.model.lora.sampler = rank, 8.0, sampler
    c.rollout.warmup = ""  # the sampler is built, not compiled ahead
    c.model.tiny_hidden, c.model.tiny_layers = 32, 1  # the least model that has adapters
    return c


def test_the_lora_block_is_one_lora_config_whose_sampler_mode_the_sampler_runs(tmp_path):
    assert policy_io.lora_config(_lora_smoke(rank=0, sampler="lowrank")) is None  # LoRA off
    config = _lora_smoke(sampler="lowrank")
    assert policy_io.lora_config(config) == lora.LoraConfig(rank=4, alpha=8.0,
                                                            sampler="lowrank")
    path = policy_io.model_path(config, str(tmp_path))
    model_cfg, _, params, tokenizer = policy_io.load_policy(config, path,
                                                            placement.make_mesh(config))
    assert lora.is_on(model_cfg) and model_cfg.lora.sampler == "lowrank"
    # lowrank: the sampler's model runs the adapters (merge would run the plain model)
    # (tests/rollout/test_lora_sampler.py runs both modes)
    sampler = engines.make_engine(config, model_cfg, params, tokenizer, str(tmp_path))
    assert sampler.model.cfg.lora == model_cfg.lora

    # an adapter loaded from model.lora.path takes the sampler's mode from the config (PEFT's
    # file has no such field), as it takes the training dropout
    adapter_dir = str(tmp_path / "adapter")
    peft_format.save_adapter(adapter_dir, model_cfg, params)
    config.model.lora.path = adapter_dir
    loaded_cfg, _, _, _ = policy_io.load_policy(config, path, placement.make_mesh(config))
    assert loaded_cfg.lora.sampler == "lowrank"
    assert not lora.is_on(policy_io.merged(loaded_cfg, params)[0])


@pytest.mark.parametrize("key, value, said", [
    ("sampler", "fused", r"model.lora: lora sampler='fused'; choose one of \('merge', "
                         r"'lowrank'\)"),
    ("dropout", 1.5, r"model.lora: lora dropout=1.5 must be in \[0, 1\)"),
    ("targets", "q_proj,qkv", r"model.lora: lora targets \['q_proj', 'qkv'\]: \['qkv'\]")])
def test_a_lora_field_the_adapters_refuse_fails_the_config_check(key, value, said):
    config = _lora_smoke()
    config.model.lora[key] = value
    with pytest.raises(ValueError, match=said):
        check(config)
    config.model.lora.rank = 0  # LoRA off: the block is not read
    check(config)
