"""LengthPredictor (history statistic, prior, online update) and the rank statistics, by hand-worked examples."""

import math

import pytest

from rhymerl.history import HistoryStore, prompt_key
from rhymerl.histopipe.predict import (LengthPredictor, moved_far_share, quantile, rank_report, ranks,
                                       spearman, summarise)


def test_quantile_interpolates_like_numpy():
    assert quantile([4, 1, 3, 2], 0.75) == 3.25  # sorted 1 2 3 4: position 2.25
    assert quantile([7], 0.3) == 7
    assert quantile([1, 2], 0.0) == 1 and quantile([1, 2], 1.0) == 2
    assert summarise([10, 20, 30, 40], "mean") == 25
    assert summarise([10, 20, 30, 40], "max") == 40
    assert summarise([10, 20, 30, 40], "median") == 25


def test_prediction_from_the_last_rollouts():
    p = LengthPredictor(statistic=0.75)  # the quantile statistic (the default is the censored lognormal)
    p.record("a", [10, 20, 30, 40])
    assert p.predict("a") == 32.5
    assert LengthPredictor(statistic="mean").predict("x") == 512.0  # nothing recorded: the default
    q = LengthPredictor(statistic="mean", max_rollouts=2)
    for lengths in ([10], [20], [30]):
        q.record("a", lengths)
    assert q.lengths("a") == [[20], [30]]  # the oldest dropped
    assert q.predict("a") == 25
    assert LengthPredictor(statistic="max").predict_many([]) == []


def test_prior_then_online_update_as_siblings_finish():
    p = LengthPredictor(statistic=0.75, default_length=100)
    assert p.prior() == 100 and p.predict("b") == 100  # nothing recorded yet
    p.record("a", [10, 20, 30, 40])
    assert p.prior() == 32.5 and p.predict("b") == 32.5  # the global 0.75 quantile
    assert "a" in p and "b" not in p
    p.observe_finished("b", 5)
    assert p.predict("b") == 5  # the longest finished sibling (Seer's estimate)
    p.observe_finished("b", 7)
    assert p.predict("b") == 7
    # The siblings also move the prior of other new prompts: pool 5 7 10 20 30 40, position 3.75.
    assert p.predict("c") == 27.5
    p.record("b", [5, 7, 9, 11])  # the group is done: its lengths replace what was seen
    assert p.predict("b") == 9.5
    # A prompt with history: a finished sibling longer than the history's statistic raises the prediction.
    p.observe_finished("a", 100)
    assert p.predict("a") == 100
    p.clear_observed()
    assert p.predict("a") == 32.5


def test_token_ids_and_keys_are_the_same_prompt():
    p = LengthPredictor(statistic="max")
    p.record([1, 2, 3], [4, 8])
    assert p.predict(prompt_key([1, 2, 3])) == 8 == p.predict([1, 2, 3])


def test_from_history_store_keeps_its_eviction_order():
    store = HistoryStore(max_rollouts=4)
    store.record_rollout([1, 2], [[1] * 4, [1] * 6])
    store.record_rollout([3, 4], [[1] * 10])
    store.record_rollout([1, 2], [[1] * 8, [1] * 2])
    order = store.keys()
    p = LengthPredictor.from_history(store, statistic="mean")
    assert store.keys() == order
    assert p.lengths([1, 2]) == [[4, 6], [8, 2]]
    assert p.predict([1, 2]) == 5 and p.predict([3, 4]) == 10
    p.load_history(HistoryStore(), prompts=[[3, 4]])  # a store without it: forgotten
    assert [3, 4] not in p


def test_bad_arguments():
    with pytest.raises(ValueError):
        LengthPredictor(statistic="p90")
    with pytest.raises(ValueError):
        LengthPredictor(statistic=1.5)
    with pytest.raises(ValueError):
        LengthPredictor(max_rollouts=0)


def test_ranks_average_ties():
    assert ranks([10, 30, 20, 20]) == [1, 4, 2.5, 2.5]


def test_spearman_hand_worked():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # 1 - 6 sum d^2 / (n (n^2 - 1)) = 1 - 6 * 4 / 60
    assert spearman([1, 2, 3, 4], [2, 1, 4, 3]) == pytest.approx(0.6)
    # ties: ranks 1 2 3 vs 1.5 1.5 3, cov 1.5, variances 2 and 1.5
    assert spearman([1, 2, 3], [1, 1, 2]) == pytest.approx(1.5 / math.sqrt(3))
    assert math.isnan(spearman([1], [1]))
    assert math.isnan(spearman([1, 2, 3], [5, 5, 5]))


def test_moved_far_share_hand_worked():
    assert moved_far_share([1, 2, 3, 4], [1, 2, 3, 4]) == 0.0
    assert moved_far_share([1, 2, 3, 4], [4, 2, 3, 1]) == 0.5  # two moved 3 ranks, more than 4 / 4
    # n = 8: more than 2 ranks is far. 1<->4 moved 3 (far, both), 5<->7 moved 2 (not far).
    assert moved_far_share(list(range(1, 9)), [4, 2, 3, 1, 7, 6, 5, 8]) == 0.25
    assert moved_far_share([], []) == 0.0
    report = rank_report([1, 2, 3, 4], [2, 1, 4, 3])
    assert report == {"rank_corr": pytest.approx(0.6), "moved_far": 0.0, "prompts": 4}
    with pytest.raises(ValueError):
        spearman([1, 2], [1])
