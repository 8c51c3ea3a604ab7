"""An SGLang-compatible HTTP server around the embedded JAX sampler, with continuous batching.

For rollout hosts where real SGLang does not run (TPU): it answers SGLang's native requests
(docs/rollout_servers.md) with the same reply shapes, so `SGLangEngine` (and any SGLang client)
cannot tell it from the real thing. FastAPI + uvicorn; generation goes through a
`ContinuousBatcher` (continuous.py), so concurrent requests share decode chunks: a request
arriving while others decode joins at the next chunk, a finished row leaves at once and its
request is answered as soon as its last row ends, and a client that disconnects aborts its rows.

Endpoints: POST /generate, /update_weights_from_disk, /flush_cache, /abort_request,
/pause_generation, /continue_generation, /load_lora_adapter, /unload_lora_adapter; GET /health,
/health_generate, /model_info, /get_model_info, /server_info, /load; with LoRA on
(`launch.serve_rollout --enable_lora`) a /generate request's `lora_path` names a loaded adapter
(one for every prompt, or one a prompt), and several adapters decode side by side
(adapter_slots.py); /generate with "stream": true answers server-sent events as its rows
decode (streaming.py), and OpenAI's /v1/models, /v1/chat/completions and /v1/completions
are served too (openai_routes.py). Every error is `{"error": {"message": ...}}`
(rl_tpu/serving.py): 400 for a malformed request and for one over a `ServerLimits` limit
(samples per prompt, rows, prompt + new tokens against the context, tokens a request may
hold), checked before admission, so no request can take the sampler's memory or time; 503
from /health while a device call has run past `stall_timeout_s`, and from /health_generate
when no token comes within its timeout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import uuid
from typing import Any, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict

from rl_tpu.core.engine import GenerateRequest, GenerateResult, SamplingParams
from rl_tpu.models import hf
from rl_tpu.models.tokenizer import ChatTokenizer
from rl_tpu.rollout import routed_experts
from rl_tpu.rollout.adapter_slots import AdapterSlotsError
from rl_tpu.rollout.continuous import ContinuousBatcher, Ticket, TokensCallback
from rl_tpu.rollout.sampler import JaxSampler
# (sampling_from_json and ServerLimits live in server_requests.py; imported from here too)
from rl_tpu.rollout.server_requests import ServerLimits, sampling_from_json
from rl_tpu.rollout.streaming import TicketEvents, generate_events, sse_stream
from rl_tpu.http_limits import HttpLimits
from rl_tpu.serving import (BadRequest, Server, client_disconnected, docs_routes, error_response,
                            flag_field, guard, install_error_handlers, read_json, shown,
                            text_field)

log = logging.getLogger(__name__)


class GenerateBody(BaseModel):
    """SGLang's /generate body: the fields rl_tpu reads (others are accepted and ignored, as
    SGLang ignores what a backend does not use)."""

    model_config = ConfigDict(extra="allow")
    # prompts and sampling_params are checked by RolloutService.prepare, element by element,
    # so a bad one is named with its index and the vocab or limit it broke
    text: Optional[Union[str, list[Any]]] = None
    input_ids: Optional[list[Any]] = None
    sampling_params: Optional[Union[dict[str, Any], list[Any]]] = None
    rid: Optional[Union[str, list[Optional[str]]]] = None
    lora_path: Optional[Union[str, list[Optional[str]]]] = None  # loaded adapters' names
    return_logprob: bool = False
    return_text_in_logprobs: bool = False
    stream: bool = False


class WeightsBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model_path: str
    weight_version: Optional[str] = None


class AdapterBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: Optional[str] = None
    lora_path: Optional[str] = None


class AbortBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    rid: Optional[str] = None
    abort_all: bool = False


class PauseBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    mode: str = "abort"


@dataclasses.dataclass
class Prepared:
    """A /generate body checked and turned into sampler requests."""

    requests: list[GenerateRequest]
    raw_params: list[dict]
    single: bool
    loras: Optional[list[Optional[str]]] = None  # each request's adapter name (lora_path)


class RolloutService:
    """The server's state and logic, separate from HTTP so it can be tested directly.

    Args:
      sampler: the engine whose programs and weights serve the requests.
      batcher: the continuous batcher over it (default: 64 rows of min(2048, model
        positions) slots).
      stall_timeout_s: /health fails once a device call has run this long.
    """

    def __init__(self, sampler: JaxSampler, model_path: str, tokenizer: Optional[ChatTokenizer],
                 limits: ServerLimits = ServerLimits(),
                 batcher: Optional[ContinuousBatcher] = None, stall_timeout_s: float = 300.0,
                 served_model_name: Optional[str] = None):
        self.sampler = sampler
        # the id /v1/models lists and OpenAI replies carry (fixed: a weight update keeps it)
        self.served_model_name = served_model_name or model_path
        self.batcher = batcher or ContinuousBatcher(
            sampler, slot_tokens=min(2048, sampler.cfg.max_position_embeddings // 16 * 16))
        self.model_path = model_path
        self.tokenizer = tokenizer
        self.limits = limits
        self.stall_timeout_s = stall_timeout_s
        # Templating and tokenizing a prompt take time in proportion to its text (seconds for
        # megabytes): done on this pool, never on the event loop, so /health and running
        # streams go on meanwhile. Two threads: a few huge prompts at once cannot hold many
        # copies of their tokens in memory either.
        self._prompt_pool = concurrent.futures.ThreadPoolExecutor(
            2, thread_name_prefix="rollout-prompts")
        # No token holds more than `longest` characters of text, so a prompt text longer than
        # context x (longest + 1) cannot fit (the + 1: a token's leading space that decoding it
        # alone drops), with a factor two for tokenizers that normalise text; it is refused
        # by its length, before any templating or tokenizing.
        self.context_tokens = min(limits.max_context_tokens or self.batcher.slot_tokens,
                                  self.batcher.slot_tokens, sampler.cfg.max_position_embeddings)
        longest = longest_token_chars(tokenizer) if tokenizer is not None else 0
        self.max_prompt_chars = 2 * self.context_tokens * (longest + 1)

    async def off_loop(self, fn, *args):
        """fn(*args) on the prompt threads, awaited (its exception raised here)."""
        return await asyncio.get_running_loop().run_in_executor(
            self._prompt_pool, functools.partial(fn, *args))

    def check_prompt_chars(self, chars: int, where: str) -> None:
        """BadRequest when `chars` characters of prompt text cannot fit the context."""
        if chars > self.max_prompt_chars:
            raise BadRequest(f"'{where}': {chars} characters of text cannot fit this server's "
                             f"context of {self.context_tokens} tokens (at most "
                             f"{self.max_prompt_chars} characters could); send a shorter "
                             "prompt")

    # -- /generate -----------------------------------------------------------------------

    def prepare(self, body: dict) -> Prepared:
        """Checks every field of a /generate body (BadRequest naming the first bad one: the
        field, what it must be and what came), then the request against `limits`."""
        has_text, has_ids = body.get("text") is not None, body.get("input_ids") is not None
        if has_text == has_ids:
            raise BadRequest("give exactly one of 'text' or 'input_ids'")
        prompts, single = self._prompts(body)
        raw = body.get("sampling_params")
        if isinstance(raw, list):
            if len(raw) != len(prompts):
                raise BadRequest(f"'sampling_params': {len(raw)} objects for {len(prompts)} "
                                 "prompts; send one, or one a prompt")
            sampling = [sampling_from_json(p, f"sampling_params[{i}]")
                        for i, p in enumerate(raw)]
        else:
            raw = [raw] * len(prompts)
            sampling = [sampling_from_json(raw[0])] * len(prompts)
        for i, params in enumerate(raw):
            for name in ("skip_special_tokens", "no_stop_trim"):  # read by _reply
                if (params or {}).get(name) is not None:
                    where = "sampling_params" + (f"[{i}]" if len(raw) > 1 else "")
                    flag_field(params[name], f"{where}.{name}")
        rids = body.get("rid")
        rids = rids if isinstance(rids, list) else [rids] * len(prompts)
        if len(rids) != len(prompts):
            raise BadRequest(f"'rid': {len(rids)} ids for {len(prompts)} prompts; send one "
                             "a prompt")
        rids = [text_field(r, "rid") if r else uuid.uuid4().hex for r in rids]
        if body.get("return_routed_experts") is not None and flag_field(
                body["return_routed_experts"], "return_routed_experts"):
            if self.sampler.cfg.moe is None:
                raise BadRequest("'return_routed_experts': this server's model is not a "
                                 "mixture of experts, it routes nothing")
            sampling = [dataclasses.replace(s, return_routed_experts=True) for s in sampling]
        context = min(self.sampler.cfg.max_position_embeddings, self.batcher.slot_tokens)
        self.limits.check(prompts, sampling, context)
        return Prepared([GenerateRequest(p, s, r) for p, s, r in zip(prompts, sampling, rids)],
                        [r or {} for r in raw], single, self._loras(body, len(prompts)))

    def _loras(self, body: dict, n: int) -> Optional[list[Optional[str]]]:
        names = body.get("lora_path")
        if names is None:
            return None
        if self.sampler.adapter_slots is None:
            raise BadRequest("'lora_path' names a LoRA adapter, but this server was launched "
                             "without LoRA (launch.serve_rollout --enable_lora)")
        names = names if isinstance(names, list) else [names] * n
        if len(names) != n:
            raise BadRequest(f"'lora_path': {len(names)} names for {n} prompts; send one, or "
                             "one a prompt")
        return [text_field(name, "lora_path") if name else None for name in names]

    def submit(self, prepared: Prepared, on_tokens: Optional[TokensCallback] = None) -> Ticket:
        """Queues the requests, each holding its adapter's slot (if any) until its ticket is
        done, so that an unload cannot hand the slot to another adapter under it."""
        slots, requests = [], prepared.requests
        try:
            if prepared.loras is not None:
                for name in prepared.loras:
                    slots.append(self.sampler.adapter_slots.acquire(name))
                requests = [dataclasses.replace(req, lora_slot=slot)
                            for req, slot in zip(requests, slots)]
            ticket = self.batcher.submit(requests, on_tokens)
        except ValueError as err:  # (AdapterSlotsError too)
            self._release(slots)
            raise BadRequest(str(err)) from err
        if slots:
            ticket.add_done_callback(lambda _: self._release(slots))
        return ticket

    def _release(self, slots: list[int]) -> None:
        for slot in slots:
            self.sampler.adapter_slots.release(slot)

    def replies(self, prepared: Prepared, body: dict, results: list[GenerateResult]) -> Any:
        expanded = [(req, r) for req, r in zip(prepared.requests, prepared.raw_params)
                    for _ in range(req.sampling.n)]
        replies = [self._reply(req, res, body, r) for (req, r), res in zip(expanded, results)]
        return replies[0] if prepared.single and len(replies) == 1 else replies

    def _prompts(self, body) -> tuple[list[list[int]], bool]:
        vocab = self.sampler.cfg.vocab_size
        if body.get("input_ids") is not None:
            ids = body["input_ids"]
            single = bool(ids) and not isinstance(ids[0], list)
            batch = [ids] if single else ids
            if not batch:
                raise BadRequest("'input_ids' is empty: send a list of token ids or of such "
                                 "lists")
            for i, prompt in enumerate(batch):
                where = "input_ids" if single else f"input_ids[{i}]"
                if not isinstance(prompt, list) or not prompt:
                    raise BadRequest(f"'{where}' must be a non-empty list of token ids, got "
                                     f"{shown(prompt)}")
                for j, token in enumerate(prompt):
                    if isinstance(token, bool) or not isinstance(token, int) or \
                            not 0 <= token < vocab:
                        raise BadRequest(f"'{where}[{j}]' must be a token id in [0, {vocab}) "
                                         f"(the model's vocab), got {shown(token)}")
            return batch, single
        if self.tokenizer is None:
            raise BadRequest("this server has no tokenizer: send input_ids instead of text")
        text = body["text"]
        single = isinstance(text, str)
        texts = [text] if single else text
        if not isinstance(texts, list) or not texts:
            raise BadRequest("'text' must be a string or a non-empty list of strings")
        prompts = []
        for i, t in enumerate(texts):
            where = "text" if single else f"text[{i}]"
            if not isinstance(t, str):
                raise BadRequest(f"'{where}' must be a string, got {shown(t)}")
            self.check_prompt_chars(len(t), where)
            prompts.append(self.tokenizer.encode(text_field(t, where)))
            if not prompts[-1]:
                raise BadRequest(f"'{where}' encodes to no tokens: a prompt needs one at least")
        return prompts, single

    def _reply(self, req: GenerateRequest, res: GenerateResult, body: dict, raw_params: dict
               ) -> dict:
        n = len(res.output_ids)
        if res.finish_reason == "stop":
            finish = {"type": "stop", "matched": res.matched_stop}
        elif res.finish_reason == "abort":
            finish = {"type": "abort", "message": "Aborted"}
        else:
            finish = {"type": "length", "length": n}
        meta = {
            "id": req.request_id, "finish_reason": finish, "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": n, "cached_tokens": 0, "weight_version": res.weight_version,
            "weight_versions": res.info.get("weight_versions") or [
                {"version": res.weight_version, "start": 0, "end": n}],
        }
        if body.get("return_logprob"):
            as_text = bool(body.get("return_text_in_logprobs")) and self.tokenizer is not None
            text_of = (lambda t: self.tokenizer.decode([t])) if as_text else (lambda t: None)
            meta["output_token_logprobs"] = [[lp, t, text_of(t)]
                                             for lp, t in zip(res.logprobs, res.output_ids)]
            meta["input_token_logprobs"] = []  # prompt scoring is the trainer's job
        if res.routed_experts is not None:  # SGLang's layout (routed_experts.py)
            meta["routed_experts"] = routed_experts.encode(res.routed_experts, self.sampler.cfg)
        text = self.text_of(res, bool(raw_params.get("skip_special_tokens", True)),
                            bool(raw_params.get("no_stop_trim")))
        return {"text": text, "output_ids": res.output_ids, "meta_info": meta}

    def text_of(self, res: GenerateResult, skip_special_tokens: bool = True,
                no_stop_trim: bool = False) -> str:
        """A result's text ("" without a tokenizer), the stop string that ended it cut."""
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(res.output_ids, skip_special_tokens=skip_special_tokens)
        if (res.finish_reason == "stop" and isinstance(res.matched_stop, str)
                and not no_stop_trim and text.endswith(res.matched_stop)):
            text = text[: -len(res.matched_stop)]
        return text

    # -- weights and control -------------------------------------------------------------

    def update_weights_from_disk(self, body: dict) -> tuple[int, dict]:
        path = body.get("model_path")
        version = body.get("weight_version")
        if not isinstance(path, str) or not path:
            raise BadRequest("update_weights_from_disk needs 'model_path'")
        text_field(path, "model_path")
        if version is not None:  # /model_info and every reply echo it
            text_field(version, "weight_version")
        cfg = self.sampler.cfg
        try:
            new_cfg, params = hf.load(path, mesh=self.sampler.mesh, dtype=cfg.param_dtype,
                                      scan_layers=cfg.scan_layers, remat=cfg.remat)
        except (OSError, ValueError) as err:
            # hf.CheckpointError (a ValueError) names the file and what is wrong with it (a
            # truncated safetensors file, a config.json that is not a JSON object...); any
            # other ValueError from reading the directory is its content's fault too: 400
            log.info("update_weights_from_disk %s failed: %s", path, err)
            what = str(err) if isinstance(err, (hf.CheckpointError, OSError)) else \
                f"{type(err).__name__}: {err}"
            return 400, {"success": False, "message": f"failed to load {path}: {what}",
                         "num_paused_requests": 0}
        if new_cfg.replace(eos_token_ids=cfg.eos_token_ids, bos_token_id=cfg.bos_token_id,
                           lora=cfg.lora) != cfg:  # (the served adapters stay loaded)
            return 400, {"success": False, "num_paused_requests": 0,
                         "message": f"{path} has a different architecture than the served model"}
        self.sampler.update_weights(params, version if version is not None else path)
        self.model_path = path
        return 200, {"success": True, "message": f"loaded {path}", "num_paused_requests": 0}

    def load_lora_adapter(self, body: dict) -> tuple[int, dict]:
        """SGLang's /load_lora_adapter {lora_name, lora_path}: the PEFT dir into a free slot."""
        return self._adapter_call(lambda: self.sampler.load_adapter(
            text_field(body.get("lora_name") or "", "lora_name"),
            text_field(body.get("lora_path") or "", "lora_path")))

    def unload_lora_adapter(self, body: dict) -> tuple[int, dict]:
        return self._adapter_call(lambda: self.sampler.adapter_slots.unload(
            text_field(body.get("lora_name") or "", "lora_name")))

    def _adapter_call(self, call) -> tuple[int, dict]:
        """(status, SGLang's reply: success, error_message, loaded_adapters)."""
        slots = self.sampler.adapter_slots
        if slots is None:
            return 400, {"success": False, "loaded_adapters": {}, "error_message":
                         "LoRA is not enabled on this server: launch it with --enable_lora"}
        try:
            call()
        except AdapterSlotsError as err:
            log.info("LoRA adapter call refused: %s", err)
            return 400, {"success": False, "error_message": str(err),
                         "loaded_adapters": slots.loaded()}
        return 200, {"success": True, "error_message": "", "loaded_adapters": slots.loaded()}

    def server_info(self) -> dict:
        """The launch settings a client checks (SGLang's /server_info): LoRA's, with the
        adapters loaded now."""
        slots = self.sampler.adapter_slots
        info = {"model_path": self.model_path, "enable_lora": slots is not None}
        if slots is not None:
            info.update(slots.server_info(), loaded_adapters=slots.loaded())
        return info

    def model_info(self) -> dict:
        return {"model_path": self.model_path, "tokenizer_path": self.model_path,
                "is_generation": True, "weight_version": self.sampler.weight_version}

    def health(self) -> Optional[str]:
        """None when healthy, else what is wrong (the scheduler died, or a device call has run
        past stall_timeout_s: a wedged sampler answers no request, so /health must not say
        it is fine)."""
        if not self.batcher.alive():
            return f"the batcher stopped: {self.batcher.error or 'closed'}"
        stalled = self.batcher.stalled_for()
        if stalled > self.stall_timeout_s:
            return (f"the sampler has been inside one device call for {stalled:.0f} s (over "
                    f"--stall_timeout_s={self.stall_timeout_s:g}); restart the server")
        return None

    def health_probe(self) -> Ticket:
        """A one-token generation that queues behind what runs (/health_generate)."""
        token = 0 if self.tokenizer is None else (self.tokenizer.eos_token_id or 0)
        return self.batcher.submit([GenerateRequest([token], SamplingParams(max_new_tokens=1),
                                                    "health-" + uuid.uuid4().hex)])

    def abort(self, body: dict):
        """Ends requests between decode chunks; they return what they have (finish abort).
        An id that is not running is ignored (nothing sticks for a later request)."""
        if body.get("abort_all"):
            self.batcher.abort()
        elif body.get("rid"):
            self.batcher.abort(text_field(body["rid"], "rid"))
        else:
            raise BadRequest("abort_request needs 'rid' or 'abort_all': true")

    def pause(self, body: dict):
        """Holds decoding between chunks. 'abort' also ends what runs; 'retract' and 'in_place'
        both resume the held samples on whatever weights are loaded by then (their
        weight_versions then show two spans)."""
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"pause mode {mode!r}: use abort, retract or in_place")
        self.sampler.pause()
        if mode == "abort":
            self.batcher.abort()

    def resume(self):
        self.sampler.resume()


def longest_token_chars(tokenizer: ChatTokenizer) -> int:
    """The most characters any one token of `tokenizer` decodes to."""
    texts = tokenizer.hf.batch_decode([[i] for i in range(tokenizer.vocab_size)],
                                      skip_special_tokens=False,
                                      clean_up_tokenization_spaces=False)
    return max((len(text) for text in texts), default=1)


async def await_ticket(ticket: Ticket, request: Optional[Request],
                        timeout_s: Optional[float] = None) -> bool:
    """Waits for `ticket` without holding a thread; False if the client went away (its rows
    are then aborted) or `timeout_s` passed first.

    The client's leaving is seen the moment its connection closes (`client_disconnected`)."""
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    ticket.add_done_callback(lambda _: loop.call_soon_threadsafe(done.set))
    finished = asyncio.ensure_future(done.wait())
    waiters = {finished}
    if request is not None:
        waiters.add(asyncio.ensure_future(client_disconnected(request)))
    try:
        ended, _ = await asyncio.wait(waiters, timeout=timeout_s,
                                      return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
    if finished in ended:
        return True
    for waiter in ended:  # the disconnect watch failing is taken as the client gone
        if waiter.exception() is not None:
            log.warning("watching for the client's disconnect failed: %r", waiter.exception())
    if request is not None and not ended:
        log.info("no result within %s s: aborting its rows", timeout_s)
    elif request is not None:
        log.info("client gone: aborting its rows")
    ticket.cancel()
    return False


def make_app(service: RolloutService, api_key: Optional[str] = None,
             health_timeout_s: float = 20.0, limits: Optional[HttpLimits] = None,
             docs: bool = False) -> FastAPI:
    app = FastAPI(title="rl_tpu rollout server", **docs_routes(docs))
    install_error_handlers(app)
    guard(app, limits or HttpLimits(), api_key)  # body limits, then the key before them
    text = lambda body="", status=200: Response(body, status, media_type="text/plain")  # noqa
    # /v1/models, /v1/chat/completions, /v1/completions (imported here: they build on this
    # module's service and helpers)
    from rl_tpu.rollout.openai_routes import add_openai_routes
    add_openai_routes(app, service)

    @app.post("/generate")
    async def generate(request: Request):
        raw = (await read_json(request, GenerateBody)).model_dump()
        prepared = await service.off_loop(service.prepare, raw)  # it may tokenize text
        if raw.get("stream"):  # SSE as rows decode (streaming.py); submitted here, so a
            # refusal is still a 400, not an error inside a started stream
            events = TicketEvents(lambda on_tokens: service.submit(prepared, on_tokens))
            return StreamingResponse(sse_stream(generate_events(service, prepared, raw,
                                                                events)),
                                     media_type="text/event-stream")
        ticket = service.submit(prepared)
        if not await await_ticket(ticket, request):
            return error_response(499, "client closed the request")
        return JSONResponse(service.replies(prepared, raw, ticket.wait(0)))

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body = (await read_json(request, WeightsBody)).model_dump()
        # loading blocks: a worker thread, so generation requests go on being served
        status, reply = await run_in_threadpool(service.update_weights_from_disk, body)
        return JSONResponse(reply, status_code=status)

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = (await read_json(request, AdapterBody)).model_dump()
        status, reply = await run_in_threadpool(service.load_lora_adapter, body)  # reads files
        return JSONResponse(reply, status_code=status)

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        status, reply = service.unload_lora_adapter(
            (await read_json(request, AdapterBody)).model_dump())
        return JSONResponse(reply, status_code=status)

    @app.get("/server_info")
    @app.get("/get_server_info")
    def server_info():
        return service.server_info()

    @app.post("/flush_cache")
    def flush_cache():  # the sampler's prefix cache, as SGLang's radix cache
        service.sampler.flush_cache()
        return text("Cache flushed.")

    @app.post("/abort_request")
    async def abort_request(request: Request):
        service.abort((await read_json(request, AbortBody)).model_dump())
        return text()

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        service.pause((await read_json(request, PauseBody)).model_dump())
        return {"success": True}

    @app.post("/continue_generation")
    def continue_generation():
        service.resume()
        return {"success": True}

    @app.get("/health")
    def health():
        problem = service.health()
        return text() if problem is None else error_response(503, problem)

    @app.get("/health_generate")
    async def health_generate():
        problem = service.health()
        if problem is not None:
            return error_response(503, problem)
        if not await await_ticket(service.health_probe(), None, health_timeout_s):
            return error_response(503, f"no token within {health_timeout_s:g} s: the sampler "
                                       f"is stalled or has more queued than it can run "
                                       f"({service.batcher.load()})")
        return text()

    @app.get("/model_info")
    @app.get("/get_model_info")
    def model_info():
        return service.model_info()

    @app.get("/load")
    def load():  # rl_tpu's: rows running and queued (for a router or a person), and the
        # programs compiled so far (flat once warm: a rise means a request waited on one)
        return dict(service.batcher.load(),
                    compiled_programs=service.sampler.stats()["compiled_programs"])

    return app


def serve(service: RolloutService, host: str = "127.0.0.1", port: int = 30000,
          api_key: Optional[str] = None, health_timeout_s: float = 20.0,
          limits: Optional[HttpLimits] = None, docs: bool = False) -> Server:
    """Binds (loopback unless told otherwise) and returns the server: `serve_forever()`, or
    `start()` to serve from a thread (it returns the URL). `limits`: the HTTP limits
    (rl_tpu/http_limits.py; default HttpLimits()); `docs` serves /docs and /openapi.json."""
    limits = limits or HttpLimits()
    return Server(make_app(service, api_key, health_timeout_s, limits, docs), host, port,
                  limits=limits)
