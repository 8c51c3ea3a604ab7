"""Built-in tools: a calculator, a Python interpreter in rl_tpu's sandbox, and document search.

calculator  safe arithmetic: numbers, + - * / // % **, parentheses, unary signs, and the
            functions abs, round, min, max, sqrt. The expression is parsed (ast) and walked,
            never eval'd; every argument of every operation is bounded (the comment at
            MAX_NESTING) so no call is slow: `9**9**9` or `round(5, -10**9)` is an error, not a
            frozen worker.
python      runs the code in a fresh sandbox (`rl_tpu.sandbox`: bubblewrap, or
            unsafe_no_isolation where bwrap cannot run) and returns what it printed, its
            stderr and how it ended.
search      top-k passages of a BM25 index (the search env's retriever, rl_tpu/envs/search.py).

How each is stopped: the calculator and search run in the caller's thread, which nothing can
stop, so their arguments are bounded (the calculator's above, a query of at most
MAX_QUERY_CHARS: BM25's cost is its query terms times their postings); python runs in a
sandbox process that is killed at its wall limit, and a run stopped by a time limit is a
TimeoutError, which the registry turns into an error result for the model.
"""

from __future__ import annotations

import ast
import math
import operator

from rl_tpu.sandbox import Limits, shared_sandbox
from rl_tpu.tools.registry import Tool

MAX_EXPRESSION_CHARS = 500
MAX_NESTING = 100
MAX_MAGNITUDE = 1e100
MAX_EXPONENT = 1000
MAX_ROUND_DIGITS = 100
MAX_QUERY_CHARS = 500
# A tool call runs in an env worker thread that a step timeout can abandon but never stop, so
# the calculator's cost is bounded by its arguments, not by a deadline: every number it meets
# (a literal, an operand, a function's argument, a result) is finite and at most MAX_MAGNITUDE
# (an int of at most 333 bits: + - * / // % on two of them cost nothing), an expression is at
# most MAX_EXPRESSION_CHARS (literals of at most 500 digits, far below Python's int-parsing
# limit) nested at most MAX_NESTING deep, `**` is refused before it runs when its result would
# pass MAX_MAGNITUDE, and round's ndigits is at most MAX_ROUND_DIGITS (round(5, -10**9) would
# compute 10**(10**9)). There are no shifts, factorials or string conversions to bound.

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
# name -> (function, fewest arguments, most arguments)
_FUNCTIONS = {"abs": (abs, 1, 1), "round": (round, 1, 2), "min": (min, 1, 64),
              "max": (max, 1, 64), "sqrt": (math.sqrt, 1, 1)}


def evaluate_arithmetic(expression: str) -> float | int:
    """The value of an arithmetic expression. Raises ValueError saying what is not allowed
    or why it has no value (division by zero, a too large number, a bound above)."""
    if not isinstance(expression, str) or not expression.strip():
        raise ValueError("the expression is empty")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is {len(expression)} characters; the most is "
                         f"{MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(expression.strip().replace("^", "**"), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        # ValueError: a NUL or an unpaired surrogate; the others: nesting past the parser's own
        # limits (the expression is short, so these are its shape, not its size)
        raise ValueError(f"not an arithmetic expression "
                         f"({getattr(e, 'msg', None) or type(e).__name__})") from None
    return _value(tree.body, 1)


def _value(node: ast.AST, depth: int) -> float | int:
    if depth > MAX_NESTING:
        raise ValueError(f"the expression nests more than {MAX_NESTING} levels deep; split it "
                         "into several calls")
    if isinstance(node, ast.Constant):
        if isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return _bounded(node.value)
        raise ValueError(f"only numbers are allowed, not {node.value!r}")
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left, depth + 1), _value(node.right, depth + 1)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        try:
            out = _BINARY[type(node.op)](left, right)
        except OverflowError:
            raise ValueError("the result is too large") from None
        except ZeroDivisionError:  # 0 ** -1
            raise ValueError("division by zero (zero to a negative power)") from None
        return _bounded(out)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_value(node.operand, depth + 1)))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
        if node.func.id not in _FUNCTIONS:
            raise ValueError(f"unknown function {node.func.id!r}; allowed: "
                             f"{', '.join(_FUNCTIONS)}")
        function, fewest, most = _FUNCTIONS[node.func.id]
        if not fewest <= len(node.args) <= most:
            raise ValueError(f"{node.func.id} takes {fewest} to {most} arguments, got "
                             f"{len(node.args)}" if fewest < most else
                             f"{node.func.id} takes {fewest} argument, got {len(node.args)}")
        args = [_value(a, depth + 1) for a in node.args]
        if node.func.id == "round" and len(args) == 2:
            _check_round_digits(args[1])
        try:
            return _bounded(function(*args))
        except (TypeError, ValueError, OverflowError) as e:
            raise ValueError(f"{node.func.id}: {e}") from None
    raise ValueError(f"{type(node).__name__} is not allowed; use numbers, + - * / // % **, "
                     f"parentheses and {', '.join(_FUNCTIONS)}")


def _check_power(base, exponent) -> None:
    """Refuses `base ** exponent` before it runs when it would be slow or too large: an int
    power is exact, so its cost grows with its size (a float's is constant, and overflow is an
    OverflowError)."""
    if abs(exponent) > MAX_EXPONENT:
        raise ValueError(f"the exponent {format_number(exponent)} is too large "
                         f"(at most {MAX_EXPONENT})")
    if isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1 and exponent > 0:
        # |base| ** exponent > MAX_MAGNITUDE exactly when exponent * log10|base| is past its log
        if exponent * math.log10(abs(base)) > math.log10(MAX_MAGNITUDE) + 1e-9:
            raise ValueError(f"the result is too large (more than {MAX_MAGNITUDE:g})")


def _check_round_digits(ndigits) -> None:
    if not isinstance(ndigits, int):
        raise ValueError(f"round: ndigits must be an integer, got {format_number(ndigits)}")
    if abs(ndigits) > MAX_ROUND_DIGITS:
        raise ValueError(f"round: ndigits {ndigits} is out of range (at most "
                         f"{MAX_ROUND_DIGITS} either way)")


def _bounded(value):
    if isinstance(value, complex) or not abs(value) <= MAX_MAGNITUDE:  # nan fails <= too
        raise ValueError("the result is too large or not a real number")
    return value


def format_number(value: float | int) -> str:
    """An int as it is; a float with 12 significant digits (an integral float as an int)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value) if isinstance(value, int) else format(value, ".12g")


def calculator_tool() -> Tool:
    def calculator(expression: str) -> str:
        return format_number(evaluate_arithmetic(expression))

    return Tool("calculator", "Evaluate an arithmetic expression, e.g. (3 + 4) * 2 / 7 or "
                "sqrt(2) ** 2.", {"type": "object", "properties": {"expression": {
                    "type": "string", "description": "numbers, + - * / // % **, parentheses, "
                    "abs, round, min, max, sqrt"}}, "required": ["expression"]}, calculator)


def execution_text(execution) -> str:
    """What a model reads of a run: its stdout, then its stderr and ending when not clean."""
    parts = [execution.stdout]
    if execution.stderr:
        parts.append(f"[stderr]\n{execution.stderr}")
    if execution.status != "ok":
        parts.append(f"[{execution.status}, exit code {execution.exit_code}]")
    text = "\n".join(p.rstrip("\n") for p in parts if p)
    return text or "[no output]"


def python_tool(mode: str = "bubblewrap", limits=None, pool_size: int = 2) -> Tool:
    """The python tool; `mode`, `limits` and `pool_size` as `rl_tpu.sandbox.make_sandbox`'s.
    Its runs share the process's sandbox pool for those settings (`shared_sandbox`), made on
    the first call: a registry whose model never runs code starts none, and the episodes of a
    step do not each warm a pool of their own."""
    def python(code: str) -> str:
        execution = shared_sandbox(mode, limits or Limits(), pool_size).run(code)
        if execution.status in ("timeout", "cpu_limit"):
            # the sandbox killed it at the limit; the model reads an error, with what the
            # program printed before, and the episode goes on
            limit = "wall-clock" if execution.status == "timeout" else "CPU"
            raise TimeoutError(f"the program ran past its {limit} time limit and was stopped; "
                               f"what it wrote before:\n{execution_text(execution)}")
        return execution_text(execution)

    return Tool("python", "Run a Python 3 program and get what it prints (stdout, stderr). "
                "Each call starts fresh: nothing persists between calls. Print the values "
                "you need.", {"type": "object", "properties": {"code": {
                    "type": "string", "description": "the complete program"}},
                    "required": ["code"]}, python)


def search_tool(index, top_k: int = 3, max_passage_chars: int = 600,
                name: str = "search", max_query_chars: int = MAX_QUERY_CHARS) -> Tool:
    """Search over `index` (an object with `search(query, k) -> [(passage dict, score)]`,
    e.g. `rl_tpu.envs.search.BM25Index`): the top-k passages as `[k] Title: text` lines.
    A query longer than `max_query_chars` is an error (the module docstring says why)."""
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")

    def search(query: str) -> str:
        if not query.strip():
            raise ValueError("the query is empty")
        if len(query) > max_query_chars:
            raise ValueError(f"the query is {len(query)} characters; the most is "
                             f"{max_query_chars} (name what you look for in a few words)")
        hits = index.search(query, top_k)
        if not hits:
            return f"No passages match {query!r}. Try the exact name of an entity."
        lines = []
        for rank, (passage, _) in enumerate(hits, 1):
            text = passage["text"]
            if len(text) > max_passage_chars:
                text = text[:max_passage_chars] + " ..."
            title = passage.get("title")
            lines.append(f"[{rank}] {title}: {text}" if title else f"[{rank}] {text}")
        return "\n".join(lines)

    return Tool(name, "Search the document collection; returns the best matching passages.",
                {"type": "object", "properties": {"query": {
                    "type": "string", "description": "what to look for, e.g. an entity's name"}},
                 "required": ["query"]}, search)


def builtin_tools(names, python_mode: str = "bubblewrap", search_index=None,
                  top_k: int = 3) -> list[Tool]:
    """Built-in tools by name ("calculator", "python", "search": the last needs
    `search_index`)."""
    out: list[Tool] = []
    for name in names:
        if name == "calculator":
            out.append(calculator_tool())
        elif name == "python":
            out.append(python_tool(python_mode))
        elif name == "search":
            if search_index is None:
                raise ValueError("the search tool needs a search_index (e.g. the search env's "
                                 "BM25Index)")
            out.append(search_tool(search_index, top_k))
        else:
            raise ValueError(f"unknown built-in tool {name!r}; built-ins: calculator, python, "
                             "search")
    return out

