"""Bubble metrics and the lower bound on timelines worked by hand."""

import math

import pytest

from rhymerl.histopipe.metrics import (bubble_ratio, busy_time, finish_gap, lower_bound, makespan, summary,
                                       tail_time)
from rhymerl.histopipe.timeline import Timeline


def test_makespan_bubble_and_gap():
    tl = Timeline(busy=[[(0.0, 10.0)], [(0.0, 4.0)]], finish=[[10.0], [4.0]], worker=[0, 1])
    assert makespan(tl) == 10 and busy_time(tl) == 14
    assert bubble_ratio(tl) == pytest.approx(1 - 14 / 20)
    assert finish_gap(tl) == 6
    gaps = Timeline(busy=[[(0.0, 2.0), (3.0, 5.0)]], finish=[[5.0]], worker=[0])
    assert bubble_ratio(gaps) == pytest.approx(0.2)  # idle from 2 to 3


def test_tail_time_is_the_last_tenth_of_requests():
    tl = Timeline(busy=[[(0.0, 20.0)]], finish=[[float(t)] for t in (1, 2, 3, 4, 5, 6, 7, 8, 9, 20)],
                  worker=[0] * 10)
    assert tail_time(tl) == 11  # 9 of 10 done at 9, the last at 20
    assert tail_time(tl, share=0.25) == 13  # ceil(2.5) = 3 left once 7 are done, at 7
    assert tail_time(Timeline(busy=[[(0.0, 4.0)]], finish=[[4.0]], worker=[0])) == 4  # one request: all tail


def test_lower_bound_by_hand():
    cost = lambda t, s=1: 1.0 + t  # noqa: E731  steps of 1..4 sequences: 2 3 4 5 s, best per token 5/4
    # alone: 10 steps of at least 2 s = 20; spread: 16 tokens x 1.25 / 2 workers = 10
    assert lower_bound([[10], [2, 2, 2]], 2, 4, cost) == 20
    # many short requests: the spread term wins, 40 x 1.25 / 2 = 25
    assert lower_bound([[1]] * 40, 2, 4, cost) == 25
    assert lower_bound([], 2, 4, cost) == 0


def test_summary_fields():
    tl = Timeline(busy=[[(0.0, 20.0)], [(0.0, 10.0)]], finish=[[20.0], [10.0]], worker=[0, 1])
    s = summary(tl, [[10], [5]], 1, lambda t, s=1: 2.0)
    assert s["makespan"] == 20 and s["lower_bound"] == 20 and s["makespan_over_lb"] == 1
    assert s["bubble"] == pytest.approx(0.25) and s["finish_gap"] == 10
    assert s["tail_time"] == 10 and s["tail_share"] == 0.5
    empty = summary(Timeline(busy=[[]], finish=[], worker=[]), [], 1, lambda t, s=1: 1.0)
    assert empty["makespan"] == 0 and math.isnan(empty["makespan_over_lb"])
