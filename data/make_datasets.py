"""Write the small shipped datasets, deterministically: `python data/make_datasets.py [OUT_DIR]`.

- `reverse_train.jsonl` / `reverse_eval.jsonl`: reverse a string of 2-4 letters drawn uniformly
  from `REVERSE_ALPHABET` (length uniform too); the eval strings are distinct and never appear in
  the training file.
- `math_train.jsonl`: synthetic integer arithmetic (`+ - *`, and `/` with exact fraction labels),
  answers expected in `<answer>…</answer>`.
- `reverse_sft_train.jsonl` / `reverse_sft_eval.jsonl`: the same strings as chat demonstrations
  (`{"messages": [user "Reverse: abc", assistant "cba"]}`), for `molt-hpc sft`.
- `reverse_prefs_train.jsonl` / `reverse_prefs_eval.jsonl`: preference pairs for `molt-hpc rm train`:
  the right reversal is chosen, a near miss rejected (the string unreversed, one letter changed, two
  neighbours swapped, a letter dropped or one added: the mistakes a policy learning the task makes).
  Every kind of near miss once per string (a tiny reward model only learns to compare the two orders
  of the letters when it meets them side by side for the same prompt).
- `calculator_sft_train.jsonl` / `calculator_sft_eval.jsonl`: demonstrations of the calculator task for
  `molt-hpc sft` (`configs/tiny_calculator_sft.toml`), half in env mode's form (`<calc>expr</calc>`, the
  `<result>` turn, `<answer>`) and half in chat mode's (the calculator offered as a tool, a `tool_calls`
  reply, the `tool` message, `<answer>`), the results written by the calculator itself; the expressions
  (`+ - *`) are never those of `math_train.jsonl` (the RL prompts), and the eval ones never the train ones.
- `color_train.jsonl` / `color_eval.jsonl` + `shapes/*.png`: "What colour is the shape?" over 56 x 56
  PNGs of a red, green or blue circle, square or triangle (`molt_hpc.agents.shapes`), `COLOR_VARIANTS`
  jittered drawings of each for training and `COLOR_EVAL_VARIANTS` other ones for evaluation; the image
  paths are relative to the data file.

Every row has a stable `id`. Re-running writes byte-identical files (the PNGs: with the same Pillow).
"""

import itertools
import json
import random
import sys
from fractions import Fraction
from pathlib import Path

REVERSE_ALPHABET = "abcd"
REVERSE_LENGTHS = (2, 3, 4)
REVERSE_TRAIN_ROWS = 1024
REVERSE_EVAL_PER_LENGTH = {2: 4, 3: 12, 4: 16}
MATH_ROWS = 300
CALC_SFT_ROWS = {"train": 1024, "eval": 64}
COLOR_VARIANTS = 8
COLOR_EVAL_VARIANTS = 4
COLOR_QUESTION = "What colour is the shape?"
SEED = 20240601


def reverse_rows(rng: random.Random) -> tuple[list[dict], list[dict]]:
    eval_strings: list[str] = []
    for length, count in REVERSE_EVAL_PER_LENGTH.items():
        every = ["".join(p) for p in itertools.product(REVERSE_ALPHABET, repeat=length)]
        eval_strings += rng.sample(every, count)
    held_out = set(eval_strings)
    train_strings: list[str] = []
    while len(train_strings) < REVERSE_TRAIN_ROWS:
        length = rng.choice(REVERSE_LENGTHS)
        text = "".join(rng.choice(REVERSE_ALPHABET) for _ in range(length))
        if text not in held_out:  # keep evaluation a test of the skill, not of memory
            train_strings.append(text)

    def row(kind: str, i: int, text: str) -> dict:
        return {"id": f"reverse-{kind}-{i:05d}", "prompt": f"Reverse: {text}", "label": text[::-1]}

    return [row("train", i, s) for i, s in enumerate(train_strings)], [
        row("eval", i, s) for i, s in enumerate(eval_strings)
    ]


def math_rows(rng: random.Random) -> list[dict]:
    rows = []
    for i in range(MATH_ROWS):
        a, b, c = rng.randint(1, 20), rng.randint(1, 20), rng.randint(1, 9)
        kind = rng.choice(["add", "sub", "mul", "mix", "div"])
        if kind == "add":
            text, value = f"{a} + {b}", Fraction(a + b)
        elif kind == "sub":
            text, value = f"{a} - {b}", Fraction(a - b)
        elif kind == "mul":
            text, value = f"{a} * {c}", Fraction(a * c)
        elif kind == "mix":
            text, value = f"{a} + {b} * {c}", Fraction(a + b * c)
        else:
            text, value = f"{a} / {c}", Fraction(a, c)
        label = str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"
        rows.append({"id": f"math-train-{i:05d}", "prompt": math_prompt(text), "label": label})
    return rows


def math_prompt(text: str) -> str:
    # An example of the format lifts SmolLM2-135M's well-formed answers from ~2% to ~9% of samples.
    return f"Compute {text}. Write the final answer as <answer>number</answer>, e.g. <answer>12</answer>."


def calculator_demo(i: int, kind: str, text: str, chat: bool) -> dict:
    """One solved calculator episode: call the tool with the expression, answer with its result."""
    from molt_hpc.agents.arith import CALCULATOR_TOOL, calculate

    value = calculate(text)
    ask, answer = (
        {"role": "user", "content": math_prompt(text)},
        {"role": "assistant", "content": f"<answer>{value}</answer>"},
    )
    row_id = f"calculator-sft-{kind}-{i:05d}"
    if not chat:
        call = {"role": "assistant", "content": f"<calc>{text}</calc>"}
        return {"id": row_id, "messages": [ask, call, {"role": "user", "content": f"<result>{value}</result>"}, answer]}
    call = {"type": "function", "id": "call_0", "function": {"name": "calculate", "arguments": {"expression": text}}}
    return {"id": row_id, "tools": [CALCULATOR_TOOL], "messages": [
        ask, {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": value}, answer]}  # fmt: skip


def calculator_sft_rows(rng: random.Random, taken: set[str]) -> dict[str, list[dict]]:
    """Train and eval demonstrations (alternating env and chat form) over expressions not in `taken`."""
    out = {}
    for kind, n in CALC_SFT_ROWS.items():
        texts = []
        while len(texts) < n:
            a, b, c = rng.randint(1, 20), rng.randint(1, 20), rng.randint(1, 9)
            text = rng.choice([f"{a} + {b}", f"{a} - {b}", f"{a} * {c}", f"{a} + {b} * {c}"])
            if text not in taken:
                taken.add(text)
                texts.append(text)
        out[kind] = [calculator_demo(i, kind, t, chat=i % 2 == 1) for i, t in enumerate(texts)]
    return out


def sft_rows(rows: list[dict], kind: str) -> list[dict]:
    return [
        {"id": f"reverse-sft-{kind}-{i:05d}", "messages": [
            {"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["label"]}]}
        for i, r in enumerate(rows)
    ]  # fmt: skip


NEAR_MISSES = ("unreversed", "changed", "swapped", "dropped", "added")


def near_miss(answer: str, kind: str, rng: random.Random) -> str:
    """A wrong answer close to `answer` (may equal it for some strings; callers check)."""
    i = rng.randrange(len(answer))
    if kind == "unreversed":
        return answer[::-1]
    if kind == "changed":
        return answer[:i] + rng.choice([c for c in REVERSE_ALPHABET if c != answer[i]]) + answer[i + 1 :]
    if kind == "swapped":
        j = rng.randrange(len(answer) - 1)
        return answer[:j] + answer[j + 1] + answer[j] + answer[j + 2 :]
    if kind == "dropped":
        return answer[:i] + answer[i + 1 :]
    return answer[:i] + rng.choice(REVERSE_ALPHABET) + answer[i:]


def pref_rows(rows: list[dict], kind: str, rng: random.Random, every_kind: bool) -> list[dict]:
    out = []
    for r in rows:
        kinds = list(NEAR_MISSES) if every_kind else [rng.choice(NEAR_MISSES)]
        for k in kinds:
            wrong = near_miss(r["label"], k, rng)
            while wrong == r["label"]:  # a palindrome unreversed, a swap of equal letters: draw another miss
                wrong = near_miss(r["label"], rng.choice(NEAR_MISSES[1:]), rng)
            out.append({"id": f"reverse-prefs-{kind}-{len(out):05d}", "prompt": r["prompt"], "chosen": r["label"],
                        "rejected": wrong})  # fmt: skip
    return out


def color_rows(out_dir: Path, kind: str, seeds: range) -> list[dict]:
    """Write the shape PNGs of `seeds` under `out_dir/shapes/` and return the rows that show them."""
    from molt_hpc.agents.shapes import COLOURS, SHAPES, draw

    (out_dir / "shapes").mkdir(parents=True, exist_ok=True)
    rows = []
    for colour, shape, k in itertools.product(sorted(COLOURS), SHAPES, seeds):
        name = f"shapes/{colour}-{shape}-{k}.png"
        draw(colour, shape, k).save(out_dir / name, format="PNG", optimize=True)
        content = [{"type": "image"}, {"type": "text", "text": COLOR_QUESTION}]
        rows.append({"id": f"color-{kind}-{colour}-{shape}-{k}", "prompt": [{"role": "user", "content": content}],
                     "images": [name], "label": colour})  # fmt: skip
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, separators=(", ", ": ")) + "\n" for r in rows))


def main(out_dir: Path) -> None:
    rng = random.Random(SEED)
    train, evaluation = reverse_rows(rng)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(out_dir / "reverse_train.jsonl", train)
    write_jsonl(out_dir / "reverse_eval.jsonl", evaluation)
    math = math_rows(random.Random(SEED + 1))
    write_jsonl(out_dir / "math_train.jsonl", math)
    taken = {r["prompt"].removeprefix("Compute ").split(". Write")[0] for r in math}
    for kind, rows in calculator_sft_rows(random.Random(SEED + 3), taken).items():
        write_jsonl(out_dir / f"calculator_sft_{kind}.jsonl", rows)
    write_jsonl(out_dir / "reverse_sft_train.jsonl", sft_rows(train, "train"))
    write_jsonl(out_dir / "reverse_sft_eval.jsonl", sft_rows(evaluation, "eval"))
    prefs = random.Random(SEED + 2)
    write_jsonl(out_dir / "reverse_prefs_train.jsonl", pref_rows(train, "train", prefs, every_kind=True))
    write_jsonl(out_dir / "reverse_prefs_eval.jsonl", pref_rows(evaluation, "eval", prefs, every_kind=True))
    write_jsonl(out_dir / "color_train.jsonl", color_rows(out_dir, "train", range(COLOR_VARIANTS)))
    eval_seeds = range(100, 100 + COLOR_EVAL_VARIANTS)  # drawings the training rows never show
    write_jsonl(out_dir / "color_eval.jsonl", color_rows(out_dir, "eval", eval_seeds))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent)
