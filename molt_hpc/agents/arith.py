"""A safe arithmetic evaluator for tool environments: numbers, + - * / // % ** and parentheses.

Model-written text is parsed into a Python AST and only number literals, the arithmetic operators
and unary signs are walked; anything else (names, calls, attributes) is refused. It never calls
`eval`. Results are exact `Fraction`s (a non-integer power falls back to float), and sizes are
bounded so `9**9**9` or a 10,000-digit literal is refused instead of hanging the process.
`calculate` is the calculator tool both calculator envs offer: the value as text, or the error;
`CALCULATOR_TOOL` is its OpenAI tool schema (chat mode, and the tool-calling demonstrations of
`data/make_datasets.py`).
"""

import ast
import math
import operator
from fractions import Fraction

MAX_CHARS = 200
MAX_EXPONENT = 64
MAX_BITS = 4096

Number = Fraction | float
CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12 * (3 + 4)"}},
            "required": ["expression"],
        },
    },
}

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


class ArithError(ValueError):
    """The expression is not plain arithmetic, or its value is undefined or too large."""


def evaluate(expr: str) -> Number:
    """The value of `expr` (`^` is read as a power, as people write it)."""
    text = expr.strip().replace("^", "**").replace("×", "*").replace("÷", "/").replace("−", "-")
    if not text:
        raise ArithError("empty expression")
    if len(text) > MAX_CHARS:
        raise ArithError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:  # malformed input is an answer, not a crash
        raise ArithError(f"not an arithmetic expression: {type(err).__name__}") from None
    return _walk(tree.body, text)


def format_value(value: Number) -> str:
    """A result as text: integers plainly, other fractions as `a/b`, floats as repr."""
    if isinstance(value, Fraction):
        return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"
    return repr(value)


def calculate(expression: str) -> str:
    """The calculator tool: the value of `expression` as text, or `error: ...` (the model reads it and goes on)."""
    try:
        return format_value(evaluate(expression))
    except ArithError as err:
        return f"error: {err}"


def _check_size(value: Number) -> Number:
    if isinstance(value, Fraction) and max(value.numerator.bit_length(), value.denominator.bit_length()) > MAX_BITS:
        raise ArithError("value too large")
    if isinstance(value, float) and not math.isfinite(value):
        raise ArithError("value is not finite")
    return value


def _walk(node: ast.AST, text: str) -> Number:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        literal = ast.get_source_segment(text, node) or repr(node.value)
        if len(literal) > 60:
            raise ArithError("number literal too long")
        return _check_size(Fraction(literal.replace("_", "")))  # exact: 0.1 is 1/10
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        value = _walk(node.operand, text)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        return _power(_walk(node.left, text), _walk(node.right, text))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _walk(node.left, text), _walk(node.right, text)
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
            raise ArithError("division by zero")
        return _check_size(_BINARY[type(node.op)](left, right))
    raise ArithError(f"unsupported element {type(node).__name__}")


def _power(base: Number, exp: Number) -> Number:
    if abs(exp) > MAX_EXPONENT:
        raise ArithError(f"exponent beyond ±{MAX_EXPONENT}")
    if isinstance(exp, Fraction) and exp.denominator == 1:
        if base == 0 and exp < 0:
            raise ArithError("division by zero")
        return _check_size(Fraction(base) ** int(exp))
    if base < 0:
        raise ArithError("fractional power of a negative number")
    try:
        return _check_size(float(base) ** float(exp))
    except OverflowError:
        raise ArithError("value too large") from None
