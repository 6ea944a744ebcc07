"""Pushing waiting requests off a worker predicted late (`histopipe.push`, migration component "push",
simulated only): the give order, the pay rule, the lazy heap of predicted ends, and a shifted group whose
renewed sibling is pushed to a busy worker before any worker runs dry."""

import pytest

from rhymerl.histopipe.fleet import MIGRATIONS, POOL_MIGRATIONS, simulate_fleet
from rhymerl.histopipe.metrics import makespan
from rhymerl.histopipe.push import Ends, give_order, pays, pushes


def test_give_order_renewed_siblings_past_the_kept_one_first_then_the_back_of_the_queue():
    queue = ["a1", "b1", "a2", "c1", "a3", "b2"]
    group = {"a1": "a", "a2": "a", "a3": "a", "b1": "b", "b2": "b", "c1": "c"}.__getitem__
    renewed = {"a1": 50.0, "a2": 40.0, "a3": 30.0, "b2": 20.0}.get
    # a keeps a1 (none of a runs here); b has one running, so its renewed b2 is given; c is not renewed
    assert give_order(queue, group, lambda r: renewed(r) or 0.0, {"b": 1}) == ["a2", "a3", "b2", "c1", "b1", "a1"]
    assert give_order(queue, group, lambda r: 0.0, {}) == queue[::-1]


def test_pays_only_well_past_the_receiver_and_without_swapping_them():
    assert pays(100.0, 10.0, 30.0)  # 40 < 70
    assert not pays(100.0, 10.0, 45.0)  # 55 < 55 fails: the receiver would end as late as the donor
    assert not pays(100.0, 95.0, 1.0)  # within 1.1 x: left alone
    assert pays(100.0, 80.0, 5.0, gap=1.2) and not pays(100.0, 90.0, 1.0, gap=1.2)


def test_ends_earliest_skips_stale_entries_and_the_asking_worker():
    ends = Ends(3)
    ends.set(0, 5.0)
    ends.set(1, 7.0)
    ends.set(2, 9.0)
    assert ends.earliest(1) == 0 and ends.earliest(0) == 1
    ends.set(0, 20.0)  # its old entry (5.0) is stale now
    assert ends.earliest(2) == 1 and ends.earliest(1) == 2
    ends.set(1, None)
    assert ends.earliest(2) == 0 and ends.earliest(0) == 2
    # worker 0 (at 20) gives 2 s requests to worker 2 (at 9): 11 < 18, then 13 < 16, then 15 < 14 fails
    moves = list(pushes(["x", "y", "z"], 0, ends, lambda r: 2.0, lambda v: True))
    assert moves == [("x", 2), ("y", 2)]
    assert ends.end[0] == 16.0 and ends.end[2] == 13.0
    assert list(pushes(["z"], 0, ends, lambda r: 0.5, lambda v: False)) == []  # no worker takes requests


def affine(tokens, seqs=1):
    return 1.0 + 0.25 * tokens


def test_a_shifted_groups_renewed_sibling_is_pushed_to_a_busy_worker():
    # worker 0: a group predicted 10 tokens that runs 100 (a rank shift), and a group of two 39s; worker 1:
    # one request of 26. With the early warning alone, the shifted group's second member is renewed once the
    # first passes 10 tokens and starts on worker 0 beside it; with push, worker 0 (predicted late) gives it
    # to worker 1 (busy, predicted earlier), so the two long ones run on two workers
    lengths = [[100, 100], [39, 39], [26]]
    predicted = [[10.0, 10.0], [39.0, 39.0], [26.0]]
    assignment = [[(0, (0, 1)), (1, (0, 1))], [(2, (0,))]]
    run = {rule: simulate_fleet(lengths, assignment, slots=2, cost_model=affine, predicted=predicted,
                                migration=rule) for rule in ("half_busiest", "half_busiest+early", "half_busiest+push")}
    assert makespan(run["half_busiest+push"][0]) == pytest.approx(157.5)
    assert run["half_busiest+push"][1] == 1
    assert makespan(run["half_busiest+early"][0]) == pytest.approx(167.75)
    assert makespan(run["half_busiest"][0]) == pytest.approx(186.0)


def test_push_is_simulated_only():
    # the Ray pool has no way for a busy worker to adopt requests mid-call: not a rollout.migration_rule choice,
    # nor a default row of bench pipe (the bench runs MIGRATIONS)
    assert not any("push" in rule for rule in POOL_MIGRATIONS + MIGRATIONS)
