"""Multi-step arithmetic word problems generated from a seed (the embedded default task).

A fixed seed gives a fixed prompt set, so the same prompts recur every epoch, which is the premise of
RhymeRL. Numbers are small enough for a 135M model to get some right, so rewards can rise during training.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

NAMES = ["Ava", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jade", "Kofi", "Lena"]
ITEMS = ["apples", "marbles", "stickers", "books", "coins", "pencils", "cookies", "shells"]
# A short, concrete format example: a 135M model follows "like this: #### 12" about twice as often as an
# abstract instruction (one sample of 16 prompts x 8 at temperature 0.7: 19% vs 9% of completions in the
# format), so rewards have signal from the first steps.
INSTRUCTION = "Give a short calculation, then the final number after '####', like this: #### 12"


@dataclass(frozen=True)
class Problem:
    question: str
    answer: int


def _problem(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(2, 30), rng.randint(2, 20), rng.randint(1, 10)
    kind = rng.randrange(4)
    if kind == 0:
        c = rng.randint(1, a + b)
        q = f"{name} has {a} {item}. {name} gets {b} more and then gives away {c}. How many {item} does {name} have now?"
        return Problem(q, a + b - c)
    if kind == 1:
        k = rng.randint(2, 6)
        q = f"{name} buys {k} boxes with {b} {item} in each box, then finds {c} more. How many {item} does {name} have?"
        return Problem(q, k * b + c)
    if kind == 2:
        k = rng.randint(2, 5)
        total = k * rng.randint(2, 12)
        q = f"{name} shares {total} {item} equally among {k} friends and keeps none. How many {item} does each friend get?"
        return Problem(q, total // k)
    q = f"{name} had {a} {item}, lost {min(b, a)}, and then doubled what was left. How many {item} does {name} have?"
    return Problem(q, 2 * (a - min(b, a)))


def make_problems(n: int, seed: int = 0) -> list[Problem]:
    rng = random.Random(seed)
    return [_problem(rng) for _ in range(n)]


def prompt_text(problem: Problem) -> str:
    return f"{problem.question}\n{INSTRUCTION}"
