"""`RemoteRewardScorer`: a `RewardScorer` whose model runs on reward servers (server.py).

The RL loop scores its trajectories with `.score(sequences) -> [N, C]` whichever it holds
(RewardMix reads nothing else), so `reward.urls` moves the reward model off the trainer's
devices onto `python -m launch.serve_reward` hosts without changing what is paid: the ids go
as they are (POST /score, no re-tokenization) and the raw scores come back.

A call is cut into requests that fit the server's limits (its /get_model_info says them:
sequences and tokens a request), sent round robin over the urls, several at once. Failures:

- connection refused, or a connection dropped before the reply (scoring changes nothing on
  the server, so it is safe to send again): retried `retries` times with exponential backoff
  (`backoff_s`, doubling), each time on the next url;
- no reply within `timeout_s`: raised at once (a hung server is not helped by waiting);
- HTTP 503 with Retry-After (the server holds as many requests as it may): sent again after
  the wait it asks for (at most MAX_BACKOFF_S), `retries` times, on the next url;
- HTTP 4xx (the request is wrong: every server would say so) or 5xx: raised at once with the
  url and the server's message.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import logging
import os
import threading
import time
from typing import Optional, Sequence

import httpx
import numpy as np

from rl_tpu.models.reward_model import RewardHead
from rl_tpu.rollout.http_transport import error_message, normalise_url
from rl_tpu.rewards.server import API_KEY_ENV

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0


class RewardServerError(RuntimeError):
    """A reward server could not score a request; `url` and `status` (None: no reply) say
    which server and how."""

    def __init__(self, message: str, url: str, status: Optional[int] = None):
        super().__init__(message)
        self.url, self.status = url, status


def parse_urls(text: str, key: str = "reward.urls") -> list[str]:
    """The comma-separated urls of `text`, each http(s)://host:port; ValueError naming `key`."""
    urls = [u.strip() for u in (text or "").split(",") if u.strip()]
    if not urls:
        raise ValueError(f"{key}={text!r} names no reward server; give http://host:port[,...]")
    try:
        checked = [normalise_url(u) for u in urls]
    except ValueError as e:
        raise ValueError(f"{key}: {str(e).replace('rollout server', 'reward server')}; give "
                         "comma-separated http://host:port of `python -m launch.serve_reward` "
                         "servers") from None
    if len(set(checked)) != len(checked):
        raise ValueError(f"{key}: a url is given twice in {checked}")
    return checked


class RemoteRewardScorer:
    """score(sequences) -> [N, C] float32, from the reward servers at `urls` (a list, or a
    comma-separated string). `api_key` (default: RL_TPU_REWARD_API_KEY) goes with every
    request; `max_in_flight` requests are sent at once (default: two a server)."""

    def __init__(self, urls, timeout_s: float = 300.0, retries: int = 3,
                 backoff_s: float = 0.5, api_key: Optional[str] = None,
                 max_in_flight: int = 0):
        self.urls = parse_urls(urls) if isinstance(urls, str) else parse_urls(",".join(urls))
        if not timeout_s > 0 or retries < 0 or backoff_s < 0:
            raise ValueError(f"RemoteRewardScorer: timeout_s={timeout_s} must be > 0, "
                             f"retries={retries} and backoff_s={backoff_s} >= 0")
        self.timeout_s, self.retries, self.backoff_s = float(timeout_s), int(retries), backoff_s
        key = api_key or os.environ.get(API_KEY_ENV)
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        # trust_env=False: reward servers sit on the cluster's network, and a proxy meant for
        # the internet must not carry the trainer's traffic (as the rollout client)
        self._client = httpx.Client(headers=headers, timeout=self.timeout_s, trust_env=False,
                                    limits=httpx.Limits(max_connections=None,
                                                        keepalive_expiry=4.0))
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_in_flight or 2 * len(self.urls), thread_name_prefix="reward-client")
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self._info: Optional[dict] = None

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self._client.close()

    # -- what the servers serve ---------------------------------------------------------

    def info(self) -> dict:
        """The first server's /get_model_info (num_labels, labels, limits), read once."""
        with self._lock:
            if self._info is None:
                info = self._call("GET", "/get_model_info", None)
                if not isinstance(info, dict) or info.get("is_generation") is not False or \
                        not isinstance(info.get("num_labels"), int):
                    raise RewardServerError(f"GET /get_model_info answered {str(info)[:200]}: "
                                            "not an rl_tpu reward server (launch.serve_reward)",
                                            self.urls[0])
                self._info = info
            return self._info

    @property
    def num_labels(self) -> int:
        return int(self.info()["num_labels"])

    @property
    def head(self) -> RewardHead:
        info = self.info()
        return RewardHead(num_labels=int(info["num_labels"]), labels=tuple(info["labels"]))

    # -- scoring ------------------------------------------------------------------------

    def chunks(self, lengths: Sequence[int]) -> list[tuple[int, int]]:
        """[start, end) spans of the sequences, in order, each within the servers' limits of
        sequences and tokens a request (one sequence alone goes as it is: the server says
        whether it is too long)."""
        limits = self.info().get("limits") or {}
        most = int(limits.get("max_sequences", 1024))
        budget = int(limits.get("max_request_tokens", 1 << 20))
        spans, start, tokens = [], 0, 0
        for i, n in enumerate(lengths):
            if i > start and (i - start >= most or tokens + n > budget):
                spans.append((start, i))
                start, tokens = i, 0
            tokens += n
        if start < len(lengths):
            spans.append((start, len(lengths)))
        return spans

    def score(self, sequences: Sequence[Sequence[int]]) -> np.ndarray:
        """[N, C] scores of `sequences` (lists of token ids, none empty), in their order."""
        c = self.num_labels
        out = np.zeros((len(sequences), c), np.float32)
        for i, s in enumerate(sequences):
            if not len(s):
                raise ValueError(f"RemoteRewardScorer.score: sequence {i} is empty; a reward "
                                 "model scores a sequence's last token")
        spans = self.chunks([len(s) for s in sequences])
        ids = [[int(t) for t in s] for s in sequences]  # numpy ints are not JSON

        def one(span: tuple[int, int]) -> None:
            start, end = span
            url, reply = self._call_any("POST", "/score", {"input_ids": ids[start:end]})
            scores = reply.get("scores") if isinstance(reply, dict) else None
            if not isinstance(scores, list) or len(scores) != end - start or \
                    any(not isinstance(r, list) or len(r) != c for r in scores):
                raise RewardServerError(f"POST {url}/score answered {str(reply)[:200]}: not "
                                        f"{end - start} rows of {c} scores", url, 200)
            out[start:end] = np.asarray(scores, np.float32)

        for future in [self._pool.submit(one, span) for span in spans]:
            future.result()
        return out

    # -- HTTP ---------------------------------------------------------------------------

    def _call_any(self, method: str, path: str, body) -> tuple[str, object]:
        """(url, reply) of one call, on the next url in turn, moving on to the next one for
        each retry of a connection failure."""
        first = next(self._turn)
        for attempt in range(self.retries + 1):
            url = self.urls[(first + attempt) % len(self.urls)]
            try:
                return url, self._call_one(url, method, path, body)
            except _NoConnection as e:
                if e.retry_after_s is not None and attempt < self.retries:
                    log.warning("%s; retrying in %.2fs", e, e.retry_after_s)
                    time.sleep(e.retry_after_s)
                    continue
                if attempt == self.retries and e.retry_after_s is not None:
                    raise RewardServerError(f"{e} (after {attempt + 1} attempts)", url,
                                            503) from e
                if attempt == self.retries:
                    raise RewardServerError(
                        f"{e} (after {attempt + 1} attempts over {len(self.urls)} server(s)); "
                        "is the reward server running? (`python -m launch.serve_reward`)",
                        url) from e
                delay = min(self.backoff_s * 2 ** attempt, MAX_BACKOFF_S)
                log.warning("%s; retrying in %.2fs", e, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def _call(self, method: str, path: str, body):
        return self._call_any(method, path, body)[1]

    def _call_one(self, url: str, method: str, path: str, body):
        what = f"{method} {url}{path}"
        data = json.dumps(body).encode() if body is not None else None
        try:
            response = self._client.request(method, url + path, content=data)
        except httpx.TimeoutException as e:
            raise RewardServerError(f"{what}: no reply within {self.timeout_s:g}s (the reward "
                                    "server is hung or overloaded)", url) from e
        except httpx.TransportError as e:  # refused, or dropped before the reply
            raise _NoConnection(f"{what}: {type(e).__name__}: {e}") from e
        try:
            payload = response.json() if response.content else None
        except ValueError:
            payload = None
        if response.status_code == 503 and "retry-after" in response.headers:
            try:
                wait = min(max(float(response.headers["retry-after"]), 0.0), MAX_BACKOFF_S)
            except ValueError:
                wait = self.backoff_s
            raise _NoConnection(f"{what}: busy (HTTP 503: "
                                f"{error_message(payload, response.content)})", wait)
        if response.status_code != 200:
            raise RewardServerError(
                f"{what} failed with HTTP {response.status_code}: "
                f"{error_message(payload, response.content)}", url, response.status_code)
        if payload is None:
            raise RewardServerError(f"{what}: HTTP 200 with a reply that is not JSON: "
                                    f"{response.content[:200]!r}", url, 200)
        return payload


class _NoConnection(Exception):
    """Nothing came back from one server, or it asked to be asked again later
    (`retry_after_s`): safe to send again."""

    def __init__(self, message: str, retry_after_s: Optional[float] = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


def probe(url: str, timeout_s: float = 5.0, key: str = "reward.urls") -> dict:
    """GET /health and /get_model_info of the reward server at `url`: its model info, or a
    ValueError naming `key`, the url and what to do (for a run's start-up checks)."""
    start = f"start one with `python -m launch.serve_reward --model_path DIR` (or fix {key})"
    scorer = RemoteRewardScorer([url], timeout_s=timeout_s, retries=0)
    try:
        health = scorer._client.get(url + "/health")
        if health.status_code in (401, 403):
            raise ValueError(f"{key}: the reward server at {url} wants an API key: set "
                             f"{API_KEY_ENV} to the key it was started with")
        if health.status_code != 200:
            raise ValueError(f"{key}: the reward server at {url} answered GET /health with "
                             f"HTTP {health.status_code}: {health.text[:200]}; check its log")
        return scorer.info()
    except httpx.HTTPError as e:
        raise ValueError(f"{key}: no reward server answers at {url} within {timeout_s:g}s "
                         f"({type(e).__name__}: {e}); {start}") from None
    except RewardServerError as e:
        raise ValueError(f"{key}: {e}") from None
    finally:
        scorer.close()
