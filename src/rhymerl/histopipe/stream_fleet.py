"""one_step_off with `rollout.stream` and `rollout.migration` on one clock (docs/design.md, section 4, "Rollout
as a stream": migration inside the stream). What `rollout/ray_stream.py` does, as a timing model (torch-free).

Each worker runs its shares one after another (step 1's, then step 2's, ...; a share is a continuous batch as in
`batching.run_worker`), a share of step t starting once the worker is done with its previous share and step t's
weights exist: at the end of the update of step t - 2 (`simulate.ready_times`, one_step_off's lag; steps 1 and 2
run on the initial weights). Updates run in turn, each `train_s` seconds after its step's last request.

Migration (`migration`): a worker that has run out of work it may start (its next share waits for weights, or it
has none left) asks, once, for work of the oldest step still running: the donor is that step's worker with the
most unfinished requests (`half_busiest`, as the sync pool's `fleet.simulate_fleet`), which hands over half of
them at its next step boundary (waiting ones first, the last queued first, then the running ones furthest past
their group's predicted longest member). The idle worker runs them as a share of their own step (on that step's
weights: a moved request re-prefills its generated tokens, `batching.reprefill_cost`, and its tokens are the
ones it would have drawn), before its own next share; when that share is done it asks again.
`remaining` (`rebalance.py`, the sync pool's rule of that name): the donors are the workers running a share of
that step, latest predicted end first (`rebalance.donors`: each worker's end predicted at its last event, its
clock plus its requests' remaining work, `rebalance.remaining_work`); the first of up to `DONORS_ASKED` from which
some move pays hands over, at its next step boundary, its requests with the most remaining work while each move
shortens the later of the two (`rebalance.moves`, both priced as batches, the receiver's re-prefills and its
weights load included: `load_s` when it holds another version than the step's). A request's length given the
`done` tokens it holds is the mean of its group's predicted lengths above `done` (the group's predictions stand
for its distribution; none above: done + 1), or, given a predictor, its live `predict_past` (renewed once the
request passes it), as on a real worker.

Weight loads (`load_s`), as `WorkerActor.stream_rollout` runs them: a worker holds one weights version (its
model's parameters, copied in place by `RolloutWorker.load_weights`; no second copy is kept), so a share of a
step whose version (step t runs on version t - 2, steps 1 and 2 on version 0) is not the one it holds first
loads it: `load_s` seconds, not busy (it decodes nothing: a load counts in the bubble), before the share's first
request. A migrated share of an older step costs its receiver a load, and its next own share loads again when
that one's version differs too. Default `LOAD_S`, measured (`scripts/weight_load_cost.py`: the parameters'
copy and the CPU backend's repack at the next forward) for the model and machine that
`docs/notebook/data/2026-11-27-pipe-cost-zen4.json` prices. With `load_s=0` and no migration the run is
`simulate.simulate_run(mode="one_step_off")`'s exactly (tested; that one prices no load).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import replace

from rhymerl.histopipe.batching import Cost, decode_costs, per_key_cost, reprefill_cost, run_cost, steps_to_reach
from rhymerl.histopipe.fleet import DONORS_ASKED
from rhymerl.histopipe.pieces import Piece
from rhymerl.histopipe.rebalance import batches, donors, moves, remaining_work
from rhymerl.histopipe.timeline import Timeline

STREAM_MIGRATIONS = ("half_busiest", "remaining")  # the rules migration inside the stream runs (simulated, on Ray)
# Seconds a worker takes to switch weights versions: smollm2-135m in bf16 on the 2-core Zen 4 VM, one torch
# thread (the saved cost model's model, dtype and machine), median of 5: 0.108 s copying the parameters and
# 0.300 s of the CPU backend's repack at the next forward (docs/notebook/2026-11-27-d-stream.md; fp32: 1.1 s).
LOAD_S = 0.41


def version_of(step: int) -> int:
    """The weights version step index `step` (from 0) runs on in one_step_off: the update of step index
    step - 2 makes version step - 1; steps 0 and 1 run on the initial weights, version 0."""
    return max(step - 1, 0)


class _Share:
    def __init__(self, step: int, rids: list[int], moved: bool = False):
        self.step, self.rids, self.moved = step, rids, moved


class _Worker:
    def __init__(self):
        self.shares: deque[_Share] = deque()  # to run, in order (a moved share first)
        self.step_of: int | None = None  # the step of the share it runs; None: idle
        self.queue: deque[int] = deque()
        self.running: list[tuple[float, int]] = []  # heap of (finish engine step, request)
        self.admitted: dict[int, float] = {}  # request -> its admission engine step, less its carried tokens
        self.carried: dict[int, float] = {}
        self.prefill: dict[int, float] = {}
        self.step = self.clock = self.key_base = 0.0
        self.version = 0  # its events' version (a stale event is dropped), not the weights'
        self.held = 0  # the weights version it holds (version_of)
        self.end: float | None = None  # "remaining": its predicted end as of its last event ...
        self.fresh = False  # ... once computed (`predicted_end`)
        self.busy: list[tuple[float, float]] = []
        self.occupancy: list[tuple[float, int]] = []


def simulate_stream(steps: Sequence[Sequence[Sequence[int]]], assignments: Sequence[Sequence[Sequence[Piece]]], *,
                    slots: int, cost_model: Cost, predicted: Sequence[Sequence[Sequence[float]]] | None = None,
                    migration: str | None = None, train_s: float = 0.0, log: list | None = None,
                    load_s: float = LOAD_S, predictor=None, keys: Sequence[Sequence] | None = None):
    """Run `steps[t]` (step t+1's groups, each its requests' true lengths) in one_step_off with the stream, worker
    w running `assignments[t][w]` (its pieces, admission order) as its share of step t+1; `migration` None or one
    of STREAM_MIGRATIONS (see the module doc); `predicted[t][g]`: group g's predicted request lengths (half_busiest
    reads the longest, remaining each group's lengths; None: the true lengths are not shown, every request is
    predicted 0); `load_s`: seconds of a weights switch (see the module doc); `predictor` (a `LengthPredictor`)
    with `keys[t][g]`, group g of step t's prompt key: remaining prices a request by the predictor's live
    `predict_past` (as the real worker's `rebalance.pool_moves` does), told each finish (`observe_finished`),
    instead of its group's predictions. Returns the run's
    timeline (step t's groups after step t-1's), each step's rollout (start, end) and update (start, end), and
    the requests moved (`simulate.simulate_run(migration=...)` wraps them as a `SimulatedRun`). `log`, when
    given, gets each share as it starts: (worker, step index, its requests as (step index, group, index), moved)."""
    if migration is not None and migration not in STREAM_MIGRATIONS:
        raise ValueError(f"unknown stream migration {migration!r}; choose from {', '.join(STREAM_MIGRATIONS)}")
    if len(assignments) != len(steps):
        raise ValueError(f"{len(steps)} steps but {len(assignments)} assignments")
    num_workers = len(assignments[0]) if assignments else 0
    step_cost, per_key = decode_costs(cost_model, slots), per_key_cost(cost_model)
    if load_s < 0:
        raise ValueError(f"load_s must be >= 0, got {load_s}")
    live = predictor if migration == "remaining" and predictor is not None else None
    if live is not None and (keys is None or [len(k) for k in keys] != [len(ls) for ls in steps]):
        raise ValueError("a predictor needs keys: one prompt key per group of each step")
    reqs: list[tuple[int, int]] = []  # request -> (timeline group, index); timeline groups: step by step
    step_of_req, first_group, length, longest, group_pred, key_of = [], [], [], [], [], []
    for t, lengths in enumerate(steps):
        first_group.append(sum(len(s) for s in steps[:t]))
        for g, ls in enumerate(lengths):
            for i, n in enumerate(ls):
                reqs.append((first_group[t] + g, i))
                step_of_req.append(t)
                length.append(max(float(n), 1.0))
                longest.append(max(predicted[t][g]) if predicted is not None else 0.0)
                group_pred.append(predicted[t][g] if predicted is not None else ())
                key_of.append(keys[t][g] if live is not None else None)
    rid = {r: k for k, r in enumerate(reqs)}
    mean_pred = [max(sum(ps) / len(ps), 1.0) if ps else 1.0 for ps in group_pred]  # "remaining", before a token
    plen = [0.0] * len(reqs)  # "remaining" with a predictor: each request's live prediction, renewed once passed
    workers = [_Worker() for _ in range(num_workers)]
    worker_of = [-1] * sum(len(lengths) for lengths in steps)  # per timeline group: its first piece's worker
    left = [sum(len(ls) for ls in lengths) for lengths in steps]  # unfinished requests per step
    for t, per_worker in enumerate(assignments):
        if len(per_worker) != num_workers:
            raise ValueError(f"step {t + 1}: {len(per_worker)} workers' shares, {num_workers} expected")
        held = sorted((g, i) for pieces in per_worker for g, idx in pieces for i in idx)
        if held != [(g, i) for g, ls in enumerate(steps[t]) for i in range(len(ls))]:
            raise ValueError(f"step {t + 1}: the assignment must hold each request exactly once")
        for w, pieces in enumerate(per_worker):
            rids = [rid[(first_group[t] + g, i)] for g, idx in pieces for i in idx]
            if rids:
                workers[w].shares.append(_Share(t, rids))
            for g, _ in pieces:
                if worker_of[first_group[t] + g] < 0:
                    worker_of[first_group[t] + g] = w
    finish = [[0.0] * len(ls) for lengths in steps for ls in lengths]
    weights_at: dict[int, float] = {0: 0.0, 1: 0.0}  # step index -> when its weights exist
    ends: dict[int, float] = {}
    updates: list[tuple[float, float]] = []
    starts: dict[int, float] = {}
    events: list[tuple[float, int, int]] = []  # (time, worker, its version then)
    moved = 0

    def busy_until(wk: _Worker, start: float, end: float) -> None:
        if wk.busy and wk.busy[-1][1] >= start:
            wk.busy[-1] = (wk.busy[-1][0], end)
        else:
            wk.busy.append((start, end))

    def schedule(w: int) -> None:
        wk = workers[w]
        while wk.queue and len(wk.running) < slots:
            r = wk.queue.popleft()
            pay = wk.prefill.pop(r, 0.0)
            if pay:
                busy_until(wk, wk.clock, wk.clock + pay)
                wk.clock += pay
            wk.admitted[r] = wk.step - wk.carried.pop(r, 0.0)
            wk.key_base += wk.admitted[r]
            heapq.heappush(wk.running, (wk.admitted[r] + length[r], r))
        if wk.step_of is not None and (not wk.occupancy or wk.occupancy[-1][1] != len(wk.running)):
            wk.occupancy.append((wk.clock, len(wk.running)))
        wk.fresh = False  # "remaining": its predicted end is renewed when next asked (it holds till its next event)
        if wk.running:
            heapq.heappush(events, (wk.clock + run_cost(len(wk.running), wk.step, wk.running[0][0], wk.key_base,
                                                        step_cost, per_key), w, wk.version))
        elif wk.step_of is not None and not wk.queue:  # ran dry off its own events (its last requests finished
            heapq.heappush(events, (wk.clock, w, wk.version))  # at a hand-over's boundary, or moved): idle then

    def advance(w: int, to_step: float) -> None:
        wk = workers[w]
        start = wk.clock
        wk.clock += run_cost(len(wk.running), wk.step, to_step, wk.key_base, step_cost, per_key)
        wk.step = to_step
        busy_until(wk, start, wk.clock)
        while wk.running and wk.running[0][0] <= to_step:
            r = heapq.heappop(wk.running)[1]
            g, i = reqs[r]
            finish[g][i] = wk.clock
            wk.key_base -= wk.admitted.pop(r)
            if live is not None:
                live.observe_finished(key_of[r], int(length[r]))
            t = step_of_req[r]
            left[t] -= 1
            if not left[t]:
                ends[t] = wk.clock
                step_done()

    def step_done() -> None:  # the updates of the steps now complete, in turn; the weights they make
        while len(updates) in ends:
            t = len(updates)
            begin = max(ends[t], updates[-1][1] if updates else 0.0)
            updates.append((begin, begin + train_s))
            weights_at[t + 2] = begin + train_s
            for w, wk in enumerate(workers):
                if wk.step_of is None and wk.shares and wk.shares[0].step == t + 2:
                    heapq.heappush(events, (max(wk.clock, weights_at[t + 2]), w, wk.version))

    def start_share(w: int, now: float) -> None:
        wk = workers[w]
        share = wk.shares.popleft()
        wk.step_of, wk.clock = share.step, max(wk.clock, now)
        if version_of(share.step) != wk.held:  # it loads the share's weights first (not busy: see the doc)
            wk.clock += load_s
            wk.held = version_of(share.step)
        starts[share.step] = min(starts.get(share.step, wk.clock), wk.clock)
        wk.queue = deque(share.rids)
        if log is not None:
            log.append((w, share.step, [(share.step, reqs[r][0] - first_group[share.step], reqs[r][1])
                                        for r in share.rids], share.moved))
        wk.version += 1
        schedule(w)

    def boundary(w: int, now: float) -> None:  # bring w to its first engine-step boundary at or after `now`
        wk = workers[w]
        if not wk.running or wk.clock >= now:
            return
        advance(w, wk.step + steps_to_reach(wk.clock, now, len(wk.running), wk.step,
                                            int(wk.running[0][0] - wk.step), wk.key_base, step_cost, per_key))
        wk.version += 1
        schedule(w)

    def expected(r: int, done: float) -> float:  # "remaining": r's length given it holds `done` tokens
        if live is not None:
            if plen[r] <= done:  # not asked yet, or run past it
                plen[r] = live.predict_past(key_of[r], done)
            return plen[r]
        if not done:
            return mean_pred[r]
        above = [p for p in group_pred[r] if p > done]
        return max(sum(above) / len(above), done + 1.0) if above else done + 1.0

    def remaining(v: int, priced: bool = False) -> tuple[list[int], list[float], list[float], tuple | None]:  # fleet's
        wk = workers[v]
        rs = [r for _, r in wk.running] + list(wk.queue)
        done = [wk.step - wk.admitted[r] if r in wk.admitted else wk.carried.get(r, 0.0) for r in rs]
        lens = [expected(r, d) for r, d in zip(rs, done)]
        owed = [0.0 if r in wk.admitted else wk.prefill.get(r, 0.0) for r in rs]
        prefills = [reprefill_cost(cost_model, step_cost, slots, d) if r in wk.admitted else p
                    for r, d, p in zip(rs, done, owed)]
        share = step_cost[max(len(wk.running), 1)] / max(len(wk.running), 1)
        works = [remaining_work(d, n, share, per_key) for d, n in zip(done, lens)]
        return rs, prefills, works, (batches(done, lens, prefills, owed, step_cost, slots, per_key) if priced else None)

    def half_of_busiest(t: int, now: float) -> tuple[int, list[int]] | None:  # the donor and what it gives
        load = {v: len(wk.running) + len(wk.queue) for v, wk in enumerate(workers) if wk.step_of == t}
        src = max(sorted(load), key=load.__getitem__)
        if load[src] < 2:
            return None
        boundary(src, now)
        s = workers[src]
        if s.step_of != t:  # its share ended at that boundary
            return None
        n = (len(s.running) + len(s.queue)) // 2
        by_past = sorted((r for _, r in s.running), key=lambda r: longest[r] - (s.step - s.admitted[r]))
        return src, (list(s.queue)[::-1] + by_past)[:n]

    def predicted_end(v: int) -> float | None:  # v's clock plus its requests' remaining work, as of its last event
        wk = workers[v]
        if not wk.fresh:
            rs, _, works, _ = remaining(v)
            wk.end, wk.fresh = (wk.clock + sum(works) if rs else None), True
        return wk.end

    def most_remaining(w: int, t: int, now: float) -> tuple[int, list[int]] | None:  # as the sync pool's rule
        ends = [predicted_end(v) if wk.step_of == t and v != w else None for v, wk in enumerate(workers)]
        for src in donors(ends, w, now)[:DONORS_ASKED]:
            boundary(src, now)
            if workers[src].step_of != t:
                continue
            rs, prefills, works, (kept, taken) = remaining(src, priced=True)
            load = load_s if workers[w].held != version_of(t) else 0.0  # it holds no work of its own
            picked = moves(works, prefills, donor=kept, receiver=replace(taken, load=load))
            if picked:
                return src, [rs[i] for i in picked]
        return None

    def migrate(w: int, now: float) -> bool:  # w is idle: requests of the oldest running step, by the rule
        nonlocal moved
        running = sorted({wk.step_of for wk in workers if wk.step_of is not None})
        if not running:
            return False
        t = running[0]
        got = half_of_busiest(t, now) if migration == "half_busiest" else most_remaining(w, t, now)
        if not got or not got[1]:
            return False
        src, picked = got
        s, d = workers[src], workers[w]
        for r in picked:
            if r in s.admitted:
                s.running.remove(next(x for x in s.running if x[1] == r))
                done = s.step - s.admitted.pop(r)
                s.key_base -= s.step - done
                d.carried[r] = done
                d.prefill[r] = reprefill_cost(cost_model, step_cost, slots, done)
            else:
                s.queue.remove(r)
                if r in s.carried:  # moved to src before, not admitted there yet: what it carries moves on
                    d.carried[r], d.prefill[r] = s.carried.pop(r), s.prefill.pop(r)
        heapq.heapify(s.running)
        s.version += 1
        schedule(src)
        moved += len(picked)
        d.shares.appendleft(_Share(t, picked, moved=True))
        start_share(w, max(now, s.clock))
        return True

    def idle(w: int, now: float) -> None:  # w's share is done (or it has not started): next, or migrate, or wait
        wk = workers[w]
        wk.step_of = None
        nxt = wk.shares[0].step if wk.shares else None
        if nxt is not None and weights_at.get(nxt, float("inf")) <= now:
            start_share(w, max(now, weights_at[nxt]))
        elif migration is not None and migrate(w, now):
            return
        elif nxt is not None and nxt in weights_at:  # its weights come later: wake then
            heapq.heappush(events, (weights_at[nxt], w, wk.version))

    for w in range(num_workers):
        idle(w, 0.0)
    while events:
        now, w, version = heapq.heappop(events)
        wk = workers[w]
        if version != wk.version:
            continue
        if wk.step_of is None:  # woken: its next share's weights exist now
            if wk.shares and weights_at.get(wk.shares[0].step, float("inf")) <= now:
                start_share(w, now)
            continue
        if wk.running:
            advance(w, wk.running[0][0])
            schedule(w)
        if not wk.running and not wk.queue:
            if wk.occupancy and wk.occupancy[-1][1]:
                wk.occupancy.append((wk.clock, 0))
            wk.version += 1
            idle(w, wk.clock)
    if any(left):
        raise RuntimeError(f"stream simulation ended with {sum(left)} requests unfinished")
    timeline = Timeline(busy=[wk.busy for wk in workers], finish=finish, worker=worker_of,
                        occupancy=[wk.occupancy for wk in workers])
    rollouts = [(starts.get(t, 0.0), ends[t]) for t in range(len(steps))]
    return timeline, rollouts, updates, moved
