"""What the env server reads and writes on the wire: the pydantic request models, the error
replies (in rl_tpu's shape or AgentGym's), and the middleware that reads every request body
before the app sees it (size cap, deadline, JSON whatever the Content-Type).

The models are strict: `"id": "0"` or `"data_idx": true` is an error naming the field, not a
guess, since a client that sends them has a bug worth seeing (AgentGym's clients send ints).
Unknown fields are ignored, as AgentGym's servers ignore them.
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any, Optional

from pydantic import BaseModel, Field, StrictBool, StrictInt, StrictStr
from starlette.responses import Response

ERROR_STYLES = ("rl_tpu", "agentgym")

Index = Annotated[StrictInt, Field(ge=0)]


# -- request bodies ---------------------------------------------------------------------------


class TaskSpec(BaseModel):
    """A whole task, for tasks that are not in the env's own task source (rl_tpu's protocol)."""
    task_id: StrictStr
    data: dict[str, Any] = Field(default_factory=dict)


class Create(BaseModel):
    """`/create`: AgentGym's item number (`data_idx` alone), an index into `split`, or a whole
    `task`; nothing at all is item 0 (AgentGym's bare create)."""
    data_idx: Optional[Index] = None
    split: Optional[StrictStr] = None
    task: Optional[TaskSpec] = None


class Reset(Create):
    id: StrictInt


class Step(BaseModel):
    id: StrictInt
    action: StrictStr
    raw: StrictBool = False  # rl_tpu's protocol: the model's whole reply, never prefixed


class Close(BaseModel):
    id: StrictInt


class SearchQACreate(BaseModel):
    id: Index  # SearchQA's item


class SearchQAReset(BaseModel):
    env_idx: StrictInt
    id: Index


class SearchQAStep(BaseModel):
    env_idx: StrictInt
    action: StrictStr


class SearchQAClose(BaseModel):
    env_idx: StrictInt


# -- replies ----------------------------------------------------------------------------------


class JSONReply(Response):
    """JSON as the hand-written server sent it (`json.dumps` defaults: ASCII escapes, NaN in
    an info dict allowed), so replies are byte-for-byte what clients already read."""
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return json.dumps(content).encode()


def error_reply(status: int, message: str, style: str, close: bool = False) -> JSONReply:
    """rl_tpu's shape, `status` + `{"error": {"message"}}` (the rollout server's too), or
    AgentGym's, HTTP 200 + `{"error": message}`. `close`: end the connection after it (the
    request body was not read to its end, so the stream cannot carry another request)."""
    headers = {"connection": "close"} if close else None
    if style == "agentgym":
        return JSONReply({"error": message}, status_code=200, headers=headers)
    return JSONReply({"error": {"message": message}}, status_code=status, headers=headers)


# -- the body reader --------------------------------------------------------------------------


class BodyGuard:
    """ASGI middleware: reads a request's whole body before the app runs, so that

    - a body larger than `max_bytes` is refused with 413 without reading it all;
    - a body shorter than its Content-Length (a client that stalls or lies) is answered 400
      once `timeout_s` has passed, instead of holding the request open until the client
      gives up;
    - any non-empty body is read as JSON whatever its Content-Type says (`curl -d` sends a
      form type; the hand-written server never looked at it either).
    """

    def __init__(self, app, error_style: str, max_bytes: int, timeout_s: float):
        self.app, self.style = app, error_style
        self.max_bytes, self.timeout_s = max_bytes, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        declared = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                declared = int(value)  # the HTTP parser has checked it is a number >= 0
        if declared is not None and declared > self.max_bytes:
            return await self._refuse(413, f"a body of {declared} bytes exceeds the limit of "
                                           f"{self.max_bytes}", scope, receive, send)
        chunks, size = [], 0
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        while True:
            try:
                async with asyncio.timeout_at(deadline):  # no task per read, unlike wait_for
                    message = await receive()
            except TimeoutError:
                expected = f" of the {declared} its Content-Length announces" if declared else ""
                return await self._refuse(
                    400, f"incomplete body: {size} bytes{expected} arrived within "
                         f"{self.timeout_s:g}s", scope, receive, send)
            if message["type"] == "http.disconnect":
                return  # the client is gone: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:  # a chunked body has no Content-Length to check first
                return await self._refuse(413, f"the body exceeds the limit of "
                                               f"{self.max_bytes} bytes", scope, receive, send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if body:
            scope = dict(scope, headers=[(k, v) for k, v in scope["headers"]
                                         if k != b"content-type"]
                         + [(b"content-type", b"application/json")])
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later messages: a disconnect, passed on

        await self.app(scope, replay, send)

    async def _refuse(self, status, message, scope, receive, send):
        path = f"{scope['method']} {scope['path']}"
        await error_reply(status, f"{path}: {message}", self.style, close=True)(
            scope, receive, send)
