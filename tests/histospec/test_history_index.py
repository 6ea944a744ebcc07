"""HistoryIndex: suffix indexes over a history store, cached per prompt version."""

from rhymerl.histospec.history_index import HistoryIndex
from rhymerl.history import HistoryStore
from suffix_index_check import check_suffix_index


def test_index_is_cached_and_rebuilt_when_history_changes():
    store = HistoryStore()
    indexes = HistoryIndex(store, index_prompt_tokens=2)
    prompt = [10, 11, 12]
    assert indexes.index(prompt) is None
    store.record_rollout(prompt, [[1, 2, 3], [1, 2, 4]], [1.0, 0.0])
    index = indexes.index(prompt)
    assert indexes.index(prompt) is index
    assert index.num_sequences == 2
    assert index.sequence(0) == [11, 12, 1, 2, 3]  # the prompt's tail in front of each response
    n, state = index.longest_match([11, 12])
    assert n == 2 and index.continuations(state) == {1: (2, 1.0)}
    n, state = index.longest_match([1, 2])
    assert index.continuations(state) == {3: (1, 1.0), 4: (1, 0.0)}
    store.record_rollout(prompt, [[1, 2, 5]], [None])  # unknown reward: weight 1.0
    rebuilt = indexes.index(prompt)
    assert rebuilt is not index and rebuilt.num_sequences == 3
    n, state = rebuilt.longest_match([1, 2])
    assert rebuilt.continuations(state)[5] == (1, 1.0)
    check_suffix_index(rebuilt)


def test_index_cache_is_bounded():
    store = HistoryStore()
    indexes = HistoryIndex(store, max_index_tokens=5, index_prompt_tokens=0)
    for i in range(4):
        store.record_rollout([i], [[1, 2]])  # 2-token indexes: two fit
    first = indexes.index([0])
    indexes.index([1])
    indexes.index([2])
    assert indexes.index([0]) is not first  # evicted from the cache, rebuilt
    assert len(indexes._indexes) == 2
    store.record_rollout([9], [[1] * 10])
    big = indexes.index([9])
    assert indexes.index([9]) is big and len(indexes._indexes) == 1  # over the budget alone: still cached


def test_a_merged_replica_rebuilds_only_the_indexes_whose_prompt_changed():
    truth, replica = HistoryStore(), HistoryStore()
    a, b = [1, 2], [3, 4]
    truth.record_rollout(a, [[5, 6]])
    truth.record_rollout(b, [[7, 8]])
    replica.merge(truth.export([a, b]))
    indexes = HistoryIndex(replica)
    index_a, index_b = indexes.index(a), indexes.index(b)
    truth.record_rollout(a, [[5, 9]])
    replica.merge(truth.export([a, b]))
    assert indexes.index(b) is index_b
    assert indexes.index(a) is not index_a and indexes.index(a).num_sequences == 2
