"""`SGLangEngine`: a `RolloutEngine` over the SGLang native HTTP API, with weight sync by disk.

Works against real SGLang servers and against rl_tpu's own SGLang-compatible JAX server
(`launch.serve_rollout`); the trainer cannot tell them apart. Stdlib HTTP only.

Generation: requests are grouped by `n` (SGLang wants one `n` per batch) and sent as batches of
at most `batch_size` prompts in one `POST /generate` (`input_ids` list of lists, one
`sampling_params` dict per prompt, `return_logprob`, `logprob_start_len=-1` for output-token
logprobs only). At most `max_concurrency` batches are in flight, each to the server with the
fewest in flight. Replies come back flat and prompt-major (p0s0, p0s1, p1s0, ...).

Failures never hang the trainer; each ends in a `RolloutError` naming the server and what went
wrong, or in a fail-over:

- connection refused, connection dropped, or HTTP 5xx: retried on the same server
  `connect_retries` times with exponential backoff (`backoff_s`, doubling, capped at 30 s),
  then the batch fails over to the next server (generation is safe to repeat: a sample that
  never came back is simply drawn again);
- no reply within `request_timeout_s`: fails over at once (a hung server is not helped by
  waiting longer on it);
- HTTP 4xx: raised at once with the server's message (the request is wrong; every server would
  say so).

A server that failed is tried last for `failover_cooldown_s`. With one URL, the worst case
before the error is `(connect_retries + 1)` attempts of at most `request_timeout_s` each plus the
backoff sleeps.

Weight sync (`update_weights(params, version)`): the trainer's params are exported with
`hf.save` to `weights_dir/<version>` (a directory every server can read), then each server
loads it with `POST /update_weights_from_disk {model_path, weight_version, flush_cache}`, and
`GET /model_info` must then report the version. SGLang re-reads neither config nor tokenizer
and crashes on a shape mismatch, so before any of that the exported tensor shapes are checked
against the ones each server serves: read once, at first contact, from the config.json of the
`model_path` that `GET /model_info` names. Older exports (dirs that carry this module's marker
file) are deleted after a successful update.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import logging
import math
import os
import re
import shutil
import socket
import threading
import time
import urllib.parse
from typing import Any, Optional, Sequence

import jax

from rl_tpu.models import hf
from rl_tpu.models.transformer import ModelConfig
from rl_tpu.rollout.engine import (FINISH_REASONS, GenerateRequest, GenerateResult,
                                   RolloutEngine, RolloutError, SamplingParams)

log = logging.getLogger(__name__)

EXPORT_MARKER = ".rl_tpu_weight_export"  # marks dirs update_weights wrote (and may delete)
_VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_MAX_BACKOFF_S = 30.0


class _ServerDown(Exception):
    """One server could not answer (after its retries); the caller may fail over."""


def _normalise_url(url: str) -> str:
    parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
        raise ValueError(f"rollout server url must look like http://host:port, got {url!r}")
    return f"{parts.scheme}://{parts.netloc}"


def _error_message(payload: Any, raw: bytes) -> str:
    """The server's own words: SGLang `{"error": {"message"}}`, FastAPI `{"detail"}`, or text."""
    if isinstance(payload, dict):
        err = payload.get("error", payload.get("detail", payload.get("message")))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err is not None:
            return str(err)
    return raw[:300].decode("utf-8", "replace") if raw else "(empty reply)"


def _dims(spec: str, cfg: ModelConfig) -> tuple[int, ...]:
    """A WEIGHT_TABLE dims spec (comma-separated products of shape letters) as a shape."""
    size = {"D": cfg.hidden_size, "N": cfg.num_heads, "K": cfg.num_kv_heads,
            "H": cfg.head_dim, "F": cfg.intermediate_size, "V": cfg.vocab_size}
    return tuple(math.prod(size[c] for c in part) for part in spec.split(","))


def tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for every tensor a checkpoint of `cfg` holds."""
    return {name: _dims(rule.hf_dims, cfg) for name, (rule, _) in hf.expected_tensors(cfg).items()}


def shape_mismatches(ours: dict, served: dict, limit: int = 6) -> list[str]:
    """Human-readable differences between two name -> shape maps (empty when they agree)."""
    problems = []
    for name in sorted(set(ours) | set(served)):
        if name not in served:
            problems.append(f"{name!r} is exported but not served")
        elif name not in ours:
            problems.append(f"{name!r} is served but not exported")
        elif tuple(ours[name]) != tuple(served[name]):
            problems.append(f"{name!r} is {list(ours[name])} here, {list(served[name])} served")
    if len(problems) > limit:
        problems = problems[:limit] + [f"and {len(problems) - limit} more"]
    return problems


class SGLangEngine(RolloutEngine):
    """A `RolloutEngine` over one or more SGLang(-compatible) servers.

    Args:
      urls: server base URLs, e.g. ["http://10.0.0.2:30000"].
      tokenizer: optional; when given, weight exports also carry its files, so the latest
        export is a complete model dir a restarted server can launch from.
      weights_dir: directory, readable by every server, for weight exports (one subdir per
        version). Needed by `update_weights`.
      model_config: the trainer's `ModelConfig` of the params `update_weights` receives.
      max_concurrency: batches in flight at once (threads).
      batch_size: prompts per `/generate` request.
      request_timeout_s: seconds to wait for one reply.
      connect_retries: extra attempts on one server after a failure (see the module doc).
      backoff_s: seconds before the first retry; doubles after each.
      health_timeout_s: how long `wait_healthy()` waits by default.
      api_key: sent as `Authorization: Bearer ...` (SGLang's `--api-key`).
      update_timeout_s: seconds one server may take to load new weights.
      served_model_path: a local copy of the served model dir, for the shape check when the
        servers' `model_path` is not a directory readable here (e.g. a hub id).
      export_dtype: dtype of exported weights (default: the config's param dtype).
      failover_cooldown_s: how long a failed server is tried last.
    """

    def __init__(self, urls: Sequence[str], *, tokenizer=None, weights_dir: Optional[str] = None,
                 model_config: Optional[ModelConfig] = None, max_concurrency: int = 8,
                 batch_size: int = 16, request_timeout_s: float = 300.0,
                 connect_retries: int = 3, backoff_s: float = 0.5,
                 health_timeout_s: float = 300.0, api_key: Optional[str] = None,
                 update_timeout_s: float = 600.0, served_model_path: Optional[str] = None,
                 export_dtype: Optional[str] = None, failover_cooldown_s: float = 30.0):
        if isinstance(urls, str):
            urls = [urls]
        if not urls:
            raise ValueError("SGLangEngine needs at least one server url")
        self.urls = [_normalise_url(u) for u in urls]
        if len(set(self.urls)) != len(self.urls):
            raise ValueError(f"duplicate server urls in {self.urls}")
        if max_concurrency < 1 or batch_size < 1 or connect_retries < 0:
            raise ValueError("max_concurrency and batch_size must be >= 1, connect_retries >= 0")
        self.tokenizer = tokenizer
        self.weights_dir = weights_dir
        self.model_config = model_config
        self.max_concurrency, self.batch_size = int(max_concurrency), int(batch_size)
        self.request_timeout_s = float(request_timeout_s)
        self.update_timeout_s = float(update_timeout_s)
        self.connect_retries, self.backoff_s = int(connect_retries), float(backoff_s)
        self.health_timeout_s = float(health_timeout_s)
        self.failover_cooldown_s = float(failover_cooldown_s)
        self.served_model_path = served_model_path
        self.export_dtype = export_dtype
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._lock = threading.Lock()
        self._inflight = {u: 0 for u in self.urls}
        self._down_until = {u: 0.0 for u in self.urls}
        self._turn = 0
        self._local = threading.local()
        self._pool = concurrent.futures.ThreadPoolExecutor(self.max_concurrency,
                                                           thread_name_prefix="sglang-client")
        self._served: dict[str, tuple[str, dict]] = {}  # url -> (model_path, name -> shape)
        self._version: Optional[str] = None

    # -- transport --------------------------------------------------------------------------

    def _connection(self, url: str, timeout: float) -> http.client.HTTPConnection:
        conns = self._local.__dict__.setdefault("conns", {})
        conn = conns.get(url)
        if conn is None:
            parts = urllib.parse.urlsplit(url)
            https = parts.scheme == "https"
            cls = http.client.HTTPSConnection if https else http.client.HTTPConnection
            conn = conns[url] = cls(parts.hostname, parts.port, timeout=timeout)
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn

    def _drop_connection(self, url: str) -> None:
        conn = self._local.__dict__.get("conns", {}).pop(url, None)
        if conn is not None:
            conn.close()

    def _call_one(self, url: str, method: str, path: str, body: Any, timeout: float,
                  retries: Optional[int] = None) -> Any:
        """One API call to one server with retries; the decoded JSON reply.

        Raises RolloutError for answers no other server would change (4xx, a reply that is
        not JSON) and _ServerDown when this server cannot answer."""
        data = json.dumps(body).encode() if body is not None else None
        what = f"{method} {url}{path}"
        retries = self.connect_retries if retries is None else retries
        attempt, stale_retry_used = 0, False
        while True:
            conn = self._connection(url, timeout)
            reused = conn.sock is not None
            try:
                conn.request(method, path, body=data, headers=self._headers)
                response = conn.getresponse()
                raw, status = response.read(), response.status
            except TimeoutError as e:  # socket.timeout is TimeoutError on 3.10+
                self._drop_connection(url)
                raise _ServerDown(f"{what}: no reply within {timeout:g}s (server hung or "
                                  "overloaded)") from e
            except (http.client.HTTPException, OSError) as e:
                self._drop_connection(url)
                if reused and not stale_retry_used:  # keep-alive closed by the server: redo now
                    stale_retry_used = True
                    continue
                failure = (f"{what}: {type(e).__name__}: {e}" if not isinstance(
                    e, (ConnectionRefusedError, socket.gaierror)) else
                    f"{what}: cannot connect ({type(e).__name__}: {e})")
            else:
                try:
                    payload = json.loads(raw) if raw else None
                except ValueError:
                    payload = None
                    if status == 200:
                        raise RolloutError(f"{what}: HTTP 200 with a reply that is not JSON: "
                                           f"{raw[:200]!r}", url, status)
                if status == 200:
                    return payload
                message = _error_message(payload, raw)
                if status < 500:
                    raise RolloutError(f"{what} failed with HTTP {status}: {message}", url, status)
                failure = f"{what}: HTTP {status}: {message}"
            if attempt >= retries:
                raise _ServerDown(f"{failure} (after {attempt + 1} attempts)")
            delay = min(self.backoff_s * 2 ** attempt, _MAX_BACKOFF_S)
            log.warning("%s; retrying in %.2fs", failure, delay)
            time.sleep(delay)
            attempt += 1

    def _ordered_urls(self) -> list[str]:
        """Servers to try, best first: up ones by fewest in flight (ties rotate), then down ones."""
        with self._lock:
            now = time.monotonic()
            self._turn += 1
            n = len(self.urls)
            rotated = [self.urls[(self._turn + k) % n] for k in range(n)]
            return sorted(rotated, key=lambda u: (self._down_until[u] > now, self._inflight[u]))

    def _call(self, method: str, path: str, body: Any = None, *,
              urls: Optional[Sequence[str]] = None, timeout: Optional[float] = None):
        """(url, reply) from the first server in `urls` (default: all, best first) that answers."""
        urls = list(urls) if urls is not None else self._ordered_urls()
        timeout = self.request_timeout_s if timeout is None else timeout
        failures = []
        for url in urls:
            with self._lock:
                self._inflight[url] += 1
            try:
                reply = self._call_one(url, method, path, body, timeout)
            except _ServerDown as e:
                failures.append(str(e))
                with self._lock:
                    self._down_until[url] = time.monotonic() + self.failover_cooldown_s
                if url != urls[-1]:
                    log.warning("%s; failing over to another server", e)
                continue
            finally:
                with self._lock:
                    self._inflight[url] -= 1
            with self._lock:
                self._down_until[url] = 0.0
            return url, reply
        hint = ("Is the rollout server running? Check its log and restart it (more urls give "
                "fail-over)." if len(urls) == 1 else "Are the rollout servers running? Check "
                "their logs and restart them.")
        raise RolloutError("; ".join(failures) + ". " + hint, urls[0] if len(urls) == 1 else None)

    # -- generation -------------------------------------------------------------------------

    @staticmethod
    def sampling_params_json(sp: SamplingParams) -> dict:
        """SGLang's `sampling_params` for one prompt. (SGLang semantics: `ignore_eos` turns off
        `stop_token_ids` too; stop strings still apply.)"""
        out = {"max_new_tokens": sp.max_new_tokens, "temperature": sp.temperature,
               "top_p": sp.top_p, "top_k": sp.top_k, "n": sp.n, "ignore_eos": sp.ignore_eos}
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
        by_n: dict[int, list[int]] = {}
        for k, r in enumerate(requests):
            by_n.setdefault(r.sampling.n, []).append(k)
        chunks = [idx[s:s + self.batch_size] for idx in by_n.values()
                  for s in range(0, len(idx), self.batch_size)]
        futures = {self._pool.submit(self._generate_batch, [requests[k] for k in chunk]): chunk
                   for chunk in chunks}
        samples: list[Optional[list[GenerateResult]]] = [None] * len(requests)
        try:
            for future in concurrent.futures.as_completed(futures):
                for k, per_request in zip(futures[future], future.result()):
                    samples[k] = per_request
        except BaseException:
            for future in futures:
                future.cancel()
            raise
        return [s for per_request in samples for s in per_request]

    def _vocab_size(self) -> Optional[int]:
        """Rows of the embedding table: the trainer's config, else what a server serves."""
        if self.model_config is not None:
            return self.model_config.vocab_size
        for _, shapes in self._served.values():
            if "model.embed_tokens.weight" in shapes:
                return shapes["model.embed_tokens.weight"][0]
        return None

    def _generate_batch(self, requests: list[GenerateRequest]) -> list[list[GenerateResult]]:
        n = requests[0].sampling.n
        body = {"input_ids": [[int(t) for t in r.prompt_ids] for r in requests],
                "sampling_params": [self.sampling_params_json(r.sampling) for r in requests],
                "return_logprob": True, "logprob_start_len": -1}
        if n == 1 and all(r.request_id for r in requests):
            body["rid"] = [str(r.request_id) for r in requests]
        url, reply = self._call("POST", "/generate", body)
        if isinstance(reply, dict):
            reply = [reply]
        if not isinstance(reply, list) or len(reply) != len(requests) * n:
            got = len(reply) if isinstance(reply, list) else type(reply).__name__
            raise RolloutError(f"POST {url}/generate: expected {len(requests) * n} samples "
                               f"({len(requests)} prompts x n={n}), got {got}", url)
        results = [self.parse_sample(item, url) for item in reply]
        return [results[k * n:(k + 1) * n] for k in range(len(requests))]

    @staticmethod
    def parse_sample(item: Any, url: str = "server") -> GenerateResult:
        """One element of a `/generate` reply -> GenerateResult (tokens from the logprob list,
        which pairs every generated token with its logprob)."""
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
        version = meta.get("weight_version")
        return GenerateResult(
            output_ids=ids, logprobs=logprobs, finish_reason=kind,
            weight_version=None if version is None else str(version),
            matched_stop=finish.get("matched") if isinstance(finish, dict) else None,
            prompt_tokens=int(meta.get("prompt_tokens") or 0), info=info)

    # -- control ----------------------------------------------------------------------------

    def _probe(self, url: str) -> Optional[str]:
        """None when the server can generate now, else why not (one attempt, no retries)."""
        for path in ("/health_generate", "/health"):
            try:
                self._call_one(url, "GET", path, None, min(self.request_timeout_s, 60.0), 0)
                return None
            except RolloutError as e:
                if e.status != 404:
                    return str(e)
            except _ServerDown as e:
                return str(e)
        return f"{url}: neither /health_generate nor /health answers"

    def health(self) -> bool:
        """True when at least one server answers `/health_generate` (a 1-token generation)."""
        return any(self._probe(u) is None for u in self.urls)

    def wait_healthy(self, timeout: Optional[float] = None, poll_s: float = 1.0) -> None:
        """Blocks until every server is healthy, then reads what each serves (model path,
        tensor shapes when readable, weight version). Raises RolloutError after `timeout`."""
        timeout = self.health_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        pending = {u: "not polled yet" for u in self.urls}
        while pending:
            for url in list(pending):
                why = self._probe(url)
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
                self.served_shapes(url, info)
            except RolloutError as e:
                log.info("%s (checked again at update_weights)", e)
        if self._version is None and len(versions) == 1:
            self._version = versions.pop()

    def model_info(self, url: str) -> dict:
        """`GET /model_info` of one server (`model_path`, `weight_version`, ...)."""
        return self._call("GET", "/model_info", urls=[url])[1]

    def abort_all(self) -> list[str]:
        """Asks every server to abort its running requests (`POST /abort_request`); they come
        back with what they generated so far and finish type `abort`. Returns the servers that
        could not be reached (best effort: a dead server has nothing to abort)."""
        failed = []
        for url in self.urls:
            try:
                self._call_one(url, "POST", "/abort_request", {"abort_all": True},
                               min(self.request_timeout_s, 30.0))
            except (RolloutError, _ServerDown) as e:
                log.warning("abort_all: %s", e)
                failed.append(url)
        return failed

    @property
    def weight_version(self) -> Optional[str]:
        return self._version

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- weight sync ------------------------------------------------------------------------

    def served_shapes(self, url: str, info: Optional[dict] = None) -> tuple[str, dict]:
        """(model_path, HF tensor name -> shape) of what `url` serves; read at first contact
        and kept (a weight update cannot change shapes)."""
        if url not in self._served:
            info = info if info is not None else self.model_info(url)
            model_path = info.get("model_path")
            readable = model_path and os.path.isdir(model_path)
            local = model_path if readable else self.served_model_path
            if not local:
                raise RolloutError(
                    f"cannot check weight shapes before updating {url}: it serves "
                    f"{model_path!r}, which is not a directory here; pass served_model_path= "
                    "(a local copy of that model dir's config.json)", url)
            try:
                shapes = tensor_shapes(hf.read_config(local))
            except hf.CheckpointError as e:
                raise RolloutError(f"cannot check weight shapes before updating {url}: {e}",
                                   url) from e
            self._served[url] = (model_path or local, shapes)
        return self._served[url]

    def _check_params(self, cfg: ModelConfig, params) -> None:
        shapes = {tuple(getattr(k, "key", k) for k in kp): tuple(v.shape)
                  for kp, v in jax.tree_util.tree_flatten_with_path(params)[0]}
        expected = {}
        for rule in hf.active_rules(cfg):
            dims = _dims(rule.our_dims, cfg)
            parts = tuple(rule.path.split("/"))
            if not rule.per_layer:
                expected[parts] = dims
            elif cfg.scan_layers:
                expected[("layers",) + parts] = (cfg.num_layers,) + dims
            else:
                for i in range(cfg.num_layers):
                    expected[(f"layers_{i}",) + parts] = dims
        bad = [f"{'/'.join(k)} is {list(shapes[k]) if k in shapes else 'missing'}, the config "
               f"implies {list(v)}" for k, v in expected.items() if shapes.get(k) != v]
        if bad:
            raise RolloutError("update_weights: params do not match model_config: " +
                               "; ".join(bad[:6]) + (f" and {len(bad) - 6} more" if len(bad) > 6
                                                     else ""))

    def update_weights(self, params, version: str) -> None:
        """Exports `params` to `weights_dir/<version>` and has every server load them.

        Refuses (RolloutError, before any request that could change a server) when the export
        would not match the shapes a server serves."""
        version = str(version)
        if not _VERSION_RE.match(version):
            raise ValueError(f"weight version {version!r}: use letters, digits, '.', '_', '-' "
                             "(it names a directory)")
        if self.model_config is None or self.weights_dir is None:
            raise ValueError("update_weights needs SGLangEngine(model_config=..., weights_dir=...)")
        cfg = self.model_config
        self._check_params(cfg, params)
        ours = tensor_shapes(cfg)
        writer = jax.process_index() == 0
        if writer:
            for url in self.urls:
                model_path, served = self.served_shapes(url)
                problems = shape_mismatches(ours, served)
                if problems:
                    raise RolloutError(
                        f"refusing to update {url} to weight version {version!r}: the exported "
                        f"tensors do not match the served model ({model_path}): "
                        + "; ".join(problems) + ". Loading them would crash the server; "
                        "restart it with a model of the new shapes instead.", url)
        path = os.path.abspath(os.path.join(self.weights_dir, version))
        os.makedirs(self.weights_dir, exist_ok=True)
        hf.save(path, cfg, params, tokenizer=self.tokenizer, dtype=self.export_dtype)
        if not writer:  # multi-host: every process gathers, process 0 writes and talks
            self._version = version
            return
        open(os.path.join(path, EXPORT_MARKER), "w").close()
        body = {"model_path": path, "weight_version": version, "flush_cache": True}

        def push(url):
            reply = self._call("POST", "/update_weights_from_disk", body, urls=[url],
                               timeout=self.update_timeout_s)[1]
            if not (isinstance(reply, dict) and reply.get("success")):
                raise RolloutError(f"POST {url}/update_weights_from_disk ({path}) did not "
                                   f"succeed: {_error_message(reply, b'')}", url)
            served = self.model_info(url).get("weight_version")
            if str(served) != version:
                raise RolloutError(f"{url} loaded {path} but reports weight_version "
                                   f"{served!r}, not {version!r}", url)

        with concurrent.futures.ThreadPoolExecutor(len(self.urls)) as pool:
            errors = [f.exception() for f in [pool.submit(push, u) for u in self.urls]]
        errors = [e for e in errors if e is not None]
        if errors:
            raise errors[0] if len(errors) == 1 else RolloutError(
                "update_weights failed on several servers: " + "; ".join(map(str, errors)))
        self._version = version
        self._delete_old_exports(keep=path)

    def _delete_old_exports(self, keep: str) -> None:
        for name in os.listdir(self.weights_dir):
            old = os.path.join(self.weights_dir, name)
            if old != keep and os.path.isfile(os.path.join(old, EXPORT_MARKER)):
                shutil.rmtree(old, ignore_errors=True)
