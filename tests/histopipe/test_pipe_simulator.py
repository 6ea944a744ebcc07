"""The simulator: hand-computed single workers, the shared planning code, and the lower bound."""

import random

import pytest

from rhymerl.cost_model import CostModel
from rhymerl.histopipe import simulate as simulate_module
from rhymerl.histopipe.metrics import lower_bound, makespan, summary
from rhymerl.histopipe.plan import POLICIES
from rhymerl.histopipe.simulate import run_plan, simulate, simulate_steps
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
    assert second.predicted == [300, 20, 280, 10]
    assert second.ranking == {"rank_corr": pytest.approx(1.0), "moved_far": 0.0, "prompts": 4}
    oracle = simulate([g for _, g in step], 2, "oracle", slots=4, cost_model=COST)
    assert makespan(second.timeline) == makespan(oracle) < makespan(first.timeline)
