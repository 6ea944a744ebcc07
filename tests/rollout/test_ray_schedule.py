"""HistoPipe across real workers (issue 24 items 3-4): `rollout.schedule` splits a call's groups by
`histopipe.plan.plan` in the Ray pool, and `rollout.migration` moves requests from a busy worker to an idle
one at a step boundary. Under every schedule, migrated or not, each response comes back once with the tokens
of the in-process pool (tiny model, fp32, keyed randomness)."""

import threading
import time

import pytest

from rhymerl.config import sections
from rhymerl.cost_model import CostModel
from rhymerl.histopipe.predict import LengthPredictor
from rhymerl.history import HistoryStore
from rhymerl.model.weights import load_decoder
from rhymerl.rollout import LocalPool, RolloutGroup, RolloutWorker, SamplingParams
from rhymerl.rollout import ray_pool
from rhymerl.rollout.ray_pool import RayPool
from helpers import worker_config
from tiny_models import peaky_checkpoint, random_prompts

# A step of more sequences costs more (as on a real machine), so that histopipe's plan is not a plain count.
COST = CostModel([1, 4], [1, 8], [[0.010, 0.030], [0.020, 0.080]])
PARAMS = SamplingParams(temperature=1.0, max_tokens=24, seed=3)
CONFIG = worker_config(num_slots=4, max_draft_tokens=8)


@pytest.fixture(scope="module")
def peaky_dir(tmp_path_factory):
    return peaky_checkpoint(tmp_path_factory.mktemp("peaky"))


@pytest.fixture(scope="module")
def policy(peaky_dir):
    return load_decoder(peaky_dir)


@pytest.fixture(scope="module")
def pool(cluster, policy, peaky_dir):
    """Two workers, shared by the module's tests; each sets the schedule and migration it needs."""
    pool = RayPool(policy, None, peaky_dir, CONFIG, HistoryStore(), num_workers=2, cost_model=COST)
    yield pool
    pool.close()


def groups(prompts, n=2, tag="s0"):
    return [RolloutGroup(p, [f"{tag}-p{i}-g{g}" for g in range(n)]) for i, p in enumerate(prompts)]


def tokens(result):
    return [(o.request_id, o.token_ids) for o in result.outputs]


def local_tokens(policy, gs, history=None):
    worker = RolloutWorker(policy, None, CONFIG, cost_model=COST)
    return tokens(LocalPool(worker, history or HistoryStore()).rollout(gs, PARAMS))


def test_schedules_are_the_config_keys_and_unknown_ones_are_refused():
    assert sections.ROLLOUT_SCHEDULES == ray_pool.SCHEDULES
    assert sections.RolloutSection().schedule == "static" and sections.RolloutSection().migration is False
    assert sections.RolloutSection(schedule="oracle").validate()  # simulation only: not a config value
    with pytest.raises(ValueError, match="schedule must be one of"):
        RayPool(None, None, "", CONFIG, HistoryStore(), num_workers=2, schedule="oracle")
    # the migration rules the pool runs are the simulator's first two; steal is simulated only
    assert sections.RolloutSection().migration_rule == "half_busiest" and sections.RolloutSection().tier2 is False
    assert sections.RolloutSection(backend="ray", migration=True, migration_rule="steal").validate()
    with pytest.raises(ValueError, match="migration_rule must be one of"):
        RayPool(None, None, "", CONFIG, HistoryStore(), num_workers=2, migration_rule="steal")
    assert sections.RolloutSection(backend="ray", tier2=True).validate()  # tier 2 splits histopipe's plan only
    assert not sections.RolloutSection(backend="ray", num_workers=2, schedule="histopipe", tier2=True).validate()


def test_every_schedule_gives_the_same_tokens(pool, policy):
    """A recorded epoch gives histopipe its predictions; then each schedule splits the next epoch its own way
    (the workers' request counts differ) and every response is what the in-process pool gives."""
    prompts = random_prompts(7, seed=21)
    pool.schedule, pool.migration = "static", False
    first = pool.rollout(groups(prompts, tag="e1"), PARAMS)
    for i, p in enumerate(prompts):
        pool.record(p, [o.token_ids for o in first.outputs[2 * i : 2 * i + 2]], [1.0, 0.0])
    gs = groups(prompts, tag="e2")
    expected = local_tokens(policy, gs, pool.history)
    plans = {}
    for schedule in ray_pool.SCHEDULES:
        pool.schedule = schedule
        # as the call plans (lengths at the cap cut); tier 2 off: every group whole, one piece of 2 requests
        pieces = pool.split(gs, 2, PARAMS.max_tokens)
        assert all(idx == (0, 1) for share in pieces for _, idx in share)
        plans[schedule] = [[g for g, _ in share] for share in pieces]
        result = pool.rollout(gs, PARAMS)
        assert tokens(result) == expected, schedule
        assert sorted(w.requests for w in result.workers) == sorted(2 * len(p) for p in plans[schedule])
    assert plans["static"] == [[0, 1, 2, 3], [4, 5, 6]] and plans["least_loaded"] == [[0, 2, 4, 6], [1, 3, 5]]
    # histopipe: every group once, each worker's list longest predicted first (its admission order)
    assert sorted(plans["histopipe"][0] + plans["histopipe"][1]) == list(range(7))
    predicted = LengthPredictor.from_history(pool.history, prompts, cap=PARAMS.max_tokens).predict_many(prompts)
    for share in plans["histopipe"]:
        assert [predicted[g] for g in share] == sorted((predicted[g] for g in share), reverse=True)


def test_migration_moves_requests_to_the_idle_worker_and_changes_no_token(pool, policy, monkeypatch):
    """A deliberately unbalanced split (one group on worker 0, five on worker 1, which has 4 slots: three
    rounds to worker 0's one): worker 0 finishes first, worker 1 hands over half of its unfinished requests,
    worker 0 finishes them. Each response comes back once, as without migration."""
    prompts = random_prompts(6, seed=22)
    gs = groups(prompts, tag="m")
    pool.schedule = "static"
    monkeypatch.setattr(pool, "split", lambda groups, n, cap=None: [[(0, (0, 1))], [(g, (0, 1)) for g in
                                                                                     range(1, len(groups))]])
    pool.migration = False
    plain = pool.rollout(gs, PARAMS)
    assert plain.engine_totals().migrations == 0
    before = pool.migrations
    pool.migration = True
    moved = pool.rollout(gs, PARAMS)
    ids = [o.request_id for o in moved.outputs]
    assert ids == [rid for g in gs for rid in g.request_ids]  # every response once, in the order given
    assert tokens(moved) == tokens(plain) == local_tokens(policy, gs)
    totals = moved.engine_totals()
    assert pool.migrations > before and totals.migrations == totals.handed_over == pool.migrations - before
    assert totals.migration_prefill_s > 0 and totals.migration_prefill_tokens > 0
    assert sum(w.requests for w in moved.workers) == len(ids)
    assert sorted({w.worker for w in moved.workers}) == [0, 1] and len(moved.workers) >= 3  # the extra share
    pool.migration = False


def test_a_worker_hands_over_between_steps_and_another_finishes_the_requests(policy):
    """The worker-level hook without Ray: `hand_over` from another thread while `rollout` runs returns
    continuations (waiting requests first, then running ones) that a second worker completes; the two
    workers' outputs together are the undisturbed rollout's."""
    prompts = random_prompts(5, seed=23)
    gs = groups(prompts, tag="w")
    expected = local_tokens(policy, gs)
    busy, idle = (RolloutWorker(policy, None, CONFIG, cost_model=COST) for _ in range(2))
    empty = HistoryStore().export([])
    assert busy.hand_over() == []  # no rollout running: nothing to hand over
    result, taken = {}, []
    stepped = threading.Event()
    step = busy.engine.step

    def slow_step():  # slowed down, so that the hand-over surely lands while requests still wait
        stepped.set()
        time.sleep(0.005)
        return step()

    busy.engine.step = slow_step
    call = threading.Thread(target=lambda: result.update(r=busy.rollout(gs, PARAMS, empty, 0)))
    call.start()
    stepped.wait(30)
    taken = busy.hand_over(8)  # of 10 requests: the 6 waiting (4 slots), then 2 running ones
    call.join(60)
    assert [bool(c.output_ids) for c in taken] == [False] * 6 + [True] * 2
    assert [c.request_id for c in taken[:6]] == [rid for g in gs for rid in g.request_ids][4:][::-1]
    kept, _ = result["r"]
    adopted, stats = idle.rollout([], PARAMS, empty, 0, continuations=taken)
    assert stats.engine.migrations == 8 and stats.requests == 8
    got = {o.request_id: o.token_ids for o in kept + adopted}
    assert len(kept) + len(adopted) == 10 and got == dict(expected)
