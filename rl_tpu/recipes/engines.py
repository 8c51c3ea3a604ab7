"""The rollout engine a config names (the embedded JAX sampler, or SGLang servers), built
over the policy's first weights, and what each later weight sync hands it.
"""

from __future__ import annotations

import os

import jax
import ml_collections

from rl_tpu import parallel
from rl_tpu.core.engine import RolloutEngine
from rl_tpu.core.shared_weights import wait_for_shared_weights
from rl_tpu.models import lora
from rl_tpu.models.tokenizer import ChatTokenizer
from rl_tpu.models.transformer import ModelConfig
from rl_tpu.recipes.config_checks import warmup_shapes
from rl_tpu.rollout.adapter_versions import run_id_of
from rl_tpu.rollout.sampler import JaxSampler
from rl_tpu.rollout.sglang import SGLangEngine


def make_engine(config: ml_collections.ConfigDict, model_cfg: ModelConfig, params,
                tokenizer: ChatTokenizer, workdir: str, version: str = "0",
                devices=None) -> RolloutEngine:
    """The rollout engine the config names, serving `params` as `version` (one weight sync:
    the sampler's own copy, or one HF export the servers load). The embedded sampler runs on
    `devices` (default: `rollout.sampler_devices` of this host's), a LoRA policy's adapters
    as its LoraConfig says (`model_cfg.lora.sampler`)."""
    r = config.rollout
    if r.engine == "sglang":
        urls = [u.strip() for u in r.urls.split(",") if u.strip()]
        weights_dir = r.weights_dir or os.path.join(workdir, "sync")
        kwargs = {}
        if lora.is_on(model_cfg):  # versions in flight: up to max_staleness behind
            # the adapters' names carry the run (adapter_versions.py): process 0's id on
            # every host, which may see the workdir under another path
            run_id = parallel.across_hosts_bytes(run_id_of(weights_dir).encode())[0].decode()
            kwargs = {"keep_adapters": r.max_staleness + 1, "adapter_run_id": run_id}
        engine = SGLangEngine(urls, model_config=model_cfg, **kwargs, weights_dir=weights_dir,
                              tokenizer=tokenizer, router_url=r.router_url or None,
                              # a server started with --api_key (launch.serve_rollout reads
                              # the same variable); kept out of configs and their logs
                              api_key=os.environ.get("RL_TPU_ROLLOUT_API_KEY") or None)
        if engine.router is not None:
            # The router answers 503 until its own health checks (every 60 s by default) have
            # marked a worker healthy, which can be a minute after everything started.
            engine.wait_healthy()
        engine.update_weights(parallel.host_copies(params), version)
        wait_for_shared_weights(engine, version)
        return engine
    shapes = warmup_shapes(r.warmup)
    if devices is None:
        devices = jax.local_devices()[:r.sampler_devices or None]
    mesh = parallel.sampler_mesh(devices, model_cfg.num_kv_heads, r.sampler_tensor)
    kwargs = {}
    if config.model.sampler_dtype:
        kwargs["dtype"] = config.model.sampler_dtype
    if r.kv_dtype:
        kwargs["kv_dtype"] = r.kv_dtype
    sampler = JaxSampler(model_cfg, parallel.host_copies(params), mesh=mesh,
                         tokenizer=tokenizer, max_batch=r.max_batch,
                         kv_tokens=r.kv_tokens_per_device * len(devices), seed=config.seed,
                         version=version, prefill_chunk=r.prefill_chunk,
                         prefix_cache_tokens=r.prefix_cache_tokens if r.prefix_reuse else 0,
                         keep_prefix_cache_on_update=r.prefix_cache_keep_on_update, **kwargs)
    sampler.warmup(shapes)
    return sampler


def engine_weights(params):
    """What a weight sync hands an engine made by `make_engine`: this host's copies
    (`parallel.host_copies`, a collective) of the params, or of a LoRA policy's adapters alone,
    since the engine holds the frozen base from its first weights on."""
    return parallel.host_copies(lora.adapters(params) if lora.has_adapters(params) else params)
