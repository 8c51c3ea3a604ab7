"""Adapter-only weight sync to SGLang (weight_sync.py, sglang.py): LoRA adapters written as PEFT
dirs, loaded with `/load_lora_adapter`, requests pinned to a version with `lora_path`.

What SGLang 0.5.23 on CPU does with LoRA, read in its source (sglang/srt/...) and run here:

  * `torch_native` is the one LoRA backend in plain torch (`lora/backend/lora_registry.py`):
    csgmv (the default), triton and triton_v2 run triton kernels, ascend needs an NPU. So a
    CPU server needs `--lora-backend torch_native`; with csgmv it dies at its warm-up forward
    (`kernels/ops/lora/dense/lora_tuning_config.py` l. 58: "AttributeError: 'NoneType' object
    has no attribute 'replace'", the GPU name it reads being None), before any triton kernel.
  * with any backend, the server dies while it builds its LoRA layers: they allocate pinned
    host memory unconditionally (`lora/layers.py` l. 141-146 for the embedding, l. 475-480
    for the column-parallel projections q/k/v and gate/up inherit, and l. 324, 594, 723, 814;
    `torch.tensor(..., device="cpu", pin_memory=True)`), which the CUDA build of torch that
    pip installs refuses on a machine without an NVIDIA driver: "RuntimeError: Found no
    NVIDIA driver on your system" (a CPU-only torch: "pin_memory=True requires a CUDA or other
    accelerator backend"). `test_stock_sglang_on_cpu_dies_building_lora_layers` pins that.
  * Pinning only speeds host-to-GPU copies, so the servers here get, beside the sgl_kernel
    stand-in (sglang_server.py), a `sitecustomize` that makes it a no-op when torch sees no
    GPU (`PIN_MEMORY_SHIM`). With it, torch_native serves the adapters, loads and unloads
    them at run time, and its logprobs match rl_tpu's own to ~1e-5.

The slow tests start one LoRA server for the module (~30 s) and two short-lived others (one
without LoRA, one without the shim); the fast ones need no server: the bookkeeping of the
versions, SGLang's constraints, and (a scripted stdlib server) what two real servers at once
would show.
"""

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_tpu import parallel
from rl_tpu.core.engine import GenerateRequest, RolloutError, SamplingParams
from rl_tpu.models import hf, lora, peft_format
from rl_tpu.models.logprobs import token_logprobs
from rl_tpu.models.tiny import tiny_config, write_tiny_model
from rl_tpu.models.transformer import Transformer
from rl_tpu.rollout import weight_sync
from rl_tpu.rollout.sglang import SGLangEngine
from rl_tpu.rollout.weight_sync import AdapterVersions

from sglang_server import lora_flags, lora_server_env, start_sglang_server  # noqa: E402

PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [100, 7, 300, 9, 11]]
LOGPROB_ATOL = 1e-4  # as test_sglang_client.py: float32 end to end, measured ~1e-5
RANK = 4

def random_adapters(cfg, seed: int, scale: float = 0.3) -> dict:
    """Adapters of `cfg.lora`'s shapes with A and B both random (B = 0 would be the base)."""
    abstract, _ = parallel.logical_axes_of(Transformer(cfg), np.zeros((1, 1), np.int32))
    leaves, tree = jax.tree.flatten(lora.adapters(abstract))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [scale * jax.random.normal(k, x.shape, jnp.float32)
                                     for k, x in zip(keys, leaves)])


def rl_tpu_logprobs(cfg, params, prompt, output, temperature=1.0) -> np.ndarray:
    """rl_tpu's own log softmax(logits / T) of `output` after `prompt` (what the trainer
    recomputes), under whatever adapters `params` and `cfg` carry."""
    tokens = jnp.asarray([list(prompt) + list(output)], jnp.int32)
    full, _ = token_logprobs(Transformer(cfg), params, {"tokens": tokens},
                             temperature=temperature, with_entropy=False)
    return np.asarray(full[0, len(prompt):], np.float64)


def greedy(max_new_tokens=8):
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)


# ----------------------------------------------------------------------------- bookkeeping


def test_versions_keep_the_newest_and_unload_the_oldest_beyond_keep():
    versions = AdapterVersions(keep=2)
    assert versions.acquire() is None  # before any load: the base
    assert versions.add("v1") == [] and versions.add("v2") == []
    assert versions.add("v3") == ["v1"]  # marked unloading: handed out once
    assert versions.add("v4") == ["v2"]
    versions.unloaded("v1")
    versions.unloaded("v2")
    assert versions.loaded() == ["v3", "v4"] and versions.newest == "v4"
    with pytest.raises(ValueError, match="loaded already"):
        versions.add("v4")
    with pytest.raises(ValueError, match="keep_adapters=0"):
        AdapterVersions(keep=0)


def test_a_version_requests_carry_is_unloaded_only_after_the_last_one_ends():
    versions = AdapterVersions(keep=1)
    versions.add("v1")
    assert versions.acquire(3) == "v1"  # one generate call of three requests
    assert versions.add("v2") == []  # v1 is past keep but carried
    assert versions.acquire() == "v2"  # new requests get the newest
    assert versions.release("v1", 2) == []
    assert versions.in_flight("v1") == 1
    assert versions.release("v1", 1) == ["v1"]  # the last one ended: unload it now
    assert versions.release("v2") == []  # the newest is never unloaded
    versions.unload_failed("v1")  # a failed unload is handed out again at the next chance
    assert versions.release(None) == [] and versions.add("v3") == ["v1", "v2"]


def test_sglang_target_sets_it_cannot_serve_are_named():
    assert weight_sync.sglang_target_problems(lora.TARGETS) == []
    assert weight_sync.sglang_target_problems(("q_proj", "v_proj")) == []
    assert weight_sync.sglang_target_problems(("o_proj", "down_proj", "gate_proj")) == []
    [qkv] = weight_sync.sglang_target_problems(("q_proj", "k_proj"))
    assert "v_proj" in qkv
    [mlp] = weight_sync.sglang_target_problems(("up_proj", "down_proj"))
    assert "gate_proj" in mlp


def test_server_info_problems_name_the_flag():
    cfg = lora.LoraConfig(rank=8, targets=("q_proj", "v_proj", "down_proj"))
    ok = {"enable_lora": True, "max_lora_rank": 8, "lora_target_modules": ["all"],
          "max_loaded_loras": None}
    problem = weight_sync.lora_server_problem
    assert problem(ok, cfg, keep=2) is None
    assert problem({}, cfg, keep=2) is None  # a reply that does not say: the load will tell
    assert "without LoRA" in problem({**ok, "enable_lora": None}, cfg, 2)
    assert "--max-lora-rank 4" in problem({**ok, "max_lora_rank": 4}, cfg, 2)
    assert problem({**ok, "lora_target_modules": ["q_proj", "down_proj"]}, cfg, 2) is None
    wide = lora.LoraConfig(rank=8, targets=("q_proj", "v_proj", "o_proj", "down_proj"))
    assert "leave out ['o_proj', 'qkv_proj']" in problem(
        {**ok, "lora_target_modules": ["down_proj"]}, wide, 2)
    assert "--max-loaded-loras >= 4" in problem({**ok, "max_loaded_loras": 3}, cfg, 3)


def test_rslora_is_exported_with_the_scale_sglang_computes(tmp_path):
    """SGLang scales by lora_alpha / r and ignores use_rslora (lora/lora.py l. 71)."""
    cfg = lora.LoraConfig(rank=4, alpha=8.0, rslora=True)
    (tmp_path / peft_format.CONFIG_FILE).write_text(json.dumps(peft_format.peft_config(cfg)))
    weight_sync.sglang_scale_config(str(tmp_path), cfg)
    config = json.loads((tmp_path / peft_format.CONFIG_FILE).read_text())
    assert config["use_rslora"] is False
    assert config["lora_alpha"] / config["r"] == pytest.approx(cfg.scale) == 4.0


# ----------------------------------------------------------------------------- two servers


class FakeLoraServer:
    """Answers /model_info, /server_info, /health_generate, /load_lora_adapter (refused with
    SGLang's own reply when `refuse_load`), /unload_lora_adapter and /generate (recording
    the lora_path it gets) as SGLang does: what two real servers at once would show."""

    def __init__(self, model_path: str, refuse_load: bool = False):
        self.model_path, self.refuse_load = model_path, refuse_load
        self.loaded, self.posts = {}, []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _reply(self, status, payload):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/model_info":
                    return self._reply(200, {"model_path": fake.model_path,
                                             "weight_version": "default"})
                if self.path == "/server_info":
                    return self._reply(200, {"enable_lora": True, "max_lora_rank": 8,
                                             "lora_target_modules": ["all"]})
                if self.path == "/v1/models":  # the base, then each adapter (its parent)
                    return self._reply(200, {"object": "list", "data": [
                        {"id": "base", "root": "base"}] + [
                        {"id": name, "root": path, "parent": "base"}
                        for name, path in fake.loaded.items()]})
                self._reply(200 if self.path == "/health_generate" else 404, {})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.posts.append((self.path, body))
                if self.path == "/load_lora_adapter" and fake.refuse_load:
                    return self._reply(400, {"success": False, "error_message":
                                             "LoRA adapter loading failed: disk quota"})
                if self.path == "/load_lora_adapter":
                    fake.loaded[body["lora_name"]] = body["lora_path"]
                    return self._reply(200, {"success": True, "error_message": "",
                                             "loaded_adapters": fake.loaded})
                if self.path == "/unload_lora_adapter":
                    fake.loaded.pop(body["lora_name"], None)
                    return self._reply(200, {"success": True, "error_message": "",
                                             "loaded_adapters": fake.loaded})
                if self.path == "/generate":
                    return self._reply(200, [{"output_ids": [1], "meta_info": {
                        "finish_reason": {"type": "length"}, "prompt_tokens": len(p),
                        "weight_version": "default", "output_token_logprobs": [[-0.5, 1, None]]}}
                        for p in body["input_ids"]])
                self._reply(404, {"detail": "Not Found"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = "http://127.0.0.1:%d" % self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def lora_cfg(tmp_path):
    """A tiny qwen2 config with rank-4 adapters; the fakes serve its base's config.json."""
    cfg = tiny_config("qwen2", vocab_size=64, eos_token_ids=(2,))
    (tmp_path / "served").mkdir()
    (tmp_path / "served" / "config.json").write_text(json.dumps(hf.config_to_hf(cfg,
                                                                                "float32")))
    return cfg.replace(lora=lora.LoraConfig(rank=RANK, alpha=8.0))


def test_a_load_one_server_refuses_is_undone_on_the_others(tmp_path, lora_cfg):
    good = FakeLoraServer(str(tmp_path / "served"))
    bad = FakeLoraServer(str(tmp_path / "served"), refuse_load=True)
    weights = tmp_path / "weights"
    engine = SGLangEngine([good.url, bad.url], model_config=lora_cfg,
                          weights_dir=str(weights), logprob_convention="full", backoff_s=0.01)
    try:
        with pytest.raises(RolloutError, match="disk quota"):
            engine.update_weights(random_adapters(lora_cfg, 0), "v1")
        name = engine.weight_sync.adapter_name("v1")
        assert good.loaded == {} and ("/unload_lora_adapter", {"lora_name": name}) in good.posts
        assert not os.path.exists(weights / "adapter_v1")
        assert engine.stats()["adapters_loaded"] == [] and engine.last_sync_bytes == 0
        engine.generate([GenerateRequest(PROMPTS[0], greedy(1))])
        [body] = [b for p, b in good.posts + bad.posts if p == "/generate"]
        assert "lora_path" not in body  # still the base everywhere
    finally:
        engine.close()
        good.close()
        bad.close()


def test_other_hosts_name_a_version_once_process_0_has_loaded_it(tmp_path, lora_cfg,
                                                                 monkeypatch):
    """Process 1 of a multi-host trainer (its own copy of the adapters): no file, no load or
    unload request; its requests name a version only once the barrier after process 0's load
    confirms it (`shared_weights_loaded`: before, process 0 may still be loading it), and it
    forgets the versions past keep."""
    server = FakeLoraServer(str(tmp_path / "served"))
    engine = SGLangEngine([server.url], model_config=lora_cfg, keep_adapters=1,
                          weights_dir=str(tmp_path / "w"), logprob_convention="full")
    monkeypatch.setattr(weight_sync.jax, "process_index", lambda: 1)

    def named():
        [result] = engine.generate([GenerateRequest(PROMPTS[0], greedy(1))])
        [body] = [b for p, b in server.posts[-1:] if p == "/generate"]
        return result.weight_version, body.get("lora_path")

    try:
        engine.update_weights(random_adapters(lora_cfg, 0), "v1")
        assert named() == ("default", None)  # announced only: the base still
        engine.shared_weights_loaded("v1")
        assert named() == ("v1", engine.weight_sync.adapter_name("v1"))
        engine.update_weights(random_adapters(lora_cfg, 1), "v2")
        assert named()[0] == "v1"  # process 0 may not hold v2 yet
        engine.shared_weights_loaded("v2")
        engine.shared_weights_loaded("v2")  # a second barrier on it changes nothing
        assert named() == ("v2", engine.weight_sync.adapter_name("v2"))
        assert not os.path.exists(tmp_path / "w")
        assert {p for p, _ in server.posts} == {"/generate"}
        assert engine.stats()["adapters_loaded"] == ["v2"] and engine.weight_version == "v2"
    finally:
        engine.close()
        server.close()


def test_process_0_unloads_no_version_another_host_may_still_name():
    """Retirement counts every host's requests: at each barrier the other hosts report the
    oldest version they may name until the next one, and process 0 keeps it and the newer."""
    elsewhere = AdapterVersions(keep=1)  # another host
    elsewhere.announce("v1")
    assert elsewhere.oldest_named() is None and elsewhere.acquire() is None
    assert elsewhere.confirm("v1") == [] and elsewhere.acquire(2) == "v1"  # a long call
    here = AdapterVersions(keep=1)  # process 0
    here.add("v1")
    assert here.hold([elsewhere.oldest_named()]) == []
    assert here.add("v2") == [] and here.add("v3") == []  # v1 is named elsewhere: kept
    assert here.loaded() == ["v1", "v2", "v3"]
    elsewhere.announce("v2")
    assert elsewhere.confirm("v2") == []  # v1 still carried there
    assert elsewhere.release("v1", 2) == ["v1"]  # that host only forgets it
    elsewhere.unloaded("v1")
    assert elsewhere.oldest_named() == "v2"
    assert here.hold([elsewhere.oldest_named()]) == ["v1"]  # free everywhere: unload it
    here.unloaded("v1")
    assert here.hold([None]) == ["v2"]  # a host naming none holds none


def test_a_resumed_run_unloads_what_its_earlier_life_left(tmp_path, lora_cfg):
    """A server that outlived the trainer still holds the adapters the run's earlier life
    loaded: the resumed run (same weights_dir: the same run id) unloads them at first contact
    and loads its own again; another run's adapters on the server are left alone."""
    server = FakeLoraServer(str(tmp_path / "served"))
    run = str(tmp_path / "run" / "sync")
    adapters = random_adapters(lora_cfg, 0)
    engines = []

    def engine(weights_dir):
        engines.append(SGLangEngine([server.url], model_config=lora_cfg, keep_adapters=2,
                                    weights_dir=weights_dir, logprob_convention="full"))
        return engines[-1]

    try:
        earlier = engine(run)
        earlier.update_weights(adapters, "1")
        earlier.update_weights(adapters, "2")  # then killed: nothing unloaded
        other = engine(str(tmp_path / "other" / "sync"))
        other.update_weights(adapters, "2")
        ours, theirs = earlier.weight_sync.adapter_name, other.weight_sync.adapter_name
        assert ours("2") != theirs("2") and set(server.loaded) == {ours("1"), ours("2"),
                                                                   theirs("2")}
        resumed = engine(run)
        resumed.update_weights(adapters, "2")
        assert set(server.loaded) == {ours("2"), theirs("2")}
        assert server.loaded[ours("2")] == os.path.join(run, "adapter_2")
        assert sorted(os.listdir(run)) == ["adapter_2"]
        [result] = resumed.generate([GenerateRequest(PROMPTS[0], greedy(1))])
        assert result.weight_version == "2"
    finally:
        for e in engines:
            e.close()
        server.close()


def test_targets_sglang_cannot_serve_are_refused_before_any_request(tmp_path, lora_cfg):
    server = FakeLoraServer(str(tmp_path / "served"))
    cfg = lora_cfg.replace(lora=lora.LoraConfig(rank=RANK, targets=("k_proj", "o_proj")))
    engine = SGLangEngine([server.url], model_config=cfg, weights_dir=str(tmp_path / "w"))
    try:
        with pytest.raises(ValueError, match="q_proj and v_proj"):
            engine.update_weights(random_adapters(cfg, 0), "v1")
        assert server.posts == [] and not os.path.exists(tmp_path / "w")
    finally:
        engine.close()
        server.close()


# ----------------------------------------------------------------------------- real SGLang

@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(model dir, config, params) of a random tiny qwen2 (2 layers, D 64, V 512)."""
    path = str(tmp_path_factory.mktemp("lora_models") / "base")
    write_tiny_model(path, "qwen2")
    cfg, params = hf.load(path)
    return path, cfg, params


@pytest.fixture(scope="module")
def server(base, tmp_path_factory):
    env = lora_server_env(str(tmp_path_factory.mktemp("lora_env")))
    proc = start_sglang_server(base[0], *lora_flags(), env=env)
    yield proc
    proc.stop()


@pytest.fixture
def lora_setup(base):
    """(config with rank-4 adapters on every projection, base params, adapters v1, v2)."""
    _, cfg, params = base
    cfg = cfg.replace(lora=lora.LoraConfig(rank=RANK, alpha=8.0))
    return cfg, params, random_adapters(cfg, 1), random_adapters(cfg, 2)


def _engine(server, cfg, tmp_path, **kwargs):
    engine = SGLangEngine([server.url], model_config=cfg, weights_dir=str(tmp_path / "weights"),
                          request_timeout_s=300, connect_retries=1, backoff_s=0.2, **kwargs)
    engine.wait_healthy(timeout=120)
    return engine


def served_names(engine) -> list[str]:
    """The adapter names the server holds (its OpenAI model list: the base, then each)."""
    models = engine.transport.call("GET", "/v1/models")[1]["data"]
    return sorted(m["id"] for m in models[1:])


def served_adapters(engine) -> list[str]:
    """The versions of `engine`'s run the server holds (names without the run's prefix)."""
    prefix = engine.weight_sync.adapter_name("")
    return sorted(n[len(prefix):] for n in served_names(engine) if n.startswith(prefix))


def _unload_all(engine):
    """Leaves the module's server as it found it: no adapters."""
    for name in served_names(engine):
        engine.transport.call("POST", "/unload_lora_adapter", {"lora_name": name})


@pytest.mark.parametrize("sampling", [greedy(), SamplingParams(max_new_tokens=8, temperature=0.8,
                                                               top_p=0.9, ignore_eos=True)],
                         ids=["greedy", "t0.8"])
@pytest.mark.slow
@pytest.mark.xdist_group("rollout_servers")
@pytest.mark.sglang_venv
def test_after_a_sync_logprobs_are_rl_tpus_own_under_that_adapter(server, lora_setup, tmp_path,
                                                                 sampling):
    """(a) Adapters sent alone (as the trainer sends them), loaded as version "v1": every
    request now carries it, and SGLang's logprobs are rl_tpu's own under those adapters
    (and far from the base's)."""
    cfg, params, v1, _ = lora_setup
    engine = _engine(server, cfg, tmp_path)
    try:
        [before] = engine.generate([GenerateRequest(PROMPTS[0], sampling)])
        np.testing.assert_allclose(  # no sync yet: the base (what fresh adapters compute)
            before.logprobs, rl_tpu_logprobs(cfg.replace(lora=None), params, PROMPTS[0],
                                             before.output_ids, sampling.temperature or 1.0),
            atol=LOGPROB_ATOL)
        engine.update_weights(v1, "v1")
        assert engine.weight_version == "v1" and served_adapters(engine) == ["v1"]
        assert sorted(os.listdir(tmp_path / "weights" / "adapter_v1")) == sorted(
            [weight_sync.EXPORT_MARKER, peft_format.CONFIG_FILE, peft_format.WEIGHTS_FILE])
        results = engine.generate([GenerateRequest(p, sampling) for p in PROMPTS])
        with_v1 = lora.with_adapters(params, v1)
        for prompt, result in zip(PROMPTS, results):
            t = sampling.temperature or 1.0
            assert result.weight_version == "v1" and len(result.output_ids) == 8
            ours = rl_tpu_logprobs(cfg, with_v1, prompt, result.output_ids, t)
            np.testing.assert_allclose(result.logprobs, ours, atol=LOGPROB_ATOL)
            base_lp = rl_tpu_logprobs(cfg.replace(lora=None), params, prompt,
                                      result.output_ids, t)
            assert np.max(np.abs(np.array(result.logprobs) - base_lp)) > 100 * LOGPROB_ATOL
    finally:
        _unload_all(engine)
        engine.close()


@pytest.mark.slow
@pytest.mark.xdist_group("rollout_servers")
@pytest.mark.sglang_venv
def test_requests_keep_the_version_they_started_with(server, lora_setup, tmp_path):
    """(b) keep_adapters=1: a long request on v1 is still running when v2 loads, so both
    versions are loaded side by side; a request sent then gets v2. Each reports its own
    version's logprobs, and v1 is unloaded (its dir deleted) once its request ends."""
    cfg, params, v1, v2 = lora_setup
    engine = _engine(server, cfg, tmp_path, keep_adapters=1)
    weights = tmp_path / "weights"
    long_request = GenerateRequest(PROMPTS[2], SamplingParams(max_new_tokens=600, seed=7,
                                                              ignore_eos=True))
    out = {}
    try:
        engine.update_weights(lora.with_adapters(params, v1), "v1")  # the whole model this time
        thread = threading.Thread(target=lambda: out.update(r=engine.generate([long_request])))
        thread.start()
        deadline = time.monotonic() + 30
        while engine.stats()["adapter_requests_in_flight"].get("v1") != 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.5)  # on the server now
        engine.update_weights(lora.adapters(lora.with_adapters(params, v2)), "v2")
        assert thread.is_alive(), "the v1 request ended before v2 loaded; make it longer"
        assert served_adapters(engine) == ["v1", "v2"]  # v1 carried: kept past keep_adapters
        assert engine.stats()["adapters_loaded"] == ["v1", "v2"]
        [short] = engine.generate([GenerateRequest(PROMPTS[0], greedy())])
        thread.join(timeout=300)
        [long_result] = out["r"]
        assert (long_result.weight_version, short.weight_version) == ("v1", "v2")
        # 600 positions in float32: a few logprobs near -6 measured 2.5e-4 (4e-5 relative)
        # apart, hence rtol too; the versions are nats apart.
        long_v1 = rl_tpu_logprobs(cfg, lora.with_adapters(params, v1), PROMPTS[2],
                                  long_result.output_ids)
        np.testing.assert_allclose(long_result.logprobs, long_v1, atol=LOGPROB_ATOL, rtol=1e-4)
        long_v2 = rl_tpu_logprobs(cfg, lora.with_adapters(params, v2), PROMPTS[2],
                                  long_result.output_ids)
        assert np.max(np.abs(np.array(long_result.logprobs) - long_v2)) > 100 * LOGPROB_ATOL
        np.testing.assert_allclose(
            short.logprobs, rl_tpu_logprobs(cfg, lora.with_adapters(params, v2), PROMPTS[0],
                                            short.output_ids), atol=LOGPROB_ATOL)
        assert served_adapters(engine) == ["v2"]  # unloaded once its last request ended
        assert engine.stats()["adapters_loaded"] == ["v2"]
        assert not os.path.exists(weights / "adapter_v1")
        assert os.path.exists(weights / "adapter_v2")
    finally:
        _unload_all(engine)
        engine.close()


@pytest.mark.slow
@pytest.mark.xdist_group("rollout_servers")
@pytest.mark.sglang_venv
def test_a_run_resumed_against_a_server_that_stayed_up_serves_its_versions(server, lora_setup,
                                                                           tmp_path):
    """(d) A trainer loads versions 1 and 2 and dies (nothing unloaded); the server stays up.
    Resumed from its step-2 checkpoint (the same weights_dir), it loads version 2 again: the
    server, which refuses a second adapter under a name it holds, holds the resumed run's 2
    alone and serves it at rl_tpu's log-probs."""
    cfg, params, v1, v2 = lora_setup
    earlier = _engine(server, cfg, tmp_path, keep_adapters=2)
    try:
        earlier.update_weights(v1, "1")
        earlier.update_weights(v2, "2")
        assert len(served_names(earlier)) == 2
        earlier.close()  # killed: its adapters stay on the server
        resumed = _engine(server, cfg, tmp_path, keep_adapters=2)
        try:
            resumed.update_weights(v2, "2")
            assert served_adapters(resumed) == ["2"] and len(served_names(resumed)) == 1
            [result] = resumed.generate([GenerateRequest(PROMPTS[1], greedy())])
            assert result.weight_version == "2"
            np.testing.assert_allclose(
                result.logprobs, rl_tpu_logprobs(cfg, lora.with_adapters(params, v2),
                                                 PROMPTS[1], result.output_ids),
                atol=LOGPROB_ATOL)
        finally:
            _unload_all(resumed)
            resumed.close()
    finally:
        earlier.close()


@pytest.mark.slow
@pytest.mark.xdist_group("rollout_servers")
@pytest.mark.sglang_venv
def test_a_sync_moves_the_adapter_files_alone(server, base, lora_setup, tmp_path):
    """(c) The bytes a sync counts are the adapter dir's files, and a small fraction of a
    full-weight sync's (measured here on the same server: the base reloaded as it is)."""
    cfg, params, v1, v2 = lora_setup
    engine = _engine(server, cfg, tmp_path, keep_adapters=2)
    full = _engine(server, cfg.replace(lora=None), tmp_path / "full")
    try:
        engine.update_weights(v1, "v1")
        engine.update_weights(v2, "v2")
        adapter_dir = tmp_path / "weights" / "adapter_v2"
        on_disk = sum(f.stat().st_size for f in adapter_dir.iterdir())
        tensors = peft_format.adapter_bytes(v2)  # float32 A and B of every adapted projection
        assert engine.last_sync_bytes == on_disk
        assert tensors < on_disk < tensors + 8192  # + the safetensors header and the json
        stats = engine.stats()
        assert stats["syncs"] == 2 and stats["total_sync_bytes"] == 2 * on_disk
        full.update_weights(params, "base-2")
        assert full.last_sync_bytes == sum(
            f.stat().st_size for f in (tmp_path / "full" / "weights" / "base-2").iterdir())
        assert engine.last_sync_bytes * 10 < full.last_sync_bytes
        [result] = engine.generate([GenerateRequest(PROMPTS[1], greedy())])  # still serves v2
        np.testing.assert_allclose(
            result.logprobs, rl_tpu_logprobs(cfg, lora.with_adapters(params, v2), PROMPTS[1],
                                             result.output_ids), atol=LOGPROB_ATOL)
    finally:
        _unload_all(engine)
        engine.close()
        full.close()


@pytest.mark.slow
@pytest.mark.xdist_group("rollout_servers")
@pytest.mark.sglang_venv
def test_rslora_adapters_serve_at_rl_tpus_scale(server, base, tmp_path):
    """use_rslora scales by alpha / sqrt(r); SGLang reads lora_alpha / r only, and the export
    makes up for it. Adapters on q/v/o and down only (a target set SGLang reads)."""
    _, cfg, params = base
    cfg = cfg.replace(lora=lora.LoraConfig(rank=RANK, alpha=8.0, rslora=True,
                                           targets=("q_proj", "v_proj", "o_proj", "down_proj")))
    adapters = random_adapters(cfg, 3)
    engine = _engine(server, cfg, tmp_path)
    try:
        engine.update_weights(adapters, "rs-1")
        [result] = engine.generate([GenerateRequest(PROMPTS[0], greedy())])
        np.testing.assert_allclose(
            result.logprobs, rl_tpu_logprobs(cfg, lora.with_adapters(params, adapters),
                                             PROMPTS[0], result.output_ids), atol=LOGPROB_ATOL)
    finally:
        _unload_all(engine)
        engine.close()


@pytest.mark.slow
@pytest.mark.xdist_group("rollout_servers")
@pytest.mark.sglang_venv
def test_a_server_without_lora_is_refused_naming_the_flags(base, lora_setup, tmp_path):
    cfg, _, v1, _ = lora_setup
    with start_sglang_server(base[0]) as plain:
        engine = SGLangEngine([plain.url], model_config=cfg,
                              weights_dir=str(tmp_path / "weights"), request_timeout_s=120)
        try:
            with pytest.raises(RolloutError, match="launched without LoRA") as err:
                engine.wait_healthy(timeout=120)
            assert "--enable-lora --max-lora-rank 4 --lora-target-modules all" in str(err.value)
            with pytest.raises(RolloutError, match="--lora-backend torch_native"):
                engine.update_weights(v1, "v1")
            assert not os.path.exists(tmp_path / "weights")  # refused before writing
            [result] = engine.generate([GenerateRequest(PROMPTS[0], greedy(2))])
            assert result.weight_version == "default"  # the base, no lora_path sent
        finally:
            engine.close()


@pytest.mark.slow
@pytest.mark.xdist_group("rollout_servers")
@pytest.mark.sglang_venv
def test_stock_sglang_on_cpu_dies_building_lora_layers(base, tmp_path):
    """Without PIN_MEMORY_SHIM, SGLang 0.5.23 cannot serve LoRA on CPU at all (module doc).
    When this fails, a newer SGLang no longer pins unconditionally: drop the shim."""
    env = lora_server_env(str(tmp_path), shim=False)
    with pytest.raises(RuntimeError) as err:
        start_sglang_server(base[0], *lora_flags(), env=env, timeout=300).stop()
    assert "Found no NVIDIA driver" in str(err.value) or "pin_memory" in str(err.value)
    assert "sglang/srt/lora/layers.py" in str(err.value)

