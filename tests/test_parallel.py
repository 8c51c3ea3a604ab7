"""Mesh, rules and sharded execution on 8 fake CPU devices (and two processes)."""

import json
import os
import re
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from rl_tpu import parallel
from rl_tpu.models import hf, tiny
from rl_tpu.models.transformer import Transformer

sys.path.insert(0, os.path.dirname(__file__))
from fake_devices import xla_flags  # noqa: E402
from multihost_logits import global_batch  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("m") / "qwen2")
    # vocab 320, D 64, F 128, 4 heads / 2 kv heads: every big matrix splits 8 ways. Weights at
    # std 0.05 keep logits O(1), as in a real LM, so 1e-5 measures sharding, not fp32 rounding.
    tiny.write_tiny_model(out, "qwen2", vocab_size=320, init_scale=0.1)
    return out


def test_mesh_sizes_and_errors():
    mesh = parallel.make_mesh({"fsdp": -1, "tensor": 2})
    assert dict(mesh.shape) == {"data": 1, "fsdp": 4, "expert": 1, "tensor": 2}
    mesh = parallel.make_mesh({"data": 2, "expert": -1})
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "expert": 4, "tensor": 1}
    assert parallel.data_parallel_size(mesh) == 8  # the expert axis splits the rows too
    with pytest.raises(ValueError, match="needs 6 devices, there are 8"):
        parallel.make_mesh({"fsdp": 3, "tensor": 2})
    with pytest.raises(ValueError, match="unknown mesh axes \\['model'\\]"):
        parallel.make_mesh({"model": 2})
    with pytest.raises(ValueError, match="at most one mesh axis may be -1"):
        parallel.make_mesh({"fsdp": -1, "tensor": -1})


def test_logical_rules_respect_divisibility_and_reuse():
    mesh = parallel.make_mesh({"fsdp": 2, "tensor": 4})
    rules = parallel.DEFAULT_RULES
    assert parallel.logical_to_spec(("embed", "heads", "kv"), mesh, rules, (64, 8, 16)) == P(
        "fsdp", "tensor", None)
    # 2 kv heads cannot split 4 ways: replicated on that dim instead of failing
    assert parallel.logical_to_spec(("embed", "kv_heads", "kv"), mesh, rules, (64, 2, 16)) == P(
        "fsdp", None, None)
    # the batch takes both data axes; a later dim cannot reuse them
    assert parallel.logical_to_spec(("act_batch", "embed"), mesh, rules, (8, 64)) == P(
        "fsdp", None)
    custom = parallel.logical_rules([("embed", None), ("mlp", ("fsdp", "tensor"))])
    assert parallel.logical_to_spec(("embed", "mlp"), mesh, custom, (64, 128)) == P(
        None, ("fsdp", "tensor"))
    with pytest.raises(ValueError, match="unknown mesh axis 'model'"):
        parallel.logical_rules([("embed", "model")])


def test_sharded_forward_equals_single_device(model_dir):
    ids = global_batch()
    cfg, single = hf.load(model_dir)
    expected = np.asarray(Transformer(cfg).apply({"params": single}, ids))

    mesh = parallel.make_mesh({"fsdp": 4, "tensor": 2})
    cfg, params = hf.load(model_dir, mesh=mesh)
    held = parallel.bytes_per_device(params)
    total = sum(x.nbytes for x in jax.tree.leaves(single))
    share = max(held.values()) / total
    print(f"param bytes: total {total}, per device max {max(held.values())} ({share:.3f} of all)")
    assert len(held) == 8 and share < 1 / 8 + 0.02  # only norms (tiny) are replicated

    model = Transformer(cfg, mesh=mesh, rules=parallel.DEFAULT_RULES)
    logits = jax.jit(lambda p, x: model.apply({"params": p}, x))(
        params, parallel.host_to_global(ids, mesh))
    assert logits.sharding.spec[0] == ("data", "fsdp") or logits.sharding.spec[0] == "fsdp"
    np.testing.assert_allclose(np.asarray(logits), expected, atol=1e-5, rtol=0)


def test_a_model_built_with_a_mesh_alone_keeps_each_devices_rows():
    """Transformer(cfg, mesh=mesh) with no rules: its activations still follow DEFAULT_RULES.
    Before, flax's with_logical_constraint did nothing without rules, and XLA ran the fsdp MLP
    as partial sums over every row of the batch on every device (a full-batch [B, T, F])."""
    cfg = tiny.tiny_config("qwen2", vocab_size=256, hidden_size=64, intermediate_size=192,
                           num_layers=1, head_dim=16)
    mesh = parallel.make_mesh({"fsdp": -1})
    model = Transformer(cfg, mesh=mesh)
    params = tiny.random_params(cfg, seed=0, mesh=mesh)
    tokens = parallel.host_to_global(np.zeros((8, 16), np.int32), mesh)
    loss = lambda p, x: model.apply({"params": p}, x, return_hidden=True).sum()  # noqa: E731
    hlo = jax.jit(jax.grad(loss)).lower(params, tokens).compile().as_text()
    mlp_shapes = set(re.findall(r"f32\[\d+,16,192\]", hlo))
    assert mlp_shapes == {"f32[1,16,192]"}  # one row a device, forward and backward
    assert parallel.constrain(tokens, ("act_batch", "act_len"), None) is tokens  # no mesh


def test_init_params_is_sharded():
    cfg = tiny.tiny_config("qwen3", vocab_size=320, scan_layers=True)
    mesh = parallel.make_mesh({"fsdp": 4, "tensor": 2})
    params = parallel.init_params(Transformer(cfg), mesh, parallel.DEFAULT_RULES,
                                  jax.random.key(0), np.zeros((1, 1), np.int32))
    kernel = params["layers"]["mlp"]["up_proj"]["kernel"]  # [L, D, F]
    assert kernel.sharding.spec == P(None, "fsdp", "tensor")
    assert kernel.addressable_shards[0].data.shape == (2, 16, 64)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_hosts(script: str, *args: str, devices: int = 0) -> list[str]:
    """Runs tests/<script> as 2 processes of one job on loopback; their logs. `devices` fake
    CPU devices a process (0: the script sets its own, 4)."""
    port = free_port()
    procs = []
    for pid in range(2):
        env = dict(os.environ, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                   JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(pid))
        env.pop("XLA_FLAGS", None)
        if devices:
            env["XLA_FLAGS"] = xla_flags(devices)
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(REPO, "tests", script), *args],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    return logs


@pytest.mark.slow
def test_two_processes_form_one_mesh(model_dir, tmp_path):
    """Two processes x 4 CPU devices on loopback = one 8-device mesh, as hosts of a TPU pod."""
    cfg, single = hf.load(model_dir)
    expected = np.asarray(Transformer(cfg).apply({"params": single}, global_batch()))
    out = str(tmp_path / "logits.npy")
    logs = run_two_hosts("multihost_logits.py", model_dir, out)
    print("\n".join(line for log in logs for line in log.splitlines() if "holds" in line))
    np.testing.assert_allclose(np.load(out), expected, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_two_processes_split_a_mixture_of_experts_one_expert_a_device(tmp_path):
    """Qwen3-MoE's 8 experts over an expert axis of 8 devices on 2 processes (the tokens
    all-gathered across both hosts, the outputs reduce-scattered back) = one device."""
    model_dir = str(tmp_path / "moe")
    tiny.write_tiny_model(model_dir, "qwen3_moe", vocab_size=320, init_scale=0.1)
    cfg, single = hf.load(model_dir)
    expected = np.asarray(Transformer(cfg).apply({"params": single}, global_batch()))
    out = str(tmp_path / "logits.npy")
    run_two_hosts("multihost_logits.py", model_dir, out, "expert=8")
    np.testing.assert_allclose(np.load(out), expected, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_weight_sync_across_two_hosts_moves_nothing_through_host_memory(model_dir, tmp_path):
    """A trainer sharded over 2 hosts x 4 devices feeds each host's own sampler by
    `parallel.host_copies` under a transfer guard that refuses any host <-> device copy; both
    samplers then sample what one device does."""
    from multihost_weight_sync import PROMPTS
    from rl_tpu.core.engine import GenerateRequest, SamplingParams
    from rl_tpu.rollout.sampler import JaxSampler

    cfg, single = hf.load(model_dir)
    expected = [r.output_ids for r in JaxSampler(cfg, single).generate([GenerateRequest(
        p, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
        for p in PROMPTS])]
    prefix = str(tmp_path / "sync")
    logs = run_two_hosts("multihost_weight_sync.py", model_dir, prefix)
    print("\n".join(line for log in logs for line in log.splitlines() if "sync" in line))
    total = sum(x.nbytes for x in jax.tree.leaves(single))
    for pid in range(2):
        with open(f"{prefix}.{pid}.json") as f:
            host = json.load(f)
        assert host["outputs"] == expected and host["version"] == "v2"
        assert "Disallowed" in host["caught"], host["caught"]  # the guard was on
        assert host["bytes_per_device"] < total / 2  # split over the host's 4 devices


@pytest.mark.slow
def test_the_multihost_contract_on_two_processes(tmp_path):
    """Two processes x 2 devices: a collective off the main thread raises, per-host bytes
    gather in order, differing data is caught by hash, and host_copies works on a mesh over
    part of each host's devices (the asynchronous learner's: it failed with "incompatible
    devices" when the copy's mesh spanned every device)."""
    prefix = str(tmp_path / "contract")
    run_two_hosts("multihost_contract.py", prefix, devices=2)
    for pid in range(2):
        with open(f"{prefix}.{pid}.json") as f:
            host = json.load(f)
        assert "parallel.across_hosts" in host["off_thread"]
        assert "'rollout-producer'" in host["off_thread"]
        assert host["on_main"] == 3  # 1 + 2
        assert host["gathered"] == ["xxx", "xxxxxxxx"]
        assert "examples differ between hosts (processes [1]" in host["differ"]
        assert host["copy_equal"] and host["copy_devices"] == host["learner_devices"]
        assert len(host["copy_devices"]) == 1


def test_collectives_refuse_other_threads_in_a_multi_process_job(monkeypatch):
    """The guard itself, in this one process made to look like one of two (the fault cannot
    be caused otherwise in one process; the 2-process test above shows the real one)."""
    import threading

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    parallel.require_main_thread("across_hosts")  # the main thread: allowed
    errors = []

    def body():
        for helper in ("host_copies", "across_hosts", "host_to_global", "sync_hosts"):
            try:
                parallel.require_main_thread(helper)
            except parallel.OffMainThreadCollectiveError as e:
                errors.append(str(e))
    thread = threading.Thread(target=body, name="weight-publisher")
    thread.start()
    thread.join()
    assert len(errors) == 4
    assert all("'weight-publisher'" in e and "2 processes" in e for e in errors)
    assert "parallel.host_to_global" in errors[2]


def test_a_thread_of_a_single_process_run_may_call_them():
    import threading

    out = []
    thread = threading.Thread(target=lambda: out.append(parallel.across_hosts(5, "min")))
    thread.start()
    thread.join()
    assert out == [5]
