"""`histopipe/rank_corr` (`rl.step_metrics.length_report`) reports the predictor the scheduler plans with
(issue 32): the censored `LengthPredictor`, lengths at max_completion_length taken as lower bounds."""

import pytest

from rhymerl.histopipe.predict import LengthPredictor, rank_report
from rhymerl.history import HistoryStore
from rhymerl.rl.step_metrics import length_report

CAP = 64


def test_the_metric_is_the_schedulers_predictor_with_the_cap():
    store = HistoryStore(max_rollouts=4)
    prompts = [[1, 2], [3, 4], [5, 6], [7, 8]]
    before = [[CAP, CAP], [CAP, 40], [20, 30], [10, 12]]  # the first two were cut: lower bounds
    for ids, lengths in zip(prompts, before):
        store.record_rollout(ids, [[1] * n for n in lengths])
    now = [[CAP, CAP], [60, CAP], [25, 31], [9, 14]]
    report = length_report(store, prompts, now, cap=CAP)
    predicted = LengthPredictor.from_history(store, prompts, cap=CAP).predict_many(prompts)
    expected = rank_report(predicted, [sum(ls) / len(ls) for ls in now])
    assert report["histopipe/rank_corr"] == pytest.approx(expected["rank_corr"]) == pytest.approx(1.0)
    assert report["histopipe/prompts_with_history"] == 4 and report["histopipe/moved_far"] == 0.0
    # censoring is what separates the two cut prompts: all cut ranks above half cut
    assert predicted[0] > predicted[1] > predicted[2] > predicted[3]
    assert length_report(store, [[9, 9]], [[5]], cap=CAP) == {}  # fewer than two with history
