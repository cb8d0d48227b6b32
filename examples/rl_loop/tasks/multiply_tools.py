"""The calculator tool of `multiply.py`'s task, written as a user writes a tool: a function
with type hints and a docstring (its JSON schema, what the model is shown, comes from them),
stateless, returning text.

    tools.funcs=[examples/rl_loop/tasks/multiply_tools.py:calculator]

The expression is parsed with `ast` and only numbers, + - * / // % ** and parentheses are
evaluated (never `eval`): anything else is refused with a ValueError, which the tool
service turns into an error observation for the model.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from fractions import Fraction

MAX_LENGTH = 200  # characters of an expression
MAX_EXPONENT = 64  # the largest power a ** b may take
MAX_DIGITS = 100  # digits of any intermediate result

_BINARY: dict[type, Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
}
_UNARY: dict[type, Callable[[Fraction], Fraction]] = {ast.UAdd: operator.pos,
                                                      ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly and return its value.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "123*456"
    """
    if len(expression) > MAX_LENGTH:
        raise ValueError(f"the expression is over {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"not an arithmetic expression: {expression!r} ({err.msg})") from None
    value = _value(tree.body)
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.12g}"


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        base, exponent = _value(node.left), _value(node.right)
        if exponent.denominator != 1 or abs(exponent) > MAX_EXPONENT:
            raise ValueError(f"powers take whole exponents up to {MAX_EXPONENT}")
        if base == 0 and exponent < 0:
            raise ZeroDivisionError("0 to a negative power")
        return _bounded(base ** int(exponent))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if right == 0 and type(node.op) in (ast.Div, ast.FloorDiv, ast.Mod):
            raise ZeroDivisionError("division by zero")
        return _bounded(Fraction(_BINARY[type(node.op)](left, right)))
    raise ValueError(f"{ast.unparse(node)!r} is not arithmetic: use numbers, + - * / // % ** "
                     "and parentheses")


def _bounded(value: Fraction) -> Fraction:
    if max(len(str(abs(value.numerator))), len(str(value.denominator))) > MAX_DIGITS:
        raise ValueError(f"a result of over {MAX_DIGITS} digits")
    return value
