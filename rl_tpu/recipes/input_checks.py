"""What a config reads from outside itself, checked before a run writes anything: the model
directories, the data files, the env servers and the reward servers it names. The launchers
call `check_inputs` right after `config.check`.
"""

from __future__ import annotations

import os
from typing import Optional

import httpx
import ml_collections

from rl_tpu.core.env import make as make_env_by_name
from rl_tpu.env_serving.remote import API_KEY_ENV, agentgym_name, parse_urls
from rl_tpu.models import hf, reward_model
from rl_tpu.rewards import remote as reward_servers


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
    /health and serves a reward model (`reward_servers.probe`). Raises hf.CheckpointError,
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
        try:
            reward_model.check_reward_dir(config.reward.model_path)
        except hf.CheckpointError as e:
            raise hf.CheckpointError(f"reward.model_path={config.reward.model_path!r}: {e}"
                                     ) from None
    if config.reward.urls:  # each reward server up, serving a reward model
        for url in reward_servers.parse_urls(config.reward.urls):
            reward_servers.probe(url, PROBE_TIMEOUT_S)
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
        for url in parse_urls(config.env.remote_url):
            probe_env_server(config, url)


def probe_env_server(config: ml_collections.ConfigDict, url: str) -> None:
    """One quick GET /info to the env server at `url` (GET / where it has no /info, as
    AgentGym's servers): ValueError naming the url unless it answers and serves `env.name`
    (or, for an AgentGym env, its AgentGym task). It sends the key the run's client will send
    (RL_TPU_ENV_API_KEY), so a missing or wrong key is found here too."""
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
