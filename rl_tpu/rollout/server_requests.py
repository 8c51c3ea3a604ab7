"""What a /generate request may ask of rl_tpu's rollout server: SGLang's `sampling_params`
checked field by field (`sampling_from_json`), and the per-request limits (`ServerLimits`), so
that a bad or oversized request is a 400 naming the field or limit before it is admitted."""

from __future__ import annotations

import dataclasses
from typing import Any

from rl_tpu.core.engine import MAX_STOP_TOKEN_IDS, SamplingParams
from rl_tpu.serving import (INT32_MAX, INT64_MAX, INT64_MIN, BadRequest, flag_field,
                            integer_field, number_field, shown, text_field)


def stop_token_ids_field(value: Any, where: str) -> tuple[int, ...]:
    """A request's stop_token_ids: a list of at most MAX_STOP_TOKEN_IDS ids, each an int32,
    duplicates dropped (the sampler checks them against the vocab). The length is checked
    before any element is read, so a list of a million ids costs nothing to refuse."""
    if not isinstance(value, (list, tuple)):
        raise BadRequest(f"'{where}' must be a list of token ids, got {shown(value)}")
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise BadRequest(f"'{where}': {len(value)} ids are over this server's limit of "
                         f"{MAX_STOP_TOKEN_IDS} stop ids a request; name the few that end a "
                         "reply")
    return tuple(dict.fromkeys(integer_field(t, f"{where}[{i}]", 0, INT32_MAX)
                               for i, t in enumerate(value)))


def sampling_from_json(raw: Any, where: str = "sampling_params") -> SamplingParams:
    """SGLang `sampling_params` dict -> SamplingParams (unknown keys ignored, as SGLang does).
    Every key it reads is checked here, so a bad one is a BadRequest naming `where.<key>`,
    what it must be and what was sent, never an error while the request runs."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest(f"'{where}' must be an object, got {shown(raw)}")
    given = lambda name: raw.get(name) is not None  # noqa: E731 - null is "not given"
    stop = raw["stop"] if given("stop") else []
    stop = ([stop] if stop else []) if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadRequest(f"'{where}.stop' must be a string or a list of strings, got "
                         f"{shown(raw.get('stop'))}")
    for i, s in enumerate(stop):
        text_field(s, f"{where}.stop[{i}]")
    stop_ids = stop_token_ids_field(raw["stop_token_ids"] if given("stop_token_ids") else (),
                                    f"{where}.stop_token_ids")

    def integer(name: str, low: int, high: int, default: Any) -> int:
        # every integer is bounded here: one that does not fit the sampler's arrays would
        # otherwise pass and fail later, while its row is built beside other requests'
        return integer_field(raw[name] if given(name) else default, f"{where}.{name}", low, high)

    def number(name: str, low: float, high: float, default: float, low_open=False) -> float:
        return number_field(raw[name], f"{where}.{name}", low, high, low_open) if given(name) \
            else default

    max_new = integer("max_new_tokens", 0, INT32_MAX, 128)
    min_new = integer("min_new_tokens", 0, INT32_MAX, 0)
    if min_new > max_new:
        raise BadRequest(f"'{where}.min_new_tokens' must be at most max_new_tokens={max_new}, "
                         f"got {min_new}")
    top_k = integer("top_k", -1, INT32_MAX, -1)
    if top_k == 0:
        raise BadRequest(f"'{where}.top_k' must be -1 (all tokens) or >= 1, got 0")
    try:
        return SamplingParams(
            max_new_tokens=max_new, min_new_tokens=min_new,
            temperature=number("temperature", 0.0, float("inf"), 1.0),
            top_p=number("top_p", 0.0, 1.0, 1.0, low_open=True), top_k=top_k,
            stop_token_ids=stop_ids,
            stop=tuple(stop),
            ignore_eos=flag_field(raw["ignore_eos"], f"{where}.ignore_eos") if given("ignore_eos")
            else False,
            n=integer("n", 1, INT32_MAX, 1),
            seed=integer("sampling_seed", INT64_MIN, INT64_MAX, None) if given("sampling_seed")
            else None)
    except BadRequest:
        raise
    except ValueError as err:  # SamplingParams' own checks, should one be missed above
        raise BadRequest(f"bad {where}: {err}") from err


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """What one /generate request may ask for; over any of them it is answered 400, naming the
    limit and the flag of `launch.serve_rollout` that sets it."""

    max_n: int = 64  # samples per prompt (--max_n)
    max_rows: int = 1024  # prompts x n (--max_rows)
    max_context_tokens: int = 0  # prompt + max_new_tokens a row; 0 = the model's positions
    max_request_tokens: int = 1 << 22  # rows x (prompt + max_new_tokens) (--max_request_tokens)

    def check(self, prompts: list[list[int]], sampling: list[SamplingParams],
              context: int) -> None:
        context = min(self.max_context_tokens or context, context)
        rows = tokens = 0
        for prompt, s in zip(prompts, sampling):
            if s.n > self.max_n:
                raise BadRequest(f"n={s.n} is over this server's limit of {self.max_n} samples "
                                 "a prompt (--max_n)")
            if len(prompt) + s.max_new_tokens > context:
                raise BadRequest(f"a prompt of {len(prompt)} tokens + max_new_tokens="
                                 f"{s.max_new_tokens} is over the context length of {context} "
                                 "tokens (--max_context_tokens, at most the model's positions)")
            rows += s.n
            tokens += s.n * (len(prompt) + s.max_new_tokens)
        if rows > self.max_rows:
            raise BadRequest(f"{rows} rows (prompts x n) are over this server's limit of "
                             f"{self.max_rows} a request (--max_rows); split the request")
        if tokens > self.max_request_tokens:
            raise BadRequest(f"{tokens} tokens (rows x (prompt + max_new_tokens)) are over this "
                             f"server's limit of {self.max_request_tokens} a request "
                             "(--max_request_tokens); split the request or ask for fewer tokens")
