"""`verify` with every node drawn in one call (the GPU's way) against the level-by-level walk."""

import random

from rhymerl.histospec.drafter import Draft
from rhymerl.histospec.verify import verify


def random_draft(rng: random.Random, vocab: int) -> Draft:
    """A tree of 0-12 nodes in topological order over a small vocabulary (so that draws often match)."""
    n = rng.randrange(13)
    parents = [rng.randrange(-1, j) for j in range(n)]
    return Draft(tokens=[rng.randrange(vocab) for _ in range(n)], parents=parents)


def keyed_draw(calls: list):
    """A deterministic draw: the token depends on (sequence, node, depth) only, like the engine's keyed draws."""
    def draw(live, nodes, depths):
        calls.append(len(live))
        tokens = [hash((i, n, d)) % 3 for i, n, d in zip(live, nodes, depths)]
        return tokens, [-0.5 * t - 0.01 * d for t, d in zip(tokens, depths)]
    return draw


def test_every_node_gives_the_walks_result_in_one_call():
    rng = random.Random(0)
    accepted = 0
    for _ in range(200):
        drafts = [random_draft(rng, 3) for _ in range(rng.randrange(1, 6))]
        level_calls, all_calls = [], []
        walked = verify(drafts, keyed_draw(level_calls))
        at_once = verify(drafts, keyed_draw(all_calls), every_node=True)
        assert at_once == walked
        assert len(all_calls) == 1 and all_calls[0] == sum(1 + len(d.tokens) for d in drafts)
        accepted += sum(len(v.path) for v in walked)
    assert accepted > 100  # the trees were walked, not just their roots drawn
