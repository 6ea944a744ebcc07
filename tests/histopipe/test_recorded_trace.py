"""The shipped trace of the `repeat` task (`histopipe/traces/repeat.jsonl`, recorded by `rhymerl train`; see
the notebook of 2026-11-27): it loads, every prompt appears at least 4 times, and its rank statistics are the
ones the notebook states. `rhyme_stats` itself is checked on a hand-made trace."""

import pytest

from rhymerl.bench.pipe_real import RECORDED_TRACE
from rhymerl.histopipe.trace import read_trace
from rhymerl.histopipe.trace_stats import epochs_by_appearance, rhyme_stats

CAP = 192  # the recorded run's rollout.max_completion_length
# The figures docs/notebook/2026-11-27.md states ("The repeat task's trace").
SPEARMAN = [0.914, 0.991, 1.0]
AT_CAP = 0.0
BETWEEN = 0.897
SPREAD = {"min": 10, "p10": 11.0, "median": 41.0, "p90": 71.0, "max": 83, "p90_over_p10": 6.5}


def test_rhyme_stats_on_a_hand_made_trace():
    rows = [{"step": 1, "groups": [{"prompt": "a", "lengths": [10, 12]}, {"prompt": "b", "lengths": [50, 60]}]},
            {"step": 2, "groups": [{"prompt": "c", "lengths": [100, 100]}, {"prompt": "a", "lengths": [11, 9]}]},
            {"step": 3, "groups": [{"prompt": "b", "lengths": [55, 100]}, {"prompt": "c", "lengths": [90, 80]}]}]
    epochs = epochs_by_appearance(rows)  # a prompt's k-th appearance is its epoch k, whatever the step
    assert epochs == [{"a": [10, 12], "b": [50, 60], "c": [100, 100]}, {"a": [11, 9], "b": [55, 100], "c": [90, 80]}]
    stats = rhyme_stats(rows, cap=100)
    assert stats["spearman"] == [pytest.approx(1.0)] and stats["appearances_min"] == 2
    assert stats["at_cap"] == 3 / 12 and stats["prompts"] == 3 and stats["responses"] == 12
    assert stats["spread"]["min"] == 9 and stats["spread"]["max"] == 100
    assert 0.8 < stats["between_prompt_share"] < 1


def test_the_shipped_trace_rhymes_as_the_notebook_says():
    rows = read_trace(RECORDED_TRACE)
    stats = rhyme_stats(rows, CAP)
    assert (stats["steps"], stats["prompts"], stats["responses"]) == (12, 12, 192)
    assert stats["appearances_min"] >= 4
    assert [round(x, 3) for x in stats["spearman"]] == SPEARMAN
    assert round(stats["at_cap"], 3) == AT_CAP
    assert round(stats["between_prompt_share"], 3) == BETWEEN
    assert {k: round(v, 1) for k, v in stats["spread"].items()} == SPREAD
