"""The math grader (real math-verify) and the math env: a table of answer/label cases, adversarial ones included."""

import pytest

from molt_hpc.agents import State
from molt_hpc.agents.grading import extract_answers, grade
from molt_hpc.agents.loader import load_agent
from molt_hpc.models import build_tiny_tokenizer

# (reply, label, expected score). Each line is one decision the grader documents.
CASES = [
    # the three answer forms
    ("<answer>42</answer>", "42", 1.0),
    (r"so \boxed{42}", "42", 1.0),
    (r"\fbox{42}", "42", 1.0),
    ("<answer>41</answer>", "42", 0.0),
    # numerically equal forms
    ("<answer>3.0</answer>", "3", 1.0),
    ("<answer>3</answer>", "3.0", 1.0),
    ("<answer>3.</answer>", "3", 1.0),
    ("<answer>03</answer>", "3", 1.0),
    ("<answer>1/2</answer>", "0.5", 1.0),
    ("<answer>0.5</answer>", "1/2", 1.0),
    ("<answer>.5</answer>", "1/2", 1.0),
    (r"<answer>\frac{1}{2}</answer>", "0.5", 1.0),
    (r"\boxed{\frac{1}{2}}", "1/2", 1.0),
    (r"\boxed{\dfrac{3}{4}}", "0.75", 1.0),
    (r"\boxed{\tfrac12}", "0.5", 1.0),
    (r"\boxed{\frac{2}{4}}", "1/2", 1.0),
    ("<answer>1e5</answer>", "100000", 1.0),
    ("<answer>1E5</answer>", "100000", 1.0),
    ("<answer>100000</answer>", "1e5", 1.0),
    (r"<answer>1 \times 10^{5}</answer>", "100000", 1.0),
    ("<answer>2.5e-3</answer>", "0.0025", 1.0),
    ("<answer>1,000</answer>", "1000", 1.0),
    ("<answer>1,000,000</answer>", "1e6", 1.0),
    # negative numbers
    ("<answer>-3</answer>", "-3", 1.0),
    ("<answer>−3</answer>", "-3", 1.0),
    ("<answer>(-3)</answer>", "-3", 1.0),
    ("<answer>3</answer>", "-3", 0.0),
    ("<answer>-3</answer>", "3", 0.0),
    (r"\boxed{-\frac{1}{2}}", "-0.5", 1.0),
    (r"\boxed{\frac{-1}{2}}", "-1/2", 1.0),
    (r"\boxed{\frac{1}{2}}", "-1/2", 0.0),
    # whitespace, LaTeX wrappers, prefixes, units
    ("<answer>   7 \n</answer>", "7", 1.0),
    ("<answer>$7$</answer>", "7", 1.0),
    ("<answer>x = 7</answer>", "7", 1.0),
    ("<answer>7 cm</answer>", "7", 1.0),
    (r"<answer>7\text{ apples}</answer>", "7", 1.0),
    ("<answer>7 m^2</answer>", "7", 0.0),  # an expression in m, not the number 7
    (r"<answer>50\%</answer>", "50", 1.0),
    ("<answer>50%</answer>", "0.5", 1.0),  # math-verify takes a percent both ways
    # closeness: decimals within 1e-9 relative, not coarser
    ("<answer>0.333</answer>", "1/3", 0.0),
    ("<answer>0.3333333333333</answer>", "1/3", 1.0),
    # no answer, empty or malformed answers
    ("The answer is 42.", "42", 0.0),
    ("42", "42", 0.0),
    ("<answer></answer>", "42", 0.0),
    ("<answer>42", "42", 0.0),
    (r"\boxed{42", "42", 0.0),
    ("<answer>forty-two</answer>", "42", 0.0),
    ("<answer>inf</answer>", "42", 0.0),
    ("<answer>nan</answer>", "42", 0.0),
    ("<answer>1/0</answer>", "42", 0.0),
    ("<answer>1e999999999</answer>", "1", 0.0),  # refused before building a huge number
    # several answers: the last one counts
    ("<answer>1</answer> no wait <answer>2</answer>", "2", 1.0),
    ("<answer>2</answer> no wait <answer>1</answer>", "2", 0.0),
    (r"<answer>2</answer> \boxed{3}", "3", 1.0),
    (r"\boxed{3} then <answer>2</answer>", "3", 0.0),
    (r"<answer>\boxed{5}</answer>", "5", 1.0),
    # a number label takes a number: arithmetic is not evaluated (copying `Compute 9 + 20` earns nothing)
    ("<answer>3+4</answer>", "7", 0.0),
    ("<answer>9 + 20</answer>", "29", 0.0),
    ("<answer>2*21</answer>", "42", 0.0),
    (r"<answer>6 \times 7</answer>", "42", 0.0),
    ("<answer>50-8</answer>", "42", 0.0),
    ("<answer>3+5</answer>", "7", 0.0),
    (r"\boxed{2^{10}}", "1024", 0.0),
    (r"\boxed{10!}", "3628800", 0.0),
    (r"\boxed{\sqrt{49}}", "7", 0.0),
    # expressions compare by equivalence (math-verify's rule) when the label is one
    (r"\boxed{2^{10}}", "2^{10}", 1.0),
    (r"\boxed{x^2+1}", "1+x^2", 1.0),
    (r"\boxed{x^2+1}", "x^2-1", 0.0),
    # sets, intervals, tuples
    (r"\boxed{\{1,2\}}", r"\{2,1\}", 1.0),
    (r"\boxed{\{1,3\}}", r"\{2,1\}", 0.0),
    (r"\boxed{[0,1)}", "[0,1)", 1.0),
    (r"\boxed{[0,1]}", "[0,1)", 0.0),
    (r"\boxed{(1,2)}", "(1,2)", 1.0),
    # labels that are not numbers compare as text
    ("<answer>Paris</answer>", "paris", 1.0),
    ("<answer>Lyon</answer>", "Paris", 0.0),
    ("<answer>42</answer>", 42, 1.0),
    ("<answer>0.5</answer>", 0.5, 1.0),
]


def test_the_table_is_large() -> None:
    assert len(CASES) >= 40


@pytest.mark.parametrize(("reply", "label", "score"), CASES)
def test_grade(reply: str, label, score: float) -> None:
    got, info = grade(reply, label)
    assert got == score
    assert info["correct"] == score


def test_missing_answers_are_counted() -> None:
    assert grade("nothing here", "1")[1] == {"answers": 0.0, "missing_answer": 1.0, "correct": 0.0}
    assert grade("<answer> </answer>", "1")[1]["missing_answer"] == 1.0
    assert grade("<answer>1</answer><answer>2</answer>", "2")[1] == {
        "answers": 2.0,
        "missing_answer": 0.0,
        "correct": 1.0,
    }


def test_nested_braces_are_extracted_whole() -> None:
    assert extract_answers(r"\boxed{\frac{1}{2}} and \fbox{{x}}") == [r"\frac{1}{2}", "{x}"]


def test_special_tokens_cannot_spell_an_answer() -> None:
    tok = build_tiny_tokenizer()
    env = load_agent("envs/math.py")()
    # `<|im_start|>` is a special token: decoded with special tokens skipped it vanishes, so a reply
    # made of specials around a bare number has no answer tag.
    ids = tok("<|im_start|>42<|im_end|>", add_special_tokens=False)["input_ids"]
    assert len(ids) == 4
    text = tok.decode(ids, skip_special_tokens=True)
    assert text == "42"
    assert env.step(State(prompt="p", label="42", action_text=text)).reward == 0.0
    ids = tok("<answer>42</answer><|im_end|>", add_special_tokens=False)["input_ids"]
    good = tok.decode(ids, skip_special_tokens=True)
    result = env.step(State(prompt="p", label="42", action_text=good))
    assert result.reward == 1.0 and result.terminated


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "answer",
    ["a" * 60 + "1", "ab." * 30 + "7", "The result is twenty nine because nine plus twenty is 29", "cm" * 40 + "%5"],
)
def test_grading_is_fast_on_long_words(answer: str) -> None:
    """Answers made of words (their spaces removed by normalisation) grade at once: a unit-suffix pattern with
    nested repetition once backtracked exponentially on them, stalling the whole rollout process."""
    import time

    t0 = time.perf_counter()
    for _ in range(10):
        assert grade(f"<answer>{answer}</answer>", "29")[0] == 0.0
    assert time.perf_counter() - t0 < 5.0
