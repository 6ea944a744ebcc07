"""The policies of `plan` on cases small enough to check by hand."""

import random

import pytest

from rhymerl.histopipe.batching import decode_costs, worker_time
from rhymerl.histopipe.plan import POLICIES, admission_order, least_loaded, plan, static_split


def affine(t, s=1):
    return 1.0 + t  # a step of n sequences costs 1 + n


def makespan_of(assignment, lengths, slots, cost):
    step_cost = decode_costs(cost, slots)
    return max(worker_time([n for g in ws for n in lengths[g]], slots, step_cost) for ws in assignment)


def test_static_is_an_equal_contiguous_split():
    assert static_split(5, 2) == [[0, 1, 2], [3, 4]]
    assert static_split(3, 4) == [[0], [1], [2], []]
    assert plan([2] * 4, 2, "static") == [[0, 1], [2, 3]]


def test_least_loaded_counts_requests_like_the_peers():
    assert plan([2, 2, 2, 2], 2, "least_loaded") == [[0, 2], [1, 3]]  # a round robin
    assert least_loaded([4, 1, 1, 1, 1], 2) == [[0], [1, 2, 3, 4]]
    # Balancing predicted tokens instead (the ablation): 100 vs 10 + 10 + 10 ...
    assert plan([1] * 4, 2, "least_loaded", predicted=[100, 10, 10, 10], balance="predicted") == [[0], [1, 2, 3]]


def test_admission_order_is_longest_first_and_stable():
    assert admission_order(["a", "b", "c", "d"], [1, 3, 3, 2]) == ["b", "c", "d", "a"]


# Groups of one request on 2 workers of 4 slots; both baselines put the two long ones on worker 0.
SKEWED = [[100], [10], [100], [10], [10], [10]]


def test_histopipe_beats_both_baselines_on_a_skewed_batch():
    groups = [len(g) for g in SKEWED]
    predicted = [g[0] for g in SKEWED]
    got = {p: plan(groups, 2, p, predicted, affine, slots=4, true_lengths=SKEWED) for p in POLICIES}
    span = {p: makespan_of(a, SKEWED, 4, affine) for p, a in got.items()}
    # static: [100, 10, 100] -> 10 steps of 3 sequences (4 s) + 90 steps of 2 (3 s) = 310
    assert got["static"] == [[0, 1, 2], [3, 4, 5]] and span["static"] == 310
    assert got["least_loaded"] == [[0, 2, 4], [1, 3, 5]] and span["least_loaded"] == 310
    # histopipe: one long per worker, [100, 10, 10] -> 10 steps of 3 (4 s) + 90 steps of 1 (2 s) = 220
    assert span["histopipe"] == 220 == span["oracle"]
    for ws in got["histopipe"]:
        assert ws[0] in (0, 2)  # the long group is admitted first


def test_local_improvement_fixes_lpt():
    # The classic case where LPT is not optimal: jobs 3 3 2 2 2 on 2 machines (LPT 7, optimum 6). With
    # enough slots and cost(n, n) = n, a worker's time is the sum of its lengths.
    lengths = [[3], [3], [2], [2], [2]]
    kw = dict(slots=10, predicted=[3, 3, 2, 2, 2])
    cost = lambda t, s=1: float(t)  # noqa: E731
    assert makespan_of(plan([1] * 5, 2, "histopipe", cost_model=cost, improve_rounds=0, **kw), lengths, 10, cost) == 7
    assert makespan_of(plan([1] * 5, 2, "histopipe", cost_model=cost, **kw), lengths, 10, cost) == 6


def test_oracle_equals_histopipe_when_predictions_are_exact():
    rng = random.Random(1)
    for _ in range(20):
        groups = [rng.randint(1, 4) for _ in range(rng.randint(1, 20))]
        true_len = [rng.randint(1, 300) for _ in groups]
        lengths = [[n] * size for n, size in zip(true_len, groups)]
        workers, slots = rng.randint(1, 6), rng.randint(1, 8)
        h = plan(groups, workers, "histopipe", true_len, affine, slots=slots)
        o = plan(groups, workers, "oracle", cost_model=affine, slots=slots, true_lengths=lengths)
        assert makespan_of(o, lengths, slots, affine) == makespan_of(h, lengths, slots, affine)


def test_every_policy_places_each_group_once():
    rng = random.Random(2)
    for _ in range(20):
        groups = [rng.randint(1, 4) for _ in range(rng.randint(0, 25))]
        lengths = [[rng.randint(1, 300) for _ in range(size)] for size in groups]
        predicted = [rng.uniform(1, 300) for _ in groups]
        workers = rng.randint(1, 7)
        for policy in POLICIES:
            a = plan(groups, workers, policy, predicted, affine, slots=4, true_lengths=lengths)
            assert len(a) == workers
            assert sorted(g for ws in a for g in ws) == list(range(len(groups)))
            if policy == "histopipe":
                for ws in a:  # longest predicted first inside each worker
                    assert [predicted[g] for g in ws] == sorted((predicted[g] for g in ws), reverse=True)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown policy"):
        plan([1], 1, "random")
    with pytest.raises(ValueError, match="needs predicted"):
        plan([1], 1, "histopipe", cost_model=affine, slots=1)
    with pytest.raises(ValueError, match="cost_model and slots"):
        plan([1], 1, "oracle", true_lengths=[[1]])
    with pytest.raises(ValueError, match="entries"):
        plan([1, 1], 1, "histopipe", [5], affine, slots=1)
    with pytest.raises(ValueError):
        plan([1], 0, "static")


def test_improve_breaks_ties_by_its_key_not_by_summation_noise():
    """Worker 0 holds groups of 6, 2 and 2 tokens, workers 1 and 2 one of 5 each: moving either 2 to either
    worker ties at a makespan of 8. Two finish functions that differ only by noise far below a token (as
    summing the same costs in another order does) must pick the same move: the stated key (the lower worker
    id, then the group ranked first), not whichever candidate the noise makes a hair shorter."""
    from rhymerl.histopipe.plan import improve

    lengths = {0: 6.0, 1: 2.0, 2: 2.0, 3: 5.0, 4: 5.0}
    position = {g: g for g in lengths}
    plans = []
    for noise in (lambda ws: 1e-12 * sum(ws), lambda ws: -1e-12 * sum(ws)):
        workers = [[0, 1, 2], [3], [4]]
        improve(workers, lambda ws: sum(lengths[g] for g in ws) + noise(ws), position, rounds=1)
        plans.append(workers)
    assert plans[0] == plans[1] == [[0, 2], [1, 3], [4]]
