"""SuffixIndex against a brute-force reference, with the exhaustive integrity check after every mutation."""

import random

import pytest

from rhymerl.histospec.suffix_index import SuffixIndex
from suffix_index_check import check_suffix_index


# ---------------------------------------------------------------- brute-force reference

def ref_continuations(seqs, weights, pattern):
    """token -> (occurrences of pattern followed by it, summed weight), searching every sequence."""
    out = {}
    k = len(pattern)
    for seq, w in zip(seqs, weights):
        for i in range(len(seq) - k):
            if seq[i:i + k] == pattern:
                c, s = out.get(seq[i + k], (0, 0.0))
                out[seq[i + k]] = (c + 1, s + w)
    return out


def ref_occurs(seqs, pattern):
    k = len(pattern)
    return any(seq[i:i + k] == pattern for seq in seqs for i in range(len(seq) - k + 1))


def ref_longest_match(seqs, context, max_window, min_len, need_continuation=True):
    for n in range(min(max_window, len(context)), min_len - 1, -1):
        pattern = context[len(context) - n:]
        if (ref_continuations(seqs, [0.0] * len(seqs), pattern) if need_continuation
                else ref_occurs(seqs, pattern)):
            return n
    return 0


def assert_matches_reference(index, seqs, weights, rng, alphabet, probes=12):
    for _ in range(probes):
        context = [rng.randrange(alphabet) for _ in range(rng.randrange(0, 9))]
        if seqs and rng.random() < 0.5:  # a context that surely occurs somewhere
            seq = rng.choice(seqs)
            j = rng.randrange(len(seq) + 1)
            context = seq[max(0, j - rng.randrange(1, 9)):j]
        for need in (True, False):
            window, min_len = rng.randrange(1, 8), rng.randrange(1, 4)
            n, state = index.longest_match(context, window, min_len, need_continuation=need)
            expected = ref_longest_match(seqs, context, min(window, index.max_count_len - 1), min_len, need)
            assert n == expected, (context, window, min_len, need)
            if n == 0:
                assert state is None
                continue
            pattern = context[len(context) - n:]
            assert index.continuations(state) == ref_continuations(seqs, weights, pattern)
            assert index.find(pattern) == state
        # Walking the continuations several tokens deep keeps the counts right.
        state, pattern = 0, []
        for _ in range(min(4, index.max_count_len - 1)):
            conts = index.continuations(state)
            assert conts == ref_continuations(seqs, weights, pattern) if pattern else True
            if not conts:
                break
            tok = rng.choice(sorted(conts))
            state = index.step(state, tok)
            pattern.append(tok)
            assert index.count(state) == sum(
                1 for s in seqs for i in range(len(s) - len(pattern) + 1) if s[i:i + len(pattern)] == pattern)


# ---------------------------------------------------------------- randomised

@pytest.mark.parametrize("seed", range(60))
def test_random_against_reference(seed):
    rng = random.Random(seed)
    alphabet = rng.choice([1, 2, 3, 4])
    index = SuffixIndex(max_count_len=rng.choice([2, 3, 64]))
    seqs, weights = [], []
    for _ in range(rng.randrange(4, 14)):
        if seqs and rng.random() < 0.55:
            sid = rng.randrange(len(seqs))  # any sequence, not only the last one
            more = [rng.randrange(alphabet) for _ in range(rng.randrange(0, 6))]
            index.extend(sid, more)
            seqs[sid] = seqs[sid] + more
        else:
            tokens = [rng.randrange(alphabet) for _ in range(rng.randrange(0, 10))]
            w = rng.choice([0.0, 0.5, 1.0, 2.0, -1.0])
            assert index.add(tokens, w) == len(seqs)
            seqs.append(tokens)
            weights.append(w)
        check_suffix_index(index)
        assert index.num_sequences == len(seqs)
        assert index.num_tokens == sum(map(len, seqs))
        assert [index.sequence(i) for i in range(len(seqs))] == seqs
        assert_matches_reference(index, seqs, weights, rng, alphabet)


def canonical(index):
    """The automaton relabelled by BFS from the root (sorted tokens): equal iff isomorphic."""
    order, label = [0], {0: 0}
    for v in order:
        for tok in sorted(index._next[v]):
            u = index._next[v][tok]
            if u not in label:
                label[u] = len(order)
                order.append(u)
    return [(index._len[v], label.get(index._link[v], -1), index._cnt[v], index._wt[v],
             sorted((t, label[u]) for t, u in index._next[v].items())) for v in order]


@pytest.mark.parametrize("seed", range(20))
def test_interleaved_extend_equals_adding_whole_sequences(seed):
    rng = random.Random(100 + seed)
    seqs = [[rng.randrange(3) for _ in range(rng.randrange(0, 25))] for _ in range(rng.randrange(1, 5))]
    weights = [rng.choice([0.5, 1.0, 3.0]) for _ in seqs]
    whole = SuffixIndex()
    for s, w in zip(seqs, weights):
        whole.add(s, w)
    pieces = SuffixIndex()
    ids = [pieces.add([], w) for w in weights]
    pos = [0] * len(seqs)
    while any(p < len(s) for p, s in zip(pos, seqs)):
        i = rng.choice([i for i, s in enumerate(seqs) if pos[i] < len(s)])
        k = rng.randrange(1, 4)
        pieces.extend(ids[i], seqs[i][pos[i]:pos[i] + k])
        pos[i] += k
    check_suffix_index(pieces)
    check_suffix_index(whole)
    assert canonical(pieces) == canonical(whole)


# ---------------------------------------------------------------- specific behaviour

def test_match_never_crosses_sequence_boundaries():
    index = SuffixIndex()
    index.add([1, 2, 3])
    index.add([4, 5, 6])
    assert index.find([3, 4]) is None
    assert index.find([2, 3]) is not None
    # [2, 3] occurs only at the end of a sequence: no continuation, so no drafting match...
    assert index.longest_match([9, 2, 3]) == (0, None)
    # ...but it does occur.
    n, state = index.longest_match([9, 2, 3], need_continuation=False)
    assert n == 2 and index.continuations(state) == {}
    # The longest match with a continuation falls back to a shorter suffix.
    index.add([3, 7])
    n, state = index.longest_match([1, 2, 3], min_len=1)
    assert n == 1 and index.continuations(state) == {7: (1, 1.0)}


def test_counts_weights_and_step():
    index = SuffixIndex()
    index.add([1, 2, 3, 1, 2, 4], weight=1.0)
    index.add([1, 2, 3], weight=0.5)
    n, state = index.longest_match([0, 1, 2], max_window=7, min_len=2)
    assert n == 2
    assert index.continuations(state) == {3: (2, 1.5), 4: (1, 1.0)}
    assert index.count(state) == 3 and index.total_weight(state) == 2.5
    deeper = index.step(state, 3)
    assert index.continuations(deeper) == {1: (1, 1.0)}
    assert index.step(state, 9) is None


def test_window_and_min_len():
    index = SuffixIndex()
    index.add(list(range(20)))
    ctx = list(range(10))
    assert index.longest_match(ctx, max_window=7)[0] == 7
    assert index.longest_match(ctx, max_window=3)[0] == 3
    assert index.longest_match([1], min_len=2) == (0, None)
    assert index.longest_match([], min_len=1) == (0, None)
    assert index.longest_match([50, 51, 5], min_len=1)[0] == 1
    assert index.longest_match([50, 51, 5], min_len=2) == (0, None)


def test_long_repeated_token_loop_stays_linear_and_exact():
    index = SuffixIndex(max_count_len=8)
    index.add([5] * 2000)
    assert index.num_states == 2001
    n, state = index.longest_match([5] * 7)
    assert n == 7 and index.continuations(state) == {5: (2000 - 7, 2000 - 7.0)}
    small = SuffixIndex(max_count_len=4)
    small.add([5] * 30)
    small.extend(0, [6, 5, 5])
    check_suffix_index(small)


def test_empty_and_errors():
    index = SuffixIndex()
    assert index.longest_match([1, 2, 3]) == (0, None)
    assert index.add([]) == 0
    assert index.num_tokens == 0 and index.num_sequences == 1
    check_suffix_index(index)
    with pytest.raises(ValueError):
        index.extend(1, [1])
    with pytest.raises(ValueError):
        index.extend(-1, [1])
    with pytest.raises(ValueError):
        index.longest_match([1, 2], min_len=0)
    with pytest.raises(ValueError):
        SuffixIndex(max_count_len=0)


@pytest.mark.parametrize("corrupt, name", [
    (lambda ix: ix._cnt.__setitem__(ix.find([1, 2]), 99), "count"),
    (lambda ix: ix._len.__setitem__(ix.find([1, 2, 3]), 1), "link-shorter"),
    (lambda ix: ix._next[0].pop(3), "transition-suffix-closed"),
    (lambda ix: ix._wt.__setitem__(ix.find([2]), 0.25), "weight"),
    (lambda ix: ix._link.__setitem__(0, 0), "root"),
    (lambda ix: ix._dlen.__setitem__(0, 1), "count-suffix-len"),
])
def test_check_integrity_names_the_broken_invariant(corrupt, name):
    index = SuffixIndex()
    index.add([1, 2, 3, 1, 2])
    index.add([2, 3])
    check_suffix_index(index)
    corrupt(index)
    with pytest.raises(AssertionError, match=name):
        check_suffix_index(index)
