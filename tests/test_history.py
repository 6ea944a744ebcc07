"""HistoryStore: last K rollouts with rewards, budgets, LRU eviction, persistence, versions and slices."""

import json
import random

import pytest

from rhymerl.history import HistoryStore, Rollout, prompt_key


def test_prompt_key_is_stable_and_distinguishes_prompts():
    assert prompt_key([1, 2, 3]) == prompt_key((1, 2, 3))
    assert prompt_key([1, 2, 3]) != prompt_key([1, 2, 4])
    assert prompt_key([]) != prompt_key([0])
    assert prompt_key([256]) != prompt_key([1, 0])  # fixed-width encoding: no ambiguity
    # Pinned: a changed key would orphan every saved history store.
    assert prompt_key([1, 2, 3]) == "abccad42d03c940bc2b249bf5a4e1e3d"


def test_keeps_last_k_rollouts_with_rewards():
    store = HistoryStore(max_rollouts=2)
    prompt = [7, 8, 9]
    for epoch in range(4):
        kept = store.record_rollout(prompt, [[epoch, 1], [epoch, 2, 3]], [epoch * 1.0, None])
        assert kept == 2
    assert store.rollouts(prompt) == [Rollout([[2, 1], [2, 2, 3]], [2.0, None]),
                                      Rollout([[3, 1], [3, 2, 3]], [3.0, None])]
    assert store.responses(prompt) == [[2, 1], [2, 2, 3], [3, 1], [3, 2, 3]]
    assert store.responses(prompt_key(prompt)) == store.responses(prompt)
    assert store.size() == {"prompts": 1, "rollouts": 2, "responses": 4, "tokens": 3 + 10}
    assert store.responses([1]) == [] and store.rollouts([1]) == []
    assert store.prompt(prompt_key(prompt)) == prompt
    # No rewards given: all None.
    store.record_rollout([1], [[2]])
    assert store.rollouts([1]) == [Rollout([[2]], [None])]
    with pytest.raises(ValueError):
        store.record_rollout([1], [[2], [3]], [1.0])


def test_lru_eviction_of_whole_prompts():
    store = HistoryStore(max_total_tokens=30)
    a, b, c = [1] * 5, [2] * 5, [3] * 5
    store.record_rollout(a, [[0] * 5])  # 10 tokens
    store.record_rollout(b, [[0] * 5])  # 20
    store.responses(a)                  # a is now more recent than b
    store.record_rollout(c, [[0] * 5])  # 30: fits
    assert len(store) == 3
    store.record_rollout(c, [[0] * 4])  # 34: evict the least recently used (b)
    assert a in store and b not in store and c in store
    assert store.size()["tokens"] == 24
    store.version(a)                    # version() counts as a use too
    store.record_rollout(b, [[0] * 5])  # 34 -> evict c
    assert a in store and b in store and c not in store
    assert store.size()["tokens"] <= 30


def test_per_prompt_budget_drops_oldest_rollout_then_trailing_responses():
    store = HistoryStore(max_tokens_per_prompt=20, max_rollouts=4)
    p = [9, 9]
    store.record_rollout(p, [[1] * 4, [2] * 4])   # 2 + 8
    store.record_rollout(p, [[3] * 4, [4] * 4])   # 18
    store.record_rollout(p, [[5] * 4])            # 22 -> drop the oldest rollout: 14
    assert store.responses(p) == [[3] * 4, [4] * 4, [5] * 4]
    assert store.size()["tokens"] == 14
    # A rollout bigger than the budget alone: oldest rollouts go, then its last responses.
    assert store.record_rollout(p, [[6] * 10, [7] * 5, [8] * 5], [1.0, 2.0, 3.0]) == 2
    assert store.rollouts(p) == [Rollout([[6] * 10, [7] * 5], [1.0, 2.0])]
    assert store.size()["tokens"] == 17
    # A prompt over the budget is not stored at all.
    assert store.record_rollout([0] * 21, [[1]]) == 0
    assert [0] * 21 not in store
    # Neither is an empty rollout.
    assert store.record_rollout([4], []) == 0 and [4] not in store


@pytest.mark.parametrize("seed", range(10))
def test_budgets_always_respected(seed):
    rng = random.Random(seed)
    store = HistoryStore(max_rollouts=3, max_tokens_per_prompt=40, max_total_tokens=100)
    prompts = [[i] * rng.randrange(1, 6) for i in range(8)]
    for _ in range(60):
        p = rng.choice(prompts)
        responses = [[rng.randrange(5)] * rng.randrange(0, 15) for _ in range(rng.randrange(1, 4))]
        store.record_rollout(p, responses, [rng.random() for _ in responses])
        total = 0
        for q in prompts:
            rollouts = store.rollouts(q)
            assert len(rollouts) <= 3
            tokens = (len(q) if q in store else 0) + sum(len(r) for ro in rollouts for r in ro.responses)
            assert tokens <= 40
            total += tokens
        assert total == store.size()["tokens"] <= 100


def test_save_load_round_trip(tmp_path):
    rng = random.Random(0)
    store = HistoryStore(max_rollouts=2, max_total_tokens=200)
    for _ in range(30):
        p = [rng.randrange(50) for _ in range(rng.randrange(1, 4))]
        responses = [[rng.randrange(1000) for _ in range(rng.randrange(1, 9))] for _ in range(2)]
        store.record_rollout(p, responses, [rng.choice([0.0, 1.0, None]), 0.5])
    path = tmp_path / "history.json"
    store.save(path)
    assert [f.name for f in tmp_path.iterdir()] == ["history.json"]  # no temp file left behind
    loaded = HistoryStore(max_rollouts=2, max_total_tokens=200)
    loaded.load(path)
    assert loaded.state_dict() == store.state_dict()
    assert json.loads(path.read_text()) == store.state_dict()
    assert loaded.size() == store.size()
    # LRU order survives: the next eviction removes the same prompt in both.
    big = [[1] * 60]
    store.record_rollout([999], big)
    loaded.record_rollout([999], big)
    assert loaded.state_dict() == store.state_dict()
    with pytest.raises(ValueError):
        loaded.load_state_dict({"format": "something else"})


def test_load_applies_this_stores_budgets():
    store = HistoryStore(max_rollouts=4)
    for epoch in range(4):
        store.record_rollout([1, 2], [[epoch] * 3])
    small = HistoryStore(max_rollouts=2)
    small.load_state_dict(store.state_dict())
    assert small.responses([1, 2]) == [[2] * 3, [3] * 3]


def test_a_replica_follows_the_store_through_export_and_merge():
    """A worker's replica gets the slice its prompts need; a prompt whose version did not move is left alone."""
    truth, replica = HistoryStore(), HistoryStore()
    a, b = [1, 2, 3], [4, 5, 6]
    truth.record_rollout(a, [[7, 8]], [1.0])
    slice_ = json.loads(json.dumps(truth.export([a, b, a])))  # plain data; b has no history yet
    assert [item["prompt"] for item in slice_["prompts"]] == [a]
    assert replica.merge(slice_) == 1
    assert replica.rollouts(a) == truth.rollouts(a) and b not in replica
    assert replica.version(a) == truth.version(a)
    assert replica.merge(truth.export([a])) == 0  # unchanged
    truth.record_rollout(a, [[9]], [0.0])
    truth.record_rollout(b, [[1]], [None])
    assert replica.merge(truth.export([a, b])) == 2
    assert replica.rollouts(a) == truth.rollouts(a) and replica.rollouts(b) == truth.rollouts(b)
    with pytest.raises(ValueError, match="not a history store state"):
        replica.merge({"prompts": []})


def test_versions_survive_a_checkpoint():
    """A resumed store keeps the versions its replicas were sent, and its clock goes on from there."""
    store = HistoryStore()
    store.record_rollout([1], [[2]])
    store.record_rollout([3], [[4]])
    resumed = HistoryStore()
    resumed.load_state_dict(json.loads(json.dumps(store.state_dict())))
    assert resumed.version([1]) == store.version([1]) and resumed.version([3]) == store.version([3])
    resumed.record_rollout([1], [[5]])
    assert resumed.version([1]) > max(store.version([1]), store.version([3]))
