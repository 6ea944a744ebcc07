"""The `repeat` task: prompts fixed by seed whose answer length the prompt carries, and its graded reward
(1.0 only for a word-for-word copy), dispatched by the default scorer and listed as a built-in task."""

import pytest

from rhymerl.config import BUILTIN_TASKS
from rhymerl.data.dataset import builtin_examples
from rhymerl.rl.rewards import RewardScorer, default_score
from rhymerl.tasks import repeat


def test_prompts_are_fixed_by_seed_and_carry_their_answer():
    texts = repeat.make_texts(40, seed=0)
    assert texts == repeat.make_texts(40, seed=0) != repeat.make_texts(40, seed=1)
    assert repeat.make_texts(8, seed=0) == texts[:8]  # a prefix of a larger set: bench pipe's real runs use it
    sentences = [t.count(".") for t in texts]
    assert min(sentences) == 1 and max(sentences) == repeat.MAX_SENTENCES  # short to long answers
    assert len(set(sentences)) >= 8
    examples = builtin_examples("repeat", 5, seed=3)
    for i, (e, text) in enumerate(zip(examples, repeat.make_texts(5, seed=3))):
        assert e.ground_truth == text and e.prompt == f"{repeat.INSTRUCTION}\n{text}"
        assert e.data_source == "repeat" and e.source == f"repeat#{i}"
    assert "repeat" in BUILTIN_TASKS


def test_reward_is_one_only_for_a_word_for_word_copy():
    text = "Ava has 12 coins. Ben went to the park with Ava."
    assert repeat.score_copy(text, text) == 1.0
    assert repeat.score_copy(f"  {text}\n<|im_end|>", text) == 1.0  # whitespace and end-of-sequence tokens
    dropped = repeat.score_copy("Ava has 12 coins. Ben went to the park.", text)
    changed = repeat.score_copy(text.replace("12", "13"), text)
    wrapped = repeat.score_copy(f"Sure! Here is the text: {text}", text)
    twice = repeat.score_copy(f"{text} {text}", text)
    cut = repeat.score_copy("Ava has", text)
    for partial in (dropped, changed, wrapped, twice, cut):
        assert 0.0 < partial < 1.0
    assert cut < dropped  # more of the text copied, more reward
    assert repeat.score_copy("", text) == 0.0 and repeat.score_copy("Hello world", text) == 0.0
    # difflib's ratio: 2 x matched words / both counts (10 of 11 words here)
    assert changed == pytest.approx(2 * 10 / 22)


def test_default_scorer_dispatches_repeat():
    example = builtin_examples("repeat", 1, seed=0)[0]
    assert default_score("repeat", example.ground_truth, example.ground_truth) == 1.0
    batch = RewardScorer().score([example.ground_truth, "no"], [example, example])
    assert batch.correct[0] == 1.0 and batch.correct[1] < 0.2 and batch.errors == 0
