"""Migration inside the stream (`rollout.stream` with `rollout.migration`, rules half_busiest and remaining; issue 33): on a
real local Ray cluster, 2 workers, a `RayStream` driven as the loop drives it (`rl/streamed_rollout.py`: step
t+1 submitted before step t is collected, the next weights published after step t is in), against the
simulator's model of the same thing (`histopipe/stream_fleet.py`) on the same lengths. fp32, keyed draws: the
tokens are the ones without migration, each token's version recorded.

The model is the tiny llama with four end-of-sequence tokens (`stopping_checkpoint`): lengths from 1 to the cap.
"""

from __future__ import annotations

import pytest
import torch

from rhymerl.histopipe.stream_fleet import simulate_stream
from rhymerl.history import HistoryStore
from rhymerl.model.weights import load_decoder
from rhymerl.rollout import RolloutGroup, SamplingParams
from rhymerl.rollout.ray_pool import RayPool
from rhymerl.rollout.ray_stream import RayStream
from helpers import worker_config
from tiny_models import random_prompts, stopping_checkpoint

PARAMS = SamplingParams(temperature=1.0, max_tokens=40, seed=5)
PLAIN = worker_config(80, num_slots=2, speculative="off")  # a token an engine step, fifo admission
# as `make_pool` builds it from the run's config: a worker whose rule is remaining measures its cost model at
# start-up (speculation off: no HistoSpec one) and prices its moves on it (`RolloutWorker.cost`)
REMAINING = worker_config(80, num_slots=2, speculative="off", backend="ray", num_workers=2, mode="one_step_off",
                          stream=True, migration=True, migration_rule="remaining")
# Per step: worker 0's share is one request, worker 1's 16 (8 waves on 2 slots); step 3 gives worker 1 one too.
SIZES = {0: (1, 16), 1: (1, 16), 2: (1, 1)}


def _step(t: int) -> tuple[list[RolloutGroup], list[list[tuple[int, tuple[int, ...]]]]]:
    """Step t's groups (one prompt per request) and its split: the first request to worker 0, the rest to 1."""
    n0, n1 = SIZES[t]
    prompts = random_prompts(n0 + n1, seed=40 + t)
    groups = [RolloutGroup(p, [f"s{t}-r{i}"]) for i, p in enumerate(prompts)]
    return groups, [[(g, (0,)) for g in range(n0)], [(g, (0,)) for g in range(n0, n0 + n1)]]


def _run(policy, model_dir, migration: str | None):
    """Steps 1 and 2 on version 0, then (as the loop publishes after step 1's update) step 3 on version 1:
    each step's outputs and the shares each worker ran, in order, as (step, request ids)."""
    config = REMAINING if migration == "remaining" else PLAIN
    pool = RayPool(policy, None, model_dir, config, HistoryStore(), num_workers=2, migration=migration is not None,
                   migration_rule=migration or "half_busiest")
    try:
        stream = RayStream(pool)
        steps = [_step(t) for t in range(3)]
        plans = iter([plan for _, plan in steps])
        pool.split = lambda groups, n, cap=None: next(plans)
        a = stream.submit(steps[0][0], PARAMS, step=1, train=True)
        b = stream.submit(steps[1][0], PARAMS, step=2, train=True)
        results = [stream.collect(a)]
        g = torch.Generator().manual_seed(1)
        stream.publish({n: p + 0.05 * torch.randn(p.shape, generator=g) for n, p in policy.named_parameters()}, 1)
        c = stream.submit(steps[2][0], PARAMS, step=3, train=True)
        results += [stream.collect(b), stream.collect(c)]
        moved = pool.migrations
    finally:
        pool.close()
    shares = sorted((w.worker, w.started, t, tuple(s.request_id for s in w.spans))
                    for t, r in enumerate(results) for w in r.workers)
    return steps, results, [(w, t, ids) for w, _, t, ids in shares], moved


@pytest.fixture(scope="module")
def runs(cluster, tmp_path_factory):
    path = stopping_checkpoint(tmp_path_factory.mktemp("stopping"))
    policy = load_decoder(path)
    return _run(policy, path, None), _run(policy, path, "half_busiest"), _run(policy, path, "remaining")


@pytest.mark.parametrize("rule", [1, 2], ids=["half_busiest", "remaining"])
def test_migration_in_the_stream_changes_no_token_and_records_each_tokens_version(runs, rule):
    """Every token is the run without migration's and was sampled by its own step's version, so no token is
    trained more than max_staleness (1) versions after it: step t trains from version t - 1."""
    (_, plain, _, none), (_, moved, _, count) = runs[0], runs[rule]
    assert none == 0 and count > 0
    for t, (p, m, version) in enumerate(zip(plain, moved, (0, 0, 1)), start=1):
        assert [(o.request_id, o.token_ids) for o in m.outputs] == [(o.request_id, o.token_ids) for o in p.outputs]
        assert all(o.versions == [version] * len(o.token_ids) for o in m.outputs)
        assert m.weights_version == version
        assert max((t - 1) - v for o in m.outputs for v in o.versions) <= 1


def test_the_simulator_runs_the_streams_shares_in_the_same_order_and_moves_the_same_requests(runs):
    """Each worker's shares in the order it ran them, real and simulated (a token an engine step, both workers
    alike), up to the first migration: worker 0 runs its shares of steps 1 and 2, then, idle while step 3's
    weights wait for step 1, takes the back of worker 1's step-1 queue (waiting requests: nothing to re-prefill).
    The same requests move, up to two (when the ask lands a finish may or may not have happened; the two
    workers' steps cost alike in the model, nearly so on the machine). Past that, migrations go back and forth on
    timing (which worker runs out first) and are not compared."""
    steps, results, shares, _ = runs[1]  # half_busiest
    length = {o.request_id: len(o.token_ids) for r in results for o in r.outputs}
    lengths = [[[length[rid] for rid in g.request_ids] for g in groups] for groups, _ in steps]
    log: list = []
    simulate_stream(lengths, [plan for _, plan in steps], slots=2, cost_model=lambda tokens, seqs: 1.0,
                    migration="half_busiest", log=log)
    own = {(t, w): tuple(rid for g, idx in plan[w] for i in idx for rid in [steps[t][0][g].request_ids[i]])
           for t, (_, plan) in enumerate(steps) for w in range(2)}
    sim = [(w, t, tuple(steps[s][0][g].request_ids[i] for s, g, i in reqs)) for w, t, reqs, _ in log]
    first = lambda xs: next(k for k, (w, t, ids) in enumerate(xs) if ids != own[(t, w)])  # noqa: E731
    real0 = [x for x in shares if x[0] == 0]
    sim0 = [x for x in sim if x[0] == 0]
    k = first(real0)
    assert [(w, t) for w, t, _ in real0[:k + 1]] == [(w, t) for w, t, _ in sim0[:first(sim0) + 1]] == [
        (0, 0), (0, 1), (0, 0)], (real0, sim0)
    queue = own[(0, 1)]  # worker 1's step-1 share, in its admission order
    real, simulated = real0[k][2], sim0[first(sim0)][2]
    assert abs(len(real) - len(simulated)) <= 2, (real, simulated)
    assert set(real) == set(queue[-len(real):]) and set(simulated) == set(queue[-len(simulated):])
