"""An SGLang-compatible HTTP server around the embedded JAX sampler.

For rollout hosts where real SGLang does not run (TPU): it answers SGLang's native requests
(docs/architecture.md, "SGLang native API") with the same reply shapes, so `SGLangEngine`
(and any SGLang client) cannot tell it from the real thing. Standard library only (ThreadingHTTPServer): one process, one
sampler; concurrent requests queue on the sampler.

Endpoints: POST /generate, /update_weights_from_disk, /flush_cache, /abort_request,
/pause_generation, /continue_generation; GET /health, /health_generate, /model_info,
/get_model_info. Malformed requests get HTTP 400 `{"error": {"message": ...}}` and never take
the server down; so does a request over one of the server's `ServerLimits` (samples per
prompt, rows, prompt + new tokens against the context, tokens a request may hold), checked
before it reaches the sampler, whose memory and time such a request could otherwise take.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

from rl_tpu.models import hf
from rl_tpu.models.tokenizer import ChatTokenizer
from rl_tpu.rollout.engine import GenerateRequest, GenerateResult, SamplingParams
from rl_tpu.rollout.sampler import JaxSampler

log = logging.getLogger(__name__)


class BadRequest(ValueError):
    """The client's fault: answered with HTTP 400 and the message."""


def sampling_from_json(raw: Any) -> SamplingParams:
    """SGLang `sampling_params` dict -> SamplingParams (unknown keys ignored, as SGLang does)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest(f"sampling_params must be an object, got {type(raw).__name__}")
    stop = raw.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    try:
        return SamplingParams(
            max_new_tokens=int(raw.get("max_new_tokens", 128)),
            min_new_tokens=int(raw.get("min_new_tokens") or 0),
            temperature=float(raw.get("temperature", 1.0)),
            top_p=float(raw.get("top_p", 1.0)), top_k=int(raw.get("top_k", -1)),
            stop_token_ids=tuple(int(t) for t in raw.get("stop_token_ids") or ()),
            stop=tuple(str(s) for s in stop), ignore_eos=bool(raw.get("ignore_eos", False)),
            n=int(raw.get("n", 1)),
            seed=None if raw.get("sampling_seed") is None else int(raw["sampling_seed"]))
    except (TypeError, ValueError, OverflowError) as err:
        raise BadRequest(f"bad sampling_params: {err}") from err


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


class RolloutService:
    """The server's state and logic, separate from HTTP so it can be tested directly."""

    def __init__(self, sampler: JaxSampler, model_path: str, tokenizer: Optional[ChatTokenizer],
                 limits: ServerLimits = ServerLimits()):
        self.sampler = sampler
        self.model_path = model_path
        self.tokenizer = tokenizer
        self.limits = limits

    # -- /generate -----------------------------------------------------------------------

    def generate(self, body: dict) -> Any:
        has_text, has_ids = body.get("text") is not None, body.get("input_ids") is not None
        if has_text == has_ids:
            raise BadRequest("give exactly one of 'text' or 'input_ids'")
        prompts, single = self._prompts(body)
        raw = body.get("sampling_params")
        if isinstance(raw, list):
            if len(raw) != len(prompts):
                raise BadRequest(f"{len(raw)} sampling_params for {len(prompts)} prompts")
        else:
            raw = [raw] * len(prompts)
        sampling = [sampling_from_json(p) for p in raw]
        rids = body.get("rid")
        rids = rids if isinstance(rids, list) else [rids] * len(prompts)
        rids = [r or uuid.uuid4().hex for r in rids]
        self.limits.check(prompts, sampling, self.sampler.cfg.max_position_embeddings)
        requests = [GenerateRequest(p, s, r) for p, s, r in zip(prompts, sampling, rids)]

        try:
            results = self.sampler.generate(requests)
        except ValueError as err:
            raise BadRequest(str(err)) from err
        expanded = [(req, r or {}) for req, r in zip(requests, raw) for _ in range(req.sampling.n)]
        replies = [self._reply(req, res, body, r) for (req, r), res in zip(expanded, results)]
        return replies[0] if single and len(replies) == 1 else replies

    def _prompts(self, body) -> tuple[list[list[int]], bool]:
        if body.get("input_ids") is not None:
            ids = body["input_ids"]
            single = bool(ids) and all(isinstance(t, int) for t in ids)
            batch = [ids] if single else ids
            if not batch or not all(isinstance(p, list) and p and
                                    all(isinstance(t, int) for t in p) for p in batch):
                raise BadRequest("input_ids must be a non-empty list of ints or of such lists")
            return batch, single
        if self.tokenizer is None:
            raise BadRequest("this server has no tokenizer: send input_ids instead of text")
        text = body["text"]
        single = isinstance(text, str)
        texts = [text] if single else text
        if not all(isinstance(t, str) for t in texts):
            raise BadRequest("text must be a string or a list of strings")
        return [self.tokenizer.encode(t) for t in texts], single

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
        text = ""
        if self.tokenizer is not None:
            skip = bool(raw_params.get("skip_special_tokens", True))
            text = self.tokenizer.decode(res.output_ids, skip_special_tokens=skip)
            if (res.finish_reason == "stop" and isinstance(res.matched_stop, str)
                    and not raw_params.get("no_stop_trim") and text.endswith(res.matched_stop)):
                text = text[: -len(res.matched_stop)]
        return {"text": text, "output_ids": res.output_ids, "meta_info": meta}

    # -- weights and control -------------------------------------------------------------

    def update_weights_from_disk(self, body: dict) -> tuple[int, dict]:
        path = body.get("model_path")
        version = body.get("weight_version")
        if not isinstance(path, str) or not path:
            raise BadRequest("update_weights_from_disk needs 'model_path'")
        cfg = self.sampler.cfg
        try:
            new_cfg, params = hf.load(path, mesh=self.sampler.mesh, dtype=cfg.param_dtype,
                                      scan_layers=cfg.scan_layers, remat=cfg.remat)
        except (hf.CheckpointError, OSError) as err:
            return 400, {"success": False, "message": f"failed to load {path}: {err}",
                         "num_paused_requests": 0}
        if new_cfg.replace(eos_token_ids=cfg.eos_token_ids, bos_token_id=cfg.bos_token_id) != cfg:
            return 400, {"success": False, "num_paused_requests": 0,
                         "message": f"{path} has a different architecture than the served model"}
        self.sampler.update_weights(params, version if version is not None else path)
        self.model_path = path
        return 200, {"success": True, "message": f"loaded {path}", "num_paused_requests": 0}

    def model_info(self) -> dict:
        return {"model_path": self.model_path, "tokenizer_path": self.model_path,
                "is_generation": True, "weight_version": self.sampler.weight_version}

    def health_generate(self) -> bool:
        token = 0 if self.tokenizer is None else (self.tokenizer.eos_token_id or 0)
        result = self.sampler.generate([GenerateRequest([token], SamplingParams(max_new_tokens=1))])
        return len(result) == 1

    def abort(self, body: dict):
        """Ends requests between decode chunks; they return what they have (finish abort)."""
        if body.get("abort_all"):
            self.sampler.abort()
        elif body.get("rid"):
            self.sampler.abort(str(body["rid"]))
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
            self.sampler.abort()

    def resume(self):
        self.sampler.resume()


def make_handler(service: RolloutService, api_key: Optional[str]):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # route access logs through logging, not stderr
            log.debug("%s - %s", self.address_string(), fmt % args)

        def _send(self, status: int, payload: Any, content_type="application/json"):
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str):
            self._send(status, {"error": {"message": message}})

        def _authorised(self) -> bool:
            if api_key and self.headers.get("Authorization") != f"Bearer {api_key}":
                self._error(401, "missing or wrong API key (Authorization: Bearer <key>)")
                return False
            return True

        def _body(self) -> dict:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b"{}"
            try:
                body = json.loads(raw or b"{}")
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise BadRequest(f"body is not JSON: {err}") from err
            if not isinstance(body, dict):
                raise BadRequest("body must be a JSON object")
            return body

        def do_GET(self):
            if not self._authorised():
                return
            path = self.path.split("?")[0]
            try:
                if path == "/health":
                    self._send(200, b"", "text/plain")
                elif path == "/health_generate":
                    self._send(200 if service.health_generate() else 503, b"", "text/plain")
                elif path in ("/model_info", "/get_model_info"):
                    self._send(200, service.model_info())
                else:
                    self._error(404, f"no such endpoint: GET {path}")
            except Exception as err:  # keep serving; the client sees what went wrong
                log.exception("GET %s failed", path)
                self._error(500, f"{type(err).__name__}: {err}")

        def do_POST(self):
            if not self._authorised():
                return
            path = self.path.split("?")[0]
            try:
                body = self._body()
                if path == "/generate":
                    reply = service.generate(body)
                    if body.get("stream"):
                        self._stream(reply)
                    else:
                        self._send(200, reply)
                elif path == "/update_weights_from_disk":
                    self._send(*service.update_weights_from_disk(body))
                elif path == "/flush_cache":  # the sampler's prefix cache, as SGLang's radix
                    service.sampler.flush_cache()
                    self._send(200, b"Cache flushed.", "text/plain")
                elif path == "/abort_request":
                    service.abort(body)
                    self._send(200, b"", "text/plain")
                elif path == "/pause_generation":
                    service.pause(body)
                    self._send(200, {"success": True})
                elif path == "/continue_generation":
                    service.resume()
                    self._send(200, {"success": True})
                else:
                    self._error(404, f"no such endpoint: POST {path}")
            except BadRequest as err:
                self._error(400, str(err))
            except Exception as err:  # a bug or a device error: report it, keep serving
                log.exception("POST %s failed", path)
                self._error(500, f"{type(err).__name__}: {err}")

        def _stream(self, reply):
            """SSE with cumulative outputs; the whole sample is ready at once here, so one
            event per sample, then [DONE]."""
            events = b"".join(f"data: {json.dumps(r)}\n\n".encode()
                              for r in (reply if isinstance(reply, list) else [reply]))
            self._send(200, events + b"data: [DONE]\n\n", "text/event-stream")

    return Handler


def serve(service: RolloutService, host: str = "127.0.0.1", port: int = 30000,
          api_key: Optional[str] = None) -> ThreadingHTTPServer:
    """Binds (loopback unless told otherwise) and returns the server; call serve_forever()."""
    server = ThreadingHTTPServer((host, port), make_handler(service, api_key))
    server.daemon_threads = True
    return server
