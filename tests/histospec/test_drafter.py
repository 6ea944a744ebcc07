"""Drafter: source choice, best-first trees under budgets, chains, EOS, loops, reward weighting."""

import random

import pytest

from rhymerl.histospec.drafter import Draft, Drafter, next_token_certainty
from rhymerl.histospec.history_index import HistoryIndex
from rhymerl.histospec.suffix_index import SuffixIndex
from rhymerl.history import HistoryStore

EOS = 0


def index_of(*seqs, weights=None):
    index = SuffixIndex()
    for i, s in enumerate(seqs):
        index.add(s, 1.0 if weights is None else weights[i])
    return index


def assert_well_formed(draft, max_tokens, max_depth=None, max_branches=None):
    assert len(draft.tokens) == len(draft.parents) == len(draft.probs) <= max_tokens
    for i, p in enumerate(draft.parents):
        assert -1 <= p < i  # topological: parent first
        if p >= 0:
            assert draft.probs[i] <= draft.probs[p] + 1e-12
    if max_depth is not None and draft.tokens:
        assert max(draft.depths()) <= max_depth
    if max_branches is not None:
        for p in set(draft.parents):
            children = [draft.tokens[i] for i, q in enumerate(draft.parents) if q == p]
            assert len(children) <= max_branches
            assert len(set(children)) == len(children)  # no duplicate siblings
    if not draft.tokens:
        assert draft.source == "" and draft.match_len == 0


def test_nothing_to_draft_from():
    drafter = Drafter(HistoryIndex(HistoryStore()))
    assert drafter.draft([1, 2, 3]) == Draft()
    assert drafter.draft([1, 2, 3], prompt=[4, 5]) == Draft()  # prompt never seen
    assert drafter.draft([1, 2, 3], history=SuffixIndex(), siblings=SuffixIndex()) == Draft()
    assert drafter.draft([1, 2, 3], own=index_of([7, 8, 9])) == Draft()  # no match
    assert drafter.draft([], own=index_of([7, 8, 9])) == Draft()
    assert drafter.draft([1, 2], own=index_of([1, 2])) == Draft()  # match only at the very end
    assert Drafter().draft([1, 2], own=index_of([1, 2, 3]), max_tokens=0) == Draft()


def test_history_via_store_and_prompt_key():
    store = HistoryStore()
    prompt = [100, 101, 102]
    store.record_rollout(prompt, [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 4]], [1.0, 1.0, 0.0])
    drafter = Drafter(HistoryIndex(store, index_prompt_tokens=3), max_branches=1)
    # Start of generation: the context is the prompt's end, matched against the indexed prompt tail.
    draft = drafter.draft(prompt, prompt=prompt)
    assert draft.tokens == [1, 2, 3, 4] and draft.source == "history" and draft.match_len == 3
    assert draft.probs == pytest.approx([1.0, 1.0, 1.0, 2 / 3])
    assert draft.is_chain()
    # A prompt never seen, with siblings available.
    draft = drafter.draft([9, 1, 2], prompt=[55], siblings=index_of([1, 2, 8, 8]))
    assert draft.source == "siblings" and draft.tokens == [8, 8]


def test_most_frequent_continuation_first_and_tree_shape():
    history = index_of([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 6, 7], [1, 2, 8])
    draft = Drafter(max_branches=4).draft([9, 1, 2], history=history, max_tokens=5)
    assert draft.tokens[0] == 3 and draft.parents[0] == -1
    assert draft.probs[0] == pytest.approx(3 / 5)
    assert draft.source == "history" and draft.match_len == 2
    # Best-first: 3 (0.6), 4 after 3 (0.6), then 6 (0.2), 8 (0.2), 7 after 6 (0.2).
    assert list(zip(draft.tokens, draft.parents)) == [(3, -1), (4, 0), (6, -1), (8, -1), (7, 2)]
    assert sorted(draft.paths()) == [[3, 4], [6, 7], [8]]
    chain = Drafter(max_branches=1).draft([9, 1, 2], history=history, max_tokens=5)
    assert chain.tokens == [3, 4] and chain.parents == [-1, 0] and chain.is_chain()
    assert not draft.is_chain()


def test_budget_respected_exactly_and_depth():
    rng = random.Random(0)
    seqs = [[rng.randrange(3) for _ in range(500)] for _ in range(4)]  # every 5-gram occurs
    history = index_of(*seqs)
    drafter = Drafter(max_branches=3, max_depth=3, max_window=2)
    for budget in (1, 2, 7, 16, 32, 39):
        draft = drafter.draft(seqs[0][:50], history=history, max_tokens=budget)
        assert len(draft) == budget
        assert_well_formed(draft, budget, max_depth=3, max_branches=3)
    draft = drafter.draft(seqs[0][:50], history=history, max_tokens=10_000)
    assert len(draft) == 3 + 9 + 27  # the full 3-ary tree of depth 3
    assert sorted(map(len, draft.paths())) == [3] * 27


@pytest.mark.parametrize("seed", range(40))
def test_tree_is_the_best_first_top_n(seed):
    """Every node in the tree is at least as likely as every candidate left out."""
    rng = random.Random(seed)
    seqs = [[rng.randrange(3) for _ in range(rng.randrange(5, 40))] for _ in range(rng.randrange(1, 5))]
    weights = [rng.choice([0.0, 1.0, 2.0]) for _ in seqs]
    history = index_of(*seqs, weights=weights)
    drafter = Drafter(max_branches=rng.randrange(1, 4), max_depth=rng.randrange(1, 6),
                      reward_weighted=rng.random() < 0.5, eos_token_ids={2} if rng.random() < 0.3 else ())
    context = rng.choice(seqs)[: rng.randrange(2, 6)]
    budget = rng.randrange(1, 20)
    draft = drafter.draft(context, history=history, max_tokens=budget)
    assert_well_formed(draft, budget, drafter.max_depth, drafter.max_branches)
    if not draft.tokens:
        return
    n, root = history.longest_match(context)
    assert draft.match_len == n

    def shares(state):
        conts = history.continuations(state)
        if drafter.reward_weighted:
            scores = {t: max(c + w, 0.1 * c) for t, (c, w) in conts.items()}
        else:
            scores = {t: c for t, (c, w) in conts.items()}
        total = sum(scores.values())
        best = sorted(scores, key=lambda t: (-scores[t], t))[: drafter.max_branches]
        return {t: scores[t] / total for t in best}

    # Rebuild each node's state and probability independently.
    states, depths = [], draft.depths()
    for i, (tok, p) in enumerate(zip(draft.tokens, draft.parents)):
        parent_state, parent_prob = (root, 1.0) if p < 0 else (states[p], draft.probs[p])
        share = shares(parent_state)
        assert tok in share
        assert draft.probs[i] == pytest.approx(parent_prob * share[tok])
        states.append(history.step(parent_state, tok))
    # Frontier: candidates not taken whose parent is in the tree (or the root).
    frontier = []
    taken = set(zip(draft.parents, draft.tokens))
    for tok, s in shares(root).items():
        if (-1, tok) not in taken:
            frontier.append(s)
    for i, tok in enumerate(draft.tokens):
        if depths[i] < drafter.max_depth and tok not in drafter.eos_token_ids:
            for t, s in shares(states[i]).items():
                if (i, t) not in taken:
                    frontier.append(draft.probs[i] * s)
    if len(draft) < budget:
        assert frontier == []  # stopped only because nothing was left
    elif frontier:
        assert min(draft.probs) >= max(frontier) - 1e-12


def test_eos_ends_the_walk_but_may_be_drafted():
    history = index_of([1, 2, 3, EOS, 4, 5], [1, 2, 3, EOS, 4, 5])
    with_eos = Drafter(eos_token_ids={EOS}).draft([1, 2], history=history)
    assert with_eos.tokens == [3, EOS]
    without = Drafter().draft([1, 2], history=history)
    assert without.tokens == [3, EOS, 4, 5]


def test_repeated_token_loop_terminates_within_budget():
    history = index_of([5] * 500)
    for branches in (1, 4):
        drafter = Drafter(max_branches=branches, max_depth=40)
        draft = drafter.draft([5] * 10, history=history, max_tokens=32)
        assert draft.tokens == [5] * 32 and draft.is_chain()
        draft = drafter.draft([5] * 10, history=history, max_tokens=1000)
        assert draft.tokens == [5] * 40  # depth-bound
    # Own output looping: the self source finds the loop.
    own = index_of([1, 2] + [5, 6, 7] * 20)
    draft = Drafter(max_depth=9).draft([5, 6, 7] * 3, own=own)
    assert draft.source == "self" and draft.tokens == [5, 6, 7] * 3


def test_depth_capped_where_counts_are_exact():
    history = SuffixIndex(max_count_len=6)
    history.add(list(range(30)))
    draft = Drafter(max_depth=32).draft([1, 2, 3], history=history)
    assert draft.match_len == 3 and draft.tokens == [4, 5, 6]


def test_longest_match_wins_and_ties_go_to_the_more_trusted_source():
    history = index_of([1, 2, 3, 10])
    siblings = index_of([0, 1, 2, 3, 20])
    own = index_of([0, 1, 2, 3, 30])
    drafter = Drafter()
    d = drafter.draft([0, 1, 2, 3], history=history, siblings=siblings, own=own)
    assert (d.source, d.match_len, d.tokens) == ("siblings", 4, [20])
    d = drafter.draft([9, 1, 2, 3], history=history, siblings=siblings, own=own)
    assert (d.source, d.match_len, d.tokens) == ("history", 3, [10])
    d = drafter.draft([0, 1, 2, 3], siblings=None, own=own)
    assert (d.source, d.tokens) == ("self", [30])


def test_equally_long_matches_go_to_the_source_most_certain_of_the_next_token():
    """A response caught in a loop: its own output has seen the window [2, 3, 4, 5] followed by 1 four
    times, the history once followed by 1 and once by 7. Both match the whole window; the loop is more
    certain (5/6 against 2/4), so it drafts. One occurrence each is a tie: the more trusted source keeps
    it."""
    loop = [1, 2, 3, 4, 5] * 5
    history = index_of([9, 2, 3, 4, 5, 1, 2, 3, 4, 6], [3, 4, 5, 1, 2, 3, 4, 5, 7])
    own = index_of(loop)
    d = Drafter(max_window=4).draft(loop, history=history, own=own)
    assert (d.source, d.match_len) == ("self", 4) and d.tokens[:6] == [1, 2, 3, 4, 5, 1]
    assert next_token_certainty(own, own.longest_match(loop, 4)[1]) == pytest.approx(5 / 6)
    d = Drafter(max_window=4).draft([0, 2, 3, 4], history=index_of([2, 3, 4, 8]), own=index_of([2, 3, 4, 9]))
    assert (d.source, d.tokens) == ("history", [8])


def test_siblings_index_fed_incrementally_including_the_running_sequence():
    group = SuffixIndex()
    a = group.add([])
    b = group.add([])
    group.extend(a, [1, 2, 3, 4, 5])
    group.extend(b, [1, 2])
    d = Drafter().draft([1, 2], siblings=group)  # b's own tail [1, 2] has no continuation
    assert d.source == "siblings" and d.tokens == [3, 4, 5]
    group.extend(b, [3, 9])
    d = Drafter().draft([7, 1, 2], siblings=group)
    assert d.tokens[:2] == [3, 4] or d.tokens[:2] == [3, 9]
    assert sorted(d.paths()) == [[3, 4, 5], [3, 9]]


def test_reward_weighting_prefers_high_reward_branches():
    history = index_of([1, 2, 3], [1, 2, 3], [1, 2, 4], weights=[0.0, 0.0, 1.0])
    plain = Drafter(max_branches=1).draft([1, 2], history=history)
    assert plain.tokens == [3]
    # count + alpha * weight: 3 -> 2 + 0 = 2, 4 -> 1 + 3 * 1 = 4.
    weighted = Drafter(max_branches=1, reward_weighted=True, reward_alpha=3.0).draft([1, 2], history=history)
    assert weighted.tokens == [4] and weighted.probs == pytest.approx([4 / 6])
    # Equal weights everywhere: the same shares as plain counts.
    even = index_of([1, 2, 3], [1, 2, 3], [1, 2, 4], weights=[0.7, 0.7, 0.7])
    a = Drafter(reward_weighted=True).draft([1, 2], history=even)
    b = Drafter().draft([1, 2], history=even)
    assert a.tokens == b.tokens and a.probs == pytest.approx(b.probs)
    # Negative rewards shrink a branch to 10% of its count, never below.
    neg = index_of([1, 2, 3], [1, 2, 4], weights=[-5.0, 1.0])
    d = Drafter(reward_weighted=True).draft([1, 2], history=neg)
    assert d.tokens == [4, 3] and d.probs == pytest.approx([2 / 2.1, 0.1 / 2.1])


def test_draft_helpers():
    d = Draft(tokens=[1, 2, 3, 4], parents=[-1, 0, -1, 2], source="history", match_len=2, probs=[1, 1, 1, 1])
    assert d.depths() == [1, 2, 1, 2]
    assert d.paths() == [[1, 2], [3, 4]]
    assert not d.is_chain() and len(d) == 4
    assert Draft().paths() == [] and Draft().is_chain()


def test_bad_arguments():
    with pytest.raises(ValueError):
        Drafter(min_len=0)
    with pytest.raises(ValueError):
        Drafter(max_window=1, min_len=2)
    with pytest.raises(ValueError):
        Drafter(max_branches=0)
