"""How the code envs score a program without letting the program reach its own score.

A program under RL optimises whatever pays, and anything that runs in its interpreter is its
to rewrite: a harness there can have its report function called with forged records, its
marker read and printed, its `type`, `bool`, `exec` or `AssertionError` replaced, the tests'
expected values read out of memory, or its process ended before a failing test reports. So no
verdict is made where the program runs. The program's process is only asked questions and
answers with plain data (rl_tpu/envs/plain_data.py); the verdict is made elsewhere:

1. The candidate run (one sandbox execution, the program in it) evaluates each call the tests
   make and writes what it returned, as a plain-data tree, or what it raised. It never holds
   an expected value or a test's source: a `call` test sends only its call (`f(3)`), an `exec`
   test (HumanEval's asserts) only the arguments of each of its calls to the function.
2. A `call` test is judged here, in this process: the answer is decoded into fresh builtin
   objects and compared with the expected literal, exact type first. A forged or patched
   object cannot survive the trip (decode builds ints, lists, ... and nothing else).
3. An `exec` test is judged by a replay run: a fresh sandbox that never held the program runs
   the test's own statements with `candidate` answering from the decoded answers, provided
   each call's arguments are the ones the program was asked about. Its records are the
   verdict; the program could not write them, since it never ran there.
   The arguments an `exec` test passes are learned once per task from a reference run: the
   task's own solution (HumanEval's canonical one) run through the test with every call
   recorded, in a sandbox of its own; cached for the life of the process. Both runs seed
   `random` per test, so a test that draws its inputs draws the same ones in each.

So the most a program can do to its score is choose its answers, and an answer counts only
when it is right: forged records are claims about return values (a wrong claim fails; a right
one is what an honest program says), exiting early leaves the later calls unanswered (failed),
and the expected values never enter its process. What the program writes to its own stdout,
marker or not, can only be its own (ignored) answers. What stays open: a program can still
recognise a test's inputs and answer from a table, as any program could, and a test whose
calls depend on the program's earlier answers fails unless they match the reference's (the
replay refuses a call it did not ask the program about).
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import secrets
import threading
from pathlib import Path
from typing import Optional

from rl_tpu.envs import plain_data

_CODEC = Path(plain_data.__file__).read_text()
NO_RESULT = "no result (the program exited or ran out of time or memory first)"

# What every harness script shares: the codec, a marked report line on the real stdout (the
# tests' and program's own prints go to stderr), a traceback tail without harness frames, and
# a per-test alarm. `%%` survives the %-formatting of the scripts below.
_COMMON = _CODEC.replace("%", "%%") + r'''
import json as _json, signal as _signal, sys as _sys, traceback as _traceback
_out = _sys.stdout
_sys.stdout = _sys.stderr
def _say(record):
    _out.write(%(marker)r + _json.dumps(record) + "\n")
    _out.flush()
def _tail(exc):
    frames = [f for f in _traceback.extract_tb(exc.__traceback__) if f.filename.startswith("<")
              and f.filename != "<string>"]
    lines = _traceback.format_list(frames[-2:]) + _traceback.format_exception_only(type(exc), exc)
    return "".join(lines)[-400:]
def _alarm(signum, frame):
    raise TimeoutError("the test ran over %%.1f s" %% %(test_seconds)r)
_signal.signal(_signal.SIGALRM, _alarm)
_namespace = {"__name__": "__main__"}
def _same_randomness(i):  # a test drawing unseeded inputs draws the same in both runs
    import random
    random.seed(i)
'''

# The candidate run: the program answers each test's calls with a value's tree, or the tail of
# what it raised.
_CANDIDATE = _COMMON + r'''
_calls = _json.loads(%(calls)r)
try:
    exec(compile(%(program)r, "<program>", "exec"), _namespace)
except BaseException as exc:
    _say({"loaded": False, "error": _tail(exc)})
    raise SystemExit(0)
_say({"loaded": True})
for _i, _test_calls in enumerate(_calls):
    _signal.setitimer(_signal.ITIMER_REAL, %(test_seconds)r)
    try:
        for _k, _call in enumerate(_test_calls):
            _record = {"test": _i, "call": _k}
            try:
                if "expression" in _call:
                    _value = eval(_call["expression"], _namespace)
                else:
                    _value = _namespace[%(entry)r](*decode(_call["args"]),
                                                   **decode(_call["kwargs"]))
                _record["value"] = encode(_value)
            except BaseException as exc:
                _record["error"] = _tail(exc)
            _say(_record)
            if "error" in _record:
                break
    except BaseException:
        pass  # the alarm between two calls: the test's later calls stay unanswered
    finally:
        _signal.setitimer(_signal.ITIMER_REAL, 0)
'''

# The reference run: the task's solution through the exec tests, each call's arguments recorded
# (before the call: a solution may change its arguments).
_REFERENCE = _COMMON + r'''
exec(compile(%(program)r, "<reference>", "exec"), _namespace)
exec(compile(%(setup)r, "<setup>", "exec"), _namespace)
_solution = _namespace.get("candidate") or _namespace[%(entry)r]
for _i, _source in enumerate(_json.loads(%(sources)r)):
    _asked = []
    def _recorder(*args, **kwargs):
        _asked.append({"args": encode(list(args)), "kwargs": encode(kwargs)})
        _namespace[%(entry)r] = _solution  # its own recursive calls are not the test's
        try:
            return _solution(*args, **kwargs)
        finally:
            _namespace[%(entry)r] = _recorder
    # a test may call the function by its name as well as by `candidate`
    _namespace["candidate"] = _namespace[%(entry)r] = _recorder
    _record = {"test": _i, "calls": _asked}
    _same_randomness(_i)
    try:
        exec(compile(_source, "<test %%d>" %% _i, "exec"), _namespace)
    except BaseException as exc:
        _record["error"] = _tail(exc)
    _say(_record)
'''

# The replay run: the exec tests' own statements, `candidate` answering from the program's
# decoded answers.
_REPLAY = _COMMON + r'''
class _ProgramFailed(Exception):
    pass
exec(compile(%(helpers)r, "<prompt>", "exec"), _namespace)
exec(compile(%(setup)r, "<setup>", "exec"), _namespace)
_asked_all, _answers_all = _json.loads(%(asked)r), _json.loads(%(answers)r)
for _i, _source in enumerate(_json.loads(%(sources)r)):
    _asked, _answers, _next = _asked_all[_i], _answers_all[_i], [0]
    def _replayer(*args, **kwargs):
        k = _next[0]
        _next[0] += 1
        if k >= len(_asked) or {"args": encode(list(args)), "kwargs": encode(kwargs)} != _asked[k]:
            raise _ProgramFailed("the test called candidate with arguments the program was not "
                                 "asked about (an answer led it off the reference's path)")
        if k >= len(_answers):
            raise _ProgramFailed(None)
        if "value" not in _answers[k]:
            raise _ProgramFailed(_answers[k].get("error") or "the program raised")
        return decode(_answers[k]["value"])
    _namespace["candidate"] = _namespace[%(entry)r] = _replayer
    _record = {"test": _i, "ok": False}
    _same_randomness(_i)
    _signal.setitimer(_signal.ITIMER_REAL, %(test_seconds)r)
    try:
        exec(compile(_source, "<test %%d>" %% _i, "exec"), _namespace)
        _record["ok"] = True
    except _ProgramFailed as exc:
        if exc.args[0] is None:
            _record["no_result"] = True
        else:
            _record["error"] = str(exc.args[0])[-400:]
    except BaseException as exc:
        _record["error"] = _tail(exc)
    finally:
        _signal.setitimer(_signal.ITIMER_REAL, 0)
    _say(_record)
'''


def script(template: str, marker: str, test_seconds: float, **fields) -> str:
    """One harness script: `template` with its fields (source text and JSON) as literals."""
    return template % {"marker": marker, "test_seconds": float(test_seconds), **fields}


def read_records(stdout: str, marker: str) -> list[dict]:
    """The marked JSON records of a run's stdout, in order (a garbled line is skipped)."""
    records = []
    for line in stdout.splitlines():
        if line.startswith(marker):
            try:
                record = json.loads(line[len(marker):])
            except (ValueError, RecursionError):
                continue  # a line cut short by the output limit, or nested past the parser
            if isinstance(record, dict):
                records.append(record)
    return records


def new_marker() -> str:
    return f"@@test-{secrets.token_hex(8)}@@"


# ---------------------------------------------------------------------------------------------
# The calls an exec test makes, from the reference run (once per task and process)
# ---------------------------------------------------------------------------------------------

_ASKED: dict[str, list[list[dict]]] = {}
_ASKED_LOCK = threading.Lock()


def reference_calls(sandbox, reference: str, setup: str, sources: list[str], entry_point: str,
                    test_seconds: float) -> list[list[dict]]:
    """Each exec test's calls ({"args", "kwargs"} trees), as the reference makes them."""
    key = hashlib.sha256(json.dumps([reference, setup, sources, entry_point]).encode()).hexdigest()
    with _ASKED_LOCK:
        if key in _ASKED:
            return _ASKED[key]
    marker = new_marker()
    execution = sandbox.run(script(_REFERENCE, marker, test_seconds, program=reference,
                                   setup=setup, entry=entry_point,
                                   sources=json.dumps(sources)))
    records = {r.get("test"): r for r in read_records(execution.stdout, marker)}
    asked = []
    for i in range(len(sources)):
        record = records.get(i)
        if record is None or "error" in record:
            why = (record or {}).get("error") or execution.stderr[-400:] or execution.status
            raise ValueError(f"the task's reference solution does not pass its test {i}, so "
                             f"the calls the test makes are unknown: {why.strip()}")
        asked.append(record["calls"])
    with _ASKED_LOCK:
        _ASKED[key] = asked
    return asked


def replay(sandbox, helpers: str, setup: str, sources: list[str], entry_point: str,
           asked: list[list[dict]], answers: list[list[dict]],
           test_seconds: float) -> dict[int, dict]:
    """The exec tests' verdicts, {index: {"ok", "error" | "no_result"}}, from a fresh sandbox
    that runs the tests on the program's answers."""
    marker = new_marker()
    execution = sandbox.run(script(_REPLAY, marker, test_seconds, helpers=helpers, setup=setup,
                                   entry=entry_point, sources=json.dumps(sources),
                                   asked=json.dumps(asked),
                                   answers=json.dumps(answers)))
    return {r["test"]: r for r in read_records(execution.stdout, marker)
            if isinstance(r.get("test"), int)}


def judge_call(answer: Optional[dict], expected: str) -> Optional[dict]:
    """A call test's verdict from the program's answer (None: it gave none): the value decoded
    into fresh builtins, equal to the expected literal and of its exact type."""
    if answer is None:
        return None
    if "value" not in answer:
        return {"ok": False, "error": str(answer.get("error") or "the program raised")}
    try:
        got = plain_data.decode(answer["value"])
    except plain_data.NotPlainData as error:
        return {"ok": False, "error": f"NotPlainData: {error}"}
    want = ast.literal_eval(expected)
    try:
        ok = type(got) is type(want) and bool(got == want)
    except (RecursionError, MemoryError):
        ok = False  # a self-nesting answer compared against the literal
    try:
        shown = repr(got)[:200]
    except (ValueError, RecursionError):  # an int past str()'s digit limit
        shown = f"a {type(got).__name__} too large to show"
    return {"ok": ok, "got": shown}


def checked_answer(record: dict) -> dict:
    """An answer as the verdict may take it: {"value": a tree that decodes} or {"error": text},
    nothing else the program wrote into the record. A tree that does not decode (too deep,
    malformed) becomes an error here, before the replay reads every answer of the run."""
    if "value" in record:
        try:
            plain_data.decode(record["value"])
            return {"value": record["value"]}
        except plain_data.NotPlainData as error:
            return {"error": f"NotPlainData: {error}"}
    return {"error": str(record.get("error") or "the program raised")[-400:]}


@dataclasses.dataclass
class Answers:
    """The candidate run: whether the program loaded (and why not), and its answers per test,
    each the run of consecutive calls it answered from the first."""

    loaded: bool
    load_error: str
    per_test: list[list[dict]]


def ask(sandbox, program: str, calls: list[list[dict]], entry_point: str,
        test_seconds: float):
    """Runs the candidate: (Answers, the sandbox's Execution)."""
    marker = new_marker()
    execution = sandbox.run(script(_CANDIDATE, marker, test_seconds, program=program,
                                   calls=json.dumps(calls), entry=entry_point))
    loaded, first = None, {}
    for record in read_records(execution.stdout, marker):
        if "loaded" in record and loaded is None:
            loaded = record
        elif isinstance(record.get("test"), int) and isinstance(record.get("call"), int):
            first.setdefault((record["test"], record["call"]), record)  # the first one counts
    per_test = []
    for i, test_calls in enumerate(calls):
        answered = []
        while (i, len(answered)) in first and len(answered) < len(test_calls):
            answered.append(checked_answer(first[(i, len(answered))]))
        per_test.append(answered)
    ok = bool(loaded and loaded.get("loaded") is True)
    error = "" if ok else str((loaded or {}).get("error") or "")
    return Answers(ok, error, per_test), execution
