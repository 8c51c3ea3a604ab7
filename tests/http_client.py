"""A bare HTTP client for the server tests: one request on a fresh connection, the reply as
sent (status and JSON, or text), so a test sees exactly what the server answered."""

import http.client
import json


def send(address, method, path, body=None, raw=None):
    """(status, the reply parsed as JSON, or its text) of one request to the server at
    `address` ((host, port)); `raw` bytes are sent as the body as they are."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    conn = http.client.HTTPConnection(*address, timeout=30)
    try:
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        text = resp.read().decode()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(text)
    except ValueError:
        return resp.status, text


def error_message(reply) -> str:
    """The message of an error reply, which must be exactly {"error": {"message": str}}."""
    assert isinstance(reply, dict) and set(reply) == {"error"}, reply
    assert set(reply["error"]) == {"message"} and isinstance(reply["error"]["message"], str)
    return reply["error"]["message"]
