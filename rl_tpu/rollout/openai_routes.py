"""OpenAI's API on the rollout server: GET /v1/models, POST /v1/chat/completions and
POST /v1/completions, over the same continuous batcher as /generate (openai_api.py holds the
request and reply shapes; docs/rollout_servers.md how to use them).

Chat prompts are the tokenizer's chat template applied to the messages (with the request's
tools when it sends some), and a reply with tools is read by rl_tpu.tools.calls for the calls
the model wrote. `"stream": true` answers server-sent events as rows decode: a row's first
text goes out after its prefill, then more after every decode chunk (`--decode_chunk` tokens
at most), so a client sees its first token long before the last. A stream with tools holds
its text to the end (a call is parsed from the whole reply). Errors are OpenAI's shape with
a 400 for a bad body, a request over a limit, or a prompt the context cannot hold.

On a server with LoRA (`--enable_lora`) a request picks a loaded adapter as SGLang's OpenAI
routes let it: `"model": "<served model>:<adapter>"`, or `"lora_path": "<adapter>"` beside the
usual fields (the `openai` client's `extra_body`); without either it samples the base.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from rl_tpu.core.engine import GenerateRequest, GenerateResult
from rl_tpu.rollout import openai_api as api
from rl_tpu.rollout.server import Prepared, RolloutService, await_ticket
from rl_tpu.rollout.streaming import TextStream, TicketEvents, sse_stream
from rl_tpu.serving import BadRequest, read_json
from rl_tpu.tools.calls import call_format_of, parse_tool_calls


class AnyBody(BaseModel):
    """Any JSON object: openai_api checks the fields, with OpenAI's names in its errors."""

    model_config = ConfigDict(extra="allow")


def chat_prompt(service: RolloutService, request: api.ChatRequest) -> list[int]:
    """The prompt ids of a chat request: its messages (and tools) through the chat template,
    ending with the assistant's turn opened. Text too long for the context is refused by its
    length first (`check_prompt_chars`), before the template runs."""
    tokenizer = service.tokenizer
    if tokenizer is None:
        raise BadRequest("this server has no tokenizer (--skip_tokenizer_init): chat needs one; "
                         "send token ids to /v1/completions instead")
    chars = sum(len(m.get("content") or "") + (len(json.dumps(m["tool_calls"]))
                                               if m.get("tool_calls") else 0)
                for m in request.messages)
    service.check_prompt_chars(chars + (len(json.dumps(request.tools)) if request.tools else 0),
                               "messages")
    extra = {"tools": request.tools} if request.tools else {}
    try:
        return tokenizer.apply_chat_template(request.messages, add_generation_prompt=True,
                                             **extra)
    except Exception as err:  # noqa: BLE001 - a template refusing these messages (jinja's
        # raise_exception, a missing key, a TypeError) is the request's fault: a 400
        raise BadRequest(f"the chat template cannot render these messages: "
                         f"{type(err).__name__}: {err}") from err


def call_format(tokenizer: Any) -> str:
    """The tool-call format of the served chat template; BadRequest when it has none."""
    try:
        return call_format_of(tokenizer)
    except ValueError as err:
        raise BadRequest(f"this server's model cannot take 'tools': {err}") from err


def adapter_of(service: RolloutService, body: dict) -> Optional[str]:
    """The LoRA adapter a request names (module docstring), or None for the base model."""
    name = body.get("lora_path")
    model = body.get("model")
    prefix = f"{service.served_model_name}:"
    if name is None and isinstance(model, str) and model.startswith(prefix):
        name = model[len(prefix):]
    if name is None:
        return None
    if not isinstance(name, str) or not name:
        raise BadRequest(f"'lora_path' must name a loaded adapter, got {name!r}")
    if service.sampler.adapter_slots is None:
        raise BadRequest(f"the request names the LoRA adapter {name!r}, but this server was "
                         "launched without LoRA (launch.serve_rollout --enable_lora)")
    return name


def prepare(service: RolloutService, prompts: list[list[int]], sampling: Any,
            max_tokens: Optional[int], request_id: str,
            adapter: Optional[str] = None) -> Prepared:
    """Sampler requests for these prompts, checked against the server's limits; without
    max_tokens a prompt gets the room left in its row. `adapter`: every row's LoRA adapter."""
    requests = []
    for i, prompt in enumerate(prompts):
        room = service.batcher.room(len(prompt))
        if service.limits.max_context_tokens:
            room = min(room, service.limits.max_context_tokens - len(prompt))
        if max_tokens is None and room < 1:
            raise BadRequest(f"a prompt of {len(prompt)} tokens leaves no room for a reply in "
                             f"this server's context of {service.batcher.slot_tokens} tokens")
        requests.append(GenerateRequest(prompt, api.with_max_tokens(
            sampling, room if max_tokens is None else max_tokens), f"{request_id}-{i}"))
    context = min(service.sampler.cfg.max_position_embeddings, service.batcher.slot_tokens)
    service.limits.check(prompts, [r.sampling for r in requests], context)
    return Prepared(requests, [{}] * len(requests), single=False,
                    loras=None if adapter is None else [adapter] * len(requests))


class OpenAIRoutes:
    """The three endpoints over `service` (one instance a FastAPI app)."""

    def __init__(self, service: RolloutService):
        self.service = service
        tokenizer = service.tokenizer
        self.decode = (lambda ids: tokenizer.decode(ids, skip_special_tokens=True)) \
            if tokenizer is not None else (lambda ids: "")
        self.token_text = (lambda t: tokenizer.decode([t])) if tokenizer is not None \
            else (lambda t: "")

    @property
    def model(self) -> str:
        return self.service.served_model_name

    async def run(self, request: Request, prepared: Prepared) -> Optional[list[GenerateResult]]:
        ticket = self.service.submit(prepared)
        if not await await_ticket(ticket, request):
            return None
        return ticket.wait(0)

    def stream(self, prepared: Prepared, chunks) -> StreamingResponse:
        events = TicketEvents(lambda on_tokens: self.service.submit(prepared, on_tokens))
        return StreamingResponse(sse_stream(chunks(events)), media_type="text/event-stream")

    # -- /v1/chat/completions ----------------------------------------------------------

    async def chat(self, request: Request):
        body = (await read_json(request, AnyBody)).model_dump()
        # checking, templating and tokenizing: off the event loop (they scale with the text)
        req = await self.service.off_loop(api.parse_chat_request, body)
        prompt = await self.service.off_loop(chat_prompt, self.service, req)
        tool_format = call_format(self.service.tokenizer) if req.tools else None
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        prepared = prepare(self.service, [prompt], req.sampling, req.max_tokens, rid,
                           adapter_of(self.service, body))
        if req.stream:
            return self.stream(prepared, lambda events: self._chat_chunks(
                req, prompt, tool_format, rid, created, events))
        results = await self.run(request, prepared)
        if results is None:
            return JSONResponse(api.error_body("client closed the request"), 499)
        choices = []
        for i, res in enumerate(results):
            text = self.service.text_of(res)
            parsed = parse_tool_calls(text, tool_format) if tool_format else None
            choices.append(api.chat_choice(i, res, text, prompt, parsed, req.logprobs,
                                           self.token_text, f"call_{rid[9:21]}"))
        return api.chat_response(rid, self.model, created, choices,
                                 api.usage([len(prompt)], results))

    async def _chat_chunks(self, req: api.ChatRequest, prompt: list[int],
                           tool_format: Optional[str], rid: str, created: int,
                           events: TicketEvents) -> AsyncIterator[dict]:
        rows = req.sampling.n
        streams = [TextStream(self.decode, req.sampling.stop) for _ in range(rows)]
        opened = [False] * rows  # the role goes with a choice's first delta

        def delta(index: int, **fields) -> dict:
            if not opened[index]:
                opened[index] = True
                fields = {"role": "assistant", **fields}
            return fields

        try:
            async for kind, payload in events:
                if kind == "tokens":
                    if req.tools:  # a call is read from the whole reply: held to the end
                        continue
                    choices = []
                    for index, (ids, logprobs) in sorted(payload.items()):
                        text = streams[index].advance(ids)
                        if not text:
                            continue
                        first, end = streams[index].released(ids) if req.logprobs else (0, 0)
                        choices.append({
                            "index": index, "delta": delta(index, content=text),
                            "logprobs": api.chat_logprobs(ids[first:end], logprobs[first:end],
                                                          self.token_text)
                            if req.logprobs else None, "finish_reason": None})
                    if choices:
                        yield api.chat_chunk(rid, self.model, created, choices)
                    continue
                for index, res in enumerate(payload):
                    text = self.service.text_of(res)
                    calls = ()
                    if tool_format:
                        parsed = parse_tool_calls(text, tool_format)
                        calls, fields = tuple(parsed.calls), {}
                        if parsed.content and (parsed.content.strip() or not calls):
                            fields["content"] = parsed.content
                        if calls:
                            fields["tool_calls"] = [
                                dict(c, index=j) for j, c in enumerate(api.tool_calls_json(
                                    calls, f"call_{rid[9:21]}_{index}"))]
                    else:
                        rest = streams[index].finish(text)
                        fields = {"content": rest} if rest else {}
                    first = streams[index].tokens_sent
                    yield api.chat_chunk(rid, self.model, created, [{
                        "index": index, "delta": delta(index, **fields),
                        "logprobs": api.chat_logprobs(res.output_ids[first:],
                                                      res.logprobs[first:], self.token_text)
                        if req.logprobs else None,
                        "finish_reason": api.finish_reason(res, bool(calls)),
                        "prompt_token_ids": prompt, "token_ids": res.output_ids,
                        "weight_version": res.weight_version}])
                if req.include_usage:
                    yield api.chat_chunk(rid, self.model, created, [],
                                         api.usage([len(prompt)], payload))
        finally:
            events.close()

    # -- /v1/completions ---------------------------------------------------------------

    def _offset(self, ids) -> int:
        """text_offset of the token after `ids`, counted as the plain reply counts it (the
        sum of each token's own text)."""
        return sum(len(self.token_text(t)) for t in ids)

    def _prompt_ids(self, req: api.CompletionRequest) -> list[list[int]]:
        """Each prompt's ids: text through the tokenizer, refused by its length first."""
        prompts = []
        for i, p in enumerate(req.prompts):
            if isinstance(p, str):
                if self.service.tokenizer is None:
                    raise BadRequest("this server has no tokenizer: send the prompt as token "
                                     "ids")
                self.service.check_prompt_chars(len(p), f"prompt[{i}]")
                p = self.service.tokenizer.encode(p)
                if not p:
                    raise BadRequest(f"prompt {i} encodes to no tokens: a prompt needs one")
            prompts.append(p)
        return prompts

    async def completions(self, request: Request):
        body = (await read_json(request, AnyBody)).model_dump()
        # checking and tokenizing: off the event loop (they scale with the prompts)
        req = await self.service.off_loop(api.parse_completion_request, body,
                                          self.service.sampler.cfg.vocab_size)
        prompts = await self.service.off_loop(self._prompt_ids, req)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        prepared = prepare(self.service, prompts, req.sampling, req.max_tokens, rid,
                           adapter_of(self.service, body))
        n = req.sampling.n
        if req.stream:
            return self.stream(prepared, lambda events: self._completion_chunks(
                req, prompts, rid, created, events))
        results = await self.run(request, prepared)
        if results is None:
            return JSONResponse(api.error_body("client closed the request"), 499)
        choices = [api.completion_choice(i, res, self.service.text_of(res), prompts[i // n],
                                         req.logprobs, self.token_text)
                   for i, res in enumerate(results)]
        return api.completion_response(rid, self.model, created, choices,
                                       api.usage([len(p) for p in prompts], results))

    async def _completion_chunks(self, req: api.CompletionRequest, prompts: list[list[int]],
                                 rid: str, created: int, events: TicketEvents
                                 ) -> AsyncIterator[dict]:
        n = req.sampling.n
        streams = [TextStream(self.decode, req.sampling.stop) for _ in range(n * len(prompts))]
        offsets = [0] * len(streams)  # text_offset after each stream's tokens sent, kept up
        try:
            async for kind, payload in events:
                if kind == "tokens":
                    choices = []
                    for index, (ids, logprobs) in sorted(payload.items()):
                        stream = streams[index]
                        text = stream.advance(ids)
                        if not text:
                            continue
                        first, end = stream.released(ids) if req.logprobs else (0, 0)
                        offset, offsets[index] = offsets[index], offsets[index] + self._offset(
                            ids[first:end])
                        choices.append({
                            "index": index, "text": text, "finish_reason": None,
                            "logprobs": api.completion_logprobs(
                                ids[first:end], logprobs[first:end], self.token_text,
                                offset) if req.logprobs else None})
                    if choices:
                        yield api.completion_chunk(rid, self.model, created, choices)
                    continue
                for index, res in enumerate(payload):
                    stream = streams[index]
                    first = stream.tokens_sent
                    offset = offsets[index]
                    yield api.completion_chunk(rid, self.model, created, [{
                        "index": index, "text": stream.finish(self.service.text_of(res)),
                        "logprobs": api.completion_logprobs(
                            res.output_ids[first:], res.logprobs[first:], self.token_text,
                            offset) if req.logprobs else None,
                        "finish_reason": api.finish_reason(res),
                        "prompt_token_ids": prompts[index // n], "token_ids": res.output_ids,
                        "weight_version": res.weight_version}])
                if req.include_usage:
                    yield api.completion_chunk(rid, self.model, created, [], api.usage(
                        [len(p) for p in prompts], payload))
        finally:
            events.close()


def add_openai_routes(app: FastAPI, service: RolloutService) -> None:
    """Registers /v1/models, /v1/chat/completions and /v1/completions on `app`; their errors
    are OpenAI's shape (`openai_api.error_body`)."""
    routes = OpenAIRoutes(service)
    started = int(time.time())

    async def answered(handler, request: Request):
        try:
            return await handler(request)
        except BadRequest as err:
            return JSONResponse(api.error_body(str(err)), status_code=400)

    @app.get("/v1/models")
    def models():
        return api.models_list(routes.model, started)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answered(routes.chat, request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answered(routes.completions, request)
