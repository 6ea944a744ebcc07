"""One worker's continuous batching model against step counts worked by hand."""

import random

import pytest

from rhymerl.cost_model import CostModel
from rhymerl.histopipe.batching import decode_costs, run_cost, run_worker, steps_to_reach, worker_time


def const(seconds):
    return lambda tokens, seqs=1: seconds


def test_fifo_refill_by_hand():
    # Two slots, lengths 5 3 4: requests 0 and 1 start; 1 ends after step 3, 2 takes its slot for steps
    # 4..7; 0 ends after step 5. Seven steps of 0.5 s.
    run = run_worker([5, 3, 4], 2, decode_costs(const(0.5), 2))
    assert run.end == 3.5
    assert run.finish == [2.5, 1.5, 3.5]
    assert run.start == [0.0, 0.0, 1.5]
    assert run.occupancy == [(0.0, 2), (2.5, 1), (3.5, 0)]  # 1 -> 2 swap keeps the batch at 2


def test_step_cost_depends_on_the_batch():
    # cost(n, n) = n: two steps of 2 sequences (2 s each), then one of 1 sequence.
    run = run_worker([3, 2], 2, decode_costs(lambda t, s=1: float(t), 2))
    assert run.finish == [5.0, 4.0] and run.end == 5.0
    assert run.occupancy == [(0.0, 2), (4.0, 1), (5.0, 0)]


def test_prefill_is_paid_at_admission_and_empty_lengths_count_one():
    run = run_worker([2, 2], 1, decode_costs(const(1.0), 1), prefill=[1.0, 1.0])
    assert run.start == [1.0, 4.0] and run.finish == [3.0, 6.0]
    assert run_worker([0], 1, [0.0, 2.0]).end == 2.0
    assert run_worker([], 3, [0.0, 1.0, 1.0, 1.0]).end == 0.0


def test_decode_costs_reads_the_cost_model():
    cm = CostModel([1, 4], [1, 2], [[1.0, 1.5], [2.0, 3.0]])
    table = decode_costs(cm, 4)
    assert table[0] == 0.0 and table[1] == cm(1, 1) and table[4] == cm(4, 4) == 2.0
    with pytest.raises(ValueError):
        decode_costs(cm, 0)


def test_worker_time_matches_run_worker():
    rng = random.Random(0)
    step_cost = decode_costs(lambda t, s=1: 1.0 + 0.1 * t, 8)
    for _ in range(50):
        lengths = [rng.randint(1, 200) for _ in range(rng.randint(0, 30))]
        slots = rng.randint(1, 8)
        assert worker_time(lengths, slots, step_cost) == pytest.approx(run_worker(lengths, slots, step_cost).end)


def test_steps_to_reach_is_the_fewest_steps_whose_cost_reaches_the_time():
    """Where a running worker's next step boundary is: checked against a linear scan, with and without the
    attention term."""
    step_cost = [0.0, 1.0, 1.5, 2.0]
    for per_key in (0.0, 0.01):
        for now in (0.0, 0.5, 3.0, 7.25, 100.0):
            clock, most = 2.0, 20
            scan = next((k for k in range(most + 1)
                         if clock + run_cost(3, 4, 4 + k, 1.0, step_cost, per_key) >= now), most)
            assert steps_to_reach(clock, now, 3, 4, most, 1.0, step_cost, per_key) == scan
