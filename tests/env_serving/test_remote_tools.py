"""A function-calling env served over HTTP: the local definition's tools reach the prompt, the
server runs the calls, and their results come back as the loop's tool messages."""

import json

import pytest

from rl_tpu.agent import env_tools, observation_messages
from rl_tpu.core.env import make
from rl_tpu.env_serving.remote import RemoteEnvFactory
from rl_tpu.env_serving.server import make_server
from rl_tpu.models.tiny_tokenizer import build_tokenizer
from rl_tpu.models.tokenizer import ChatTokenizer
from rl_tpu.recipes.env_factory import check_call_format
from rl_tpu.recipes.config import CALCULATOR_ARITHMETIC

pytestmark = pytest.mark.slow  # a real uvicorn server on 127.0.0.1

KWARGS = {"task_env": "arithmetic", "tools": "calculator",
          "task_kwargs": {"config": dict(CALCULATOR_ARITHMETIC), "isolate": False}}


def test_a_served_tool_env_plays_a_call_and_an_answer():
    server = make_server("tool_calling", env_kwargs=KWARGS)
    server.start()
    local = make("tool_calling", **KWARGS)
    factory = RemoteEnvFactory(local, [server.url], timeout=10)
    try:
        env = factory()
        assert env_tools(env) == local.tools and env.call_format == "hermes"
        check_call_format(factory, ChatTokenizer(build_tokenizer(512)))
        task = factory.task_source.get("eval", 2)
        expression = task.data["metadata"]["expression"]
        a, op, b = expression.split()
        value = int(a) + int(b) if op == "+" else int(a) * int(b)
        env.reset(task)
        result = env.step("<tool_call>" + json.dumps(
            {"name": "calculator", "arguments": {"expression": expression}}) + "</tool_call>")
        assert not result.done
        assert observation_messages(env.name, result) == [
            {"role": "tool", "content": str(value), "name": "calculator"}]
        final = env.step(f"<answer>{value}</answer>")
        assert final.done and final.reward == 1.0
        env.close()
    finally:
        factory.close()
        server.shutdown()
