"""The config's envs and tasks: the factory every episode's env comes from (local, or on the
env servers of `env.remote_url`), the task source (the env's own or a built dataset), the
env's text for a tiny tokenizer's corpus, and the check that a function-calling env parses
calls as the policy writes them.
"""

from __future__ import annotations

import json
from typing import Callable

import ml_collections

from rl_tpu.agent import conversation_start, env_tools
from rl_tpu.core.env import DelayedEnv, Env, TaskSource, make as make_env_by_name
from rl_tpu.data.jsonl import JsonlTaskSource
from rl_tpu.env_serving.remote import RemoteEnvFactory, parse_urls
from rl_tpu.models.tokenizer import ChatTokenizer
from rl_tpu.tools.calls import call_format_of


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
        return JsonlTaskSource(config.env.dataset_dir)
    env = make_env()
    try:
        return env.tasks()
    finally:
        env.close()


def env_text(config: ml_collections.ConfigDict, num_tasks: int) -> list[str]:
    """The env's own text for a tiny tokenizer's corpus: its conversation start and the first
    observation of `num_tasks` train tasks (none when 0)."""
    if num_tasks <= 0:
        return []
    make_env = make_env_factory(config)
    source, env, texts = task_source(config, make_env), make_env(), []
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
