"""The graders of the shipped tasks: string reversal (`reverse_reward`), and the math grader, which finds
the final answer in a reply and checks it against the label with `math-verify` (Hugging Face's answer
verifier: LaTeX and plain expressions parsed to sympy, equivalence by value and by simplification, sets,
intervals, matrices, equations).

What this module does itself, because the library does not:
- **Finding the answer.** An answer is written as `<answer>…</answer>`, `\\boxed{…}` or `\\fbox{…}` (braces
  may nest); with several answers **the last one counts** (the model's final word; hedging gains nothing).
  No answer, or an empty one, scores 0 and is counted as missing. The library knows `\\boxed` but not the
  `<answer>` tag, nor the last-answer rule across both forms. The scan is linear in the reply's length.
- **Plain-number forms the LaTeX parser misreads:** `1e5` / `2.5E-3` (read as `1·e·5`) and `3.` are
  rewritten as `1\\times10^{5}`, `2.5\\times10^{-3}`, `3` before parsing, so `1e5 == 100000`.
- **Text labels** (`Paris`) match case-insensitively, whitespace collapsed, before any parsing.
- **A number answers a number.** When the label is a plain number (`7`, `-0.5`, `1e5`, `3/4`), an answer
  that is arithmetic (`3+4`, `2*21`, `2^{10}`, `10!`, `\\sqrt{49}`) scores 0 without being evaluated:
  the arithmetic prompts ask for the result, and copying the question (`Compute 9 + 20` →
  `9 + 20`) must not earn it. Scientific notation (`1e5`, `1 \\times 10^{5}`), fractions (`1/2`,
  `\\frac{1}{2}`), signs, units and percent stay numbers. Labels that are expressions compare by
  equivalence as the library does.
- **Bounded work.** An answer over `MAX_ANSWER_CHARS` scores 0 unparsed (a 10 MB reply costs one linear
  scan), and a parsed answer whose value may have over `MAX_DIGITS` digits (`9^{9^{9^9}}`, `(10^{10})!`,
  `x^{9^{99}}`: bounded from the parse tree, never evaluated) scores 0 before the library compares it.
  The library's own timeout is `signal.alarm`, which works only in a main thread; envs run in worker
  threads, so it is off here, and `rollout.env_timeout_s` bounds what gets past these checks (the env
  worker running it is killed; only that sample fails).

The library's rules hold otherwise (tested in `tests/test_envs_math.py`): numbers by value (`3 == 3.0`,
`1/2 == 0.5 == \\frac{1}{2}`, `1,000 == 1000`), expressions by equivalence (`x^2+1 == 1+x^2`, `x = 7 == 7`),
`50\\% == 0.5`, units in `\\text{…}` ignored, `0.333 != 1/3` (6 significant decimals compared).
The grader sees text decoded with special tokens skipped, so special tokens cannot spell an answer.
"""

import logging
import math
import re
from functools import lru_cache
from typing import Any

TAG_RE = re.compile(r"<answer>|</answer>")
BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
BRACE_RE = re.compile(r"[{}]")
SCI_RE = re.compile(r"([+-]?(?:\d+\.?\d*|\.\d+))[eE]([+-]?\d{1,3})")
TRAILING_DOT_RE = re.compile(r"([+-]?\d+)\.")
NUMBER_RE = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?(?:/[+-]?\d+)?")
LATEX_SCI_RE = re.compile(r"(?:\\times|\\cdot|\*)\s*10\s*\^\s*(?:\{\s*[+\-−]?\d+\s*\}|[+\-−]?\d+)")
# an operator of arithmetic: + * ^ ! \times \cdot \sqrt, or a minus between two operands
ARITHMETIC_RE = re.compile(r"[+*^!]|\\times|\\cdot|\\sqrt|(?<=[\w)}])\s*[-−]\s*(?=[\w(\\{])")
# The library warns once that its signal timeout is off; here that is by design (see above).
logging.getLogger("math_verify").setLevel(logging.ERROR)
MAX_ANSWER_CHARS = 1000
"""Longer answers score 0 without parsing."""
MAX_DIGITS = 100_000
"""Answers whose value may have more decimal digits than this score 0 unevaluated (`_digits`)."""


def _closing_braces(text: str) -> dict[int, int]:
    """Index of the matching `}` of every `{` in `text` that has one: one pass with a stack."""
    closes: dict[int, int] = {}
    stack: list[int] = []
    for m in BRACE_RE.finditer(text):
        if m.group() == "{":
            stack.append(m.start())
        elif stack:
            closes[stack.pop()] = m.start()
    return closes


def extract_answers(text: str) -> list[str]:
    """Every answer in `text`, in order of where it starts (a tag spans from its first `<answer>` to the
    next `</answer>`)."""
    found: list[tuple[int, str]] = []
    opened = -1
    for m in TAG_RE.finditer(text):
        if m.group() == "<answer>":
            opened = m.end() if opened < 0 else opened
        elif opened >= 0:
            found.append((opened, text[opened : m.start()]))
            opened = -1
    boxes = list(BOX_RE.finditer(text))
    closes = _closing_braces(text) if boxes else {}
    for m in boxes:
        end = closes.get(m.end() - 1)
        if end is not None:
            found.append((m.start(), text[m.end() : end]))
    return [answer for _, answer in sorted(found, key=lambda item: item[0])]


def _plain_numbers(answer: str) -> str:
    """`1e5`, `2.5E-3`, `3.` written as LaTeX numbers the parser reads as such."""
    text = answer.strip().strip("$").strip()
    if m := SCI_RE.fullmatch(text):
        return f"{m.group(1)}\\times10^{{{m.group(2)}}}"
    if m := TRAILING_DOT_RE.fullmatch(text):
        return m.group(1)
    return text


def _digits(expr: Any) -> float:
    """An upper bound on the decimal digits of a parsed answer's constant parts once evaluated (inf when
    too large to bound cheaply): what sympy may have to compute when it compares it."""
    from sympy import Integer, Pow, Rational, factorial

    if isinstance(expr, Rational):  # integers too
        return len(str(abs(expr.p))) + (len(str(expr.q)) if not isinstance(expr, Integer) else 0)
    if isinstance(expr, Pow) and not expr.exp.free_symbols:
        exp_digits = _digits(expr.exp)
        return math.inf if exp_digits > 6 else _digits(expr.base) * 10**exp_digits + exp_digits
    if isinstance(expr, factorial) and not expr.args[0].free_symbols:
        arg_digits = _digits(expr.args[0])
        return math.inf if arg_digits > 5 else arg_digits * 10**arg_digits
    return 1 + sum(_digits(arg) for arg in getattr(expr, "args", ()))


def _explodes(expr: Any) -> bool:
    """Whether comparing a parsed answer could take unbounded time (`9^{9^{9^9}}`, `(10^{10})!`)."""
    from sympy import Basic

    return isinstance(expr, Basic) and _digits(expr) > MAX_DIGITS


@lru_cache(maxsize=4096)
def _parse(answer: str) -> tuple:
    """math-verify's parse of one answer (LaTeX first, then a plain expression), cached: labels repeat."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    configs = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    return tuple(parse(f"\\boxed{{{_plain_numbers(answer)}}}", configs, parsing_timeout=None))


def parse_cache_clear() -> None:
    """Forget the parsed answers and labels (benchmarks time parsing afresh)."""
    _parse.cache_clear()


def _text(value: str) -> str:
    return " ".join(value.split()).casefold()


def _is_number(label: str) -> bool:
    """Whether a label is a plain number (`7`, `-0.5`, `1,000`, `1e5`, `3/4`)."""
    return bool(NUMBER_RE.fullmatch(label.strip().replace(",", "")))


def _is_arithmetic(answer: str) -> bool:
    """Whether an answer computes something rather than states a number (see the module docstring)."""
    text = SCI_RE.sub("0", LATEX_SCI_RE.sub("", answer)).strip().strip("$").strip()
    return bool(ARITHMETIC_RE.search(text.lstrip("+-−").lstrip()))


def answer_matches(answer: str, label: Any) -> bool:
    """Whether one extracted answer equals the label (as text, else by math-verify's equivalence)."""
    from math_verify import verify

    want = str(label)
    if len(answer) > MAX_ANSWER_CHARS or len(want) > MAX_ANSWER_CHARS:
        return False
    if _text(answer) and _text(answer) == _text(want):
        return True
    if _is_number(want) and _is_arithmetic(answer):
        return False
    got, gold = _parse(answer), _parse(want)
    if not got or not gold or any(_explodes(e) for e in (*got, *gold)):
        return False
    return verify(list(gold), list(got), timeout_seconds=None)


def grade(text: str, label: Any) -> tuple[float, dict[str, float]]:
    """(score in {0, 1}, info) for a reply; info counts `answers`, `missing_answer` and `correct`."""
    answers = extract_answers(text)
    final = answers[-1].strip() if answers else ""
    missing = not final
    correct = (not missing) and answer_matches(final, label)
    info = {"answers": float(len(answers)), "missing_answer": float(missing), "correct": float(correct)}
    return float(correct), info


def reverse_reward(answer: str, label: str) -> float:
    """Matching positions of `answer` against `label`, divided by the longer length (0 for empty)."""
    answer = answer.strip()
    longest = max(len(answer), len(label))
    if longest == 0:
        return 0.0
    return sum(a == b for a, b in zip(answer, label, strict=False)) / longest
