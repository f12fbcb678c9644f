"""Math grading throughput: the hand-written grader molt-hpc shipped before (kept here, verbatim, as
`OldGrader`) against `molt_hpc.agents.grading.grade` (math-verify), on the same replies in the same run.

Replies are built from `data/math_train.jsonl`'s labels in the forms a model writes: a correct plain
answer in tags, a correct one in `\\boxed{}` as an unreduced fraction or as a decimal, a wrong one, a
reply with no answer, and a long reply of reasoning ending in a boxed answer. Each grader grades every
reply `--repeats` times (math-verify's parse cache is cleared before each pass, so labels are parsed
again as they are for new rows); the table gives answers per second, and how often the two agree.

    python bench/grading.py [--rows 300 --repeats 3]
"""

import argparse
import json
import math
import re
import statistics
import sys
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


# ---- the previous grader: regular expressions and `Fraction`s, numbers only (expressions refused) ----
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


def old_grade(text: str, label: Any) -> tuple[float, dict[str, float]]:
    """(score in {0, 1}, info) for a reply; info counts `answers`, `missing_answer` and `correct`."""
    answers = extract_answers(text)
    final = answers[-1].strip() if answers else ""
    missing = not final
    correct = (not missing) and answer_matches(final, label)
    info = {"answers": float(len(answers)), "missing_answer": float(missing), "correct": float(correct)}
    return float(correct), info


# ---- the bench ----------------------------------------------------------------------------------------
def replies(rows: int) -> list[tuple[str, str]]:
    """(reply, label) pairs in the forms a model writes, six per row."""
    out = []
    with open(ROOT / "data" / "math_train.jsonl", encoding="utf-8") as f:
        labels = [json.loads(line)["label"] for line in f][:rows]
    for label in labels:
        value = Fraction(label)
        out += [
            (f"<answer>{label}</answer>", label),
            (rf"so the total is \boxed{{\frac{{{2 * value.numerator}}}{{{2 * value.denominator}}}}}", label),
            (f"<answer>{float(value)!r}</answer>", label),
            (f"<answer>{value + 1}</answer>", label),
            ("I think the answer is " + label, label),
            ("First add the tens, then the units. " * 8 + rf"\boxed{{{label}}}", label),
        ]
    return out


def rate(fn, pairs: list[tuple[str, str]], repeats: int, clear=None) -> tuple[float, list[float]]:
    """(answers per second, the scores of the last pass)."""
    times = []
    for _ in range(repeats):
        if clear is not None:
            clear()
        t0 = time.perf_counter()
        scores = [fn(reply, label)[0] for reply, label in pairs]
        times.append(time.perf_counter() - t0)
    return len(pairs) / statistics.median(times), scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from molt_hpc.agents import grading

    pairs = replies(args.rows)
    grading.grade("<answer>1</answer>", "1")  # imports sympy and math-verify outside the clock
    old_rate, old_scores = rate(old_grade, pairs, args.repeats)
    new_rate, new_scores = rate(grading.grade, pairs, args.repeats, clear=grading.parse_cache_clear)
    agree = sum(a == b for a, b in zip(old_scores, new_scores, strict=True)) / len(pairs)
    print(f"{len(pairs)} replies, median of {args.repeats} passes")
    print(f"{'grader':<28} {'answers/s':>10} {'mean score':>11}")
    print(f"{'old (regex + Fraction)':<28} {old_rate:>10.0f} {statistics.fmean(old_scores):>11.3f}")
    print(f"{'new (math-verify)':<28} {new_rate:>10.0f} {statistics.fmean(new_scores):>11.3f}")
    print(f"new / old: {new_rate / old_rate:.3f}; the two agree on {agree:.1%} of replies")


if __name__ == "__main__":
    main()
