"""nanochat's calculator tool, without ``eval``.

A chat model of nanochat writes ``<|python_start|>expr<|python_end|>``; its engine answers
with ``<|output_start|>str(use_calculator(expr))<|output_end|>`` when ``use_calculator``
(``nanochat/engine.py``) gives a value. :func:`evaluate` gives what that would, for the
expressions the engine accepts, but never runs Python code: the text passes the engine's own
checks (commas dropped; arithmetic characters only and no ``**``, or else the characters of
a string ``.count(...)`` call, none of the engine's dangerous words, and a ``.count(``), then
:func:`ast.parse` reads it and a small interpreter of a whitelisted node set computes it:

- ``int`` / ``float`` / ``str`` constants (adjacent string literals are one constant);
- ``+ - * / //`` between numbers, unary ``+`` / ``-`` on numbers;
- ``()``, the empty tuple (``str(())`` is ``"()"``, as the engine answers);
- ``<str>.count(<str>[, <int>[, <int>]])``.

Anything else is ``None``, as is any error of the computation (division by zero, overflow,
a syntax error) and a result whose ``str`` Python refuses (integers over 4300 digits).

Python's ``eval`` accepts some texts that pass the engine's checks but use more than this
(``...``, ``not 'a'.count('a')``, ``'ab'.upper().count('A')``, ``() + ()``): those give
``None`` here. The work is bounded: the text is at most :data:`MAX_CHARS` characters, and
with no power operator a number cannot have more digits than the text has characters.
"""

from __future__ import annotations

import ast
import operator
import warnings
from collections.abc import Callable
from typing import Any

MAX_CHARS = 10_000
_MAX_INT = 10**4300  # sys.int_info.default_max_str_digits: str() refuses longer integers

_MATH_CHARS = frozenset("0123456789*+-/.() ")
_STRING_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789'\"()._ ")
_DANGEROUS = (
    "__", "import", "exec", "eval", "compile", "open", "file", "input", "raw_input",
    "globals", "locals", "vars", "dir", "getattr", "setattr", "delattr", "hasattr",
)  # fmt: skip

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}


class _Refused(Exception):
    pass


def accepted(expr: str) -> bool:
    """Whether nanochat's ``use_calculator`` would evaluate ``expr`` at all (its checks
    before ``eval``), commas already removed."""
    if all(c in _MATH_CHARS for c in expr):
        return "**" not in expr
    if not all(c in _STRING_CHARS for c in expr):
        return False
    lower = expr.lower()
    if any(p in lower for p in _DANGEROUS):
        return False
    return ".count(" in expr


def evaluate(expr: str) -> str | None:
    """``str(use_calculator(expr))`` of nanochat's engine, or ``None`` where it gives
    ``None`` (or where this interpreter does not go: module docstring)."""
    if not isinstance(expr, str):
        return None
    expr = expr.replace(",", "")
    if len(expr) > MAX_CHARS or not accepted(expr):
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(expr.lstrip(" \t"), mode="eval")  # as eval() strips a str
        value = _run(tree.body)
        return str(value)
    except (_Refused, SyntaxError, ValueError, ArithmeticError, TypeError, MemoryError):
        return None
    except RecursionError:  # a chain of ~3000 operators: Python's eval fails on it too
        return None


def _number(value: Any) -> int | float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _Refused
    if isinstance(value, int) and not -_MAX_INT < value < _MAX_INT:
        raise _Refused
    return value


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Refused
    return value


def _run(root: ast.expr) -> Any:
    """Evaluates the whitelisted tree without recursion (a long chain of ``+`` is a deep
    tree): nodes are visited after their operands, whose values wait on a stack."""
    values: list[Any] = []
    todo: list[tuple[ast.expr, bool]] = [(root, False)]
    while todo:
        node, ready = todo.pop()
        if not ready:
            todo.append((node, True))
            todo.extend((child, False) for child in reversed(_operands(node)))
            continue
        n = len(_operands(node))
        args = values[len(values) - n :] if n else []
        del values[len(values) - n :]
        values.append(_apply(node, args))
    (value,) = values
    return value


def _operands(node: ast.expr) -> list[ast.expr]:
    """The sub-expressions ``node`` computes from, refusing every other kind of node."""
    match node:
        case ast.Constant(value=value):
            if isinstance(value, bool) or not isinstance(value, int | float | str):
                raise _Refused
            return []
        case ast.Tuple(elts=[], ctx=ast.Load()):
            return []
        case ast.BinOp(left=left, op=op, right=right) if type(op) in _BINARY:
            return [left, right]
        case ast.UnaryOp(op=op, operand=operand) if type(op) in _UNARY:
            return [operand]
        case ast.Call(
            func=ast.Attribute(value=target, attr="count", ctx=ast.Load()),
            args=args,
            keywords=[],
        ) if 1 <= len(args) <= 3 and not any(isinstance(a, ast.Starred) for a in args):
            return [target, *args]
    raise _Refused


def _apply(node: ast.expr, args: list[Any]) -> Any:
    match node:
        case ast.Constant(value=value):
            return _number(value) if not isinstance(value, str) else value
        case ast.Tuple():
            return ()
        case ast.BinOp(op=op):
            return _number(_BINARY[type(op)](_number(args[0]), _number(args[1])))
        case ast.UnaryOp(op=op):
            return _number(_UNARY[type(op)](_number(args[0])))
        case ast.Call():
            target, sub, *bounds = args
            if not isinstance(target, str) or not isinstance(sub, str):
                raise _Refused
            return target.count(sub, *(_int(b) for b in bounds))
    raise _Refused
