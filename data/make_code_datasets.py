"""Write the code task's datasets, deterministically: `python data/make_code_datasets.py [OUT_DIR]`.

`code_train.jsonl` / `code_eval.jsonl`: "write a function" tasks for `envs/code.py`. Each row's prompt
asks for one function in a ```python block; its label holds the function's name and the hidden tests
(plain `assert` lines the model never sees); the reward is the fraction that pass in the sandbox. The
eval tasks are different functions from the training ones. Each task also carries a reference solution
(`solution`, not shown to the model) that passes all its tests: the shipped rows are checked by
running them (tests/test_code_env.py).
"""

import json
import sys
from pathlib import Path

# (name, description, reference solution, hidden tests)
TASKS = [
    (
        "add",
        "add(a, b) returns the sum of a and b",
        "def add(a, b):\n    return a + b",
        ["add(1, 2) == 3", "add(-5, 5) == 0", "add(10, 0) == 10", "add(2.5, 0.5) == 3.0"],
    ),
    (
        "square",
        "square(n) returns n times n",
        "def square(n):\n    return n * n",
        ["square(3) == 9", "square(0) == 0", "square(-4) == 16"],
    ),
    (
        "is_even",
        "is_even(n) returns True when the integer n is even",
        "def is_even(n):\n    return n % 2 == 0",
        ["is_even(2) is True", "is_even(7) is False", "is_even(0) is True", "is_even(-3) is False"],
    ),
    (
        "maximum",
        "maximum(xs) returns the largest number of a non-empty list",
        "def maximum(xs):\n    return max(xs)",
        ["maximum([1, 5, 3]) == 5", "maximum([-2, -9]) == -2", "maximum([7]) == 7"],
    ),
    (
        "minimum",
        "minimum(xs) returns the smallest number of a non-empty list",
        "def minimum(xs):\n    return min(xs)",
        ["minimum([4, 2, 8]) == 2", "minimum([-1, -7, 3]) == -7", "minimum([0]) == 0"],
    ),
    (
        "reverse",
        "reverse(s) returns the string s reversed",
        "def reverse(s):\n    return s[::-1]",
        ["reverse('abc') == 'cba'", "reverse('') == ''", "reverse('ab') == 'ba'"],
    ),
    (
        "count_vowels",
        "count_vowels(s) returns how many of the letters a, e, i, o, u (lower case) s has",
        "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s)",
        ["count_vowels('hello') == 2", "count_vowels('xyz') == 0", "count_vowels('aeiou') == 5"],
    ),
    (
        "factorial",
        "factorial(n) returns n! for n >= 0",
        "def factorial(n):\n    out = 1\n    for i in range(2, n + 1):\n        out *= i\n    return out",
        ["factorial(0) == 1", "factorial(1) == 1", "factorial(5) == 120", "factorial(10) == 3628800"],
    ),
    (
        "fib",
        "fib(n) returns the n-th Fibonacci number, with fib(0) == 0 and fib(1) == 1",
        "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
        ["fib(0) == 0", "fib(1) == 1", "fib(10) == 55", "fib(20) == 6765"],
    ),
    (
        "sum_list",
        "sum_list(xs) returns the sum of a list of numbers (0 for an empty list)",
        "def sum_list(xs):\n    return sum(xs)",
        ["sum_list([1, 2, 3]) == 6", "sum_list([]) == 0", "sum_list([-1, 1]) == 0"],
    ),
    (
        "mean",
        "mean(xs) returns the arithmetic mean of a non-empty list",
        "def mean(xs):\n    return sum(xs) / len(xs)",
        ["mean([1, 2, 3]) == 2", "mean([5]) == 5", "mean([1, 2]) == 1.5"],
    ),
    (
        "is_palindrome",
        "is_palindrome(s) returns True when s reads the same backwards",
        "def is_palindrome(s):\n    return s == s[::-1]",
        ["is_palindrome('abba') is True", "is_palindrome('abc') is False", "is_palindrome('') is True"],
    ),
    (
        "count_char",
        "count_char(s, c) returns how many times the character c occurs in s",
        "def count_char(s, c):\n    return s.count(c)",
        ["count_char('banana', 'a') == 3", "count_char('abc', 'z') == 0", "count_char('', 'a') == 0"],
    ),
    (
        "clamp",
        "clamp(x, lo, hi) returns x limited to the range [lo, hi]",
        "def clamp(x, lo, hi):\n    return max(lo, min(hi, x))",
        ["clamp(5, 0, 10) == 5", "clamp(-3, 0, 10) == 0", "clamp(42, 0, 10) == 10"],
    ),
    (
        "absolute",
        "absolute(x) returns the absolute value of x without using abs",
        "def absolute(x):\n    return -x if x < 0 else x",
        ["absolute(-3) == 3", "absolute(4) == 4", "absolute(0) == 0"],
    ),
    (
        "gcd",
        "gcd(a, b) returns the greatest common divisor of two positive integers",
        "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a",
        ["gcd(12, 18) == 6", "gcd(7, 13) == 1", "gcd(100, 10) == 10"],
    ),
    (
        "is_prime",
        "is_prime(n) returns True when the integer n is a prime number",
        "def is_prime(n):\n    if n < 2:\n        return False\n"
        "    return all(n % d for d in range(2, int(n ** 0.5) + 1))",
        ["is_prime(2) is True", "is_prime(1) is False", "is_prime(17) is True", "is_prime(21) is False"],
    ),
    (
        "evens",
        "evens(xs) returns the even numbers of a list, in order",
        "def evens(xs):\n    return [x for x in xs if x % 2 == 0]",
        ["evens([1, 2, 3, 4]) == [2, 4]", "evens([]) == []", "evens([1, 3]) == []"],
    ),
    (
        "double_all",
        "double_all(xs) returns a list with every number of xs doubled",
        "def double_all(xs):\n    return [2 * x for x in xs]",
        ["double_all([1, 2]) == [2, 4]", "double_all([]) == []"],
    ),
    (
        "first_word",
        "first_word(s) returns the first space-separated word of s ('' when there is none)",
        "def first_word(s):\n    parts = s.split()\n    return parts[0] if parts else ''",
        ["first_word('hello world') == 'hello'", "first_word('') == ''", "first_word('  pad') == 'pad'"],
    ),
    (
        "word_count",
        "word_count(s) returns the number of space-separated words in s",
        "def word_count(s):\n    return len(s.split())",
        ["word_count('a b c') == 3", "word_count('') == 0", "word_count('one') == 1"],
    ),
    (
        "capitalize_words",
        "capitalize_words(s) upper-cases the first letter of every space-separated word",
        "def capitalize_words(s):\n    return ' '.join(w[:1].upper() + w[1:] for w in s.split(' '))",
        ["capitalize_words('hello world') == 'Hello World'", "capitalize_words('a') == 'A'"],
    ),
    (
        "dedupe",
        "dedupe(xs) returns xs without repeated items, keeping the first occurrence of each",
        "def dedupe(xs):\n    seen, out = set(), []\n    for x in xs:\n        if x not in seen:\n"
        "            seen.add(x)\n            out.append(x)\n    return out",
        ["dedupe([1, 2, 1, 3, 2]) == [1, 2, 3]", "dedupe([]) == []", "dedupe(['a', 'a']) == ['a']"],
    ),
    (
        "flatten",
        "flatten(xss) joins a list of lists into one list",
        "def flatten(xss):\n    return [x for xs in xss for x in xs]",
        ["flatten([[1], [2, 3]]) == [1, 2, 3]", "flatten([]) == []", "flatten([[], [4]]) == [4]"],
    ),
    (
        "digit_sum",
        "digit_sum(n) returns the sum of the decimal digits of a non-negative integer",
        "def digit_sum(n):\n    return sum(int(d) for d in str(n))",
        ["digit_sum(123) == 6", "digit_sum(0) == 0", "digit_sum(9999) == 36"],
    ),
    (
        "count_positive",
        "count_positive(xs) returns how many numbers of xs are greater than 0",
        "def count_positive(xs):\n    return sum(1 for x in xs if x > 0)",
        ["count_positive([1, -2, 3, 0]) == 2", "count_positive([]) == 0"],
    ),
    (
        "last",
        "last(xs) returns the last item of a list, or None for an empty one",
        "def last(xs):\n    return xs[-1] if xs else None",
        ["last([1, 2, 3]) == 3", "last([]) is None"],
    ),
    (
        "power",
        "power(b, e) returns b raised to the non-negative integer e",
        "def power(b, e):\n    return b ** e",
        ["power(2, 10) == 1024", "power(5, 0) == 1", "power(-2, 3) == -8"],
    ),
    (
        "celsius",
        "celsius(f) converts a temperature from Fahrenheit to Celsius",
        "def celsius(f):\n    return (f - 32) * 5 / 9",
        ["celsius(32) == 0", "celsius(212) == 100"],
    ),
    (
        "repeat",
        "repeat(s, n) returns the string s repeated n times",
        "def repeat(s, n):\n    return s * n",
        ["repeat('ab', 3) == 'ababab'", "repeat('x', 0) == ''"],
    ),
    (
        "swap_case",
        "swap_case(s) turns upper-case letters to lower case and lower-case ones to upper case",
        "def swap_case(s):\n    return s.swapcase()",
        ["swap_case('aB') == 'Ab'", "swap_case('') == ''"],
    ),
    (
        "second_largest",
        "second_largest(xs) returns the second largest distinct number of xs",
        "def second_largest(xs):\n    return sorted(set(xs))[-2]",
        ["second_largest([1, 5, 3]) == 3", "second_largest([4, 4, 2]) == 2"],
    ),
    (
        "running_sum",
        "running_sum(xs) returns the list of prefix sums of xs",
        "def running_sum(xs):\n    out, total = [], 0\n    for x in xs:\n        total += x\n"
        "        out.append(total)\n    return out",
        ["running_sum([1, 2, 3]) == [1, 3, 6]", "running_sum([]) == []"],
    ),
    (
        "is_sorted",
        "is_sorted(xs) returns True when xs is in non-decreasing order",
        "def is_sorted(xs):\n    return all(a <= b for a, b in zip(xs, xs[1:]))",
        ["is_sorted([1, 2, 2, 5]) is True", "is_sorted([3, 1]) is False", "is_sorted([]) is True"],
    ),
    (
        "char_freq",
        "char_freq(s) returns a dict from each character of s to how many times it occurs",
        "def char_freq(s):\n    out = {}\n    for c in s:\n        out[c] = out.get(c, 0) + 1\n    return out",
        ["char_freq('aab') == {'a': 2, 'b': 1}", "char_freq('') == {}"],
    ),
    (
        "binary",
        "binary(n) returns the binary digits of a non-negative integer as a string",
        "def binary(n):\n    return bin(n)[2:]",
        ["binary(5) == '101'", "binary(0) == '0'", "binary(8) == '1000'"],
    ),
]
EVAL_TASKS = [
    (
        "subtract",
        "subtract(a, b) returns a minus b",
        "def subtract(a, b):\n    return a - b",
        ["subtract(5, 3) == 2", "subtract(0, 4) == -4", "subtract(-1, -1) == 0"],
    ),
    (
        "cube",
        "cube(n) returns n to the third power",
        "def cube(n):\n    return n ** 3",
        ["cube(2) == 8", "cube(-3) == -27", "cube(0) == 0"],
    ),
    (
        "is_odd",
        "is_odd(n) returns True when the integer n is odd",
        "def is_odd(n):\n    return n % 2 == 1",
        ["is_odd(3) is True", "is_odd(4) is False", "is_odd(-1) is True"],
    ),
    (
        "product",
        "product(xs) returns the product of a list of numbers (1 for an empty list)",
        "def product(xs):\n    out = 1\n    for x in xs:\n        out *= x\n    return out",
        ["product([2, 3, 4]) == 24", "product([]) == 1", "product([5, 0]) == 0"],
    ),
    (
        "count_upper",
        "count_upper(s) returns how many upper-case letters s has",
        "def count_upper(s):\n    return sum(c.isupper() for c in s)",
        ["count_upper('HeLLo') == 3", "count_upper('abc') == 0"],
    ),
    (
        "lcm",
        "lcm(a, b) returns the least common multiple of two positive integers",
        "def lcm(a, b):\n    x, y = a, b\n    while y:\n        x, y = y, x % y\n    return a * b // x",
        ["lcm(4, 6) == 12", "lcm(3, 5) == 15", "lcm(7, 7) == 7"],
    ),
    (
        "odds",
        "odds(xs) returns the odd numbers of a list, in order",
        "def odds(xs):\n    return [x for x in xs if x % 2]",
        ["odds([1, 2, 3, 4]) == [1, 3]", "odds([]) == []"],
    ),
    (
        "longest_word",
        "longest_word(s) returns the longest space-separated word of s (the first one on a tie)",
        "def longest_word(s):\n    return max(s.split(), key=len)",
        ["longest_word('a bbb cc') == 'bbb'", "longest_word('hi yo') == 'hi'"],
    ),
    (
        "triangle",
        "triangle(n) returns 1 + 2 + ... + n",
        "def triangle(n):\n    return n * (n + 1) // 2",
        ["triangle(1) == 1", "triangle(4) == 10", "triangle(0) == 0"],
    ),
    (
        "vowel_strip",
        "vowel_strip(s) returns s without its lower-case vowels a, e, i, o, u",
        "def vowel_strip(s):\n    return ''.join(c for c in s if c not in 'aeiou')",
        ["vowel_strip('hello') == 'hll'", "vowel_strip('xyz') == 'xyz'"],
    ),
    (
        "count_zeros",
        "count_zeros(xs) returns how many items of xs equal 0",
        "def count_zeros(xs):\n    return xs.count(0)",
        ["count_zeros([0, 1, 0]) == 2", "count_zeros([]) == 0"],
    ),
    (
        "middle",
        "middle(xs) returns the middle item of a list of odd length",
        "def middle(xs):\n    return xs[len(xs) // 2]",
        ["middle([1, 2, 3]) == 2", "middle([9]) == 9"],
    ),
]


def row(split: str, i: int, task: tuple) -> dict:
    name, description, solution, tests = task
    prompt = f"Write a Python function such that {description}. Reply with the code in a ```python block."
    label = {"entry": name, "tests": [f"assert {t}" for t in tests], "solution": solution}
    return {"id": f"code-{split}-{i:03d}", "prompt": prompt, "label": label}


def main(out: Path) -> None:
    assert not {t[0] for t in TASKS} & {t[0] for t in EVAL_TASKS}, "eval functions must be new ones"
    for split, tasks in (("train", TASKS), ("eval", EVAL_TASKS)):
        lines = [json.dumps(row(split, i, t)) for i, t in enumerate(tasks)]
        (out / f"code_{split}.jsonl").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent)
