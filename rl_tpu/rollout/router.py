"""Rollout workers behind SGLang's router (`sglang-router`): what it forwards, and how to ask.

`SGLangEngine(urls, router_url=...)` (config `rollout.router_url`) sends generation through the
router, which picks a worker (cache-aware by default), and everything that must reach *every*
worker to each of `urls` directly. The facts below were measured against sglang-router 0.3.2
(`python -m sglang_router.launch_router --worker-urls ...`) in front of two
`launch.serve_rollout` workers, and in front of a real SGLang 0.5.23 worker
(tests/rollout/test_router.py runs both):

Forwarded to one worker (the one the router picks):
- `POST /generate`, but parsed into the router's own request schema first, which takes
  `sampling_params` as ONE dict and `rid` as ONE string: a list of either is HTTP 422 (plain
  text, "Failed to deserialize the JSON body..."). The router re-serialises the body: unknown
  sampling-param keys are dropped, and it adds its own defaults (`model: null`, `stream`,
  `return_text_in_logprobs`, `log_metrics`, `return_hidden_states`, `background`, `no_logs`,
  `return_bytes`, `return_entropy`), which a worker must accept (SGLang and rl_tpu's server
  do). `Authorization` passes through.
  A batch (`input_ids` list of lists) with one dict and `n` works: the reply is the worker's.
- `GET /get_model_info` (the worker's reply); `/model_info` is 404 at the router.

Answered by the router itself:
- `GET /health`: always 200 `OK` (plain text) while the router process lives: liveness only.
- `GET /health_generate`: 200 plain text "At least one router has healthy workers", 503 "No
  routers with healthy workers available". It generates nothing; the router's own periodic
  worker health checks (`GET /health` on each worker) decide. This is the readiness signal.
- `GET /workers`: JSON list of the workers it routes to, with their health.
- `POST /flush_cache`: the router sends it to every worker itself.
- `/generate` with no healthy worker: HTTP 503 JSON `{"error": {"message": ...}}`.

Not forwarded (HTTP 404 at the router): `/update_weights_from_disk`, `/abort_request`,
`/pause_generation`, `/continue_generation`, `/model_info`. So the client sends these to each
worker of `urls`: a weight update must reach every worker before generation may assume it
(each worker's `weight_version` is checked after the update, and every sample still reports the
version that drew it); abort and pause are per worker too. A request id the client sends
through the router is only a label: aborting one request means `abort_all` on every worker, or
a per-rid abort sent to every worker (only the worker that runs it has it).

Hence the client, in router mode:
- groups the prompts of one `generate` call by identical sampling params, one `/generate` per
  group (split at `batch_size`), with the params as one dict; a `rid` string only on a request
  of one prompt with n = 1 (a batch under one rid would share it);
- polls the router's `/health_generate` (plain text) and each worker's own `/health_generate`;
- reads model info, served shapes and the logprob convention from the workers directly (the
  router has no `/model_info`, and the logprob probe sends four different sampling params in
  one batch, which the router refuses); all workers must agree on the convention, since a reply
  through the router does not say which worker drew it;
- checks once that the router routes only to workers in `urls` (`GET /workers`): a worker the
  client does not know would never get weight updates and serve stale weights forever.
"""

from __future__ import annotations

import json
import logging
from typing import Callable, Optional, Sequence

from rl_tpu.core.engine import GenerateRequest, RolloutError, SamplingParams
from rl_tpu.rollout.http_transport import HttpTransport, ServerDown, normalise_url
from rl_tpu.rollout.logprob_probe import ServerLogprobs

log = logging.getLogger(__name__)


def group_by_params(requests: Sequence[GenerateRequest],
                    params_json: Callable[[SamplingParams], dict]) -> list[list[int]]:
    """Indices of `requests` grouped by identical wire sampling params, groups in order of
    first appearance (so one request per group can carry them as one dict)."""
    groups: dict[str, list[int]] = {}
    for k, r in enumerate(requests):
        key = json.dumps(params_json(r.sampling), sort_keys=True)
        groups.setdefault(key, []).append(k)
    return list(groups.values())


def generate_body(requests: Sequence[GenerateRequest], params: dict) -> dict:
    """The `/generate` body the router accepts for prompts that share `params`."""
    ids = [[int(t) for t in r.prompt_ids] for r in requests]
    body = {"input_ids": ids, "sampling_params": params, "return_logprob": True,
            "logprob_start_len": -1}
    if len(requests) == 1 and params.get("n", 1) == 1 and requests[0].request_id:
        # One prompt sent as a single (not batched) request, so the rid names exactly it.
        body["input_ids"], body["rid"] = ids[0], str(requests[0].request_id)
    return body


def routed_workers(router: HttpTransport, timeout: float) -> Optional[list[str]]:
    """The worker urls the router routes to (`GET /workers`), or None when it does not say
    (an older router without that endpoint, or a reply of another shape)."""
    try:
        reply = router.call_one(router.urls[0], "GET", "/workers", None, timeout, retries=0)
    except RolloutError as e:
        log.info("%s: cannot list its workers (%s); not checking them against rollout.urls",
                 router.urls[0], e)
        return None
    workers = reply.get("workers") if isinstance(reply, dict) else None
    if not isinstance(workers, list):
        return None
    urls = []
    for w in workers:
        url = w.get("url") if isinstance(w, dict) else None
        if isinstance(url, str):
            try:
                urls.append(normalise_url(url))
            except ValueError:
                urls.append(url)
    return urls


def check_workers(router: HttpTransport, urls: Sequence[str], timeout: float) -> None:
    """RolloutError when the router routes to a worker that is not in `urls` (it would never
    get weight updates); a warning for a worker in `urls` that the router does not route to."""
    try:
        routed = routed_workers(router, timeout)
    except ServerDown as e:
        raise RolloutError(f"the router does not answer: {e}", router.urls[0]) from e
    if routed is None:
        return
    unknown = sorted(set(routed) - set(urls))
    if unknown:
        raise RolloutError(
            f"the router {router.urls[0]} routes generation to {unknown}, which are not in "
            f"rollout.urls {list(urls)}: they would never get weight updates, aborts or "
            "pauses. List every worker of the router in rollout.urls, written as in its "
            "--worker-urls (host names are compared as written).", router.urls[0])
    idle = sorted(set(urls) - set(routed))
    if idle:
        log.warning("the router %s does not (yet) route to %s: they get weight updates but no "
                    "generation until it registers them", router.urls[0], idle)


def agreed_logprobs(router_url: str, meanings: dict[str, ServerLogprobs]) -> ServerLogprobs:
    """The one logprob meaning of every worker behind the router (a reply through it does not
    say which worker drew it); RolloutError when workers differ."""
    kinds = {(m.top_p, m.top_k, m.temperature_scaled) for m in meanings.values()}
    if len(kinds) > 1:
        raise RolloutError(
            f"the workers behind {router_url} report different logprobs, and a sample through "
            "the router does not say which worker drew it: " +
            "; ".join(f"{u}: {m.describe()}" for u, m in meanings.items()) +
            ". Launch every worker the same way (or declare SGLangEngine(logprob_convention=)).",
            router_url)
    return next(iter(meanings.values()))
