"""The env server fuzzed over loopback (the `largest` env, real servers on 127.0.0.1, one per
dialect for the module): every field of /create, /reset, /step, /close, /observation and /task
sent wrong (wrong types, negative and huge numbers, missing fields, unknown ids, a client task
lacking its data, JSON nested 100,000 deep, a 5,000-digit integer), then a seeded random
mutation of valid bodies. Not one answer is a 500; every 4xx is `{"error": {"message"}}`
naming the field or the id; afterwards the server is healthy and a fixed episode plays exactly
as it did before."""

import copy
import json
import random
import urllib.parse

import pytest

import http_client

from rl_tpu.env_serving.server import make_server


@pytest.fixture(scope="module")
def server():
    srv = make_server("largest", max_instances=4096, idle_timeout_s=None)
    srv.start()
    srv.before = episode(srv)
    yield srv
    srv.shutdown()


@pytest.fixture(scope="module")
def searchqa():
    """The same env in SearchQA's dialect (`env_idx` is the instance, `id` the item)."""
    srv = make_server("largest", max_instances=64, idle_timeout_s=None, dialect="searchqa")
    srv.start()
    yield srv
    srv.shutdown()


def send(server, method, path, body=None, raw=None):
    return http_client.send(server.server_address, method, path, body, raw)


def episode(server) -> list:
    """Eval task 3 played with its answer: every reply but the instance id."""
    status, created = send(server, "POST", "/create", {"split": "eval", "data_idx": 3})
    assert status == 200, created
    env_id = created.pop("id")
    status, task = send(server, "GET", "/task?split=eval&index=3")
    assert status == 200, task
    status, stepped = send(server, "POST", "/step", {"id": env_id,
                                                     "action": task["data"]["answer"]})
    assert status == 200 and stepped["reward"] == 1.0, stepped
    assert send(server, "POST", "/close", {"id": env_id})[0] == 200
    return [created, task, stepped]


BIG = 10**30
TASK = {"task_id": "mine", "data": {"numbers": [3, 9, 4], "answer": "9"}}
# (method, path, body, status, text its message must hold: the field or the id, and why)
CASES = [
    ("POST", "/create", {"data_idx": -1}, 400, "'data_idx': Input should be greater than or "
                                               "equal to 0"),
    ("POST", "/create", {"data_idx": BIG}, 400, f"task index {BIG} is out of range for split "
                                                "'train', which has 1000000 tasks"),
    ("POST", "/create", {"data_idx": 1000, "split": "eval"}, 400,
     "task index 1000 is out of range for split 'eval', which has 1000 tasks"),
    ("POST", "/create", {"data_idx": "1"}, 400, "'data_idx': Input should be a valid integer"),
    ("POST", "/create", {"data_idx": 1.5}, 400, "'data_idx'"),
    ("POST", "/create", {"data_idx": True}, 400, "'data_idx'"),
    ("POST", "/create", {"data_idx": [0]}, 400, "'data_idx'"),
    ("POST", "/create", {"split": "nope"}, 400, "unknown split 'nope'"),
    ("POST", "/create", {"split": 5}, 400, "'split': Input should be a valid string"),
    ("POST", "/create", {"split": None, "task": 5}, 400, "'task'"),
    ("POST", "/create", {"task": "t"}, 400, "'task'"),
    ("POST", "/create", {"task": {}}, 400, "'task.task_id': Field required"),
    ("POST", "/create", {"task": {"task_id": 5}}, 400, "'task.task_id'"),
    ("POST", "/create", {"task": {"task_id": None}}, 400, "'task.task_id'"),
    ("POST", "/create", {"task": {"task_id": "t", "data": [1]}}, 400, "'task.data'"),
    ("POST", "/create", {"task": {"task_id": "t", "data": "x"}}, 400, "'task.data'"),
    # a client task lacking data the env reads at /step: refused at /create, naming it
    ("POST", "/create", {"task": {"task_id": "t", "data": {"numbers": [1, 2]}}}, 400,
     "task 't': 'data' lacks ['answer'], which env 'largest' reads"),
    ("POST", "/create", {"task": {"task_id": "t"}}, 400, "task 't': 'data' lacks ['answer']"),
    ("POST", "/create", {"task": {"task_id": "t", "data": {"answer": "1"}}}, 400,
     "cannot start task 't'"),
    ("POST", "/create", {"task": {"task_id": "t", "data": {"numbers": 5, "answer": "5"}}}, 400,
     "cannot start task 't' with data"),
    ("POST", "/create", {"task": {"task_id": "\ud800", "data": {"numbers": [1]}}}, 400,
     "'data' lacks ['answer']"),
    ("POST", "/create", {"split": "\ud800"}, 400, "unknown split"),
    ("POST", "/reset", {}, 400, "'id': Field required"),
    ("POST", "/reset", {"id": "0"}, 400, "'id': Input should be a valid integer"),
    ("POST", "/reset", {"id": -1}, 404, "no live env with id -1"),
    ("POST", "/reset", {"id": BIG}, 404, f"no live env with id {BIG}"),
    ("POST", "/reset", {"id": None}, 400, "'id'"),
    ("POST", "/reset", {"id": "LIVE", "data_idx": -5}, 400, "'data_idx'"),
    ("POST", "/reset", {"id": "LIVE", "split": "x"}, 400, "unknown split 'x'"),
    ("POST", "/reset", {"id": "LIVE", "data_idx": BIG}, 400, f"task index {BIG} is out of"),
    ("POST", "/reset", {"id": "LIVE", "task": {"task_id": "q", "data": {"numbers": [1]}}},
     400, "task 'q': 'data' lacks ['answer']"),
    ("POST", "/reset", {"id": "LIVE", "task": {"task_id": 7}}, 400, "'task.task_id'"),
    ("POST", "/step", {}, 400, "'id': Field required; 'action': Field required"),
    ("POST", "/step", {"id": "LIVE"}, 400, "'action': Field required"),
    ("POST", "/step", {"id": "LIVE", "action": 5}, 400, "'action': Input should be a valid "
                                                        "string"),
    ("POST", "/step", {"id": "LIVE", "action": None}, 400, "'action'"),
    ("POST", "/step", {"id": "LIVE", "action": ["9"]}, 400, "'action'"),
    ("POST", "/step", {"id": "LIVE", "action": "9", "raw": "yes"}, 400, "'raw'"),
    ("POST", "/step", {"id": "LIVE", "action": "9", "raw": 1}, 400, "'raw'"),
    ("POST", "/step", {"id": -3, "action": "9"}, 404, "no live env with id -3"),
    ("POST", "/step", {"id": BIG, "action": "9"}, 404, f"no live env with id {BIG}"),
    ("POST", "/step", {"id": 1.0, "action": "9"}, 400, "'id'"),
    ("POST", "/close", {}, 400, "'id': Field required"),
    ("POST", "/close", {"id": "x"}, 400, "'id'"),
    ("POST", "/close", {"id": -1}, 404, "no live env with id -1"),
    ("POST", "/close", {"id": 10**100}, 404, "no live env with id 1000"),
    ("GET", "/observation", None, 400, "query parameter 'id': Field required"),
    ("GET", "/observation?id=x", None, 400, "query parameter 'id'"),
    ("GET", "/observation?id=1.5", None, 400, "query parameter 'id'"),
    ("GET", "/observation?id=-1", None, 404, "no live env with id -1"),
    ("GET", f"/observation?id={BIG}", None, 404, f"no live env with id {BIG}"),
    ("GET", "/observation?id=" + "9" * 5000, None, 400, "query parameter 'id'"),
    ("GET", "/task", None, 400, "query parameter 'index': Field required"),
    ("GET", "/task?index=-1", None, 400, "task index -1 is out of range for split 'train'"),
    ("GET", f"/task?index={BIG}", None, 400, f"task index {BIG} is out of range"),
    ("GET", "/task?index=" + "9" * 5000, None, 400, "query parameter 'index'"),
    ("GET", "/task?index=x", None, 400, "query parameter 'index'"),
    ("GET", "/task?index=0&split=zz", None, 400, "unknown split 'zz'"),
    ("GET", "/task?index=0&split=" + urllib.parse.quote("\x00\u2603"), None, 400,
     "unknown split"),
    ("POST", "/nowhere", {}, 404, "no route POST /nowhere"),
    ("GET", "/step", None, 405, "/step takes POST, not GET"),
    ("POST", "/health", {}, 405, "/health takes GET, not POST"),
]

RAW = [  # bodies that are not a JSON object, or break a JSON limit
    ("/create", b"{nope", "not valid JSON"),
    ("/step", b"[1, 2]", "the body must be a JSON object"),
    ("/step", b'"text"', "the body must be a JSON object"),
    ("/reset", b"\xff\xfe", "not valid JSON"),
    ("/close", b"null", "the body must be a JSON object"),
    ("/create", b"[" * 100_000 + b"]" * 100_000, "JSON nested deeper than"),
    ("/step", b'{"id": 0, "action": "a", "x": [' + b"[" * 100_000, "JSON nested deeper than"),
    ("/create", b'{"data_idx": ' + b"9" * 5000 + b"}", "a number of 5000 digits"),
    ("/close", b'{"id": -' + b"1" * 5000 + b"}", "a number of 5000 digits"),
]


def live(server) -> int:
    status, created = send(server, "POST", "/create", {"data_idx": 0})
    assert status == 200, created
    return created["id"]


def with_live_id(server, body):
    if isinstance(body, dict) and body.get("id") == "LIVE":
        return {**body, "id": live(server)}
    return body


@pytest.mark.parametrize("method,path,body,status,text", CASES,
                         ids=[f"{m} {p[:40]} {json.dumps(b)[:50]}" for m, p, b, _, _ in CASES])
def test_each_bad_field_or_id_is_a_4xx_naming_it(server, method, path, body, status, text):
    answered, reply = send(server, method, path, with_live_id(server, body))
    assert answered == status, reply
    assert text in http_client.error_message(reply)


@pytest.mark.parametrize("path,raw,text", RAW, ids=[f"{p}:{r[:20]!r}" for p, r, _ in RAW])
def test_a_body_that_is_not_a_json_object_is_a_400_saying_so(server, path, raw, text):
    status, reply = send(server, "POST", path, raw=raw)
    assert status == 400, reply
    assert text in http_client.error_message(reply)


def test_a_client_task_with_its_data_plays_and_one_lacking_it_is_never_created(server):
    """The env reads "answer" only at /step: before, a task without it was created and its
    first step was a 500; now /create refuses it, and no instance is left behind."""
    before = send(server, "GET", "/health")[1]["instances"]
    status, reply = send(server, "POST", "/create", {"task": {"task_id": "t",
                                                              "data": {"numbers": [1, 2]}}})
    assert status == 400 and "'answer'" in http_client.error_message(reply)
    assert send(server, "GET", "/health")[1]["instances"] == before
    status, created = send(server, "POST", "/create", {"task": TASK})
    assert status == 200 and created["observation"] == "Which number is largest? 3 9 4"
    status, stepped = send(server, "POST", "/step", {"id": created["id"], "action": "9"})
    assert status == 200 and stepped["reward"] == 1.0


SEARCHQA = [
    ("/create", {}, 400, "'id': Field required"),
    ("/create", {"id": -1}, 400, "'id'"),
    ("/create", {"id": BIG}, 400, f"task index {BIG} is out of range"),
    ("/create", {"id": "0"}, 400, "'id'"),
    ("/reset", {"env_idx": 0}, 400, "'id': Field required"),
    ("/reset", {"env_idx": BIG, "id": 0}, 404, f"no live env with id {BIG}"),
    ("/reset", {"env_idx": "a", "id": 0}, 400, "'env_idx'"),
    ("/step", {"env_idx": 0}, 400, "'action': Field required"),
    ("/step", {"env_idx": -1, "action": "a"}, 404, "no live env with id -1"),
    ("/step", {"env_idx": 0, "action": {}}, 400, "'action'"),
    ("/close", {"env_idx": None}, 400, "'env_idx'"),
    ("/close", {"id": 0}, 400, "'env_idx': Field required"),
]


@pytest.mark.parametrize("path,body,status,text", SEARCHQA,
                         ids=[f"{p} {json.dumps(b)}" for p, b, _, _ in SEARCHQA])
def test_searchqas_dialect_names_its_fields_too(searchqa, path, body, status, text):
    answered, reply = send(searchqa, "POST", path, body)
    assert answered == status, reply
    assert text in http_client.error_message(reply)


# Values a mutation puts in a field: every JSON type, signed and huge numbers, empty things.
HOSTILE = [None, True, False, 0, 1, -1, 7, 2**31, 2**63, -2**63 - 1, 10**40, 0.5, -0.0, 1e308,
           "", "0", "train", "eval", "x" * 300, "\ud800", [], [1], ["a"], {}, {"a": 1},
           {"task_id": "m"}, {"task_id": "m", "data": {}}, {"task_id": "m", "data": None}]
VALID = [
    ("/create", {"data_idx": 2}), ("/create", {"split": "eval", "data_idx": 5}),
    ("/create", {"task": TASK}), ("/reset", {"id": "LIVE", "data_idx": 1}),
    ("/reset", {"id": "LIVE", "task": TASK}), ("/step", {"id": "LIVE", "action": "9"}),
    ("/step", {"id": "LIVE", "action": "9", "raw": True}), ("/close", {"id": "LIVE"}),
]


def mutate(rng: random.Random, body: dict) -> tuple[dict, str]:
    """A copy of `body` with one field (or one of its task's) set to a hostile value, deleted,
    or added; (it, the field's name)."""
    body = copy.deepcopy(body)
    target = body["task"] if "task" in body and rng.random() < 0.4 else body
    names = list(target) + (["task_id", "data"] if target is not body else
                            ["id", "data_idx", "split", "task", "action", "raw"])
    name = rng.choice(names)
    if name in target and rng.random() < 0.2:
        del target[name]
    else:
        target[name] = rng.choice(HOSTILE)
    return body, name


def test_random_mutations_of_valid_bodies_never_get_a_500(server):
    rng = random.Random(27)
    answered = {}
    for i in range(300):
        path, valid = VALID[i % len(VALID)]
        body, name = mutate(rng, with_live_id(server, valid))
        status, reply = send(server, "POST", path, body)
        answered[status] = answered.get(status, 0) + 1
        assert status in (200, 400, 404), (path, body, reply)
        if status == 400:
            message = http_client.error_message(reply)
            # the field, or the task or split it named, or what a task's data lacks
            assert name in message or "task" in message or "split" in message, (body, message)
        elif status == 404:
            assert "no live env with id" in http_client.error_message(reply), reply
    assert answered.get(400, 0) > 100 and answered.get(200, 0) > 30, answered
    send(server, "POST", "/close", {"id": 0})


def test_after_the_fuzzing_the_server_is_healthy_and_plays_as_before(server):
    # named so that it runs after the fuzzing tests of this module (pytest keeps file order)
    status, health = send(server, "GET", "/health")
    assert status == 200 and health["instances"] < health["max_instances"]
    assert episode(server) == server.before
