"""The graders of the shipped tasks: string reversal (`reverse_reward`), and the math grader, which
finds the final answer in a reply and compares it to the label numerically.

Math rules (each is tested in `tests/test_envs_math.py`):
- An answer is written as `<answer>…</answer>`, `\\boxed{…}` or `\\fbox{…}` (braces may nest).
  With several answers **the last one counts** (the model's final word; hedging with several
  answers gains nothing). No answer, or an empty one, scores 0 and is counted as missing.
- Numbers are compared by value: `3 == 3.0`, `1/2 == 0.5 == \\frac{1}{2}`, `1e5 == 100000 ==
  1\\times10^{5}`, `-\\frac{1}{2} == -0.5`, `1,000 == 1000`; decimals compare within a relative
  1e-9 (so `0.333` is not `1/3`).
- Only a number is accepted, never an expression to evaluate: `<answer>3+4</answer>` is not 7
  (otherwise copying the question would score).
- Surrounding whitespace, `$…$`, `x =` prefixes, `\\text{…}` and trailing unit words or `%` are
  ignored (`5 cm == 5`, `5\\% == 5`: a percent sign is a unit here, not a division by 100).
- A label that is not a number is compared as text, ignoring case and whitespace.
The grader sees text decoded with special tokens skipped, so special tokens cannot spell an answer.
"""

import math
import re
from fractions import Fraction
from typing import Any

TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
DECIMAL = r"(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d{1,3})?"
NUMBER_RE = re.compile(rf"[+-]?{DECIMAL}")
FRACTION_RE = re.compile(rf"([+-]?)\(?([+-]?{DECIMAL})\)?/\(?([+-]?{DECIMAL})\)?")
SCI_RE = re.compile(rf"([+-]?{DECIMAL})\*10\*\*\(?([+-]?\d{{1,3}})\)?")
THOUSANDS_RE = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
# One letter per repetition: `([A-Za-z]+\.?)+` matches the same tails but backtracks exponentially on a
# long run of letters that is not at the end (a reply's words with the spaces removed), holding the GIL.
UNIT_TAIL_RE = re.compile(r"(?:%|°|[A-Za-z]\.?|\*\*\(?[23]\)?)+$")
LATEX_DROP = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "~", "$", "\\(", "\\)", "\\[", "\\]", "\\%")
MAX_ANSWER_CHARS = 100


def _braced(text: str, open_at: int) -> tuple[str, int] | None:
    """Content of the brace group whose `{` is at `open_at`, and the index after its `}`."""
    depth = 0
    for i in range(open_at, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[open_at + 1 : i], i + 1
    return None


def extract_answers(text: str) -> list[str]:
    """Every answer in `text`, in order of where it starts."""
    found = [(m.start(), m.group(1)) for m in TAG_RE.finditer(text)]
    for m in BOX_RE.finditer(text):
        group = _braced(text, m.end() - 1)
        if group is not None:
            found.append((m.start(), group[0]))
    return [answer for _, answer in sorted(found, key=lambda item: item[0])]


def _unwrap(text: str, command: str, keep: bool) -> str:
    """Replace every `\\command{x}` by `x` (keep) or by nothing."""
    while (start := text.find(command + "{")) >= 0:
        group = _braced(text, start + len(command))
        if group is None:
            break
        text = text[:start] + (group[0] if keep else " ") + text[group[1] :]
    return text


def _fractions(text: str) -> str:
    for command in ("\\dfrac", "\\tfrac", "\\frac"):
        shorthand = re.escape(command) + r"(\d)(\d)"  # \frac12 means \frac{1}{2}
        text = re.sub(shorthand, lambda m, c=command: f"{c}{{{m.group(1)}}}{{{m.group(2)}}}", text)
        while (start := text.find(command + "{")) >= 0:
            num = _braced(text, start + len(command))
            den = _braced(text, num[1]) if num and num[1] < len(text) and text[num[1]] == "{" else None
            if num is None or den is None:
                break
            text = text[:start] + f"({num[0]})/({den[0]})" + text[den[1] :]
    return text


def normalize(answer: str) -> str:
    """An answer as a compact plain string: LaTeX wrappers, units, prefixes and spaces removed."""
    text = answer.strip()
    for command in ("\\boxed", "\\fbox"):
        text = _unwrap(text, command, keep=True)
    for command in ("\\text", "\\mathrm", "\\mbox"):
        text = _unwrap(text, command, keep=False)
    for token in LATEX_DROP:
        text = text.replace(token, " " if token == "\\%" else "")
    text = text.replace("−", "-").replace("×", "*").replace("·", "*").replace("÷", "/")
    text = text.replace("\\times", "*").replace("\\cdot", "*").replace("\\div", "/")
    text = _fractions(text).replace("^", "**").replace("{", "(").replace("}", ")")
    text = text.rsplit("=", 1)[-1]
    return "".join(text.split())


def parse_number(text: str) -> Fraction | None:
    """The value of a normalised answer that is a single number (decimal, fraction or a×10^b), else None."""
    if len(text) > MAX_ANSWER_CHARS:
        return None
    if THOUSANDS_RE.fullmatch(text):
        text = text.replace(",", "")
    candidates = [text, UNIT_TAIL_RE.sub("", text)]
    for cand in candidates:
        while cand.startswith("(") and cand.endswith(")") and cand.count("(") == 1:
            cand = cand[1:-1]
        if NUMBER_RE.fullmatch(cand):
            return Fraction(cand)
        if m := SCI_RE.fullmatch(cand):
            return Fraction(m.group(1)) * Fraction(10) ** int(m.group(2))
        if (m := FRACTION_RE.fullmatch(cand)) and Fraction(m.group(3)) != 0:
            value = Fraction(m.group(2)) / Fraction(m.group(3))
            return -value if m.group(1) == "-" else value
    return None


def numbers_equal(a: Fraction, b: Fraction) -> bool:
    return a == b or math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)


def answer_matches(answer: str, label: Any) -> bool:
    """Whether one extracted answer equals the label (numerically when both are numbers)."""
    got, want = normalize(answer), normalize(str(label))
    got_value, want_value = parse_number(got), parse_number(want)
    if want_value is not None:
        return got_value is not None and numbers_equal(got_value, want_value)
    return bool(got) and got.lower() == want.lower()


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
