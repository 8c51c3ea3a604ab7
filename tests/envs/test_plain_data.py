"""The plain-data codec that carries a scored program's answers out of its sandbox: what goes
in comes out as fresh builtins; anything else, however malformed, is NotPlainData."""

import json
import math
import random

import pytest

from rl_tpu.envs.plain_data import MAX_DEPTH, NotPlainData, decode, encode


@pytest.mark.parametrize("value", [
    None, True, 0, -7, 10 ** 5000, 1.5, -0.0, float("inf"), 2 + 3j, "", "é\udc80", b"\x00\xff",
    [1, [2, (3, "x")]], (), {1, 2}, frozenset({"a"}), {"k": [1.0], (1, 2): None}, set(),
], ids=lambda value: type(value).__name__)
def test_a_value_of_builtins_comes_back_equal_and_of_its_type(value):
    back = decode(json.loads(json.dumps(encode(value))))
    assert type(back) is type(value) and back == value


def test_nan_comes_back_nan():
    assert math.isnan(decode(encode(float("nan"))))


def test_subclasses_and_objects_are_refused_by_name():
    class Anything(int):
        def __eq__(self, other):
            return True

    for value in (Anything(1), [Anything(1)], object(), {"k": lambda: 1}):
        with pytest.raises(NotPlainData, match="is not plain data"):
            encode(value)
    nested = []
    for _ in range(MAX_DEPTH + 2):
        nested = [nested]
    with pytest.raises(NotPlainData, match="deeper"):
        encode(nested)


def test_a_malformed_tree_is_not_plain_data_and_nothing_else():
    deep = ["list", []]
    for _ in range(10_000):
        deep = ["list", [deep]]
    cases = [None, [], [1], ["int"], ["int", 5], ["int", "zz"], ["Anything", "1"],
             ["set", [["list", []]]], ["dict", [[["list", []], ["None"]]]], ["dict", [[1]]],
             ["float", "1e400x"], ["bool", 1], ["None", 1], deep, ["str", ["str", "x"]]]
    rng = random.Random(0)
    atoms = ["int", "str", "list", "dict", "set", "float", "1", 1, None, True, [], "ff"]
    for _ in range(2000):  # random shapes of the tagged form
        cases.append([rng.choice(atoms) for _ in range(rng.randint(1, 3))])
    for tree in cases:
        try:
            decode(tree)
        except NotPlainData:
            pass
