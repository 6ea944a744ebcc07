"""`histopipe/stream_fleet.py`: one_step_off with the stream on one clock, with and without migration."""

from __future__ import annotations

import random

import pytest

from rhymerl.cost_model import CostModel
from rhymerl.histopipe.simulate import _step_assignment, as_pieces, simulate_run
from rhymerl.histopipe.stream_fleet import simulate_stream

COST = CostModel([1, 64], [1, 2], [[0.010, 0.011], [0.030, 0.050]])


def _steps(seed: int, count: int = 4, groups: int = 12, size: int = 4) -> list:
    rng = random.Random(seed)
    return [[[rng.randint(1, 300) for _ in range(size)] for _ in range(groups)] for _ in range(count)]


@pytest.mark.parametrize("policy", ["static", "least_loaded", "histopipe"])
@pytest.mark.parametrize("workers", [1, 3, 5, 20])
def test_without_migration_it_is_simulate_runs_one_step_off(policy, workers):
    """Shares run one after another per worker, each once its weights exist (the update of the step two
    before): the same finishes, busy intervals and updates as `simulate_run`'s step-by-step one_step_off."""
    steps = _steps(workers)
    predicted = [[max(g) * 0.8 for g in ls] for ls in steps]
    run = simulate_run(steps, workers, policy, mode="one_step_off", slots=4, cost_model=COST, predicted=predicted,
                       train_s=0.5)
    plans = [as_pieces(_step_assignment(t, ls, workers, policy, "one_step_off", 4, COST, predicted, None, {}), ls)
             for t, ls in enumerate(steps, start=1)]
    timeline, _, updates, moved = simulate_stream(steps, plans, slots=4, cost_model=COST, train_s=0.5, load_s=0.0)
    assert moved == 0
    assert [t for g in timeline.finish for t in g] == pytest.approx([t for g in run.timeline.finish for t in g])
    flat = lambda ivs: [x for w in ivs for iv in w for x in iv]  # noqa: E731
    assert flat(timeline.busy) == pytest.approx(flat(run.timeline.busy))
    assert flat([updates]) == pytest.approx(flat([run.updates]))


def test_an_idle_worker_takes_the_back_half_of_the_busiest_workers_share_of_the_oldest_running_step():
    """Worker 0 has one short request a step, worker 1 sixteen long ones on 2 slots. Done with steps 1 and 2,
    worker 0 waits for step 3's weights (the update of step 1): it takes half of worker 1's unfinished step-1
    requests, the last queued first (waiting: nothing to re-prefill). Every request still finishes once; the
    run ends sooner; a cost of one second per engine step makes the times token counts."""
    steps = [[[3]] + [[40]] * 16, [[3]] + [[40]] * 16, [[3], [3]]]
    plans = [[[(0, (0,))], [(g, (0,)) for g in range(1, len(ls))]] for ls in steps]
    unit = lambda tokens, seqs: 1.0  # noqa: E731
    log: list = []
    timeline, _, updates, moved = simulate_stream(steps, plans, slots=2, cost_model=unit, migration="half_busiest",
                                                  log=log)
    _, _, plain, _ = simulate_stream(steps, plans, slots=2, cost_model=unit)
    assert moved > 0 and updates[-1][1] < plain[-1][1]
    assert all(t > 0 for g in timeline.finish for t in g)
    w, t, reqs, was_moved = log[3]  # worker 0 after its two shares (and worker 1's first)
    assert [(x[0], x[1]) for x in log[:3]] == [(0, 0), (1, 0), (0, 1)]
    # at time 6 (3 + 3 steps) worker 1 has finished none and admitted 2: 16 unfinished, 8 move, 14 waiting
    assert (w, t, was_moved) == (0, 0, True) and reqs == [(0, g, 0) for g in range(16, 8, -1)]


def test_migration_is_the_streams_and_its_rules_are_named():
    steps = _steps(0, count=2)
    with pytest.raises(ValueError, match="one_step_off, without defer_tail"):
        simulate_run(steps, 2, "static", mode="sync", slots=4, cost_model=COST, migration="half_busiest")
    with pytest.raises(ValueError, match="unknown stream migration .tail.; choose from half_busiest, remaining"):
        simulate_run(steps, 2, "static", mode="one_step_off", slots=4, cost_model=COST, migration="tail")


UNIT = lambda tokens, seqs: 1.0  # noqa: E731  (a second per engine step: times are token counts)


def test_a_share_of_another_weights_version_first_loads_it_and_a_load_is_not_busy():
    """Worked by hand (2 slots, 1 s a step, updates of 0 s, a load 0.5 s). Steps 1 and 2 run on version 0, step 3
    on version 1, step 4 on version 2. Worker 0: step 1 (0-1), step 2 (1-2); loads version 1 (2-2.5), step 3
    (2.5-3.5); idle, waiting for step 4's weights (the update of step 2), it takes the back half of worker 1's
    step-2 share at worker 1's next step boundary (4), loads version 0 again (4-4.5) and runs the two moved
    requests (4.5-14.5); step 2 is in at 14.5, so version 2 exists: it loads it (14.5-15) and runs step 4
    (15-16). Worker 1: steps 1 and 2 (0-11), loads version 1 (11-11.5), step 3 (11.5-17.5), loads version 2
    (17.5-18), step 4 (18-19). Without loads the same shares end at 18."""
    steps = [[[1], [1]], [[1]] + [[10]] * 4, [[1], [6]], [[1], [1]]]
    plans = [[[(0, (0,))], [(g, (0,)) for g in range(1, len(ls))]] for ls in steps]
    timeline, _, updates, moved = simulate_stream(steps, plans, slots=2, cost_model=UNIT, migration="half_busiest",
                                                  load_s=0.5)
    assert moved == 2
    assert timeline.busy == [[(0.0, 2.0), (2.5, 3.5), (4.5, 14.5), (15.0, 16.0)],
                             [(0.0, 11.0), (11.5, 17.5), (18.0, 19.0)]]
    assert updates == [(1.0, 1.0), (14.5, 14.5), (17.5, 17.5), (19.0, 19.0)]
    _, _, unloaded, _ = simulate_stream(steps, plans, slots=2, cost_model=UNIT, migration="half_busiest", load_s=0.0)
    assert unloaded[-1][1] == 18.0
    with pytest.raises(ValueError, match="load_s must be >= 0"):
        simulate_stream(steps, plans, slots=2, cost_model=UNIT, load_s=-1.0)


GROWING = lambda tokens, seqs: 0.5 + 0.5 * seqs  # noqa: E731  (a step of n sequences: 0.5 + 0.5 n seconds)


def test_remaining_takes_from_the_latest_predicted_end_what_pays_where_half_busiest_counts_requests():
    """Step 1: worker 1 runs two requests predicted (and true) 100 tokens, worker 2 six of 5 on 4 slots, worker 0
    one of 1. Idle from time 2 (steps 1 and 2 done, step 3's weights wait for step 1), worker 0 asks: by count
    (half_busiest) worker 2 gives, by predicted work left (remaining) worker 1, one of its two long requests (a
    second move would not shorten the later of the two), and the run ends sooner. A step's cost grows with its
    batch here: at a flat cost per step (UNIT) worker 1 would save nothing by giving one (`rebalance.Batch`)."""
    steps = [[[1], [100, 100], [5] * 6], [[1], [1], [1]], [[1], [1], [1]]]
    plans = [[[(0, (0,))], [(1, (0, 1))], [(2, tuple(range(6)))]]] + [[[(0, (0,))], [(1, (0,))], [(2, (0,))]]] * 2
    ends = {}
    for rule in ("half_busiest", "remaining"):
        log: list = []
        _, _, updates, moved = simulate_stream(steps, plans, slots=4, cost_model=GROWING, migration=rule,
                                               predicted=steps, log=log)
        first = next(x for x in log if x[3])
        ends[rule] = updates[-1][1]
        if rule == "half_busiest":
            assert first[0] == 0 and {g for _, g, _ in first[2]} == {2}
        else:
            assert moved == 1 and first[:2] == (0, 0) and len(first[2]) == 1 and first[2][0][:2] == (0, 1)
    assert ends["remaining"] < ends["half_busiest"]


def test_remaining_prices_the_receivers_weights_load():
    """Worker 0 runs steps 1-3 (one short request each) and, holding version 1 for step 3, runs dry while
    worker 1 still runs step 2's two 100-token requests (version 0, a step of n costing 0.5 + 0.5 n). Taking
    one costs it a load of version 0 first: at 0.5 s the move pays and the run ends at 105.5; at 60 s it does
    not (max(60 + its re-prefill + 88 steps, the donor's 88) > the donor's 137 left), so nothing moves and the
    run ends at 212 (pricing the receiver's load at 0, the rule moved it and the run ended at 274.5)."""
    steps = [[[1], [1]], [[1], [100, 100]], [[1]], [[1]]]
    plans = [[[(0, (0,))], [(1, (0,))]], [[(0, (0,))], [(1, (0, 1))]], [[(0, (0,))], []], [[(0, (0,))], []]]
    ran = {}
    for load_s in (0.5, 60.0):
        log: list = []
        _, _, updates, moved = simulate_stream(steps, plans, slots=2, cost_model=GROWING, migration="remaining",
                                               predicted=steps, load_s=load_s, log=log)
        ran[load_s] = moved, updates[-1][1], [(w, t) for w, t, _, was_moved in log if was_moved]
    assert ran[0.5] == (1, pytest.approx(105.5), [(0, 1)])
    assert ran[60.0] == (0, pytest.approx(212.0), [])


@pytest.mark.parametrize("rule", ["half_busiest", "remaining"])
@pytest.mark.parametrize("workers", [3, 8])
def test_each_rule_moves_requests_and_finishes_each_once_as_simulate_run_reports(rule, workers):
    steps = _steps(workers, count=4, groups=16)
    steps[0][0] = [900] * 4  # one long group: its worker holds step 1 (and so step 3's weights) back
    point = [[max(g) * 0.8 for g in ls] for ls in steps]
    run = simulate_run(steps, workers, "histopipe", mode="one_step_off", slots=4, cost_model=COST, predicted=point,
                       migration=rule)
    plans = [as_pieces(_step_assignment(t, ls, workers, "histopipe", "one_step_off", 4, COST, point, None, {}), ls)
             for t, ls in enumerate(steps, start=1)]
    per_request = [[[p] * len(g) for p, g in zip(ps, ls)] for ps, ls in zip(point, steps)]
    timeline, _, updates, moved = simulate_stream(steps, plans, slots=4, cost_model=COST, predicted=per_request,
                                                  migration=rule)
    assert moved == run.moved > 0 and updates == run.updates
    assert all(t > 0 for g in timeline.finish for t in g)
    assert sum(map(len, timeline.finish)) == sum(len(g) for ls in steps for g in ls)


@pytest.mark.parametrize("rule", ["half_busiest", "remaining"])
def test_a_donor_that_runs_dry_at_the_hand_over_still_goes_on_to_its_next_share(rule):
    """A donor whose last requests finish at the boundary the hand-over brings it to (or are all moved) runs dry
    off its own events: it must still go idle and start its next share (it once stayed stuck: requests of later
    steps never ran). Small random runs, a second an engine step, each request a group."""
    for seed in range(300):
        rng = random.Random(seed)
        workers = rng.randint(2, 3)
        steps, plans = [], []
        for _ in range(3):
            per = [[rng.randint(1, 12) for _ in range(rng.randint(1, 3))] for _ in range(workers)]
            steps.append([[n] for ns in per for n in ns])
            firsts = [sum(map(len, per[:w])) for w in range(workers)]
            plans.append([[(k + j, (0,)) for j in range(len(ns))] for k, ns in zip(firsts, per)])
        timeline, *_ = simulate_stream(steps, plans, slots=2, cost_model=UNIT, migration=rule, predicted=steps,
                                       load_s=0.0)
        assert all(t > 0 for g in timeline.finish for t in g)
