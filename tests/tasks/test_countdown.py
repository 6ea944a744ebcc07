"""Countdown puzzles: generated puzzles are solvable and fixed by seed; equations are checked strictly."""

from __future__ import annotations

import pytest

from rhymerl.tasks.countdown import (
    Puzzle, ground_truth, make_puzzles, marked_answer, prompt_text, read_ground_truth, score_equation)


def test_generated_puzzles_are_solvable_and_in_range():
    for puzzle in make_puzzles(300, seed=0):
        assert len(puzzle.numbers) in (3, 4)
        assert all(1 <= n <= 20 for n in puzzle.numbers)
        assert isinstance(puzzle.target, int) and 1 <= puzzle.target <= 100
        assert score_equation(f"Let me think.\n#### {puzzle.solution}", puzzle.numbers, puzzle.target) == 1.0


def test_same_seed_same_puzzles():
    assert make_puzzles(20, seed=7) == make_puzzles(20, seed=7)
    assert make_puzzles(20, seed=7) != make_puzzles(20, seed=8)


def test_prompt_and_ground_truth():
    puzzle = Puzzle((3, 5, 2), 16, "(3 + 5) * 2")
    text = prompt_text(puzzle)
    assert "[3, 5, 2]" in text and "16" in text and "####" in text
    assert "(3 + 5) * 2" not in text.split("e.g.")[0]  # the solution is not given away
    assert read_ground_truth(ground_truth(puzzle)) == ((3, 5, 2), 16)
    with pytest.raises(ValueError, match="numbers"):
        read_ground_truth('{"target": 3}')
    with pytest.raises(ValueError, match="not JSON"):
        read_ground_truth("numbers: 3, 5")
    with pytest.raises(ValueError, match="JSON object"):
        read_ground_truth("16")


@pytest.mark.parametrize("completion", [
    "#### (3 + 5) * 2",
    "work...\n#### (3+5)*2\n",
    "#### (3 + 5) * 2 = 16",
    "#### (3 + 5) \\times 2<|im_end|>",
    "so \\boxed{(3 + 5) * 2}",
])
def test_correct_equations_score_one(completion):
    assert score_equation(completion, (3, 5, 2), 16) == 1.0


def test_subset_of_numbers_and_exact_division():
    assert score_equation("#### 7 - 3", (3, 7, 9), 4) == 1.0
    assert score_equation("#### 7 / 2 * 4", (2, 4, 7), 14) == 1.0  # exact: 7/2 is not truncated
    assert score_equation("#### -3 + 7", (3, 7), 4) == 1.0


@pytest.mark.parametrize("completion", [
    "#### (3 + 5) * 2 - x",           # a name
    "#### abs(-16)",                  # a call
    "#### 2 ** 4",                    # a power
    "#### (3 + 5) * 2 + 5 - 5",       # 5 used more often than given
    "#### 5 * 3 + 1",                 # a number not given
    "#### 16",                        # the target itself, not given
    "#### 0x10",                      # a non-decimal literal
    "#### 3 // 5 + 16",               # floor division
    "#### (5 + 3) * 2.0",             # a float
    "#### [16][0]",
    "#### 5 / (3 - 3) + 16",          # division by zero
    "#### (3 + 5) * 2)",              # syntax error
    "(3 + 5) * 2",                    # not marked
    "#### (3 + 5) + 2",               # wrong value
    "#### 2 * " + "(" * 300 + "3" + ")" * 300,  # absurdly long
])
def test_illegal_or_wrong_equations_score_zero(completion):
    assert score_equation(completion, (3, 5, 2), 16) == 0.0


def test_repeated_number_allowed_as_often_as_given():
    assert score_equation("#### 4 * 4", (4, 4, 1), 16) == 1.0
    assert score_equation("#### 4 * 4 * 4", (4, 4, 1), 64) == 0.0


def test_marked_answer_prefers_last_marker():
    assert marked_answer("#### 1\nno wait\n#### 2 + 2\n<|endoftext|>") == "2 + 2"
    assert marked_answer("\\boxed{1} then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert marked_answer("nothing here") is None
