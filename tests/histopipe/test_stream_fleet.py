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
    timeline, _, updates, moved = simulate_stream(steps, plans, slots=4, cost_model=COST, train_s=0.5)
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
    with pytest.raises(ValueError, match="unknown stream migration 'tail'"):
        simulate_run(steps, 2, "static", mode="one_step_off", slots=4, cost_model=COST, migration="tail")
