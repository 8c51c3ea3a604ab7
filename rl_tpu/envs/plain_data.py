"""Plain data: the only form in which a scored program's answers leave its sandbox.

`encode(value)` turns a value built of exact builtin types (None, bool, int, float, complex,
str, bytes, and lists, tuples, sets, frozensets and dicts of them) into a tree of JSON lists,
each tagged with its type: `["int", "1f"]`, `["list", [...]]`. `decode(tree)` builds fresh
builtin objects from such a tree and nothing else: it calls no method of any object the
program made, so what comes out compares, hashes and prints as Python's own types do. A
subclass (an int whose `__eq__` is always True) is refused by `encode`, and a tree that claims
one cannot be written, since the tags name builtin types only. A tree that is malformed, too
deep or too big raises NotPlainData, never anything else.

This file imports nothing from rl_tpu and runs on any Python 3.8+: the code envs' harness
scripts carry its text into the sandbox (rl_tpu/envs/code_verdict.py), where the system's
interpreter runs them.
"""

MAX_DEPTH = 64  # deeper trees are refused: no RecursionError in whoever decodes them
MAX_ITEMS = 1_000_000  # items in one tree: bounded work however the tree was written


class NotPlainData(ValueError):
    """A value (or tree) that is not plain data, with the reason."""


_SEQUENCES = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}


def encode(value, _depth=0):
    """The tagged tree of `value`; NotPlainData names the first part that is not plain data."""
    if _depth > MAX_DEPTH:
        raise NotPlainData("the value is nested deeper than %d levels" % MAX_DEPTH)
    kind = type(value)
    if value is None:
        return ["None"]
    if kind is bool:
        return ["bool", value]
    if kind is int:
        return ["int", format(value, "x")]  # hex: no limit on digits, unlike str(int)
    if kind is float:
        return ["float", value.hex()]  # exact, nan and inf included
    if kind is complex:
        return ["complex", value.real.hex(), value.imag.hex()]
    if kind is str:
        return ["str", value]
    if kind is bytes:
        return ["bytes", value.hex()]
    if kind in (list, tuple, set, frozenset):
        return [kind.__name__, [encode(item, _depth + 1) for item in value]]
    if kind is dict:
        return ["dict", [[encode(k, _depth + 1), encode(v, _depth + 1)] for k, v in value.items()]]
    raise NotPlainData("a %s is not plain data (builtin None, bool, int, float, complex, str, "
                       "bytes, list, tuple, set, frozenset or dict)" % kind.__name__)


def decode(tree):
    """A fresh value of builtin types from a tree `encode` wrote; NotPlainData otherwise."""
    budget = [MAX_ITEMS]
    try:
        return _decode(tree, 0, budget)
    except NotPlainData:
        raise
    except (TypeError, ValueError, OverflowError, RecursionError, MemoryError) as error:
        # an unhashable set item or dict key, a malformed number, ...
        raise NotPlainData("a malformed value: %s: %s" % (type(error).__name__, error))


def _decode(tree, depth, budget):
    budget[0] -= 1
    if depth > MAX_DEPTH or budget[0] < 0:
        raise NotPlainData("the value is nested deeper than %d levels or holds more than %d "
                           "items" % (MAX_DEPTH, MAX_ITEMS))
    if type(tree) is not list or not tree or type(tree[0]) is not str:
        raise NotPlainData("a malformed value: expected a tagged list")
    tag, rest = tree[0], tree[1:]
    if tag == "None" and not rest:
        return None
    if len(rest) == 1:
        (payload,) = rest
        if tag == "bool" and type(payload) is bool:
            return payload
        if tag == "int" and type(payload) is str:
            return int(payload, 16)
        if tag == "float" and type(payload) is str:
            return float.fromhex(payload)
        if tag == "str" and type(payload) is str:
            return payload
        if tag == "bytes" and type(payload) is str:
            return bytes.fromhex(payload)
        if tag in _SEQUENCES and type(payload) is list:
            return _SEQUENCES[tag](_decode(item, depth + 1, budget) for item in payload)
        if tag == "dict" and type(payload) is list:
            pairs = {}
            for pair in payload:
                if type(pair) is not list or len(pair) != 2:
                    raise NotPlainData("a malformed value: a dict item is not a pair")
                pairs[_decode(pair[0], depth + 1, budget)] = _decode(pair[1], depth + 1, budget)
            return pairs
    if tag == "complex" and len(rest) == 2 and all(type(p) is str for p in rest):
        return complex(float.fromhex(rest[0]), float.fromhex(rest[1]))
    raise NotPlainData("a malformed value: tag %r" % (tag,)[:80])

