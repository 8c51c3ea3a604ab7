"""Ahead-of-time compiles for TPU slices (rl_tpu/aot.py, launch.compile_check): the sizes and
advice checked by hand here; the compiles (libtpu, no TPU) in subprocesses, marked slow; the real
model sizes (minutes and GBs each) also `pod`, outside the default command."""

import os
import subprocess
import sys

import jax
import pytest

from rl_tpu import aot
from rl_tpu.models import lora
from rl_tpu.models.presets import PRESETS, preset_config
from rl_tpu.recipes.config import base_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = aot.GIB


def test_presets_have_the_published_parameter_counts():
    # Qwen2.5-7B: 28 layers of D=3584, F=18944, 28/4 heads of 128, qkv bias, untied V=152064.
    d, f, v, layers = 3584, 18944, 152064, 28
    attn = d * (28 + 2 * 4) * 128 + 28 * 128 * d + (28 + 2 * 4) * 128
    expected = layers * (attn + 3 * d * f + 2 * d) + 2 * v * d + d
    assert preset_config("qwen2.5-7b").num_params() == expected  # 7,615,616,512
    assert round(preset_config("Qwen2.5-1.5B").num_params() / 1e9, 2) == 1.54  # tied head
    assert preset_config("llama-3.1-8b").rope_scaling.rope_type == "llama3"
    assert preset_config("qwen3-8b").qk_norm
    with pytest.raises(ValueError, match="unknown model preset 'gpt-5'.*qwen2.5-7b"):
        preset_config("gpt-5")
    # Qwen3-MoE as published, truncated: 30.5B total / 3.3B activated (ours: 30.53B / 3.35B,
    # the embeddings and head counted), 235B / 22B (235.09B / 22.19B)
    for name, total, active, unit in (("qwen3-30b-a3b", 305, 33, 1e8),
                                      ("qwen3-235b-a22b", 235, 22, 1e9)):
        moe = preset_config(name)
        assert int(moe.num_params() / unit) == total, name
        assert int(moe.num_active_params() / unit) == active, name
        assert moe.moe.num_experts == 128 and moe.moe.top_k == 8 and moe.qk_norm
    assert len(PRESETS) == 9


def test_unknown_topology_names_the_chips():
    with pytest.raises(ValueError, match="v7x:2x2.*v5e.*v5p"):
        aot.topology_devices("v7x:2x2")
    with pytest.raises(ValueError, match="<chip>:<shape>"):
        aot.topology_devices("v5p")


def _report(*programs, fsdp=1, chips=16):
    return aot.Report("v5p:2x2x4", chips, 95 * GIB, "m", {"data": chips // fsdp, "fsdp": fsdp,
                                                         "tensor": 1}, list(programs))


def test_a_program_fits_when_its_whole_footprint_does():
    # arguments + outputs - donated + temporaries: a donated state is counted once
    update = aot.ProgramMemory("policy_update", 1.0, argument=60 * GIB, output=60 * GIB,
                               alias=60 * GIB, temp=30 * GIB)
    assert update.total == 90 * GIB
    assert not _report(update).misfits()
    bigger = aot.ProgramMemory("policy_update", 1.0, 60 * GIB, 60 * GIB, 60 * GIB, 36 * GIB)
    assert _report(bigger).misfits() == [bigger]
    # what the chip holds meanwhile (a synchronous run's sampler weights) counts too
    beside = aot.ProgramMemory("policy_update", 1.0, 60 * GIB, 60 * GIB, 60 * GIB, 30 * GIB,
                               held=6 * GIB)
    assert beside.peak == 96 * GIB and _report(beside).misfits() == [beside]
    (line,) = aot.advice(_report(beside, fsdp=16), base_config("grpo"))
    assert line.startswith("policy_update needs 96.0 GiB") and "model.lora.rank=8" in line


def test_advice_names_the_keys_that_shrink_a_program():
    config = base_config("grpo")
    config.train.micro_batches = 2
    state_bound = aot.ProgramMemory("policy_update", 1.0, 120 * GIB, 120 * GIB, 120 * GIB,
                                    10 * GIB)
    (line,) = aot.advice(_report(state_bound), config)
    assert line.startswith("policy_update needs 130.0 GiB of 95.0 GiB: try ")
    # the state is what does not fit: shard it first
    assert line.index("--config.mesh.fsdp=16") < line.index("--config.train.micro_batches=4")
    activation_bound = aot.ProgramMemory("score", 1.0, 10 * GIB, 0, 0, 100 * GIB)
    (line,) = aot.advice(_report(activation_bound, fsdp=16), config)
    assert "micro_batches=4" in line and "remat" not in line and "fsdp" not in line
    config.rollout.max_batch = 64
    sampler = aot.ProgramMemory("sampler_prefill", 1.0, 1 * GIB, 1 * GIB, 0, 100 * GIB)
    (line,) = aot.advice(_report(sampler), config)
    assert "--config.rollout.max_batch=32" in line


def test_advice_shards_over_the_learners_chips_when_the_sampler_has_some():
    # an asynchronous run's learner on 8 of 16 chips: fsdp over those 8, and the table says so
    config = base_config("grpo")
    state_bound = aot.ProgramMemory("policy_update", 1.0, 120 * GIB, 120 * GIB, 120 * GIB,
                                    10 * GIB)
    report = _report(state_bound, chips=16)
    report.learner_chips = 8
    (line,) = aot.advice(report, config)
    assert "--config.mesh.fsdp=8 " in line
    assert "learner programs on 8 of the 16 chips" in report.table()


def _tiny_bf16(rank=0, algo="grpo"):
    """A bf16 tiny policy (2 layers of 256) on 4 fake CPU devices, params sharded over them:
    the setting where full fine-tuning's fp32 master and Adam moments outweigh the base."""
    config = base_config(algo)
    config.model.dtype = "bfloat16"
    config.model.tiny_hidden, config.model.tiny_vocab = 256, 512
    config.model.lora.rank = rank
    config.mesh.data, config.mesh.fsdp = 1, -1
    config.train.tasks_per_step, config.train.samples_per_task = 4, 2
    config.train.minibatches = 1
    config.train.length_buckets = (128,)
    config.env.max_context_tokens = 128
    return config


def _cpu_plan(config):
    return aot.plan(config, "cpu:4", devices=jax.devices()[:4])


def _path_keys(tree):
    return [(tuple(getattr(k, "key", getattr(k, "name", k)) for k in path), x)
            for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def test_a_lora_policy_update_needs_less_than_full_fine_tuning():
    """A LoRA config's abstract state trains the adapters alone (optimizer moments of their
    shapes, no fp32 master: fp32 adapters on the bf16 base), and its compiled policy update
    holds a fraction of full fine-tuning's state and less in all."""
    full_plan, lora_plan = _cpu_plan(_tiny_bf16()), _cpu_plan(_tiny_bf16(rank=4))
    state = lora_plan.learner.policy
    assert state.trainable == frozenset(lora.ADAPTER_KEYS) and state.master is None
    adapter_shapes = {x.shape for _, x in _path_keys(lora.adapters(lora_plan.params))}
    moments = [(path, x) for path, x in _path_keys(state.opt_state) if x.ndim]
    assert moments and all(path[-1] in lora.ADAPTER_KEYS and x.shape in adapter_shapes
                           for path, x in moments), moments
    assert sum(x.size for _, x in moments) == 2 * lora.adapter_count(lora_plan.params)  # mu, nu
    assert full_plan.learner.policy.master is not None  # the bf16 base's fp32 copy

    (full,), (low,) = [[p for p in aot.learner_programs(planned) if p.name == "policy_update"]
                       for planned in (full_plan, lora_plan)]
    # bf16 params + fp32 master + two fp32 moments (14 bytes a param) against the bf16 base
    # and fp32 adapters with their moments (2 bytes a param and a little); the batch beside
    assert aot.chip_bytes(state) < aot.chip_bytes(full_plan.learner.policy) / 4
    assert low.argument < full.argument / 3, (low, full)
    assert low.total < full.total and low.peak < full.peak, (low, full)


def test_a_lora_critic_trains_its_adapters_and_head_and_the_sampler_holds_its_mode():
    """PPO with LoRA: the critic's optimizer covers its adapters and value head only. The
    sampler in merge mode runs the plain model and keeps the base it merges from beside the
    merged params; in lowrank mode it runs the adapters and holds the base once."""
    config = _tiny_bf16(rank=4, algo="ppo")
    critic = _cpu_plan(config).learner.critic
    assert critic.trainable == frozenset(lora.ADAPTER_KEYS + ("head",))
    trained = {path[-1] if path[-1] in lora.ADAPTER_KEYS else path[-2]
               for path, x in _path_keys(critic.opt_state) if x.ndim}
    assert trained == {"lora_a", "lora_b", "head"}

    cfg = aot.model_config(config)[1]
    host = jax.devices()[:4]
    merge = aot.sampler_weights(config, cfg, host)
    config.model.lora.sampler = "lowrank"  # the mode travels in the model config's LoraConfig
    low_cfg = aot.model_config(config)[1]
    assert (cfg.lora.sampler, low_cfg.lora.sampler) == ("merge", "lowrank")
    low = aot.sampler_weights(config, low_cfg, host)
    assert merge.cfg.lora is None and not lora.has_adapters(merge.params)
    assert low.cfg.lora == low_cfg.lora and lora.has_adapters(low.params)
    # the base it merges from, beside the merged tree; the same prefix pool in both
    assert merge.held - low.held == aot.chip_bytes(merge.params) > 0
    config.model.lora.sampler = "fused"
    with pytest.raises(ValueError, match="model.lora: lora sampler='fused'.*merge"):
        aot.model_config(config)


# tests/conftest.py turns XLA's backend optimisation off for the suite's CPU programs; a TPU
# program's fit (its memory analysis) is measured as `launch.compile_check` measures it for users
TPU_COMPILE_AS_USERS_DO = {"JAX_DISABLE_MOST_OPTIMIZATIONS": "0"}


def _compile_check(*args, timeout=900):
    env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1", **TPU_COMPILE_AS_USERS_DO)
    return subprocess.run([sys.executable, "-m", "launch.compile_check", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_compile_check_fits_the_babyai_smoke_on_a_v5e_slice():
    out = _compile_check("--config", "configs/babyai_cpu.py:smoke", "--topology", "v5e:2x2")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert any("on v5e:2x2 (4 chips, 16.0 GiB HBM each)" in line for line in lines)
    for program in ("policy_update", "score", "sampler_prefill", "sampler_decode"):
        (row,) = [line for line in lines if line.startswith(program + " ")]
        assert row.endswith("yes")


@pytest.mark.slow
def test_compile_check_compiles_the_replayed_rows_too():
    # bapo_offpolicy:replay,smoke on one host of 4 chips: 4 tasks x 2 samples and as many
    # replayed groups (ceil(0.5 / 0.5 x 4) = 4 of 2), 16 rows, a multiple of 4 data-parallel x
    # 2 minibatches; recipes/shapes.py, as the trainer batches them (tests/recipes/test_shapes.py)
    out = _compile_check("--config", "configs/bapo_offpolicy.py:replay,smoke", "--topology",
                         "v5e:2x2", "--programs", "score")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    (row,) = [line for line in out.stdout.splitlines() if line.startswith("score ")]
    assert row.split()[1].startswith("16x")


@pytest.mark.slow
def test_compile_check_gives_an_asynchronous_sampler_half_of_each_host():
    # v5p:2x2x4, 4 hosts of 4 chips: the sampler compiles for 2 chips, the learner for the
    # other 8 (placement.split_devices, as the trainer splits them)
    out = _compile_check("--config", "configs/babyai_cpu.py:smoke", "--topology", "v5p:2x2x4",
                         "--programs", "score,sampler_decode", "--config.rollout.max_staleness=1",
                         "--config.train.tasks_per_step=8")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "mesh {'data': 8, 'fsdp': 1, 'expert': 1, 'tensor': 1}" in out.stdout
    assert "learner programs on 8 of the 16 chips" in out.stdout
    assert "(one host's 2 chips)" in out.stdout


@pytest.mark.slow
def test_compile_check_names_what_does_not_fit_and_exits_1():
    # 8192 episodes of 2048 tokens, 2048 rows a chip, and a score budget that holds them all
    # (2048 x 2048 tokens): even the last 512-query attention block of the score pass holds
    # [2048 rows, 4 heads, 512, 2048] fp32 logits (32 GiB), twice a v5e chip's HBM.
    out = _compile_check("--config", "configs/babyai_cpu.py:smoke", "--topology", "v5e:2x2",
                         "--programs", "score", "--config.train.tasks_per_step=4096",
                         "--config.train.score_tokens_per_device=4194304")
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-3000:]
    assert "8192x2048/1" in out.stdout
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("does not fit: score needs")]
    assert "--config.train.score_tokens_per_device=2097152" in line


@pytest.mark.slow
@pytest.mark.pod
@pytest.mark.timeout(2700)
def test_qwen25_7b_agentgym_update_and_score_fit_a_v5p_128_slice():
    """The shipped AgentGym BabyAI settings (256 episodes of up to 8192 tokens, 4 minibatches,
    fsdp over every chip, scanned layers, full remat) with Qwen2.5-7B on v5p:4x4x4."""
    out = _compile_check("--config", "configs/agentgym.py:babyai", "--model", "qwen2.5-7b",
                         "--topology", "v5p:4x4x4", "--programs", "policy_update,score",
                         timeout=1500)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()
            if line.startswith(("policy_update ", "score "))}
    assert set(rows) == {"policy_update", "score"}
    for name, row in rows.items():
        assert row[-1] == "yes" and float(row[-2]) <= 95.0, (name, row)


@pytest.mark.slow
@pytest.mark.pod
@pytest.mark.timeout(2700)
def test_qwen25_1_5b_agentgym_fits_a_v5e_16_slice():
    """The shipped AgentGym BabyAI settings with Qwen2.5-1.5B on v5e:4x4 (16 chips of 16 GiB),
    every program: the token budgets pick the update's and the score pass's micro-batches
    (4 rows of 8192 a chip: 4 and 8 micro-batches) and the sampler's rows (8 of 8448 slots)."""
    out = _compile_check("--config", "configs/agentgym.py:babyai", "--model", "qwen2.5-1.5b",
                         "--topology", "v5e:4x4", timeout=2400)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()
            if line.startswith(("policy_update ", "score ", "sampler_"))}
    assert rows["policy_update"][1] == "256x8192/4" and rows["score"][1] == "256x8192/8"
    assert rows["sampler_prefill"][1] == "8x8192"
    for name, row in rows.items():
        assert row[-1] == "yes" and float(row[-2]) <= 15.75, (name, row)


SPLASH_FOR_TPU = """
import jax, jax.numpy as jnp, numpy as np
from rl_tpu import aot, parallel
from rl_tpu.models import tiny
from rl_tpu.models.logprobs import token_logprobs
from rl_tpu.models.transformer import Transformer
devices, _ = aot.topology_devices("v5e:2x2")
mesh = parallel.make_mesh({"fsdp": -1}, devices=devices)
cfg = tiny.tiny_config("qwen2", vocab_size=256, hidden_size=256, intermediate_size=512,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=128,
                       attention_impl="splash", remat="full", scan_layers=True)
params = aot.abstract_params(cfg, mesh)
model = Transformer(cfg, mesh=mesh)
batch = aot.rollout_batch(8, 1024, mesh, ["tokens", "segment_ids"])
loss = lambda p, b: token_logprobs(model, p, b, with_entropy=False)[0].sum()
hlo = jax.jit(jax.grad(loss)).lower(params, batch).compile().as_text()
print("mosaic kernels:", hlo.count("tpu_custom_call"))
"""


@pytest.mark.slow
def test_splash_attention_compiles_for_tpu_forward_and_backward():
    """A scanned, rematerialised policy's gradient with model.attention_impl=splash, compiled
    for a v5e slice: the Pallas kernels (Mosaic custom calls) are in the program."""
    env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1", JAX_PLATFORMS="cpu",
               **TPU_COMPILE_AS_USERS_DO)
    out = subprocess.run([sys.executable, "-c", SPLASH_FOR_TPU], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("mosaic kernels:")]
    assert int(line.split(":")[1]) >= 3  # the forward, and the backward's dq and dkv kernels
