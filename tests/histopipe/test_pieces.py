"""Tier 2 (`histopipe.pieces`, `plan.plan_pieces`): a long group split over several workers, sized on the
worker model; and the attention-priced batching model against a step-by-step reference."""

import random

import pytest

from rhymerl.histopipe.batching import ContextCost, decode_costs, run_worker, worker_time
from rhymerl.histopipe.metrics import lower_bound, makespan
from rhymerl.histopipe.pieces import split_groups
from rhymerl.histopipe.plan import plan, plan_pieces
from rhymerl.histopipe.simulate import run_plan


def affine(tokens, seqs=1):
    return 1.0 + 0.25 * tokens  # a step of n sequences costs 1 + n/4: batching pays, up to a point


PRICED = ContextCost(affine, per_key=0.01)


def reference_worker(lengths, slots, cost):
    """One decode step at a time: the admitted requests, each step costing cost(n, n) + per_key x keys."""
    queue, running, clock, finish = list(range(len(lengths))), {}, 0.0, [0.0] * len(lengths)
    while queue or running:
        while queue and len(running) < slots:
            running[queue.pop(0)] = 0  # tokens decoded so far
        n = len(running)
        clock += cost(n, n) + cost.per_key * sum(done + 1 for done in running.values())
        for r in list(running):
            running[r] += 1
            if running[r] >= max(lengths[r], 1):
                finish[r] = clock
                del running[r]
    return finish


def test_attention_priced_batching_matches_the_step_by_step_reference():
    rng = random.Random(0)
    lengths = [rng.randint(1, 60) for _ in range(23)]
    run = run_worker(lengths, 4, decode_costs(PRICED, 4), per_key=PRICED.per_key)
    assert run.finish == pytest.approx(reference_worker(lengths, 4, PRICED))
    assert worker_time(lengths, 4, decode_costs(PRICED, 4), PRICED.per_key) == pytest.approx(run.end)
    # a request alone: L steps of cost(1) plus L (L + 1) / 2 keys, the lower bound's "alone" term
    assert run_worker([50], 4, decode_costs(PRICED, 4), per_key=0.01).end == pytest.approx(50 * 1.25 + 0.01 * 1275)
    assert lower_bound([[50]], 1, 4, PRICED) == pytest.approx(50 * 1.25 + 0.01 * 1275)


def test_a_long_group_is_split_and_short_ones_stay_whole():
    # one group of 4 long requests among 12 short groups, 4 workers of 4 slots
    lengths = [[400.0] * 4] + [[20.0] * 4 for _ in range(12)]
    pieces = split_groups(lengths, 4, 4, PRICED)
    long_pieces = [idx for g, idx in pieces if g == 0]
    assert len(long_pieces) > 1 and sorted(i for idx in long_pieces for i in idx) == [0, 1, 2, 3]
    assert all(len(idx) == 4 for g, idx in pieces if g != 0)
    # the longest requests are dealt round robin (pieces alike), and no further than the longest request alone
    # allows: two pieces, not four singletons
    uneven = split_groups([[900.0, 800.0, 100.0, 90.0]] + [[20.0] * 4] * 12, 4, 4, PRICED)
    assert [idx for g, idx in uneven if g == 0] == [(0, 2), (1, 3)]
    with pytest.raises(ValueError):
        split_groups(lengths, 4, 4, PRICED, split_at=0)


def test_tier2_shortens_the_step_when_one_group_dominates():
    lengths = [[400] * 4] + [[20] * 4 for _ in range(12)]
    sizes = [4] * 13
    whole = plan_pieces(sizes, 4, "oracle", cost_model=PRICED, slots=4, true_lengths=lengths, tier2=False)
    split = plan_pieces(sizes, 4, "oracle", cost_model=PRICED, slots=4, true_lengths=lengths)
    assert [[g for g, _ in ws] for ws in whole] == plan(sizes, 4, "oracle", cost_model=PRICED, slots=4,
                                                        true_lengths=lengths)
    t_whole = makespan(run_plan(lengths, whole, slots=4, cost_model=PRICED))
    t_split = makespan(run_plan(lengths, split, slots=4, cost_model=PRICED))
    assert t_split < 0.8 * t_whole
    # every request placed once; the baselines keep their groups whole
    assert sorted((g, i) for ws in split for g, idx in ws for i in idx) == [(g, i) for g in range(13) for i in range(4)]
    assert all(len(idx) == 4 for ws in plan_pieces(sizes, 4, "static") for _, idx in ws)


def test_histopipe_plans_on_per_request_predictions():
    predicted = [[400.0, 300.0, 200.0, 100.0]] + [[20.0] * 4] * 12
    a = plan_pieces([4] * 13, 4, "histopipe", predicted, PRICED, slots=4)
    assert sorted((g, i) for ws in a for g, idx in ws for i in idx) == [(g, i) for g in range(13) for i in range(4)]
    with pytest.raises(ValueError, match="predicted lengths"):
        plan_pieces([4, 4], 2, "histopipe", [[1.0] * 3, [1.0] * 4], PRICED, slots=4)
