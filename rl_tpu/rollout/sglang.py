"""`SGLangEngine`: a `RolloutEngine` over the SGLang native HTTP API, with weight sync by disk.

Works against real SGLang servers and against rl_tpu's own SGLang-compatible JAX server
(`launch.serve_rollout`); the trainer cannot tell them apart. The engine is three parts, one
file each: the transport (http_transport.py, on httpx: retries, backoff, fail-over,
least-loaded server, timeouts), the weight sync (weight_sync.py: HF export +
`/update_weights_from_disk`), and this file (generation, health, and what the logprobs mean).

LoRA (`model_config.lora` set): a weight update moves only the adapters (weight_sync.py:
a PEFT dir loaded with `/load_lora_adapter` under the run's id and the version,
adapter_versions.py), and each `generate`
call pins its requests to the newest version loaded when it starts (`lora_path` in the
body; the results carry that version), however many updates land before they finish. The
servers keep `keep_adapters` versions; an older one is unloaded once no pinned request is
left. Before the first update, requests carry no adapter: the base, which is what fresh
adapters (B = 0) compute. `last_sync_bytes` / `stats()` count the bytes each update wrote.

Generation: requests are grouped by `n` (SGLang wants one `n` per batch) and sent as batches of
at most `batch_size` prompts in one `POST /generate` (`input_ids` list of lists, one
`sampling_params` dict per prompt, `return_logprob`, `logprob_start_len=-1` for output-token
logprobs only). At most `max_concurrency` batches are in flight, each to the server with the
fewest in flight. Replies come back flat and prompt-major (p0s0, p0s1, p1s0, ...). A batch that
fails on one server fails over to the next (see http_transport.py); every failure ends in a
`RolloutError` naming the server and what went wrong.

Behind SGLang's router (`router_url`; router.py has what the router does and does not
forward): generation goes to the router, grouped by identical sampling params (its /generate
takes one dict and a string rid), and weight updates, abort, pause/continue and flush go to
each worker of `urls` directly, since the router forwards none of them to every worker.

Logprobs under top-p / top-k. Read in SGLang 0.5.23's installed source,
`sglang/srt/layers/sampler.py`, `Sampler.forward` (line 148): the standard path divides the
logits by the temperature in place (l. 275), overwrites them with their softmax (`probs`,
l. 293-299), samples with `_sample_from_probs` (l. 362), and returns `torch.log(probs)` (l. 307-
318): the *full* distribution at temperature T, before any truncation. Neither sampling backend
writes into `probs`: "flashinfer" (`top_k_top_p_sampling_from_probs`, l. 403-473, the CUDA
default when flashinfer is installed, `arg_groups/overrides.py` `_sampling_backend_default`
l. 1019) reads it, and "pytorch" (the CPU backend, forced by `arg_groups/platform_hook.py`
`handle_cpu_backends` l. 158-172, and the CUDA fallback and deterministic mode, overrides.py
l. 1030) truncates a sorted copy in `top_k_top_p_min_p_sampling_from_probs_torch` (l. 785,
copies at l. 819/821). Ascend returns `log_softmax(logits / T)` (`_forward_ascend_backend`,
l. 689-712), all-greedy batches `log_softmax(logits)` (l. 208; greedy requests run at T = 1,
`sampling/sampling_params.py` l. 245-248), speculative verification `log_softmax(logits / T)`
(`layers/logprob_processor.py` l. 417). `top_p_normalize_probs_torch` (sampler.py l. 1007), which
older (0.4-era) copies of this file applied to the returned logprobs on the flashinfer backend
(renormalised over top-p, not top-k), is no longer called by the sampler. So 0.5.23 is "full" everywhere,
measured on CPU by tests/rollout/test_sglang_client.py.

The one switch: `SGLANG_RETURN_ORIGINAL_LOGPROB=1` in the server's environment (sampler.py l. 82,
`environ.py` l. 1508) returns `original_logprobs = log_softmax(logits)` taken *before* the
temperature division (l. 231-237, 320-323): untruncated, but at temperature 1 whatever the
request's. No `GenerateResult` convention covers that at T != 1, so an engine that knows a
server does it refuses such requests rather than report numbers the trainer would misread.

Penalties act before all of this: `ModelRunner._preprocess_logits` (`model_executor/
model_runner.py` l. 2075-2093) adds them to the logits the sampler then reads, so with
`min_new_tokens` (sent as given; SGLang's `MinNewTokensPenalizer._apply`, `sampling/penaltylib/
min_new_tokens.py` l. 85-90, sets eos and the stop ids to -inf until that many tokens exist)
the first positions report logprobs of that penalised distribution. rl_tpu's own sampler does
the same; the trainer, which applies no penalty, sees the difference as the constraint's cost.

Hence `logprob_convention`: "auto" (default) measures each server once at first contact
(logprob_probe.py: one tiny request) and labels every result by the server that produced it
and its sampling params; "full" or "truncated" declares it for every server instead (no probe).
Untruncated and greedy samples are always "full".
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Any, Optional, Sequence

import jax

from rl_tpu.models import lora
from rl_tpu.models.transformer import ModelConfig
from rl_tpu.rollout import logprob_probe, routed_experts
from rl_tpu.core.engine import (FINISH_REASONS, GenerateRequest, GenerateResult,
                                   RolloutEngine, RolloutError, SamplingParams)
from rl_tpu.rollout.http_transport import HttpTransport, ServerDown
from rl_tpu.rollout.logprob_probe import ServerLogprobs
from rl_tpu.rollout.router import (agreed_logprobs, check_workers, generate_body,
                                   group_by_params)
from rl_tpu.rollout.weight_sync import (EXPORT_MARKER, DiskWeightSync,  # noqa: F401 (re-exported)
                                        shape_mismatches, tensor_shapes)

log = logging.getLogger(__name__)


class SGLangEngine(RolloutEngine):
    """A `RolloutEngine` over one or more SGLang(-compatible) servers.

    Args:
      urls: server base URLs, e.g. ["http://10.0.0.2:30000"].
      tokenizer: optional; when given, weight exports also carry its files, so the latest
        export is a complete model dir a restarted server can launch from.
      weights_dir: directory, readable by every server, for weight exports (one subdir per
        version). Needed by `update_weights`.
      model_config: the trainer's `ModelConfig` of the params `update_weights` receives.
        Needed by `update_weights`; also bounds prompt token ids before they are sent.
      max_concurrency: batches in flight at once (threads); behind a router, up to
        `max_concurrency * batch_size` requests (see `router_url`).
      batch_size: prompts per `/generate` request.
      request_timeout_s: seconds to wait for one reply.
      connect_retries: extra attempts on one server after a failure (http_transport.py).
      backoff_s: seconds before the first retry; doubles after each.
      health_timeout_s: how long `wait_healthy()` waits by default.
      api_key: sent as `Authorization: Bearer ...` (SGLang's `--api-key`).
      update_timeout_s: seconds one server may take to load new weights.
      served_model_path: a local copy of the served model dir, for the shape check when the
        servers' `model_path` is not a directory readable here (e.g. a hub id).
      export_dtype: dtype of exported weights (default: the config's param dtype).
      failover_cooldown_s: how long a failed server is tried last.
      logprob_convention: "auto" (probe each server at first contact), or "full" /
        "truncated" to declare what every server reports for truncated samples (module doc).
      router_url: an sglang-router in front of the workers `urls` (router.py): generation
        goes through it; weight updates, abort, pause and flush go to each worker directly.
        Its requests carry one set of sampling params each, and RL gives every episode its
        own seed, so most are one prompt: the client then keeps as many prompts in flight as
        direct mode would (`max_concurrency * batch_size` requests), which also lets the
        router place each episode's turns by their own prefix.
      keep_adapters: with `model_config.lora`, how many adapter versions stay loaded on the
        servers; an async run passes max_staleness + 1 (the versions its requests may carry).
      adapter_run_id: with `model_config.lora`, the run's id in the adapters' names on the
        servers (default: `weights_dir`'s; adapter_versions.py). The same on every host.
    """

    def __init__(self, urls: Sequence[str], *, tokenizer=None, weights_dir: Optional[str] = None,
                 model_config: Optional[ModelConfig] = None, max_concurrency: int = 8,
                 batch_size: int = 16, request_timeout_s: float = 300.0,
                 connect_retries: int = 3, backoff_s: float = 0.5,
                 health_timeout_s: float = 300.0, api_key: Optional[str] = None,
                 update_timeout_s: float = 600.0, served_model_path: Optional[str] = None,
                 export_dtype: Optional[str] = None, failover_cooldown_s: float = 30.0,
                 logprob_convention: str = "auto", router_url: Optional[str] = None,
                 keep_adapters: int = 2, adapter_run_id: Optional[str] = None):
        if max_concurrency < 1 or batch_size < 1:
            raise ValueError(f"max_concurrency and batch_size must be >= 1, got "
                             f"{max_concurrency} and {batch_size}")
        self.transport = HttpTransport(
            urls, request_timeout_s=request_timeout_s, connect_retries=connect_retries,
            backoff_s=backoff_s, failover_cooldown_s=failover_cooldown_s, api_key=api_key)
        # The router is one more endpoint with the same retry policy; it does its own
        # fail-over among workers, so it is the only url of its transport.
        self.router = None if not router_url else HttpTransport(
            [router_url], request_timeout_s=request_timeout_s, connect_retries=connect_retries,
            backoff_s=backoff_s, failover_cooldown_s=failover_cooldown_s, api_key=api_key)
        if self.router is not None and self.router.urls[0] in self.transport.urls:
            raise ValueError(f"router_url {router_url!r} is also in urls: list the workers in "
                             "urls, the router alone in router_url")
        self.weight_sync = DiskWeightSync(
            self.transport, weights_dir=weights_dir, model_config=model_config,
            tokenizer=tokenizer, served_model_path=served_model_path, export_dtype=export_dtype,
            update_timeout_s=update_timeout_s, keep_adapters=keep_adapters,
            run_id=adapter_run_id)
        self._declared = (None if logprob_convention == "auto"
                          else logprob_probe.declared(logprob_convention))
        self.max_concurrency, self.batch_size = int(max_concurrency), int(batch_size)
        self.health_timeout_s = float(health_timeout_s)
        in_flight = self.max_concurrency * (self.batch_size if self.router is not None else 1)
        self._pool = concurrent.futures.ThreadPoolExecutor(in_flight,
                                                           thread_name_prefix="sglang-client")
        self._logprobs: dict[str, ServerLogprobs] = {}  # url -> what its logprobs mean
        self._probe_locks = {u: threading.Lock() for u in self.urls + self.router_urls}
        self._version: Optional[str] = None

    @property
    def urls(self) -> list[str]:
        return self.transport.urls

    @property
    def router_urls(self) -> list[str]:
        """[the router's url] in router mode, else []."""
        return self.router.urls if self.router is not None else []

    @property
    def _generation(self) -> HttpTransport:
        """Where `/generate` goes: the router, else the workers (least loaded first)."""
        return self.router if self.router is not None else self.transport

    @property
    def model_config(self) -> Optional[ModelConfig]:
        return self.weight_sync.model_config

    @model_config.setter
    def model_config(self, cfg: Optional[ModelConfig]) -> None:
        self.weight_sync.model_config = cfg

    # -- generation -------------------------------------------------------------------------

    @staticmethod
    def sampling_params_json(sp: SamplingParams) -> dict:
        """SGLang's `sampling_params` for one prompt. (SGLang semantics: `ignore_eos` turns off
        `stop_token_ids` too; stop strings still apply; `min_new_tokens` holds back eos and
        stop ids, not stop strings.)"""
        out = {"max_new_tokens": sp.max_new_tokens, "min_new_tokens": sp.min_new_tokens,
               "temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k, "n": sp.n,
               "ignore_eos": sp.ignore_eos}
        if sp.stop:
            out["stop"] = list(sp.stop)
        if sp.stop_token_ids:
            out["stop_token_ids"] = [int(t) for t in sp.stop_token_ids]
        if sp.seed is not None:
            out["sampling_seed"] = int(sp.seed)
        return out

    def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        requests = list(requests)
        vocab = self._vocab_size()
        for k, r in enumerate(requests):
            if len(r.prompt_ids) == 0:
                raise ValueError(f"request {k} ({r.request_id}) has an empty prompt")
            # An id outside the embedding table crashes a real SGLang server (IndexError in its
            # scheduler), taking every other request down with it: refuse it here.
            if vocab and not all(0 <= int(t) < vocab for t in r.prompt_ids):
                bad = next(int(t) for t in r.prompt_ids if not 0 <= int(t) < vocab)
                raise ValueError(f"request {k} ({r.request_id}): token id {bad} is outside the "
                                 f"vocabulary [0, {vocab})")
            for url, known in list(self._logprobs.items()):
                if known.refuses(r.sampling):
                    raise ValueError(self._temperature_message(url, r.sampling, f"request {k}"))
        if self.router is not None:
            groups = group_by_params(requests, self.sampling_params_json)
        else:
            by_n: dict[int, list[int]] = {}
            for k, r in enumerate(requests):
                by_n.setdefault(r.sampling.n, []).append(k)
            groups = list(by_n.values())
        chunks = [idx[s:s + self.batch_size] for idx in groups
                  for s in range(0, len(idx), self.batch_size)]
        adapters = self.weight_sync.adapters
        # Pinned for the whole call, so an update meanwhile cannot unload what it samples with.
        adapter = adapters.acquire(len(requests)) if self._lora else None
        samples: list[Optional[list[GenerateResult]]] = [None] * len(requests)
        try:
            futures = {self._pool.submit(self._generate_batch, [requests[k] for k in chunk],
                                         adapter): chunk for chunk in chunks}
            try:
                for future in concurrent.futures.as_completed(futures):
                    for k, per_request in zip(futures[future], future.result()):
                        samples[k] = per_request
            except BaseException:
                for future in futures:
                    future.cancel()
                raise
        finally:
            self.weight_sync.retire(adapters.release(adapter, len(requests)))
        return [s for per_request in samples for s in per_request]

    @property
    def _lora(self) -> bool:
        return self.model_config is not None and lora.is_on(self.model_config)

    def _vocab_size(self) -> Optional[int]:
        """Rows of the embedding table: the trainer's config, else what a server serves."""
        if self.model_config is not None:
            return self.model_config.vocab_size
        return self.weight_sync.served_vocab_size()

    def _generate_batch(self, requests: list[GenerateRequest],
                        adapter: Optional[str] = None) -> list[list[GenerateResult]]:
        n = requests[0].sampling.n
        if self.router is not None:  # one params dict for the whole group (generate())
            body = generate_body(requests, self.sampling_params_json(requests[0].sampling))
        else:
            body = {"input_ids": [[int(t) for t in r.prompt_ids] for r in requests],
                    "sampling_params": [self.sampling_params_json(r.sampling) for r in requests],
                    "return_logprob": True, "logprob_start_len": -1}
            if n == 1 and all(r.request_id for r in requests):
                body["rid"] = [str(r.request_id) for r in requests]
        routed = any(r.sampling.return_routed_experts for r in requests)
        if routed:  # one flag for the whole request, as SGLang takes it
            body["return_routed_experts"] = True
        if adapter is not None:  # SGLang repeats one name for every prompt and sample
            body["lora_path"] = self.weight_sync.adapter_name(adapter)
        try:
            url, reply = self._generation.call("POST", "/generate", body)
        except RolloutError as e:
            if adapter is not None and e.status == 400 and "LoRA" in str(e):
                raise RolloutError(f"{e} (adapter version {adapter!r}, which update_weights "
                                   "loaded: was the server restarted since? Update the weights "
                                   "again to load them there)", e.url, e.status) from e
            raise
        if isinstance(reply, dict):
            reply = [reply]
        if not isinstance(reply, list) or len(reply) != len(requests) * n:
            got = len(reply) if isinstance(reply, list) else type(reply).__name__
            raise RolloutError(f"POST {url}/generate: expected {len(requests) * n} samples "
                               f"({len(requests)} prompts x n={n}), got {got}", url)
        results = [self.parse_sample(item, url) for item in reply]
        if routed:
            for result in results:
                self._read_routing(result, url)
        meaning = self.server_logprobs(url)  # the server just answered: probe it if new
        for k, request in enumerate(requests):
            if meaning.refuses(request.sampling):
                raise RolloutError(self._temperature_message(url, request.sampling,
                                                             "a sample") +
                                   " (these samples were drawn but are dropped)", url)
            for result in results[k * n:(k + 1) * n]:
                result.logprob_convention = meaning.convention(request.sampling)
                if adapter is not None:  # SGLang reports the base's version; this is the policy's
                    result.weight_version = adapter
                    result.info["adapter"] = body["lora_path"]
                    # every id sampled under the one adapter (the base's spans say nothing)
                    result.info["weight_versions"] = [
                        {"version": adapter, "start": 0, "end": len(result.output_ids)}]
        return [results[k * n:(k + 1) * n] for k in range(len(requests))]

    def _read_routing(self, result: GenerateResult, url: str) -> None:
        """result.routed_experts from the reply's meta_info.routed_experts (kept in
        result.info by parse_sample), in the trainer's model's layers."""
        text = result.info.pop("routed_experts", None)
        if text is None:
            raise RolloutError(
                f"POST {url}/generate: the request asked for routed experts and the reply has "
                "none: launch SGLang with --enable-return-routed-experts (0.5.23 records them "
                "on NVIDIA GPUs only: its capturer registers host memory with CUDA) and serve a "
                "mixture of experts", url)
        cfg = self.model_config
        if cfg is None or cfg.moe is None:
            raise RolloutError("reading routed experts needs the trainer's mixture-of-experts "
                               "config (SGLangEngine(model_config=...))", url)
        try:
            result.routed_experts = routed_experts.decode(
                text, result.prompt_tokens + len(result.output_ids) - 1, cfg)
        except ValueError as err:
            raise RolloutError(f"POST {url}/generate: {err}", url) from err

    @staticmethod
    def _temperature_message(url: str, sp: SamplingParams, what: str) -> str:
        return (f"{what} samples at temperature {sp.temperature:g}, but {url} reports "
                "logprobs before temperature scaling (log_softmax(logits); SGLang does this "
                "when launched with SGLANG_RETURN_ORIGINAL_LOGPROB=1), which the trainer would "
                "misread as log_softmax(logits / T). Relaunch the server without that "
                "variable, or sample at temperature 1.")

    @staticmethod
    def parse_sample(item: Any, url: str = "server") -> GenerateResult:
        """One element of a `/generate` reply -> GenerateResult (tokens from the logprob list,
        which pairs every generated token with its logprob). Its `logprob_convention` is set
        by the caller, which knows the sampling params and the server."""
        what = f"POST {url}/generate"
        meta = item.get("meta_info") if isinstance(item, dict) else None
        if not isinstance(meta, dict):
            raise RolloutError(f"{what}: a sample without meta_info: {str(item)[:200]}", url)
        finish = meta.get("finish_reason")
        kind = finish.get("type") if isinstance(finish, dict) else finish
        if kind not in FINISH_REASONS:
            raise RolloutError(f"{what}: unknown finish_reason {finish!r} (sample "
                               f"{meta.get('id')})", url)
        entries = meta.get("output_token_logprobs")
        if entries is None:
            raise RolloutError(f"{what}: no meta_info.output_token_logprobs in the reply (does "
                               "the server support return_logprob?)", url)
        try:
            ids = [int(e[1]) for e in entries]
            logprobs = [float(e[0]) for e in entries]
        except (TypeError, ValueError, IndexError) as e:
            raise RolloutError(f"{what}: malformed output_token_logprobs {str(entries)[:200]}",
                               url) from e
        output_ids = item.get("output_ids")
        if output_ids is not None and list(output_ids) != ids[:len(output_ids)]:
            raise RolloutError(f"{what}: output_ids {output_ids[:8]}... disagree with the tokens "
                               f"of output_token_logprobs {ids[:8]}...", url)
        info = {"url": url, "id": meta.get("id"), "weight_versions": meta.get("weight_versions"),
                "completion_tokens": meta.get("completion_tokens"),
                "cached_tokens": meta.get("cached_tokens")}
        if isinstance(finish, dict) and "message" in finish:
            info["message"] = finish["message"]
        if "text" in item:
            info["text"] = item["text"]
        if "routed_experts" in meta:  # decoded by the engine, which knows the model's layers
            info["routed_experts"] = meta["routed_experts"]
        version = meta.get("weight_version")
        return GenerateResult(
            output_ids=ids, logprobs=logprobs, finish_reason=kind,
            weight_version=None if version is None else str(version),
            matched_stop=finish.get("matched") if isinstance(finish, dict) else None,
            prompt_tokens=int(meta.get("prompt_tokens") or 0), info=info)

    # -- what the logprobs mean -------------------------------------------------------------

    def server_logprobs(self, url: str) -> ServerLogprobs:
        """What `url`'s logprobs are the log of: declared, or probed once (logprob_probe.py).
        A probe the server refuses (HTTP 4xx) leaves the contract's "full"; one it cannot
        answer now is tried again at the next contact."""
        if self._declared is not None:
            return self._declared
        if url in self.router_urls:
            # A reply through the router does not say which worker drew it: ask each worker
            # (the router refuses the probe's per-row params), and require them to agree.
            meanings = {u: self.server_logprobs(u) for u in self.urls}
            meaning = agreed_logprobs(url, meanings)
            if all(u in self._logprobs for u in self.urls):  # keep only a measured answer
                self._logprobs[url] = meaning
            return meaning
        with self._probe_locks[url]:  # concurrent batches on a new server probe it once
            if url not in self._logprobs:
                vocab = self._vocab_size()
                prompt = logprob_probe.PROBE_PROMPT if not vocab or vocab > 12 else (0,)
                try:
                    reply = self.transport.call("POST", "/generate",
                                                logprob_probe.probe_body(prompt), urls=[url])[1]
                except RolloutError as e:
                    if e.status is None:
                        log.warning("%s: cannot probe its logprobs now (%s); assuming the "
                                    "contract (full, temperature-scaled)", url, e)
                        return ServerLogprobs(notes=("probe failed",))
                    reply = None
                    log.warning("%s refused the logprob probe: %s", url, e)
                self._logprobs[url] = meaning = logprob_probe.read_probe(reply)
                log.info("%s logprobs: %s", url, meaning.describe())
            return self._logprobs[url]

    # -- control ----------------------------------------------------------------------------

    def _health_problem(self, url: str) -> Optional[str]:
        """None when the server (or the router: it has a healthy worker) can generate now,
        else why not (one attempt, no retries). The router answers in plain text."""
        transport = self.router if url in self.router_urls else self.transport
        timeout = min(transport.request_timeout_s, 60.0)
        for path in ("/health_generate", "/health"):
            try:
                transport.call_one(url, "GET", path, None, timeout, retries=0, text_ok=True)
                return None
            except RolloutError as e:
                if e.status != 404:
                    return str(e)
            except ServerDown as e:
                return str(e)
        return f"{url}: neither /health_generate nor /health answers"

    def health(self) -> bool:
        """True when at least one server answers `/health_generate` (a 1-token generation);
        in router mode, when the router does (it has a healthy worker to route to)."""
        return any(self._health_problem(u) is None for u in self.router_urls or self.urls)

    def wait_healthy(self, timeout: Optional[float] = None, poll_s: float = 1.0) -> None:
        """Blocks until every server (and the router) is healthy, then reads what each serves
        (model path, tensor shapes when readable, weight version, what its logprobs mean) and
        that the router routes only to `urls`. Raises RolloutError after `timeout`."""
        timeout = self.health_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        pending = {u: "not polled yet" for u in self.urls + self.router_urls}
        while pending:
            for url in list(pending):
                why = self._health_problem(url)
                if why is None:
                    del pending[url]
                else:
                    pending[url] = why
            if pending:
                if time.monotonic() > deadline:
                    raise RolloutError(
                        f"rollout server(s) not healthy after {timeout:g}s: " +
                        "; ".join(f"{u}: {w}" for u, w in pending.items()),
                        next(iter(pending)) if len(pending) == 1 else None)
                time.sleep(poll_s)
        versions = set()
        for url in self.urls:
            info = self.model_info(url)
            versions.add(str(info.get("weight_version")))
            try:  # first contact: keep the served shapes for update_weights' check
                self.weight_sync.served_shapes(url, info)
            except RolloutError as e:
                log.info("%s (checked again at update_weights)", e)
            if self._lora and jax.process_index() == 0:
                self.weight_sync.check_lora_server(url)  # launch flags: fail before training
            self.server_logprobs(url)
        if self.router is not None:
            check_workers(self.router, self.urls, min(self.router.request_timeout_s, 60.0))
            self.server_logprobs(self.router.urls[0])
        if self._version is None and len(versions) == 1:
            self._version = versions.pop()

    def model_info(self, url: str) -> dict:
        """`GET /model_info` of one server (`model_path`, `weight_version`, ...)."""
        return self.weight_sync.model_info(url)

    def abort_all(self) -> list[str]:
        """Asks every server to abort its running requests (`POST /abort_request`); they come
        back with what they generated so far and finish type `abort`. Returns the servers that
        could not be reached (best effort: a dead server has nothing to abort)."""
        failed = []
        timeout = min(self.transport.request_timeout_s, 30.0)
        for url in self.urls:
            try:
                self.transport.call_one(url, "POST", "/abort_request", {"abort_all": True},
                                        timeout)
            except (RolloutError, ServerDown) as e:
                log.warning("abort_all: %s", e)
                failed.append(url)
        return failed

    def pause_generation(self, mode: str = "abort") -> None:
        """`POST /pause_generation {mode}` to every worker ("abort": running requests end now
        with finish type `abort`; "retract" / "in_place": they wait and finish after
        `continue_generation`, on the weights loaded meanwhile)."""
        self._every_worker("/pause_generation", {"mode": mode})

    def continue_generation(self) -> None:
        """`POST /continue_generation` to every worker."""
        self._every_worker("/continue_generation", {})

    def flush_cache(self, busy_wait_s: float = 30.0) -> None:
        """`POST /flush_cache` to every worker. SGLang refuses with 400 while its scheduler
        still holds a request, which it can for a moment after the request's reply has been
        sent; a 400 is retried for up to `busy_wait_s` before it counts as a failure."""
        self._every_worker("/flush_cache", None, retry_400_for_s=busy_wait_s)

    def _every_worker(self, path: str, body: Optional[dict],
                      retry_400_for_s: float = 0.0) -> None:
        """One control call to each worker directly (never through a router, which forwards
        none of them to every worker); RolloutError naming every worker that failed."""
        timeout = min(self.transport.request_timeout_s, 60.0)
        failures = []
        for url in self.urls:
            deadline = time.monotonic() + retry_400_for_s
            while True:
                try:
                    # SGLang answers /flush_cache in plain text ("Cache flushed...")
                    self.transport.call_one(url, "POST", path, body, timeout, text_ok=True)
                    break
                except RolloutError as e:
                    if e.status == 400 and time.monotonic() < deadline:
                        time.sleep(0.2)
                        continue
                    failures.append(str(e))
                    break
                except ServerDown as e:
                    failures.append(str(e))
                    break
        if failures:
            raise RolloutError(f"POST {path} failed on {len(failures)} of {len(self.urls)} "
                               "workers: " + "; ".join(failures),
                               self.urls[0] if len(self.urls) == 1 else None)

    @property
    def weight_version(self) -> Optional[str]:
        return self._version

    @property
    def last_sync_bytes(self) -> int:
        """Bytes of the files the last `update_weights` wrote (0 on other hosts)."""
        return self.weight_sync.last_sync_bytes

    def stats(self) -> dict:
        """Weight-sync counters for the trainer to log: `syncs`, `last_sync_bytes` and
        `total_sync_bytes` (files written: the HF export, or with LoRA the adapter dir), and
        with LoRA `adapters_loaded` (versions on the servers, oldest first) and
        `adapter_requests_in_flight` (requests pinned to each)."""
        sync = self.weight_sync
        out = {"syncs": sync.syncs, "last_sync_bytes": sync.last_sync_bytes,
               "total_sync_bytes": sync.total_sync_bytes}
        if self._lora:
            loaded = sync.adapters.loaded()
            out["adapters_loaded"] = loaded
            out["adapter_requests_in_flight"] = {v: sync.adapters.in_flight(v) for v in loaded}
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.transport.close()
        if self.router is not None:
            self.router.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- weight sync (weight_sync.py) -------------------------------------------------------

    def served_shapes(self, url: str, info: Optional[dict] = None) -> tuple[str, dict]:
        """(model_path, HF tensor name -> shape) of what `url` serves."""
        return self.weight_sync.served_shapes(url, info)

    # The servers are the same for every host of a multi-host job, and process 0 alone loads
    # new weights into them: a caller on several hosts waits for every host (on its main
    # thread) before anyone samples with a version just loaded (producer.py).
    shared_across_hosts = True

    def shared_weights_loaded(self, version) -> None:
        """Every host passed the barrier after process 0 loaded `version`: with LoRA, other
        hosts' requests may name it from now on (main thread: wait_for_shared_weights)."""
        if self._lora:
            self.weight_sync.confirm_loaded(str(version))

    def oldest_adapter_named(self) -> Optional[str]:
        """With LoRA, the oldest adapter version this host's requests may name until the next
        `shared_weights_loaded` (None: none, or no LoRA)."""
        return self.weight_sync.adapters.oldest_named() if self._lora else None

    def hold_adapters_for_other_hosts(self, oldest: list) -> None:
        """Process 0, with LoRA: the other hosts' `oldest_adapter_named`; those versions and
        newer stay loaded until the next call."""
        if self._lora:
            self.weight_sync.hold_for_other_hosts(oldest)

    def update_weights(self, params, version: str) -> None:
        """Exports `params` to `weights_dir/<version>` and has every server load them
        (weight_sync.py); with `model_config.lora`, the adapters alone (`params` may be just
        those), to `weights_dir/adapter_<version>`, which requests submitted from now on use
        (on other hosts than process 0: from `shared_weights_loaded(version)` on).
        Refuses (ValueError / RolloutError, before any request that could change a server)
        when the export would not match what a server serves, a server was not launched
        with LoRA (the error names the flags), or the router routes to a worker not in
        `urls` (it would keep the old weights)."""
        if self.router is not None and jax.process_index() == 0:
            check_workers(self.router, self.urls, min(self.router.request_timeout_s, 60.0))
        self.weight_sync.update(params, version)
        self._version = str(version)
