"""What a recipe builds from its config before the loop: mesh, policy, tokenizer, engine, envs.

Each builder reads one config block and fails with a message naming the key when the block
asks for something that cannot be had (a model dir without config.json, an engine without
urls). Recipes call these in order; nothing here loops.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from typing import Callable, Optional

import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh

from rl_tpu import parallel, schedules
from rl_tpu.core.engine import RolloutEngine, SamplingParams
from rl_tpu.core.env import DelayedEnv, Env, TaskSource, make as make_env_by_name
from rl_tpu.core.shared_weights import wait_for_shared_weights
from rl_tpu.models import hf, lora, tiny
from rl_tpu.models.tokenizer import ChatTokenizer, load_tokenizer
from rl_tpu.recipes.config_checks import warmup_shapes
from rl_tpu.models.transformer import ModelConfig, Transformer
from rl_tpu.train.state import OptimConfig, TrainState, create_state, make_optimizer

log = logging.getLogger(__name__)


def step_seed(seed: int, step: int, what: int = 0) -> int:
    """The sampling seed of one step (and purpose), for every driver: fresh each step, the same on a rerun."""
    return int(np.random.SeedSequence([seed, step, what]).generate_state(1)[0] & 0x7FFFFFFF)


def make_mesh(config: ml_collections.ConfigDict, devices=None) -> Mesh:
    """The training mesh over `devices` (default: every device of every host)."""
    m = config.mesh
    return parallel.make_mesh({"data": m.data, "fsdp": m.fsdp, "tensor": m.tensor},
                              devices=devices)


def split_devices(config: ml_collections.ConfigDict, devices: Optional[list] = None,
                  process_index: Optional[int] = None) -> tuple[list, list]:
    """(learner devices, host `process_index`'s embedded-sampler devices) among `devices`.

    `devices`: every device of every host, each knowing its host (`process_index`); default
    jax.devices(), and launch.compile_check passes a TPU topology's abstract devices (rl_tpu/
    aot.py). `process_index`: default this process's. A host's devices are those of `devices`
    on it, in order (as jax.local_devices() lists them).

    Synchronous (and with SGLang servers, which sample elsewhere) both span every device, the
    sampler `rollout.sampler_devices` of them (0 = all local): they take turns. Asynchronous
    with the embedded sampler they run at once, so they get devices of their own: the sampler
    takes the first `rollout.sampler_devices` local devices of each host (0 = half of them)
    and the learner's mesh every other device of every host. A host of one device (a plain
    CPU: what `python -m launch.train` gets without XLA flags) cannot split: there the
    asynchronous producer's sampler shares the device with the learner, each on its own copy
    of the weights as in a synchronous run, and the two take turns on it instead of
    overlapping (the learner's mesh and the sampler are one device either way, so a lock-step
    run's numbers are those of a two-device host's).
    """
    r = config.rollout
    devices = list(jax.devices() if devices is None else devices)
    host = jax.process_index() if process_index is None else process_index
    local = [d for d in devices if d.process_index == host]
    if r.max_staleness == 0 or r.engine != "jax":
        return devices, local[:r.sampler_devices] if r.sampler_devices else local
    if len(local) == 1 and r.sampler_devices in (0, 1):
        log.warning("rollout.max_staleness=%d on a host of one device: the embedded sampler "
                    "shares it with the learner and they take turns (on a CPU, "
                    "XLA_FLAGS=--xla_force_host_platform_device_count=2 gives each its own)",
                    r.max_staleness)
        return devices, local
    n = r.sampler_devices or len(local) // 2
    if not 1 <= n < len(local):
        allowed = ("rollout.sampler_devices to 0 (the one device, shared)" if len(local) == 1
                   else f"rollout.sampler_devices to 0 (half of them) or 1 <= "
                        f"rollout.sampler_devices < {len(local)}")
        raise ValueError(
            f"rollout.sampler_devices={r.sampler_devices}, but this host has {len(local)} "
            f"device(s): rollout.max_staleness={r.max_staleness} runs the embedded sampler "
            f"beside the learner on the first rollout.sampler_devices of them, the learner on "
            f"the rest. Set {allowed}")
    # every host gives its first n devices to its sampler: the rest of all hosts form the mesh
    by_host: dict[int, list] = {}
    for d in devices:
        by_host.setdefault(d.process_index, []).append(d)
    sampler_ids = {d.id for on_host in by_host.values() for d in on_host[:n]}
    return ([d for d in devices if d.id not in sampler_ids],
            [d for d in local if d.id in sampler_ids])


def check_hosts(config: ml_collections.ConfigDict) -> None:
    """Refuses, before anything is built, a mode that cannot be run on this many hosts.

    Lock-step asynchronous rollouts (`rollout.deterministic`) on SGLang servers that several
    hosts share: the servers hold one weight version at a time, process 0 swaps it, and each
    host's producer thread starts its chunks at its own pace, so one host's chunk could be
    sampled with the version another host's chunk needs; agreeing on the swaps would take a
    collective in the producer threads. (Free-running tolerates it: every token's version is
    reported and counted, and with LoRA a host names a version only after a barrier on the
    main thread says process 0 loaded it, which unloads none another host may still name:
    `wait_for_shared_weights`; synchronous runs swap on the main thread, hosts waiting
    together.)"""
    r = config.rollout
    if (jax.process_count() > 1 and r.engine == "sglang" and r.max_staleness > 0
            and r.deterministic):
        raise ValueError(
            f"rollout.deterministic=True with rollout.max_staleness={r.max_staleness} and "
            f"SGLang servers cannot run on {jax.process_count()} hosts: the hosts share the "
            "servers' one weight version, and their producers would swap it under each "
            "other. Set rollout.deterministic=False (free-running: every token's version "
            "is tracked), rollout.max_staleness=0, or use the embedded JAX sampler "
            "(--rollout_urls unset)")


def data_parallel_size(mesh: Mesh) -> int:
    return mesh.shape["data"] * mesh.shape["fsdp"]


def model_path(config: ml_collections.ConfigDict, workdir: str) -> str:
    """The HF dir of the initial policy: `model.path`, or a tiny random model written once
    into <workdir>/init_model (same seed, same model: a rerun finds it there)."""
    if config.model.path:
        if not os.path.isfile(os.path.join(config.model.path, "config.json")):
            raise FileNotFoundError(f"model.path={config.model.path!r} has no config.json; "
                                    "point it at a Hugging Face model directory")
        return config.model.path
    out = os.path.join(workdir, "init_model")
    if jax.process_index() == 0 and not os.path.isfile(os.path.join(out, "config.json")):
        m = config.model
        tiny.write_tiny_model(out, arch=m.tiny_arch, vocab_size=m.tiny_vocab, seed=config.seed,
                              corpus=env_text(config, m.tiny_corpus_tasks),
                              init_scale=m.tiny_init_scale, **tiny_shape(config))
    parallel.sync_hosts("tiny_model")
    return out


# Seconds a start-up probe of an env server waits (at most env.remote_timeout_s): a server
# that is up answers GET /info in milliseconds, and a dead one should not hold the start.
PROBE_TIMEOUT_S = 5.0


def check_inputs(config: ml_collections.ConfigDict, model_path: Optional[str] = None) -> None:
    """What the config reads from outside itself, checked before a run writes anything (the
    launchers call it right after `config.check`): the model directory (`model_path`, default
    `model.path`; none for the tiny model) loads (`hf.check_model_dir`: config.json and every
    safetensors header, no tensor data), the data files it names are there (`sft.data_path`,
    `dpo.data_path`, `env.dataset_dir`), and each env server of `env.remote_url` is up and
    serves `env.name` (`probe_env_server`), and each reward server of `reward.urls` answers
    /health and serves a reward model (`remote.probe`). Raises hf.CheckpointError,
    FileNotFoundError or ValueError, naming the key or file and what to do."""
    path = model_path or config.model.path
    key = "--model_path" if model_path else "model.path"
    if path and not os.path.isdir(path):
        raise hf.CheckpointError(f"{key}={path!r}: no such directory; point it at an HF model "
                                 "directory (config.json and *.safetensors)" +
                                 ("" if model_path else ", or leave it empty for the config's "
                                  "tiny random model"))
    if path:
        try:
            hf.check_model_dir(path)
        except hf.CheckpointError as e:
            raise hf.CheckpointError(f"{key}={path!r}: {e}") from None
    if config.reward.judge_model_path:
        try:
            hf.check_model_dir(config.reward.judge_model_path)
        except hf.CheckpointError as e:
            raise hf.CheckpointError(f"reward.judge_model_path="
                                     f"{config.reward.judge_model_path!r}: {e}") from None
    if config.reward.model_path:
        from rl_tpu.models import reward_model
        try:
            reward_model.check_reward_dir(config.reward.model_path)
        except hf.CheckpointError as e:
            raise hf.CheckpointError(f"reward.model_path={config.reward.model_path!r}: {e}"
                                     ) from None
    if config.reward.urls:  # each reward server up, serving a reward model
        from rl_tpu.rewards import remote
        for url in remote.parse_urls(config.reward.urls):
            remote.probe(url, PROBE_TIMEOUT_S)
    # each data path the run will read (an SFT file with no SFT steps is not read)
    for key, kind, what, read in (
            ("sft.data_path", "file", "a JSONL of chats",
             config.sft.steps > 0 or config.recipe == "sft"),
            ("dpo.data_path", "file", "a JSONL of preference pairs", config.recipe == "dpo"),
            ("reward_model.data_path", "file", "a JSONL of preference pairs",
             config.recipe == "reward_model"),
            ("env.dataset_dir", "directory", "a dataset made by launch.make_dataset", True)):
        block, _, leaf = key.partition(".")
        given = config[block][leaf]
        is_there = os.path.isfile if kind == "file" else os.path.isdir
        if read and given and not is_there(given):
            raise FileNotFoundError(f"{key}={given!r}: no such {kind}; give {what}, or leave "
                                    "it empty")
    if config.env.remote_url:
        from rl_tpu.env_serving.remote import parse_urls
        for url in parse_urls(config.env.remote_url):
            probe_env_server(config, url)


def probe_env_server(config: ml_collections.ConfigDict, url: str) -> None:
    """One quick GET /info to the env server at `url` (GET / where it has no /info, as
    AgentGym's servers): ValueError naming the url unless it answers and serves `env.name`
    (or, for an AgentGym env, its AgentGym task). It sends the key the run's client will send
    (RL_TPU_ENV_API_KEY), so a missing or wrong key is found here too."""
    import httpx

    from rl_tpu.env_serving.remote import API_KEY_ENV

    name = config.env.name
    start = (f"start it with `python -m launch.serve_env --env {name} --port PORT` (or fix "
             "env.remote_url)")
    timeout = min(PROBE_TIMEOUT_S, config.env.remote_timeout_s)
    try:
        key = os.environ.get(API_KEY_ENV)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        # as the env client: proxies honoured, the same key
        with httpx.Client(timeout=timeout, headers=headers) as client:
            reply = client.get(f"{url}/info")
            if reply.status_code == 404:  # AgentGym's own servers have no /info: is it up?
                reply = client.get(f"{url}/")
                info = None
            else:
                info = reply.json() if reply.status_code == 200 else None
    except httpx.HTTPError as e:
        raise ValueError(f"env.remote_url: no env server answers at {url} within {timeout:g}s "
                         f"({type(e).__name__}: {e}); {start}") from None
    except ValueError:  # a 200 that is not JSON: not rl_tpu's env server
        raise ValueError(f"env.remote_url: {url} answered GET /info with something other than "
                         f"JSON; it is not an env server: {start}") from None
    if reply.status_code in (401, 403):
        raise ValueError(f"env.remote_url: the env server at {url} "
                         f"{'refused the key in' if key else 'wants an API key: set'} "
                         f"{API_KEY_ENV} (the key it was started with, --api_key or its "
                         f"{API_KEY_ENV})")
    if reply.status_code >= 400:
        raise ValueError(f"env.remote_url: the env server at {url} answered GET "
                         f"{reply.request.url.path} with HTTP {reply.status_code}; check its "
                         f"log, or {start}")
    served = info.get("env") if isinstance(info, dict) else None
    if served == name:
        return
    from rl_tpu.env_serving.remote import agentgym_name
    local = make_env_by_name(name, **config.env.kwargs.to_dict())
    try:
        theirs = agentgym_name(local)
    finally:
        local.close()
    if info is None and theirs is not None:
        return  # an AgentGym server: it cannot be asked which env it serves
    if isinstance(info, dict) and theirs is not None and info.get("agentgym_name") == theirs:
        return
    if info is None:
        raise ValueError(f"env.remote_url: {url} has no /info, so it is not rl_tpu's env "
                         f"server, and env {name!r} has no AgentGym task name: only `python -m "
                         f"launch.serve_env --env {name}` can serve it")
    raise ValueError(f"env.remote_url: the env server at {url} serves {served!r}, but env.name "
                     f"is {name!r}; point env.remote_url at a server of {name!r} (`python -m "
                     f"launch.serve_env --env {name} --port PORT`), or set env.name={served!r}")


def tiny_shape(config: ml_collections.ConfigDict) -> dict:
    """The ModelConfig fields of the tiny random model `model.tiny_*` describe."""
    m = config.model
    heads = max(1, m.tiny_hidden // 16)
    return dict(hidden_size=m.tiny_hidden, intermediate_size=2 * m.tiny_hidden,
                num_layers=m.tiny_layers, num_heads=heads, num_kv_heads=max(1, heads // 2),
                head_dim=16)


def env_text(config: ml_collections.ConfigDict, num_tasks: int) -> list[str]:
    """The env's own text for a tiny tokenizer's corpus: its conversation start and the first
    observation of `num_tasks` train tasks (none when 0)."""
    if num_tasks <= 0:
        return []
    make_env = make_env_factory(config)
    source, env, texts = task_source(config, make_env), make_env(), []
    from rl_tpu.agent import conversation_start, env_tools
    for i in range(num_tasks):
        texts.append(env.reset(source.get(config.env.train_split, i)))
        texts += [m["content"] for m in conversation_start(env)]
        # a function-calling env's tool schemas: the template writes them into every prompt
        texts += [json.dumps(t) for t in env_tools(env) or ()]
    env.close()
    return texts


def check_call_format(make_env: Callable[[], Env], tokenizer: ChatTokenizer) -> None:
    """A function-calling env (one with `tools` and a `call_format`) must parse replies in the
    format the policy's chat template writes calls in; else every call would be malformed and
    the run would learn nothing. Raises ValueError naming both formats and the fix."""
    env = make_env()
    try:
        wanted = getattr(env, "call_format", None)
        if wanted is None or not getattr(env, "tools", None):
            return
        from rl_tpu.tools.calls import call_format_of
        try:
            written = call_format_of(tokenizer)
        except ValueError as e:
            raise ValueError(f"env {env.name!r} calls tools, but the policy's tokenizer cannot: "
                             f"{e}") from None
        if written != wanted:
            raise ValueError(
                f"env {env.name!r} parses tool calls as {wanted!r}, but the policy's chat "
                f"template writes them as {written!r}; set env.kwargs.call_format={written!r}")
    finally:
        env.close()


def load_policy(config: ml_collections.ConfigDict, path: str, mesh: Mesh
                ) -> tuple[ModelConfig, Transformer, dict, ChatTokenizer]:
    """(model config, model, params in their shardings, chat tokenizer) from an HF dir."""
    m = config.model
    cfg, params = hf.load(path, mesh=mesh, dtype=m.dtype, remat=m.remat,
                          scan_layers=m.scan_layers, attention_block=m.attention_block,
                          attention_impl=m.attention_impl)
    adapter = lora_config(config)
    if adapter is not None and m.lora.path:  # a PEFT adapter to start from
        from rl_tpu.models import peft_format
        cfg, params = peft_format.load_adapter(m.lora.path, cfg, params, mesh=mesh)
        check_adapter_matches(cfg.lora, adapter, m.lora.path)
        cfg = cfg.replace(lora=dataclasses.replace(cfg.lora, dropout=adapter.dropout))
    elif adapter is not None:  # fresh adapters on the loaded (frozen) base
        cfg = cfg.replace(lora=adapter)
        params = with_fresh_adapters(Transformer(cfg, mesh=mesh), params, mesh, config.seed)
    return cfg, Transformer(cfg, mesh=mesh), params, load_tokenizer(path)


def with_fresh_adapters(model, params, mesh: Mesh, seed: int) -> dict:
    """`params` (a base without adapters) plus fresh adapters of `model` (a Transformer or a
    model over one, whose cfg has `lora`), each in its sharding on `mesh`. B starts at zero
    under PEFT's inits, so the result computes exactly what the base does."""
    abstract, names = parallel.logical_axes_of(model, np.zeros((1, 1), np.int32))
    shardings = parallel.param_shardings(abstract, names, mesh)
    return lora.with_adapters(params, lora.init_adapters(model, (abstract, shardings), seed))


@functools.lru_cache(maxsize=8)
def _merge_fn(cfg: lora.LoraConfig):
    return jax.jit(lambda p: lora.merge(p, cfg))  # one compile a LoRA config, not a call


def merged(model_cfg: ModelConfig, params) -> tuple[ModelConfig, dict]:
    """(config, params) of the plain model computing what a LoRA policy computes: every
    adapter merged into its kernel, on device in the kernels' shardings. A model without
    adapters is returned as it is."""
    if model_cfg.lora is None:
        return model_cfg, params
    return model_cfg.replace(lora=None), _merge_fn(model_cfg.lora)(params)


def check_adapter_matches(loaded: lora.LoraConfig, configured: lora.LoraConfig,
                          path: str) -> None:
    """The adapter of model.lora.path must be the one model.lora.* describes (rank, alpha,
    targets, rslora), so a config read later (a resume, a sweep) means what ran."""
    fields = ("rank", "alpha", "targets", "rslora")
    diff = {f: (getattr(loaded, f), getattr(configured, f)) for f in fields
            if (sorted(getattr(loaded, f)) if f == "targets" else getattr(loaded, f))
            != (sorted(getattr(configured, f)) if f == "targets" else getattr(configured, f))}
    if diff:
        said = ", ".join(f"model.lora.{f}={theirs!r} (the adapter: {ours!r})"
                         for f, (ours, theirs) in diff.items())
        raise ValueError(f"model.lora.path={path} holds another adapter than the config "
                         f"describes: {said}; set those keys to the adapter's values")


def engine_weights(params):
    """What a weight sync hands an engine made by `make_engine`: this host's copies
    (`parallel.host_copies`, a collective) of the params, or of a LoRA policy's adapters alone,
    since the engine holds the frozen base from its first weights on."""
    return parallel.host_copies(lora.adapters(params) if lora.has_adapters(params) else params)


def lora_config(config: ml_collections.ConfigDict) -> Optional[lora.LoraConfig]:
    """The adapters `model.lora.*` describe, or None for full fine-tuning (rank 0)."""
    b = config.model.lora
    if b.rank <= 0:
        return None
    targets = (lora.TARGETS if b.targets.strip() == "all"
               else tuple(t.strip() for t in b.targets.split(",") if t.strip()))
    try:
        return lora.LoraConfig(rank=b.rank, alpha=b.alpha, dropout=b.dropout, targets=targets,
                               init=b.init, rslora=b.rslora)
    except ValueError as e:
        raise ValueError(f"model.lora: {e}") from None


def export_hf(path: str, model_cfg: ModelConfig, params, tokenizer: ChatTokenizer) -> None:
    """The final policy as an HF directory at `path`; a disk that refuses it (full, read-only,
    no permission) is one RunWriteError naming the path, as a refused checkpoint is. The run
    is not marked finished before its export, so a rerun exports again from the checkpoint."""
    from rl_tpu.checkpoint_errors import RunWriteError

    model_cfg, params = merged(model_cfg, params)  # a plain HF model: adapters merged in
    try:
        hf.save(path, model_cfg, params, tokenizer=tokenizer.hf)
    except RunWriteError:
        raise
    except OSError as err:
        raise RunWriteError("the final HF export", path, err,
                            "the checkpoints are intact: rerun the same command to export "
                            "again") from err


def export_adapter(path: str, model_cfg: ModelConfig, params, base_path: str) -> None:
    """A LoRA policy's adapters as a PEFT adapter dir at `path` (peft_format.py: loads with
    `PeftModel.from_pretrained(<the base at base_path>, path)`, or SGLang's --lora-paths);
    a refused write is one RunWriteError, as for export_hf."""
    from rl_tpu.checkpoint_errors import RunWriteError
    from rl_tpu.models import peft_format

    try:
        peft_format.save_adapter(path, model_cfg, params, base_model_path=base_path)
    except OSError as err:
        raise RunWriteError("the final adapter export", path, err,
                            "the checkpoints are intact: rerun the same command to export "
                            "again") from err


def optim_config(lr: float, config: ml_collections.ConfigDict, total_steps: int,
                 warmup_steps: Optional[int] = None, updates_per_step: int = 1) -> OptimConfig:
    o = config.optim
    return OptimConfig(lr=lr, schedule=o.schedule,
                       warmup_steps=o.warmup_steps if warmup_steps is None else warmup_steps,
                       total_steps=max(total_steps, 1), weight_decay=o.weight_decay,
                       grad_clip=o.grad_clip or None, updates_per_step=updates_per_step)


def rl_optim_config(config: ml_collections.ConfigDict, lr: float) -> OptimConfig:
    """The optimizer of an RL learner (policy or critic): its schedule is configured in RL
    steps, and each RL step makes epochs x minibatches optimizer updates."""
    t = config.train
    return optim_config(lr, config, t.steps, updates_per_step=t.epochs * t.minibatches)


def new_state(params, optim: OptimConfig, heads: tuple[str, ...] = ()) -> TrainState:
    """A TrainState over `params`; params with LoRA adapters train only those (and `heads`,
    e.g. a critic's value head, trained whole beside its trunk's adapters)."""
    trainable = frozenset(lora.ADAPTER_KEYS + heads) if lora.has_adapters(params) else None
    return create_state(params, make_optimizer(optim), trainable)


def new_critic_state(config: ml_collections.ConfigDict, policy_params, model_cfg: ModelConfig,
                     mesh: Mesh) -> TrainState:
    """The critic's TrainState: the policy's trunk copied, a zero head (values start at 0),
    with its own learning rate `algo.value_lr`."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from rl_tpu.models.value import value_params_from

    def on_mesh(x):  # the fresh head is not on the mesh yet: replicate it there
        if isinstance(getattr(x, "sharding", None), NamedSharding):
            return x
        return jax.device_put(x, NamedSharding(mesh, P()))

    params = jax.tree.map(on_mesh, value_params_from(policy_params, model_cfg))
    return new_state(params, rl_optim_config(config, config.algo.value_lr), heads=("head",))


def make_env_factory(config: ml_collections.ConfigDict) -> Callable[[], Env]:
    """Builds the config's env (with `env.step_latency_s` of waiting per step, if set); with
    `env.remote_url`, a RemoteEnv on one of those servers (`remote_env_factory`)."""
    name, kwargs = config.env.name, config.env.kwargs.to_dict()
    latency = config.env.step_latency_s
    local = make_env_by_name(name, **kwargs)  # a bad env name or kwarg fails here, by name
    if config.env.remote_url:
        make = remote_env_factory(config, local)
    else:
        local.close()
        make = lambda: make_env_by_name(name, **kwargs)  # noqa: E731
    if latency:
        return lambda: DelayedEnv(make(), latency)
    return make


def remote_env_factory(config: ml_collections.ConfigDict, local: Env) -> Callable[[], Env]:
    """Envs on the servers of `env.remote_url` (round robin), with `local`'s tasks, prompts and
    conversation start (docs/env_servers.md); each server is asked, before any compute,
    whether it is up and serves this env."""
    from rl_tpu.env_serving.remote import RemoteEnvFactory, parse_urls
    e = config.env
    try:
        factory = RemoteEnvFactory(local, parse_urls(e.remote_url), env_name=e.name,
                                   timeout=e.remote_timeout_s, retries=e.remote_retries,
                                   backoff=e.remote_backoff_s)
    finally:
        local.close()  # only its definition is needed; its task source outlives it
    factory.check_servers()
    return factory


def task_source(config: ml_collections.ConfigDict, make_env: Callable[[], Env]) -> TaskSource:
    """The tasks to train and evaluate on: a dataset built by `launch.make_dataset` when
    `env.dataset_dir` names one, else the env's own task source."""
    if config.env.dataset_dir:
        from rl_tpu.data.jsonl import JsonlTaskSource
        return JsonlTaskSource(config.env.dataset_dir)
    env = make_env()
    try:
        return env.tasks()
    finally:
        env.close()


def sampling_params(config: ml_collections.ConfigDict, seed: Optional[int]) -> SamplingParams:
    r = config.rollout
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, seed=seed)


def make_engine(config: ml_collections.ConfigDict, model_cfg: ModelConfig, params,
                tokenizer: ChatTokenizer, workdir: str, version: str = "0",
                devices=None) -> RolloutEngine:
    """The rollout engine the config names, serving `params` as `version` (one weight sync:
    the sampler's own copy, or one HF export the servers load). The embedded sampler runs on
    `devices` (default: `rollout.sampler_devices` of this host's)."""
    r = config.rollout
    if r.engine == "sglang":
        from rl_tpu.rollout.sglang import SGLangEngine
        urls = [u.strip() for u in r.urls.split(",") if u.strip()]
        weights_dir = r.weights_dir or os.path.join(workdir, "sync")
        kwargs = {}
        if model_cfg.lora is not None:  # versions in flight: up to max_staleness behind
            # the adapters' names carry the run (adapter_versions.py): process 0's id on
            # every host, which may see the workdir under another path
            from rl_tpu.rollout.adapter_versions import run_id_of
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
    from rl_tpu.rollout.sampler import JaxSampler
    shapes = warmup_shapes(r.warmup)
    if devices is None:
        devices = jax.local_devices()[:r.sampler_devices or None]
    mesh = parallel.sampler_mesh(devices, model_cfg.num_kv_heads, r.sampler_tensor)
    kwargs = {}
    if config.model.sampler_dtype:
        kwargs["dtype"] = config.model.sampler_dtype
    if r.kv_dtype:
        kwargs["kv_dtype"] = r.kv_dtype
    if model_cfg.lora is not None:
        kwargs["lora_mode"] = config.model.lora.sampler
    sampler = JaxSampler(model_cfg, parallel.host_copies(params), mesh=mesh,
                         tokenizer=tokenizer, max_batch=r.max_batch,
                         kv_tokens=r.kv_tokens_per_device * len(devices), seed=config.seed,
                         version=version, prefill_chunk=r.prefill_chunk,
                         prefix_cache_tokens=r.prefix_cache_tokens if r.prefix_reuse else 0,
                         keep_prefix_cache_on_update=r.prefix_cache_keep_on_update, **kwargs)
    sampler.warmup(shapes)
    return sampler


def horizon_at(config: ml_collections.ConfigDict, step: int) -> int:
    """The turn limit H at 0-based RL step `step` (ScalingInter-RL's stages, else
    env.max_turns)."""
    return schedules.horizon(step, tuple(config.schedules.horizon_turns),
                             config.schedules.horizon_every, config.env.max_turns)


def budget_at(config: ml_collections.ConfigDict, step: int) -> int:
    """The per-turn generation budget L at 0-based RL step `step` (SIRI; env.max_new_tokens
    when schedules.budget is off)."""
    s = config.schedules
    return schedules.generation_budget(step, s.budget, s.budget_min, config.env.max_new_tokens,
                                       s.budget_period, s.budget_start, s.budget_stairs)


def eval_horizon(config: ml_collections.ConfigDict) -> int:
    """The eval turn limit: `eval.max_turns`, else the final stage of the horizon schedule
    (ScalingInter-RL), else `env.max_turns`. Fixed over the run, so an eval curve measures the
    policy, not the schedule (evaluating at each step's training horizon would make success
    jump at every stage by construction)."""
    stages = tuple(config.schedules.horizon_turns)
    return int(config.eval.max_turns or (stages[-1] if stages else config.env.max_turns))


def evaluate_policy(config: ml_collections.ConfigDict, engine: RolloutEngine, make_env,
                    tasks, tokenizer: ChatTokenizer, seed: int, failures=None,
                    step: int = 0) -> dict[str, float]:
    """The config's eval suite on `tasks` (greedy success, pass@k, turns, tokens): the one
    place rl, sft and evaluate build the eval's arguments. `failures`: the run's
    agent.env_failures.EnvFailureWatch, told of step `step`'s eval episodes."""
    from rl_tpu.agent import run_episodes
    from rl_tpu.agent.evaluation import evaluate
    from rl_tpu.agent.program import player_for
    env = config.env
    return evaluate(engine, make_env, tasks, tokenizer=tokenizer,
                    play=player_for(config, run_episodes),
                    max_turns=eval_horizon(config),
                    max_new_tokens=config.eval.max_new_tokens or env.max_new_tokens,
                    max_context_tokens=env.max_context_tokens, pass_k=config.eval.pass_k,
                    sampling=sampling_params(config, None), seed=seed,
                    step_timeout_s=env.step_timeout_s, reward_reduce=env.reward_reduce,
                    failures=failures, step=step)
