"""The simulator: hand-computed single workers, the shared planning code, and the lower bound."""

import random

import pytest

from rhymerl.cost_model import CostModel
from rhymerl.histopipe import simulate as simulate_module
from rhymerl.histopipe.metrics import bubble_ratio, lower_bound, makespan, summary
from rhymerl.histopipe.plan import POLICIES
from rhymerl.histopipe.simulate import run_plan, simulate, simulate_run, simulate_steps
from rhymerl.histopipe.timeline import Timeline

# A measured-looking model: decode steps of 1, 4, 16 sequences cost 1.0, 1.2, 2.0 (one token each).
COST = CostModel([1, 4, 16], [1, 2], [[1.0, 1.1], [1.2, 1.5], [2.0, 3.0]])


def test_one_worker_is_step_count_times_cost():
    # Two slots, lengths 5 3 | 4, every step 0.5 s: seven steps (see test_batching).
    tl = simulate([[5, 3], [4]], 1, "static", slots=2, cost_model=lambda t, s=1: 0.5)
    assert tl.finish == [[2.5, 1.5], [3.5]] and tl.worker == [0, 0]
    assert tl.busy == [[(0.0, 3.5)]] and makespan(tl) == 3.5


def test_workers_without_groups_are_idle():
    tl = simulate([[3]], 3, "static", slots=2, cost_model=lambda t, s=1: 1.0)
    assert tl.busy == [[(0.0, 3.0)], [], []] and tl.worker_ends() == [3.0, 0.0, 0.0]
    assert summary(tl, [[3]], 2, lambda t, s=1: 1.0)["bubble"] == pytest.approx(2 / 3)


def test_prefill_is_paid_once_per_group():
    tl = simulate([[2, 2]], 1, "static", slots=1, cost_model=lambda t, s=1: 1.0, prefill=[3.0])
    assert tl.finish == [[5.0, 7.0]]


def test_simulate_goes_through_plan_and_only_oracle_sees_the_truth(monkeypatch):
    seen = []
    real_plan = simulate_module.plan

    def spy(groups, num_workers, policy, predicted, cost_model, **kw):
        seen.append((policy, kw["true_lengths"]))
        return real_plan(groups, num_workers, policy, predicted, cost_model, **kw)

    monkeypatch.setattr(simulate_module, "plan", spy)
    lengths = [[5, 6], [1, 2]]
    for policy in POLICIES:
        simulate(lengths, 2, policy, slots=2, cost_model=COST, predicted=[3, 3])
    assert seen == [("static", None), ("least_loaded", None), ("histopipe", None), ("oracle", lengths)]


def test_static_loses_to_histopipe_on_a_skewed_set():
    # Eight groups of four: the two long ones arrive first, so the contiguous split gives both to worker 0.
    lengths = [[400] * 4, [380] * 4] + [[50] * 4] * 6
    predicted = [g[0] for g in lengths]
    spans = {p: makespan(simulate(lengths, 2, p, slots=8, cost_model=COST, predicted=predicted))
             for p in POLICIES}
    assert spans["histopipe"] < 0.8 * spans["static"]
    assert spans["oracle"] == spans["histopipe"]  # exact predictions, groups of equal lengths


def test_lower_bound_holds_for_every_policy():
    rng = random.Random(3)
    for _ in range(30):
        groups = rng.randint(1, 30)
        lengths = [[rng.choice([rng.randint(1, 50), rng.randint(100, 800)]) for _ in range(rng.randint(1, 4))]
                   for _ in range(groups)]
        predicted = [sum(g) / len(g) * rng.uniform(0.5, 1.5) for g in lengths]  # noisy predictions
        workers, slots = rng.randint(1, 8), rng.choice([1, 4, 16])
        bound = lower_bound(lengths, workers, slots, COST)
        for policy in POLICIES:
            tl = simulate(lengths, workers, policy, slots=slots, cost_model=COST, predicted=predicted)
            assert makespan(tl) >= bound * (1 - 1e-9), policy


def test_run_plan_checks_the_assignment():
    with pytest.raises(ValueError):
        run_plan([[1], [2]], [[0], [0]], slots=1, cost_model=COST)
    tl = run_plan([[1], [2]], [[1, 0]], slots=1, cost_model=lambda t, s=1: 1.0)
    assert tl.finish == [[3.0], [2.0]]
    assert Timeline.from_dict(tl.as_dict()) == tl


def test_simulate_steps_learns_lengths_from_the_steps_before():
    # The same four prompts twice with the same lengths: the second step's predictions are exact.
    step = [("a", [300, 300]), ("b", [20, 20]), ("c", [280, 280]), ("d", [10, 10])]
    first, second = simulate_steps([step, step], 2, "histopipe", slots=4, cost_model=COST)
    assert first.predicted == [512.0] * 4 and first.ranking is None  # nothing known: the default prior
    assert second.predicted == pytest.approx([300, 20, 280, 10], rel=1e-5)
    assert second.ranking == {"rank_corr": pytest.approx(1.0), "moved_far": 0.0, "prompts": 4}
    oracle = simulate([g for _, g in step], 2, "oracle", slots=4, cost_model=COST)
    assert makespan(second.timeline) == makespan(oracle) < makespan(first.timeline)


# ------------------------------------------------------------------ runs of steps: sync vs one_step_off

UNIT = lambda t, s=1: 1.0  # noqa: E731  every decode step 1 s, whatever the batch


def test_one_step_off_fills_a_worker_bubble_with_the_next_step():
    # Two workers, static split: step 1 is long on worker 0, step 2 on worker 1. Sync waits for the long worker
    # each step (10 + 10); one_step_off lets each worker go on with its next share (10 + 2 on both).
    steps = [[[10], [2]], [[2], [10]]]
    sync = simulate_run(steps, 2, "static", mode="sync", slots=1, cost_model=UNIT)
    off = simulate_run(steps, 2, "static", mode="one_step_off", slots=1, cost_model=UNIT)
    assert sync.total == 20.0 and sync.rollouts == [(0.0, 10.0), (10.0, 20.0)]
    assert off.total == 12.0 and off.rollouts == [(0.0, 10.0), (2.0, 12.0)]
    assert off.timeline.busy == [[(0.0, 12.0)], [(0.0, 12.0)]]  # no bubble at all
    assert off.timeline.finish == [[10.0], [2.0], [12.0], [12.0]] and off.timeline.worker == [0, 1, 0, 1]
    assert bubble_ratio(off.timeline, span=off.total) == 0.0
    assert bubble_ratio(sync.timeline, span=sync.total) == pytest.approx(16 / 40)


def test_one_step_off_waits_for_the_weights_when_the_update_is_slow():
    # One worker, rollouts of 1 s, updates of 2 s. one_step_off: r1 [0,1] u1 [1,3]; r2 [1,2] (version 0)
    # u2 [3,5]; r3 needs version 2 = the update of step 1, done at 3 > 2 when the worker is free: (b) binds.
    steps = [[[1]]] * 3
    off = simulate_run(steps, 1, "static", mode="one_step_off", slots=1, cost_model=UNIT, train_s=2.0)
    assert off.rollouts == [(0.0, 1.0), (1.0, 2.0), (3.0, 4.0)]
    assert off.updates == [(1.0, 3.0), (3.0, 5.0), (5.0, 7.0)] and off.total == 7.0
    sync = simulate_run(steps, 1, "static", mode="sync", slots=1, cost_model=UNIT, train_s=2.0)
    assert sync.rollouts == [(0.0, 1.0), (3.0, 4.0), (6.0, 7.0)] and sync.total == 9.0


def test_sync_run_is_its_steps_back_to_back():
    lengths = [[400] * 4, [380] * 4] + [[50] * 4] * 6
    predicted = [g[0] for g in lengths]
    for policy in POLICIES:
        one = makespan(simulate(lengths, 2, policy, slots=8, cost_model=COST, predicted=predicted))
        run = simulate_run([lengths] * 3, 2, policy, slots=8, cost_model=COST, predicted=[predicted] * 3,
                           train_s=0.5)
        assert run.total == pytest.approx(3 * (one + 0.5)), policy
        off = simulate_run([lengths] * 3, 2, policy, mode="one_step_off", slots=8, cost_model=COST,
                           predicted=[predicted] * 3, train_s=0.5)
        if policy in ("static", "least_loaded"):  # same order as sync, and the update now overlaps
            assert off.total < run.total, policy
        else:
            # Shortest first on odd steps puts the long groups last on their worker: a tail that a worker
            # cannot hide, since (a) keeps its next share waiting for its whole step-t share.
            assert off.total > run.total, policy


def test_one_step_off_alternates_admission_for_histopipe_only(monkeypatch):
    # One worker, one slot: the admission order is the finish order. Odd steps shortest first, even longest.
    steps = [[[5], [1], [3]]] * 2
    predicted = [[5, 1, 3]] * 2
    off = simulate_run(steps, 1, "histopipe", mode="one_step_off", slots=1, cost_model=UNIT, predicted=predicted)
    assert off.timeline.finish[:3] == [[9.0], [1.0], [4.0]]  # 1, 3, 5
    assert off.timeline.finish[3:] == [[14.0], [18.0], [17.0]]  # 5, 3, 1 from 9
    sync = simulate_run(steps, 1, "histopipe", slots=1, cost_model=UNIT, predicted=predicted)
    assert sync.timeline.finish[:3] == [[5.0], [9.0], [8.0]]  # the plan's longest first
    base = simulate_run(steps, 1, "static", mode="one_step_off", slots=1, cost_model=UNIT)
    assert base.timeline.finish[:3] == [[5.0], [6.0], [9.0]]  # arrival order
    with pytest.raises(ValueError):
        simulate_run(steps, 1, "static", mode="two_steps_off", slots=1, cost_model=UNIT)
