"""What the env server reads and writes on the wire: the pydantic request models and the error
replies (in rl_tpu's shape or AgentGym's). Every request body is read before the app sees it
by rl_tpu.http_limits.BodyGuard (size cap, deadline, JSON limits, JSON whatever the
Content-Type), whose refusals `error_reply` shapes.

The models are strict: `"id": "0"` or `"data_idx": true` is an error naming the field, not a
guess, since a client that sends them has a bug worth seeing (AgentGym's clients send ints).
Unknown fields are ignored, as AgentGym's servers ignore them.
"""

from __future__ import annotations

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
