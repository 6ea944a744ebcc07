"""Countdown puzzles generated from a seed: reach a target from a few numbers with + - * /.

Each puzzle is built from a random expression over its numbers, so at least one solution exists (kept in
`Puzzle.solution`, never shown to the model). A fixed seed gives a fixed puzzle set, so the same prompts
recur every epoch, as for the arithmetic task.

The model answers with an equation on its last line after '####' (e.g. "#### (3 + 5) * 2"); `score_equation`
checks it exactly: only integers, + - * /, unary minus and parentheses, each given number used at most once,
evaluated with fractions so 7 / 2 * 2 is exactly 7.
"""

from __future__ import annotations

import ast
import json
import random
import re
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction

INSTRUCTION = (
    "Use each number at most once, with + - * / and parentheses. "
    "End your answer with the equation on the last line after '####', e.g. '#### (3 + 5) * 2'."
)
MAX_TARGET = 100
MAX_NUMBER = 20
# An answer longer than this is not a countdown equation; the bound also keeps ast.parse far from its
# recursion limit on adversarial completions.
MAX_EQUATION_CHARS = 200

_SPECIAL_TOKENS_AT_END = re.compile(r"(?:\s*(?:<\|[^|<>]*\|>|</s>|<eos>|<end_of_turn>))+\s*$")
# LaTeX and typographic operators that models write for * and /; rewritten before parsing.
_OPERATOR_SPELLINGS = {"\\times": "*", "\\cdot": "*", "\\div": "/", "×": "*", "·": "*", "÷": "/", "−": "-"}


@dataclass(frozen=True)
class Puzzle:
    numbers: tuple[int, ...]
    target: int
    solution: str  # one equation that reaches target (what the generator built); not part of the prompt


def _combine(rng: random.Random, a: tuple[int, str], b: tuple[int, str]) -> tuple[int, str] | None:
    """One random legal operation on two (value, expression) pairs, keeping every value a positive int."""
    (x, ex), (y, ey) = (a, b) if a[0] >= b[0] else (b, a)
    ops = ["+", "*"]
    if x > y:
        ops.append("-")
    if y > 1 and x % y == 0:
        ops.append("/")
    op = rng.choice(ops)
    value = {"+": x + y, "-": x - y, "*": x * y, "/": x // y}[op]
    if value > MAX_TARGET * MAX_NUMBER:  # keeps intermediate values small enough to read
        return None
    return value, f"({ex} {op} {ey})"


def _puzzle(rng: random.Random) -> Puzzle:
    while True:
        numbers = [rng.randint(1, MAX_NUMBER) for _ in range(rng.choice((3, 4)))]
        pool = [(n, str(n)) for n in numbers]
        while len(pool) > 1:
            a = pool.pop(rng.randrange(len(pool)))
            b = pool.pop(rng.randrange(len(pool)))
            combined = _combine(rng, a, b)
            if combined is None:
                break
            pool.append(combined)
        if len(pool) != 1:
            continue
        target, expression = pool[0]
        # A target equal to a given number is solved by copying it; such puzzles teach nothing.
        if 1 <= target <= MAX_TARGET and target not in numbers:
            rng.shuffle(numbers)
            return Puzzle(tuple(numbers), target, expression[1:-1])


def make_puzzles(n: int, seed: int = 0) -> list[Puzzle]:
    """n solvable puzzles with 3 or 4 numbers in 1..20 and an integer target in 1..100, fixed by seed."""
    rng = random.Random(seed)
    return [_puzzle(rng) for _ in range(n)]


def prompt_text(puzzle: Puzzle) -> str:
    numbers = ", ".join(str(n) for n in puzzle.numbers)
    return f"Using the numbers [{numbers}], write an equation that equals {puzzle.target}.\n{INSTRUCTION}"


def ground_truth(puzzle: Puzzle) -> str:
    """The puzzle as the JSON ground truth `{"numbers": [...], "target": N}` (what the reward reads)."""
    return json.dumps({"numbers": list(puzzle.numbers), "target": puzzle.target})


def read_ground_truth(text: str) -> tuple[tuple[int, ...], int]:
    """(numbers, target) from a ground truth written by `ground_truth` (or verl/TinyZero's countdown layout,
    the same two keys). Raises ValueError saying what is wrong."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, TypeError) as e:
        raise ValueError(f"countdown ground truth is not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"countdown ground truth must be a JSON object with 'numbers' and 'target': {text!r}")
    numbers, target = value.get("numbers"), value.get("target")
    if not (isinstance(numbers, list) and numbers and all(_is_int(n) for n in numbers)):
        raise ValueError(f"countdown ground truth field 'numbers' must be a non-empty list of ints: {text!r}")
    if not _is_int(target):
        raise ValueError(f"countdown ground truth field 'target' must be an int: {text!r}")
    return tuple(numbers), target


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def strip_special_tokens(text: str) -> str:
    """text without trailing whitespace and end-of-sequence tokens (<|im_end|>, </s>, ...) left by decoding."""
    return _SPECIAL_TOKENS_AT_END.sub("", text).rstrip()


def last_boxed(text: str) -> str | None:
    """Contents of the last \\boxed{...} in text (braces balanced), or None when there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin - 1, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i].strip()
    return None  # unclosed: the completion was cut off inside the box


def marked_answer(text: str) -> str | None:
    """The final answer a completion marks: the first non-empty line after its last '####', else the contents
    of its last \\boxed{...}; None when it marks neither (or marks nothing after '####' and has no box)."""
    text = strip_special_tokens(text)
    marker = text.rfind("####")
    if marker >= 0:
        for line in text[marker + 4:].splitlines():
            if line.strip():
                return line.strip()
    return last_boxed(text)


def _normalise(equation: str) -> str:
    for spelling, op in _OPERATOR_SPELLINGS.items():
        equation = equation.replace(spelling, op)
    equation = equation.strip().strip("$").strip()
    # "(3 + 5) * 2 = 16" is common; only the left-hand side is checked, so a wrong right side costs nothing
    # and a wrong left side still scores 0.
    equation = equation.split("=", 1)[0].strip()
    return equation.rstrip(".").strip()


def _evaluate(node: ast.AST, source: str, used: list[int]) -> Fraction:
    """Value of an allowed expression node; records each integer literal in used. Raises ValueError for
    anything outside ints, + - * /, unary minus and parentheses, ZeroDivisionError for division by zero."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        # Only plain decimal literals: 0x10 or 1_6 would let a model spell numbers it was not given.
        if not ast.get_source_segment(source, node).isdigit():
            raise ValueError("not a plain decimal integer")
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand, source, used)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        left, right = _evaluate(node.left, source, used), _evaluate(node.right, source, used)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        return left / right
    raise ValueError(f"{type(node).__name__} is not allowed")


def evaluate_equation(equation: str, numbers) -> Fraction | None:
    """Exact value of an equation that uses only the given numbers (each at most as often as given), ints,
    + - * /, unary minus and parentheses; None when it is anything else or divides by zero."""
    equation = _normalise(equation)
    if not equation or len(equation) > MAX_EQUATION_CHARS:
        return None
    try:
        tree = ast.parse(equation, mode="eval")
        used: list[int] = []
        value = _evaluate(tree.body, equation, used)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return None
    if Counter(used) - Counter(numbers):  # some number used more often than given
        return None
    return value


def score_equation(completion: str, numbers, target: int) -> float:
    """1.0 iff the completion's marked equation (after its last '####', else in its last \\boxed{}) is legal
    for these numbers and evaluates exactly to target, else 0.0."""
    equation = marked_answer(completion)
    if equation is None:
        return 0.0
    value = evaluate_equation(equation, numbers)
    return 1.0 if value is not None and value == target else 0.0
