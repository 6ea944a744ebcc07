"""HistoPipe in the real Ray pool (issue 32): tier 2 (a long group split over both workers), the paper's
migration rule (`rollout.migration_rule=tail`) and the rule by predicted remaining work (`remaining`), each
fp32 token-identical to the in-process pool (keyed draws); a worker's prediction informed by the siblings finished so far (`observe_finished`); and the
simulator's worker model replaying the training loop's per-worker timeline in sync mode.

The model is the tiny llama with four end-of-sequence tokens (`stopping_checkpoint`), so that responses end
at lengths from 1 to the cap, as a length-aware schedule needs."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from rhymerl.config import load_config
from rhymerl.cost_model import CostModel
from rhymerl.histopipe.batching import run_worker, worker_time
from rhymerl.histopipe.pricing import TokensPerForward
from rhymerl.histopipe.predict import LengthPredictor
from rhymerl.history import HistoryStore, prompt_key
from rhymerl.model.weights import load_decoder
from rhymerl.rollout import LocalPool, RolloutGroup, RolloutWorker, SamplingParams
from rhymerl.rollout.ray_pool import RayPool
from rhymerl.rl.loop import TrainingRun
from rhymerl.rollout.timeline import read_timeline
from helpers import one_step_off_overrides, train_rows, worker_config
from tiny_models import random_prompts, stopping_checkpoint, tiny_smol_checkpoint

COST = CostModel([1, 4], [1, 8], [[0.010, 0.030], [0.020, 0.080]])  # more sequences, a dearer step
PARAMS = SamplingParams(temperature=1.0, max_tokens=40, seed=3)
SPEC = worker_config(80, num_slots=4, max_draft_tokens=8)  # HistoSpec on
PLAIN = worker_config(80, num_slots=4, speculative="off")  # a token a step


@pytest.fixture(scope="module")
def stop_dir(tmp_path_factory):
    return stopping_checkpoint(tmp_path_factory.mktemp("stopping"))


@pytest.fixture(scope="module")
def policy(stop_dir):
    return load_decoder(stop_dir)


@pytest.fixture(scope="module")
def pool(cluster, policy, stop_dir):
    """Two HistoSpec workers, shared by the tier-2 and tail tests (each sets the schedule and migration it
    needs, and its own history: the pool's truth is an attribute too)."""
    pool = RayPool(policy, None, stop_dir, SPEC, HistoryStore(), num_workers=2, cost_model=COST)
    yield pool
    pool.close()


def groups(prompts, n, tag):
    return [RolloutGroup(p, [f"{tag}-p{i}-g{g}" for g in range(n)]) for i, p in enumerate(prompts)]


def tokens(result):
    return [(o.request_id, o.token_ids) for o in result.outputs]


def local_tokens(policy, gs, history):
    return tokens(LocalPool(RolloutWorker(policy, None, SPEC, cost_model=COST), history).rollout(gs, PARAMS))


def test_tier2_spreads_a_long_group_over_both_workers_and_changes_no_token(pool, policy):
    """Prompt 0's history says its answers are long, the others' short: histopipe with tier 2 cuts its group
    into pieces on both workers (a piece is a group of some of its request ids), and every response is the
    unsplit pool's and the in-process pool's. Priced in tokens (a step dearer with more sequences): priced in
    forwards under HistoSpec a step costs the same whatever its batch, and a group that fits a worker's slots
    gains nothing by a split (`histopipe.pricing`)."""
    prompts = random_prompts(5, seed=31)
    pool.history = history = HistoryStore()
    pool.schedule, pool.tier2, pool.migration, pool.pricing = "histopipe", True, False, "tokens"
    for i, p in enumerate(prompts):
        pool.record(p, [[5] * (36 if i == 0 else 2)] * 4)
    gs = groups(prompts, 4, "t")
    plan = pool.split(gs, 2, PARAMS.max_tokens)
    assert {w for w, share in enumerate(plan) for g, _ in share if g == 0} == {0, 1}
    assert sorted((g, i) for share in plan for g, idx in share for i in idx) == [(g, i) for g in range(5)
                                                                                 for i in range(4)]
    split = pool.rollout(gs, PARAMS)
    assert sorted(w.requests for w in split.workers) == sorted(sum(len(idx) for _, idx in s) for s in plan)
    pool.tier2 = False
    assert all(len(idx) == 4 for share in pool.split(gs, 2, PARAMS.max_tokens) for _, idx in share)
    whole = pool.rollout(gs, PARAMS)
    assert tokens(split) == tokens(whole) == local_tokens(policy, gs, history)


def test_histopipe_prices_requests_in_forwards_and_changes_no_token(pool, policy):
    """The pool learns each prompt's tokens per forward from its calls (`RayPool.rates`); histopipe with
    `pricing="measured"` then plans in predicted forwards at those rates (`histopipe.pricing`). Prompt 0's
    answers are predicted 3x as long as the others' but draft at 4 tokens a forward: token pricing gives it
    a worker of its own, forward pricing balances the workers' predicted forwards better, and the tokens are
    static's and the in-process pool's."""
    prompts = random_prompts(5, seed=33)
    pool.history = history = HistoryStore()
    pool.schedule, pool.tier2, pool.migration = "histopipe", False, False
    for i, p in enumerate(prompts):
        pool.record(p, [[5] * (36 if i == 0 else 12)] * 4)
    gs = groups(prompts, 4, "f")
    pool.rates = TokensPerForward(prior_forwards=0)  # the rates as observed (the shrinkage: test_pricing.py)
    pool.rates.observe([SimpleNamespace(prompt_ids=p, token_ids=[5] * 40, forwards=10 if i == 0 else 40)
                        for i, p in enumerate(prompts)])
    plans = {}
    for pool.pricing in ("tokens", "measured"):
        plans[pool.pricing] = pool.split(gs, 2, PARAMS.max_tokens)
    flat = [0.0] + [1.0] * SPEC.rollout.num_slots

    def forwards(share):  # a worker's predicted forwards: the pool's predicted lengths over the rates
        predictor = LengthPredictor.from_history(history, prompts, cap=PARAMS.max_tokens)
        lengths = [pool.rates.forwards(prompts[g], predictor.predict_group(prompts[g], 4)) for g, _ in share]
        return worker_time([n for ls in lengths for n in ls], SPEC.rollout.num_slots, flat)

    worst = {k: max(forwards(share) for share in plan) for k, plan in plans.items()}
    assert worst["measured"] < worst["tokens"]
    priced = pool.rollout(gs, PARAMS)
    assert sorted(w.requests for w in priced.workers) == sorted(sum(len(i) for _, i in s) for s in plans["measured"])
    pool.schedule = "static"
    assert tokens(priced) == tokens(pool.rollout(gs, PARAMS)) == local_tokens(policy, gs, history)
    learned = pool.rates.state_dict()["rates"][prompt_key(prompts[1])]  # the calls' own forwards were learned
    assert learned != [40.0, 40.0] and learned[1] > 40.0


def test_the_plan_is_the_same_whatever_the_timing_of_the_calls_that_recorded_the_history(pool):
    """Issue 32's real runs: with the same history, cost model and slots, histopipe's plan (each request's
    worker and its place in the order) must not depend on how fast epoch 1 ran. Its calls' forwards are
    timing-driven (HistoSpec drafts what each worker's clock says pays), so two epoch-1 outcomes with the
    same tokens and other forwards (prompt 0 drafted at 4 tokens a forward and prompt 3 at 1, or the
    reverse) give one plan: the pool prices forwards from the recorded tokens (`ReplayedRates`). Prompt 0's
    answers repeat each other, so it is priced at more than a token a forward; prompt 3's match nothing."""
    prompts = random_prompts(6, seed=35)
    pool.history = HistoryStore()
    pool.schedule, pool.tier2, pool.migration, pool.pricing = "histopipe", True, False, "replayed"
    answers = [[list(range(20, 56))] * 4,  # the same answer four times: drafts from its siblings
               [[6] * 30] * 4, [[7] * 26] * 4,
               [list(range(60 + 34 * k, 94 + 34 * k)) for k in range(4)],  # unseen tokens: nothing drafts
               [[9] * 14] * 4, [[10] * 8] * 4]
    for p, a in zip(prompts, answers):
        pool.record(p, a)
    gs = groups(prompts, 4, "d")
    plans = []
    for fast, slow in ((0, 3), (3, 0)):  # two timings of epoch 1, the same tokens
        pool.rates = TokensPerForward()
        for _ in range(5):  # epoch 1's calls
            pool.rates.observe([SimpleNamespace(prompt_ids=p, token_ids=r, forwards=len(r) // 4 if i == fast
                                                else len(r) if i == slow else len(r) // 2)
                                for i, (p, a) in enumerate(zip(prompts, answers)) for r in a])
        plans.append(pool.split(gs, 2, PARAMS.max_tokens))
    assert plans[0] == plans[1]
    rates = pool.replayed.rates(pool.history, prompts, COST, SPEC.rollout.num_slots)
    assert rates[0] > 1.5 and rates[3] == 1.0  # k = 1 under COST, where a drafting row is dear


def _migrated_call(pool, policy, monkeypatch, rule: str, prompts, answers, tag: str):
    """The migration tests' call: `answers[k]` recorded as prompt k's history, 4 requests a prompt, worker 0
    given the shortest request alone and worker 1 the rest (23 on 4 slots), migration by `rule`. Every call
    must return each response once with the tokens of the unmigrated call and of the in-process pool; one of
    three must migrate (worker 0's ask must find worker 1 still running: a loaded machine may miss it).
    Returns the migrating call and the responses' lengths by request id."""
    pool.history = history = HistoryStore()
    pool.schedule, pool.migration, pool.migration_rule = "static", False, rule
    for p, a in zip(prompts, answers):
        pool.record(p, a)
    gs = groups(prompts, 4, tag)
    plain = pool.rollout(gs, PARAMS)
    lengths = {o.request_id: len(o.token_ids) for o in plain.outputs}
    g0, i0 = min(((g, i) for g in range(6) for i in range(4)), key=lambda x: lengths[gs[x[0]].request_ids[x[1]]])
    rest = [(g, tuple(i for i in range(4) if (g, i) != (g0, i0))) for g in range(6)]
    monkeypatch.setattr(pool, "split", lambda groups, n, cap=None: [[(g0, (i0,))], [p for p in rest if p[1]]])
    reference = local_tokens(policy, gs, history)
    for _ in range(3):
        before, pool.migration = pool.migrations, True
        moved = pool.rollout(gs, PARAMS)
        pool.migration = False
        assert [o.request_id for o in moved.outputs] == [rid for g in gs for rid in g.request_ids]
        assert tokens(moved) == tokens(plain) == reference
        totals = moved.engine_totals()
        if totals.migrations:
            break
    assert totals.migrations == totals.handed_over == pool.migrations - before > 0
    return moved, lengths


def test_the_tail_rule_moves_requests_grown_past_their_history_one_at_a_time(pool, policy, monkeypatch):
    """Worker 0 is given one short request, worker 1 the rest (23 on 4 slots). The history (1-token answers)
    makes every longer response "grown past it": once a group's last request on worker 1 runs beside
    another, it is moved to worker 0, one request per hand-over. Each response comes back once, with the
    tokens of the unmigrated call and of the in-process pool."""
    # The rule fires only while a qualifying request runs beside another on worker 1, and worker 0's ask
    # arrives when its one request is done: on a loaded machine that can miss the window.
    prompts = random_prompts(6, seed=32)
    moved, lengths = _migrated_call(pool, policy, monkeypatch, "tail", prompts, [[[5]] * 4 for _ in prompts], "m")
    extra = moved.workers[2:]  # the shares of moved requests, after the two planned ones
    assert len(extra) == moved.engine_totals().migrations and all(w.requests == 1 and w.worker == 0 for w in extra)
    assert all(lengths[s.request_id] > 1 for w in extra for s in w.spans)  # grown past the history's 1 token


def test_the_remaining_rule_moves_work_to_the_dry_worker_and_changes_no_token(pool, policy, monkeypatch):
    """Rule "remaining" (histopipe/rebalance.py): worker 0 is given one short request, worker 1 the rest (23
    on 4 slots). When worker 0 runs dry the driver asks the worker with the most predicted tokens left
    (worker 1), which hands over the requests with the most predicted work left while the move pays. Each
    response comes back once, with the tokens of the unmigrated call and of the in-process pool."""
    prompts = random_prompts(6, seed=34)
    moved, _ = _migrated_call(pool, policy, monkeypatch, "remaining", prompts,
                              [[[5] * (1 + 6 * i)] * 4 for i in range(len(prompts))], "r")
    # the first moved share ran on the dry worker (later ones may go back: worker 1, once done, asks worker 0)
    assert moved.workers[2].worker == 0


def _first_admitted(stats) -> list[str]:
    """The prompts (`p<i>` of the request ids) of the requests a worker's share admitted at its first step."""
    first = min(s.start for s in stats.spans)
    return [str(s.request_id).split("-")[1] for s in stats.spans if s.start == first]


def test_the_early_warning_admits_one_of_each_group_first_and_changes_no_token(policy):
    """Rule "remaining+early" on one worker in process (`RolloutWorker.rollout(early=True)`,
    rollout/early_queue.py): the worker holds its requests back and admits one member of each group first
    (FIFO admits group 0 whole), then the rest as slots free, some of them renewed ahead of their turn by
    siblings that outgrew the history (1-token answers recorded); every response is the plain rollout's."""
    prompts = random_prompts(5, seed=35)
    store = HistoryStore()
    for p in prompts:
        store.record_rollout(p, [[5]] * 4)
    gs = groups(prompts, 4, "e")
    runs = {}
    for early in (False, True):
        worker = RolloutWorker(policy, None, SPEC, cost_model=COST)
        outputs, stats = worker.rollout(gs, PARAMS, store.export(prompts), 0, early=early)
        runs[early] = ([(o.request_id, o.token_ids) for o in outputs], stats, worker)
    assert runs[True][0] == runs[False][0]
    assert set(_first_admitted(runs[False][1])) == {"p0"}  # FIFO: the first group fills the 4 slots
    first = _first_admitted(runs[True][1])
    assert len(first) == 4 and len(set(first)) == 4  # one member of each of 4 groups
    assert runs[True][2]._early.renewals > 0  # waiting siblings renewed and admitted ahead


def test_the_remaining_rule_with_the_early_warning_moves_work_and_changes_no_token(pool, policy, monkeypatch):
    """Rule "remaining+early" in the Ray pool: set up as the "remaining" test (worker 0 one short request,
    worker 1 the other 23 on 4 slots). Worker 1 admits one member of each group first (the call tells it:
    `RayCall.send`), and when worker 0 runs dry worker 1 hands over requests, held ones included; each response
    comes back once with the tokens of the unmigrated call and of the in-process pool."""
    prompts = random_prompts(6, seed=34)
    moved, _ = _migrated_call(pool, policy, monkeypatch, "remaining+early", prompts,
                              [[[5] * (1 + 6 * i)] * 4 for i in range(len(prompts))], "q")
    assert moved.workers[2].worker == 0  # the first moved share ran on the dry worker
    first = _first_admitted(moved.workers[1])
    assert len(first) > 1 and len(set(first)) == len(first)  # FIFO would admit group 0's siblings together


def test_a_worker_predicts_from_the_siblings_finished_so_far(policy):
    """Prompt A has no history, prompt B has: A's prediction starts at the data set's prior and, as A's
    siblings finish, becomes the expected length past the longest finished one, at every step boundary what
    a reference `LengthPredictor` fed the same finishes says."""
    a, b = random_prompts(2, seed=33)
    store = HistoryStore()
    store.record_rollout(b, [[5] * n for n in (3, 6, 12, 20)])
    worker = RolloutWorker(policy, None, PLAIN)
    finished, checks = [], []
    step = worker.engine.step

    def watched():  # a step boundary: the worker has observed every finish so far
        reference = LengthPredictor.from_history(store, [a, b], cap=PARAMS.max_tokens)
        for prompt, n in finished:
            reference.observe_finished(prompt, n)
        seen_a = [n for prompt, n in finished if prompt == a]
        checks.append((max(seen_a, default=0), worker.predicted_length(a), reference.predict(a)))
        events = step()
        finished.extend((ev.output.prompt_ids, len(ev.output.token_ids)) for ev in events if ev.output is not None)
        return events

    worker.engine.step = watched
    worker.rollout([RolloutGroup(a, [f"a{i}" for i in range(6)]), RolloutGroup(b, ["b0", "b1"])], PARAMS,
                   store.export([a, b]), 0)
    assert all(got == pytest.approx(ref) for _, got, ref in checks)
    prior = checks[0][1]
    assert prior == pytest.approx(LengthPredictor.from_history(store, [a, b], cap=PARAMS.max_tokens).prior())
    informed = [(seen, got) for seen, got, _ in checks if seen > 0]
    assert informed and all(got >= seen for seen, got in informed)
    assert any(got != pytest.approx(prior) for _, got in informed)


def test_the_simulator_replays_the_loops_timeline(pool, smollm2_dir, tmp_path):
    """Sync mode, the real loop (`TrainingRun`, two steps on 2 Ray workers, 16 requests a step on 2 slots
    each: 4 waves a worker), its timeline as it writes it (RUN_DIR/timeline.jsonl): per worker and step, the
    simulator's continuous batching (`batching.run_worker`) on the requests' true lengths, in the worker's
    admission order, gives the order in which they start and finish (a request that starts or finishes a
    step before another does so in the run too), and, in step 2 (step 1's first forwards are cold), with a
    step's cost and the first step's extra (the weights the update sent are repacked there) fitted by least
    squares, each start and finish to within 40% of the span (prefill steps cost more than decode steps,
    which the fitted model prices alike, and other processes share the cores: at load 5-9 the error reached
    25-35%).
    Speculation off: a step is one token, as the model has it."""
    pool.close()  # the cluster's two CPUs, for the run's two workers
    model = tiny_smol_checkpoint(tmp_path / "tiny", smollm2_dir, embed_std=0.3)
    config = json.loads((model / "config.json").read_text())  # ~8% of the vocabulary ends a response
    (model / "config.json").write_text(json.dumps(config | {"eos_token_id": list(range(2, 4002))}))
    (model / "reward_fns.py").write_text("def length_mod(completion, ground_truth, data_source, prompt):\n"
                                         "    return len(completion or '') % 7 / 6\n")
    overrides = one_step_off_overrides(model, tmp_path / "run", "length_mod", "rollout.mode=sync",
                                       "rollout.speculative=off", "train.total_steps=2", "run.save_every=0",
                                       "train.prompts_per_step=4", "rollout.num_generations=4",
                                       "rollout.num_slots=2", "rollout.max_completion_length=24",
                                       prompts=4, micro_batch=16)
    run = TrainingRun(load_config(None, overrides))
    train_rows(run)
    rows = read_timeline(run.run_dir)
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert len({r["tokens"] for r in row["requests"]}) > 3  # lengths that differ: an order to get right
        _replay(row, timed=row["step"] == 2)


def _replay(row: dict, timed: bool) -> None:
    for w in row["workers"]:
        mine = [r for r in row["requests"] if r["worker"] == w]  # in the order given: its admission order
        assert len(mine) == 8
        steps = run_worker([r["tokens"] for r in mine], 2, [1.0] * 3)  # times in steps
        origin = min(r["start"] for r in mine)
        span = max(r["end"] for r in mine) - origin
        points = [(x, r[kind] - origin) for kind, sim in (("start", steps.start), ("end", steps.finish))
                  for x, r in zip(sim, mine) if x > 0]
        first_s, step_s = _line([x for x, _ in points], [y for _, y in points])
        for kind, sim in (("start", steps.start), ("end", steps.finish)):
            real = [r[kind] - origin for r in mine]
            for i in range(8):
                for j in range(8):
                    if sim[i] < sim[j]:
                        assert real[i] < real[j], (w, kind, mine[i]["id"], mine[j]["id"])
                model = first_s + sim[i] * step_s if sim[i] > 0 else 0.0
                assert not timed or abs(real[i] - model) <= 0.4 * span, (w, kind, mine[i]["id"], real[i], model)


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """The least-squares line y = a + b x through the points: (a, b)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b
