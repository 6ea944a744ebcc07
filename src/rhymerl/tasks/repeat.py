"""Copy a short text exactly: a task whose answer length the prompt carries (HistoPipe's real workload).

Each prompt holds a paragraph of 1 to MAX_SENTENCES short sentences generated from a seed, and asks for it
back word for word. A correct answer is as long as the paragraph, so response lengths range from a few
tokens to over a hundred for a reason the prompt states, and a prompt's length stays about the same epoch
after epoch: the premise of HistoPipe's scheduling (docs/design.md, "Built-in tasks"). Copying is within
reach of a 135M model (SmolLM2-135M-Instruct at temperature 0.7 copies one-sentence texts exactly and longer
ones with a few words wrong or dropped), so the reward has signal from the first step.

The reward (`score_copy`) is verifiable and graded: difflib's similarity of the completion's words to the
text's words, 2 x matched / (both counts), so 1.0 exactly for a word-for-word copy and less for a missing,
extra or changed word, a cut-off copy, or a copy wrapped in commentary.
"""

from __future__ import annotations

import difflib
import random

from rhymerl.tasks.countdown import strip_special_tokens

MAX_SENTENCES = 8
INSTRUCTION = "Copy this text exactly:"

NAMES = ["Ava", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jade", "Kofi", "Lena"]
ITEMS = ["apples", "marbles", "stickers", "books", "coins", "pencils", "cookies", "shells"]
PLACES = ["the park", "the library", "the market", "school", "the beach", "the garden"]


def _sentence(rng: random.Random) -> str:
    a, b = rng.sample(NAMES, 2)
    item, place = rng.choice(ITEMS), rng.choice(PLACES)
    return rng.choice([
        f"{a} went to {place} with {b}.",
        f"{a} has {rng.randint(2, 30)} {item}.",
        f"{b} gave {a} {rng.randint(2, 9)} {item} at {place}.",
        f"In the evening {a} read a book about {item}.",
        f"{a} and {b} counted the {item} in {place}.",
    ])


def make_texts(n: int, seed: int = 0) -> list[str]:
    """n paragraphs of 1..MAX_SENTENCES sentences (uniformly many), fixed by seed."""
    rng = random.Random(seed)
    return [" ".join(_sentence(rng) for _ in range(rng.randint(1, MAX_SENTENCES))) for _ in range(n)]


def prompt_text(text: str) -> str:
    return f"{INSTRUCTION}\n{text}"


def score_copy(completion: str, text: str) -> float:
    """difflib's ratio of the completion's words to the text's (whitespace-split, case and punctuation kept,
    end-of-sequence tokens stripped): 1.0 iff the completion is the text word for word, 0.0 for an empty one."""
    got, want = strip_special_tokens(completion).split(), text.split()
    if not got or not want:
        return float(got == want)
    return difflib.SequenceMatcher(None, got, want, autojunk=False).ratio()
