"""The engine contract: the one interface every rollout backend implements, token ids in,
token ids + logprobs out.

A contract of rl_tpu.core: backends (rl_tpu/rollout/: the embedded JAX sampler, HTTP clients
of SGLang-compatible servers, i.e. real SGLang on GPUs or rl_tpu's own JAX server on TPU
hosts) implement it, and the agent loop, the rewards and the recipes see only it, as do
scripted engines in tests. It imports no other rl_tpu package. Waiting for weights that
servers share across hosts is in rl_tpu/core/shared_weights.py (it needs JAX; this does not).
"""

from __future__ import annotations

import abc
import concurrent.futures
import dataclasses
import numbers
import threading
from typing import Any, Optional, Sequence


# The most distinct stop_token_ids a request may name: each row holds its stop ids in a
# power-of-two wide array that is part of the compiled programs' shapes, and a server's pool
# keeps the widest it has seen, so without a cap one request could make every later one slow.
MAX_STOP_TOKEN_IDS = 256


def check_stop_token_ids(ids: Sequence[int], vocab_size: int,
                         where: str = "sampling stop_token_ids") -> None:
    """ValueError unless `ids` are at most MAX_STOP_TOKEN_IDS distinct ids of the vocab: an id
    the model cannot sample never stops a row, and the count sets the width of the compiled
    programs (`JaxSampler.stop_width`)."""
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or \
                not 0 <= t < vocab_size:
            raise ValueError(f"{where}[{i}]={t!r}: must be a token id in [0, {vocab_size}) "
                             "(the model's vocab)")
    if len(set(ids)) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"{where}: {len(set(ids))} distinct ids are over the limit of "
                         f"{MAX_STOP_TOKEN_IDS} a request; name the few that end a reply")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling, with SGLang's meanings (temperature < 1e-6 means greedy)."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0  # as in SGLang: no token-based stop (eos, stop ids) before this many
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = all tokens
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings (matched on the decoded output)
    ignore_eos: bool = False  # as in SGLang: also turns off stop_token_ids (not stop strings)
    n: int = 1  # samples per prompt (results come prompt-major: p0s0, p0s1, p1s0...)
    seed: Optional[int] = None
    # a mixture of experts' chosen experts on the result (GenerateResult.routed_experts), as
    # SGLang's request field of that name; an engine that cannot record them refuses it
    return_routed_experts: bool = False

    def __post_init__(self):
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= max(self.max_new_tokens, 0):
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}]"
                             f", got {self.min_new_tokens}")
        if not (0 <= self.temperature < float("inf")):  # NaN fails too: it samples NaNs
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (all) or >= 1, got {self.top_k}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    prompt_ids: Sequence[int]
    sampling: SamplingParams = SamplingParams()
    request_id: Optional[str] = None
    # a serving sampler's LoRA slot (adapter_slots.py: what `AdapterSlots.acquire` gave for
    # the request's lora_path); 0, the base, everywhere else
    lora_slot: int = 0


FINISH_REASONS = ("stop", "length", "abort")

# What `GenerateResult.logprobs` are the log of, for a sample drawn with top-p / top-k < all:
#   "full":      softmax(logits / temperature) over the whole vocab, before truncation: the
#                quantity the trainer recomputes (rl_tpu's sampler; SGLang by default, see
#                docs/architecture.md);
#   "truncated": the renormalised distribution over the kept top-p / top-k tokens, which
#                differs from "full" by -log(kept mass) per token.
# Without truncation (top_p = 1, top_k = -1) the two are the same number.
LOGPROB_CONVENTIONS = ("full", "truncated")


@dataclasses.dataclass
class GenerateResult:
    """One sample. `logprobs[i]` is the engine's log-probability of `output_ids[i]`: log
    softmax of the logits divided by the temperature (1 when greedy), before top-p/top-k
    truncation, which is the quantity the trainer recomputes with the same temperature."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # stop | length | abort
    weight_version: Optional[str] = None
    matched_stop: Any = None  # the stop token id or string that ended it, if any
    prompt_tokens: int = 0
    info: dict = dataclasses.field(default_factory=dict)
    logprob_convention: str = "full"  # one of LOGPROB_CONVENTIONS
    # A mixture of experts' routing (the embedded sampler records it): int32
    # [prompt + output - 1, sparse layers, k], row p the experts chosen for the token at
    # position p of prompt_ids + output_ids in the pass that computed its K/V, -1 where this
    # call computed none (a reused prefix); the last output id, never fed, has no row. None
    # for a dense model or an engine that does not report it.
    routed_experts: Optional[Any] = None

    def __post_init__(self):
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason {self.finish_reason!r} not in {FINISH_REASONS}")
        if self.logprob_convention not in LOGPROB_CONVENTIONS:
            raise ValueError(f"logprob_convention {self.logprob_convention!r} not in "
                             f"{LOGPROB_CONVENTIONS}")


class RolloutError(RuntimeError):
    """A rollout backend failed or refused; the message names the server and what went wrong.
    `url` is the server (None when several failed or the engine is in-process), `status` the
    HTTP code (None: no reply)."""

    def __init__(self, message: str, url: Optional[str] = None, status: Optional[int] = None):
        super().__init__(message)
        self.url = url
        self.status = status


class RolloutEngine(abc.ABC):
    """A source of samples whose weights the trainer can replace."""

    @abc.abstractmethod
    def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        """Samples for every request, `n` per request, flat and request-major."""

    @abc.abstractmethod
    def update_weights(self, params, version: str) -> None:
        """Serve `params` (the trainer's pytree) from now on, reported as `version`."""

    @abc.abstractmethod
    def health(self) -> bool:
        """True when the engine can serve a request now."""

    @property
    def weight_version(self) -> Optional[str]:
        return None

    def submit(self, requests: Sequence[GenerateRequest]) -> "concurrent.futures.Future":
        """The non-blocking form of `generate`: returns at once; the future's `result()` is
        what `generate(requests)` returns (or raises), `done()` polls it. Requests submitted
        while others run proceed side by side as far as the backend allows (the embedded
        sampler runs one batch on its devices at a time; servers batch them). This default
        runs `generate` on a small thread pool; a backend with its own queue may override."""
        with _POOL_LOCK:
            pool = self.__dict__.get("_submit_pool")
            if pool is None:
                pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=4, thread_name_prefix=f"{type(self).__name__}-submit")
                self.__dict__["_submit_pool"] = pool
        return pool.submit(self.generate, list(requests))


_POOL_LOCK = threading.Lock()
