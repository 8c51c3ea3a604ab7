"""Built-in tools: a calculator, a Python interpreter in rl_tpu's sandbox, and document search.

calculator  safe arithmetic: numbers, + - * / // % **, parentheses, unary signs, and the
            functions abs, round, min, max, sqrt. The expression is parsed (ast) and walked,
            never eval'd; exponents and results are bounded so `9**9**9` is an error, not a
            frozen worker.
python      runs the code in a fresh sandbox (`rl_tpu.sandbox`: bubblewrap, or
            unsafe_no_isolation where bwrap cannot run) and returns what it printed, its
            stderr and how it ended.
search      top-k passages of a BM25 index (the search env's retriever, rl_tpu/envs/search.py).
"""

from __future__ import annotations

import ast
import math
import operator

from rl_tpu.tools.registry import Tool

MAX_EXPRESSION_CHARS = 500
MAX_EXPONENT = 1000
MAX_MAGNITUDE = 1e100

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS = {"abs": abs, "round": round, "min": min, "max": max, "sqrt": math.sqrt}


def evaluate_arithmetic(expression: str) -> float | int:
    """The value of an arithmetic expression. Raises ValueError saying what is not allowed
    or why it has no value (division by zero, a too large number)."""
    if not isinstance(expression, str) or not expression.strip():
        raise ValueError("the expression is empty")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is {len(expression)} characters; the most is "
                         f"{MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(expression.strip().replace("^", "**"), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression ({e.msg})") from None
    return _value(tree.body)


def _value(node: ast.AST) -> float | int:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        raise ValueError(f"only numbers are allowed, not {node.value!r}")
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"the exponent {right} is too large (at most {MAX_EXPONENT})")
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        try:
            out = _BINARY[type(node.op)](left, right)
        except OverflowError:
            raise ValueError("the result is too large") from None
        return _bounded(out)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
        function = _FUNCTIONS.get(node.func.id)
        if function is None:
            raise ValueError(f"unknown function {node.func.id!r}; allowed: "
                             f"{', '.join(_FUNCTIONS)}")
        args = [_value(a) for a in node.args]
        try:
            return _bounded(function(*args))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{node.func.id}: {e}") from None
    raise ValueError(f"{type(node).__name__} is not allowed; use numbers, + - * / // % **, "
                     f"parentheses and {', '.join(_FUNCTIONS)}")


def _bounded(value):
    if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
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
    from rl_tpu.sandbox import Limits, shared_sandbox

    def python(code: str) -> str:
        return execution_text(shared_sandbox(mode, limits or Limits(), pool_size).run(code))

    return Tool("python", "Run a Python 3 program and get what it prints (stdout, stderr). "
                "Each call starts fresh: nothing persists between calls. Print the values "
                "you need.", {"type": "object", "properties": {"code": {
                    "type": "string", "description": "the complete program"}},
                    "required": ["code"]}, python)


def search_tool(index, top_k: int = 3, max_passage_chars: int = 600,
                name: str = "search") -> Tool:
    """Search over `index` (an object with `search(query, k) -> [(passage dict, score)]`,
    e.g. `rl_tpu.envs.search.BM25Index`): the top-k passages as `[k] Title: text` lines."""
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")

    def search(query: str) -> str:
        if not query.strip():
            raise ValueError("the query is empty")
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

