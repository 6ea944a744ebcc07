"""The fleet simulation (`histopipe.fleet`): every worker on one clock, so that requests can migrate. Without
migration it is the per-worker model exactly; the paper's tail rule moves only a straggler past its
history's prediction; half_busiest and steal as their docs say."""

import random

import pytest

from rhymerl.histopipe.batching import ContextCost
from rhymerl.histopipe.fleet import simulate_fleet
from rhymerl.histopipe.metrics import makespan
from rhymerl.histopipe.plan import plan, plan_pieces
from rhymerl.histopipe.simulate import run_plan


def affine(tokens, seqs=1):
    return 1.0 + 0.25 * tokens


PRICED = ContextCost(affine, per_key=0.001, prefill_per_pair=0.0001)


def flat(nested):
    return [x for part in nested for item in part for x in (item if isinstance(item, tuple) else (item,))]


def whole(assignment, lengths):
    return [[(g, tuple(range(len(lengths[g])))) for g in ws] for ws in assignment]


@pytest.mark.parametrize("cost", [affine, PRICED])
def test_without_migration_it_is_the_per_worker_model(cost):
    rng = random.Random(1)
    lengths = [[rng.randint(1, 80) for _ in range(4)] for _ in range(30)]
    predicted = [[40.0] * 4] * 30
    for assignment in (whole(plan([4] * 30, 3, "static"), lengths),
                       plan_pieces([4] * 30, 3, "oracle", cost_model=cost, slots=4, true_lengths=lengths)):
        expected = run_plan(lengths, assignment, slots=4, cost_model=cost)
        timeline, moved = simulate_fleet(lengths, assignment, slots=4, cost_model=cost, predicted=predicted)
        assert moved == 0
        assert flat(timeline.finish) == pytest.approx(flat(expected.finish))
        assert flat(timeline.busy) == pytest.approx(flat(expected.busy))
        assert flat(timeline.occupancy) == pytest.approx(flat(expected.occupancy))


# Worker 0: group 0 (one sibling short, one a straggler far past its history's 20 tokens), a long group 1
# predicted as long as it is, and short group 2; worker 1: one short group, then out of work.
LENGTHS = [[10, 200], [300, 300], [10, 10], [5, 5]]
PREDICTED = [[20.0, 20.0], [300.0, 300.0], [10.0, 10.0], [5.0, 5.0]]
ASSIGNMENT = whole([[0, 1, 2], [3]], LENGTHS)


def test_the_tail_rule_moves_the_straggler_past_its_history():
    still, _ = simulate_fleet(LENGTHS, ASSIGNMENT, slots=4, cost_model=PRICED, predicted=PREDICTED)
    moved_tl, moved = simulate_fleet(LENGTHS, ASSIGNMENT, slots=4, cost_model=PRICED, predicted=PREDICTED,
                                     migration="tail")
    assert moved == 1  # the straggler alone: its group's last request, grown past 1.2 x 20 tokens
    assert moved_tl.finish[0][1] < still.finish[0][1]  # it runs at batch 1 on the idle worker
    assert moved_tl.busy[1][-1][1] == pytest.approx(moved_tl.finish[0][1])  # ... and finishes there
    assert moved_tl.finish[1] == pytest.approx(still.finish[1]) or moved_tl.finish[1][0] < still.finish[1][0]
    # not past its threshold (grown 20x allowed): nothing moves
    _, none = simulate_fleet(LENGTHS, ASSIGNMENT, slots=4, cost_model=PRICED, predicted=PREDICTED,
                             migration="tail", grow=20.0)
    assert none == 0
    # the long group's members are never candidates: they are not past their prediction
    _, tail_only = simulate_fleet([[10, 10], [300, 300], [10, 10], [5, 5]], ASSIGNMENT, slots=4,
                                  cost_model=PRICED, predicted=PREDICTED, migration="tail")
    assert tail_only == 0


def test_half_busiest_moves_half_the_unfinished_requests_waiting_first():
    lengths = [[50] * 8, [5] * 2]
    timeline, moved = simulate_fleet(lengths, whole([[0], [1]], lengths), slots=2, cost_model=PRICED,
                                     predicted=[[50.0] * 8, [5.0] * 2], migration="half_busiest")
    # worker 0 holds 2 running + 6 waiting when worker 1 runs out: half of 8, all waiting; later, whichever
    # runs out first takes half of the other's again
    assert moved >= 4
    still = run_plan(lengths, whole([[0], [1]], lengths), slots=2, cost_model=PRICED)
    assert makespan(timeline) < 0.75 * makespan(still)


def test_steal_takes_waiting_requests_only_from_the_longest_queue():
    lengths = [[30] * 6, [30] * 2, [1] * 2]
    assignment = whole([[0], [1], [2]], lengths)
    timeline, moved = simulate_fleet(lengths, assignment, slots=2, cost_model=affine,
                                     predicted=[[30.0] * 6, [30.0] * 2, [1.0] * 2], migration="steal")
    still = run_plan(lengths, assignment, slots=2, cost_model=affine)
    assert moved == 2  # worker 2 out of its own work takes half of worker 0's 4 waiting (its 2 free slots)
    assert makespan(timeline) < makespan(still)
    # nothing running moved: no re-prefill anywhere, so every worker's busy time is its decode steps
    assert sum(e - s for ivs in timeline.busy for s, e in ivs) <= sum(e - s for ivs in still.busy for s, e in ivs)


def test_unknown_rule_and_bad_assignment():
    with pytest.raises(ValueError, match="migration"):
        simulate_fleet(LENGTHS, ASSIGNMENT, slots=4, cost_model=affine, predicted=PREDICTED, migration="random")
    with pytest.raises(ValueError, match="exactly once"):
        simulate_fleet(LENGTHS, ASSIGNMENT[:1], slots=4, cost_model=affine, predicted=PREDICTED)
