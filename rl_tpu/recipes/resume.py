"""Resuming checks the config: a run continues only under the config it was started with.

A checkpoint's meta holds `config_record(config)`, the resolved config as a flat JSON dict. On
resume, `check_resume(meta.get("config"), config, workdir)` compares it with the config of the
rerun and refuses any difference outside `RESUME_MAY_CHANGE`: a changed clip range, learning
rate or env would otherwise silently continue the saved state under another experiment, and
the run would match neither the old config nor the new one.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Optional

import ml_collections

log = logging.getLogger(__name__)

# Keys that may differ on resume: each changes nothing already computed (params, optimizer
# state, task stream position, the seeds of the steps still to come), only how far the run
# goes and what it reports and writes.
RESUME_MAY_CHANGE = (
    # Where the run ends: the loop, the last eval and the last checkpoint. Not allowed when
    # the LR schedule decays over train.steps (see _schedule_reads_steps).
    "train.steps",
    # Eval reads the policy and never feeds training (its sampling seeds are its own), so any
    # eval setting only changes the eval/* metrics of the steps still to come.
    "eval.",
    "log.",  # TensorBoard and plots: outputs only
    # How often and how many checkpoints are written, how they are written, and whether the
    # final policy is exported: the state saved is the same either way.
    "checkpoint.every",
    "checkpoint.keep",
    "checkpoint.async_save",
    "checkpoint.export_hf",
    # Where SGLang servers live (a resumed job may get other hosts); they are sent the
    # trainer's weights at the start of the resumed run. The engine itself may not change.
    "rollout.urls",
    "rollout.router_url",  # generation through a router or not: the same samples either way
    "reward.urls",  # reward servers of the same model (reward.model_path may not change)
    # Likewise where env servers live and how their calls are retried: an episode's task and
    # every reply are the same whichever server plays it.
    "env.remote_url",
    "env.max_failed_steps",  # when a failing run stops: nothing it trained on changes
    "env.remote_timeout_s",
    "env.remote_retries",
    "env.remote_backoff_s",
    # Prefix reuse is exact (a turn's log-probs and tokens are the same with or without it),
    # so turning it on or off, or resizing its cache, changes speed only. Keeping the cache
    # across weight updates is not exact and is not here.
    "rollout.prefix_reuse",
    "rollout.prefix_cache_tokens",
)


class ResumeConfigError(ValueError):
    """A rerun whose config differs from its checkpoint's: a user's mistake, which the
    launchers report in one line (exit status 2) rather than as a traceback."""


def config_record(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """The resolved config as a flat JSON-able dict, keys sorted: {"algo.clip_high": 0.28, ...}.

    Tuples become lists (what a JSON round trip gives back anyway); an empty block is kept as
    {} so that adding its first key shows as a difference. A value JSON cannot hold raises,
    naming its key: call this at the start of a run, not at its first checkpoint.
    """
    flat: dict[str, Any] = {}

    def walk(block: dict, prefix: str) -> None:
        for key, value in block.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict) and value:
                walk(value, name + ".")
            else:
                flat[name] = _jsonable(value, name)

    walk(config.to_dict(), "")  # to_dict resolves FieldReferences to their values
    return dict(sorted(flat.items()))


def _jsonable(value, name: str):
    if isinstance(value, (tuple, list)):
        return [_jsonable(v, name) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v, f"{name}.{k}") for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"config key {name!r} holds a {type(value).__name__} ({value!r}), which "
                    "a checkpoint cannot record; use numbers, strings, bools, None, tuples, "
                    "lists or dicts")


def may_change(key: str) -> bool:
    """Whether `key` is in RESUME_MAY_CHANGE ("eval." covers every key of the eval block)."""
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in RESUME_MAY_CHANGE)


def _schedule_reads_steps(record: dict[str, Any]) -> bool:
    """Whether the learning rate depends on train.steps: the optimizer's decay ends at
    train.steps, so the saved steps were taken on a schedule a new train.steps changes."""
    return record.get("optim.schedule", "constant") != "constant"


def _same(a, b) -> bool:
    # Canonical JSON: exact for floats (repr round trips), NaN equal to NaN, 1 unlike True.
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def check_resume(saved_record: Optional[dict[str, Any]], config: ml_collections.ConfigDict,
                 workdir: str) -> None:
    """Raises ResumeConfigError (a ValueError) naming every key where `config` differs from
    the checkpoint's record.

    `saved_record` is the checkpoint meta's "config" (None for checkpoints saved before meta
    held one: accepted, with a warning). Keys in RESUME_MAY_CHANGE may differ.
    """
    if saved_record is None:
        log.warning("the checkpoint in %s holds no config record (saved by an older version): "
                    "resuming without checking that the config is the one it was trained with",
                    workdir)
        return
    new = config_record(config)
    # A key only one side has is a difference too: a config file that gained or lost a key.
    missing = object()
    lines, steps_refused = [], False
    for key in sorted(set(saved_record) | set(new)):
        old_value, new_value = saved_record.get(key, missing), new.get(key, missing)
        if old_value is not missing and new_value is not missing and _same(old_value, new_value):
            continue
        if key == "train.steps" and _schedule_reads_steps(saved_record):
            steps_refused = True
        elif may_change(key):
            continue
        lines.append(f"{key}: saved {_show(old_value, missing)}, now {_show(new_value, missing)}")
    if not lines:
        return
    why = (f" (train.steps may change only with optim.schedule='constant': with "
           f"optim.schedule={saved_record.get('optim.schedule')!r} the learning rate decays "
           "over train.steps, so the steps already taken followed another schedule)"
           if steps_refused else "")
    # One line, as the launchers print it: the keys first, then what to do.
    raise ResumeConfigError(
        f"cannot resume the run in {workdir}: its config differs from the one its checkpoint "
        f"was saved with, in {len(lines)} key(s): " + "; ".join(lines) + why +
        ". Rerun with the original config and overrides to continue this run, or pass a new "
        "--workdir to start a new run with this config (keys that may change on resume: "
        + ", ".join(RESUME_MAY_CHANGE) + ")")


def _show(value, missing) -> str:
    return "(no such key)" if value is missing else json.dumps(value)
