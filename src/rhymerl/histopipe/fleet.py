"""One sync step on every worker at once, with migration between them (docs/design.md, section 4, Migration).

`simulate`'s workers run apart (`batching.run_worker`). Migration needs them together: the same batching
model (fixed slots, a freed slot refilled for the next step, a step of n costing `step_cost[n]` plus
attention) on one clock over all workers, each worker's next event its next finish; a moved running request
leaves at its worker's next step boundary and, on its new worker, first re-prefills the tokens it generated
(`reprefill`), then decodes on. Without migration it gives `run_worker`'s times exactly (tested).

Rules (`migration`; each in full in docs/design.md, section 4, "Migration"):
- "half_busiest" (the pool's default): a worker out of work takes half the unfinished requests of the one
  with the most, waiting ones first (the last queued first), then running ones furthest past their prediction;
- "tail" (the paper's, `deferral.py`): each worker out of work takes one running request in its group's
  tail grown past (1 + `grow`) x its group's predicted longest member, from the worker running the most;
- "steal": a worker with a dry queue and a free slot takes waiting requests from the longest queue's back;
- "remaining" (`rebalance.py`, shared with the rollout worker): a worker that runs dry takes, from the latest
  predicted end, the requests with the most predicted remaining work while each move pays;
- "early" (`early_warning.py`, shared with the rollout worker): one member of each group admitted first;
  waiting siblings renewed (repriced, admitted first) once a member passes their predicted length;
- "push" (`push.py`, simulated only; implies "early"): a worker predicted late gives the earliest waiting work.
Rules combine with "+" (e.g. "steal+tail", "half_busiest+push").

Every finish is reported to `predictor.observe_finished` when a predictor is given, and the running
requests' predicted lengths are then its live `predict` (what "furthest past predicted" reads).
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import replace

from rhymerl.histopipe.batching import Cost, decode_costs, per_key_cost, reprefill_cost, run_cost, steps_to_reach
from rhymerl.histopipe.deferral import GROW, TAIL_SHARE, tail_size, threshold as tail_threshold
from rhymerl.histopipe.pieces import Piece
from rhymerl.histopipe.early_warning import evidence, probe_order, renewed_first, renewed_length
from rhymerl.histopipe.push import Ends, give_order, pushes
from rhymerl.histopipe.rebalance import batches, donors, moves, remaining_work
from rhymerl.histopipe.timeline import Timeline

DONORS_ASKED = 8  # "remaining": a worker that runs dry asks the 8 latest predicted ends, latest first
MIGRATIONS = ("half_busiest", "tail", "remaining", "steal", "steal+tail", "remaining+early")
POOL_MIGRATIONS = MIGRATIONS[:3] + MIGRATIONS[5:]  # rollout.migration_rule's choices: the rules the Ray pool runs too


class _Worker:
    def __init__(self, queue: list[int]):
        self.queue = deque(queue)  # request ids waiting, admission order
        self.prefill: dict[int, float] = {}  # a moved request's re-prefill seconds, paid when admitted
        self.carried: dict[int, float] = {}  # a moved request's tokens generated before the move
        self.running: list[tuple[float, int]] = []  # heap of (finish step, request)
        self.watch: list[tuple[float, int]] = []  # heap of (step, request): a tail request's threshold
        self.admitted: dict[int, float] = {}  # request -> the step it would have started at (keys: see batching)
        self.step = self.clock = self.key_base = 0.0
        self.recheck = math.inf  # "remaining": the step where a running request passes its prediction
        self.version = 0  # bumps when the worker's running set changes off its own events
        self.busy: list[tuple[float, float]] = []
        self.occupancy: list[tuple[float, int]] = []


def simulate_fleet(lengths: Sequence[Sequence[int]], assignment: Sequence[Sequence[Piece]], *, slots: int,
                   cost_model: Cost, predicted: Sequence[Sequence[float]], migration: str | None = None,
                   tail_share: float = TAIL_SHARE, grow: float = GROW, predictor=None,
                   keys: Sequence[str] | None = None) -> tuple[Timeline, int]:
    """Run one sync step of `assignment` (per worker, its pieces in admission order) on the true `lengths`
    with `migration` (None, or one of MIGRATIONS; see the module doc). `predicted[g]`: group g's predicted
    request lengths (its history's). Returns the timeline and the number of requests moved."""
    rules = set(migration.split("+")) if migration else set()
    if migration is not None and not rules <= {"half_busiest", "tail", "steal", "remaining", "early", "push"}:
        raise ValueError(f"unknown migration {migration!r}; choose from {', '.join(MIGRATIONS)}")
    step_cost, per_key = decode_costs(cost_model, slots), per_key_cost(cost_model)
    reqs = [(g, i) for g, ls in enumerate(lengths) for i in range(len(ls))]
    rid = {r: k for k, r in enumerate(reqs)}
    length = [max(float(lengths[g][i]), 1.0) for g, i in reqs]
    unfinished = [len(ls) for ls in lengths]
    threshold = [tail_threshold(max(predicted[g]), grow) for g, _ in reqs]
    workers = [_Worker([rid[(g, i)] for g, idx in pieces for i in idx]) for pieces in assignment]
    early, priced = bool(rules & {"early", "push"}), bool(rules & {"remaining", "push"})
    for wk in workers if early else []:
        wk.queue = deque(probe_order(list(wk.queue), [reqs[r][0] for r in wk.queue]))
    longest_done = [0.0] * len(lengths)  # "early": a group's longest finished member
    where = {r: w for w, wk in enumerate(workers) for r in wk.queue}
    if sorted(where) != list(range(len(reqs))):
        raise ValueError("the assignment must hold each request exactly once")
    finish = [[0.0] * len(ls) for ls in lengths]
    events: list[tuple[float, int, int]] = []  # (time, worker, its version then)
    moved = 0
    tail = [tail_size(len(ls), tail_share) for ls in lengths]  # a group's tail: its last unfinished requests
    candidates: set[int] = set()  # "tail": requests in their group's tail, grown past their threshold
    idle: set[int] = set()  # workers out of work

    def reprefill(tokens: float) -> float:  # on the new worker
        return reprefill_cost(cost_model, step_cost, slots, tokens)

    def live_prediction(r: int) -> float:
        g = reqs[r][0]
        return predictor.predict(keys[g]) if predictor is not None else max(predicted[g])

    queues = [(-len(wk.queue), w) for w, wk in enumerate(workers)]  # lazy heap: the longest queue first
    heapq.heapify(queues)

    def steal(w: int) -> None:  # w's queue is dry and it has free slots: take from the longest queue
        nonlocal moved
        while queues:
            size, v = heapq.heappop(queues)
            now_size = len(workers[v].queue)
            if -size != now_size:  # stale (the queue has shrunk since): put it back at its size
                if now_size:
                    heapq.heappush(queues, (-now_size, v))
                continue
            if now_size < 2:  # the longest queue holds one request at most: leave it
                heapq.heappush(queues, (size, v))
                return
            n = min(slots - len(workers[w].running), now_size // 2)
            for _ in range(n):
                r = workers[v].queue.pop()
                workers[w].queue.append(r)
                where[r] = w
            moved += n
            heapq.heappush(queues, (-(now_size - n), v))
            return

    def schedule(w: int) -> None:
        wk = workers[w]
        if "steal" in rules and not wk.queue and len(wk.running) < slots:
            steal(w)
        if "push" in rules and wk.queue:
            push(w)
        if early and wk.queue and len(wk.running) < slots:  # renewed ones first, longest first; the rest as queued
            wk.queue = deque(renewed_first(wk.queue, renew))
        while wk.queue and len(wk.running) < slots:  # refill the free slots before the next step
            r = wk.queue.popleft()
            pay = wk.prefill.pop(r, 0.0)
            if pay:  # busy re-prefilling
                if wk.busy and wk.busy[-1][1] >= wk.clock:
                    wk.busy[-1] = (wk.busy[-1][0], wk.clock + pay)
                else:
                    wk.busy.append((wk.clock, wk.clock + pay))
                wk.clock += pay
            done = wk.carried.pop(r, 0.0)  # tokens generated elsewhere before a migration
            wk.admitted[r] = wk.step - done
            wk.key_base += wk.admitted[r]
            heapq.heappush(wk.running, (wk.step + length[r] - done, r))
            if "tail" in rules and unfinished[reqs[r][0]] <= tail[reqs[r][0]]:
                heapq.heappush(wk.watch, (wk.admitted[r] + threshold[r], r))
        if not wk.occupancy or wk.occupancy[-1][1] != len(wk.running):
            wk.occupancy.append((wk.clock, len(wk.running)))
        while wk.watch and (wk.watch[0][1] not in wk.admitted or wk.watch[0][0] <= wk.step):
            _, r = heapq.heappop(wk.watch)
            if r in wk.admitted:  # still running here, past its threshold
                candidates.add(r)
        if priced:
            estimate(w)
        if wk.running:
            nxt = min(wk.running[0][0], wk.watch[0][0] if wk.watch else math.inf, wk.recheck)
            heapq.heappush(events, (wk.clock + run_cost(len(wk.running), wk.step, nxt, wk.key_base, step_cost,
                                                        per_key), w, wk.version))

    def advance(w: int, to_step: float) -> None:  # run w's current batch up to `to_step`, finishes included
        wk = workers[w]
        start = wk.clock
        wk.clock += run_cost(len(wk.running), wk.step, to_step, wk.key_base, step_cost, per_key)
        wk.step = to_step
        while wk.running and wk.running[0][0] <= to_step:
            r = heapq.heappop(wk.running)[1]
            g, i = reqs[r]
            finish[g][i] = wk.clock
            wk.key_base -= wk.admitted.pop(r)
            unfinished[g] -= 1
            candidates.discard(r)
            if "tail" in rules and unfinished[g] == tail[g]:  # the group's tail begins: watch its members
                for j in range(len(lengths[g])):
                    q = rid[(g, j)]
                    o = workers[where[q]]
                    if q in o.admitted:
                        heapq.heappush(o.watch, (o.admitted[q] + threshold[q], q))
                        if o is not wk:
                            o.version += 1
                            pending.add(where[q])
            longest_done[g] = max(longest_done[g], length[r])
            if predictor is not None:
                predictor.observe_finished(keys[g], int(length[r]))
        if wk.busy and wk.busy[-1][1] >= start:
            wk.busy[-1] = (wk.busy[-1][0], wk.clock)
        else:
            wk.busy.append((start, wk.clock))

    def boundary(w: int, now: float) -> None:  # bring w to its first step boundary at or after `now`
        wk = workers[w]
        if not wk.running or wk.clock >= now:
            return
        advance(w, wk.step + steps_to_reach(wk.clock, now, len(wk.running), wk.step,
                                            int(wk.running[0][0] - wk.step), wk.key_base, step_cost, per_key))
        wk.version += 1  # its queued event was priced from before: price the rest again
        schedule(w)

    def take(src: int, dst: int, rs: list[int], now: float) -> None:  # move `rs` (src at a boundary) to dst
        nonlocal moved
        s, d = workers[src], workers[dst]
        for r in rs:
            if r in s.admitted:  # running: it carries its generated tokens over and re-prefills them
                s.running.remove(next(x for x in s.running if x[1] == r))
                done = s.step - s.admitted.pop(r)
                s.key_base -= s.step - done
                d.carried[r] = done
                d.prefill[r] = reprefill(done)
            else:
                s.queue.remove(r)
                if r in s.carried:  # moved here before, not admitted yet: what it carries moves on
                    d.carried[r], d.prefill[r] = s.carried.pop(r), s.prefill.pop(r)
            d.queue.append(r)
            where[r] = dst
        heapq.heapify(s.running)
        moved += len(rs)
        s.version += 1
        schedule(src)
        d.clock = max(d.clock, now, s.clock)
        d.version += 1
        schedule(dst)

    def half_busiest(idle_w: int, now: float) -> None:  # idle_w takes half of the busiest worker's requests
        src = max(range(len(workers)), key=lambda w: (len(workers[w].running) + len(workers[w].queue), -w))
        if src == idle_w or not (workers[src].running or workers[src].queue):
            return
        boundary(src, now)
        s = workers[src]
        n = (len(s.running) + len(s.queue)) // 2
        running = sorted((r for _, r in s.running), key=lambda r: live_prediction(r) - (s.step - s.admitted[r]))
        picked = (list(s.queue)[::-1] + running)[:n]
        if picked:
            take(src, idle_w, picked, now)

    def tail_moves(now: float) -> None:  # each idle worker takes one candidate, from the fullest worker first
        ready = sorted((r for r in candidates if len(workers[where[r]].running) >= 2),
                       key=lambda r: (-len(workers[where[r]].running), r))
        for idle_w in sorted(idle):
            while ready:
                r = ready.pop(0)
                src = where[r]
                if r not in workers[src].admitted:
                    continue
                boundary(src, now)  # which may finish it, or others
                if r in workers[src].admitted and len(workers[src].running) >= 2:  # still so after moves
                    candidates.discard(r)
                    take(src, idle_w, [r], now)
                    break

    plen: list[float] = [0.0] * len(reqs)  # "remaining": each request's predicted length, renewed once passed
    ending = Ends(len(workers), heap="push" in rules)  # "remaining", "push": each worker's predicted end
    ends = ending.end

    def predicted_length(r: int, done: float) -> float:
        if plen[r] <= done:  # not asked yet, or run past it: the live prediction given what it holds
            g, i = reqs[r]
            plen[r] = predictor.predict_past(keys[g], done) if predictor is not None else max(predicted[g][i],
                                                                                              done + 1)
        return plen[r]

    def renew(r: int) -> float:  # "early": a waiting request's renewed length (0: not renewed; early_warning)
        g, i = reqs[r]
        seen = evidence(longest_done[g], (workers[where[q]].step - workers[where[q]].admitted[q] for q in
                                          (rid[(g, j)] for j in range(len(lengths[g])))
                                          if q in workers[where[q]].admitted))
        base = predicted_length(r, workers[where[r]].carried.get(r, 0.0))
        renewed[r] = renewed_length(seen, base, (lambda x: predictor.predict_past(keys[g], x))
                                    if predictor is not None else float)
        return renewed[r]

    renewed = [0.0] * len(reqs)  # "early": a waiting request's renewed length (0: not renewed)

    def remaining(w: int, priced: bool = False) -> tuple[list[int], list[float], list[float], tuple | None]:
        """w's requests, re-prefills, works at w's batch, and (`priced`) `rebalance.batches` (no load: one
        weights version in a sync step)."""
        wk = workers[w]
        rs = [r for _, r in wk.running] + list(wk.queue)
        done = [wk.step - wk.admitted[r] if r in wk.admitted else wk.carried.get(r, 0.0) for r in rs]
        ends = [(early and r not in wk.admitted and renew(r)) or predicted_length(r, d) for r, d in zip(rs, done)]
        owed = [0.0 if r in wk.admitted else wk.prefill.get(r, 0.0) for r in rs]
        prefills = [reprefill(d) if r in wk.admitted else p for r, d, p in zip(rs, done, owed)]
        share = step_cost[max(len(wk.running), 1)] / max(len(wk.running), 1)
        works = [remaining_work(d, n, share, per_key) for d, n in zip(done, ends)]
        return rs, prefills, works, (batches(done, ends, prefills, owed, step_cost, slots, per_key) if priced else None)

    def estimate(w: int) -> None:  # "remaining": w's predicted end, and when to look again (see the doc)
        wk = workers[w]
        rs, _, works, _ = remaining(w)
        ending.set(w, wk.clock + sum(works) if rs else None)
        wk.recheck = min((math.ceil(wk.admitted[r] + max(plen[r], (wk.step - wk.admitted[r]) * 1.02 + 16))
                          for _, r in wk.running), default=math.inf)  # whole steps, as everywhere here

    def rebalance(idle_w: int, now: float) -> bool:  # "remaining": idle_w takes from the latest end
        own = sum(remaining(idle_w)[2])
        free = slots - len(workers[idle_w].running) - len(workers[idle_w].queue)
        for src in donors(ends, idle_w, now)[:DONORS_ASKED]:
            boundary(src, now)
            rs, prefills, works, (kept, taken) = remaining(src, priced=True)
            picked = moves(works, prefills, donor=kept, receiver=replace(taken, own=own))[:free]
            if picked:
                take(src, idle_w, [rs[i] for i in picked], now)
                return True
        return False

    def push(w: int) -> None:  # "push" (push.py): w gives waiting requests to the earliest predicted end
        nonlocal moved
        wk = workers[w]
        order = give_order(list(wk.queue), lambda r: reqs[r][0], renew, Counter(reqs[r][0] for r in wk.admitted))
        for r, v in pushes(order, w, ending, lambda r: remaining_work(0.0, renewed[r] or predicted_length(r, 0.0),
                                                                      step_cost[slots] / slots, per_key),
                           lambda v: bool(workers[v].running)):
            wk.queue.remove(r)
            workers[v].queue.append(r)
            if r in wk.carried:  # moved here before, not admitted yet: what it carries moves on
                workers[v].carried[r], workers[v].prefill[r] = wk.carried.pop(r), wk.prefill.pop(r)
            where[r], moved = v, moved + 1

    pending: set[int] = set()  # workers whose watches changed off their own events: rescheduled next
    for w in range(len(workers)):
        schedule(w)
    while events:
        t, w, version = heapq.heappop(events)
        wk = workers[w]
        if version != wk.version or not wk.running:
            continue
        nxt = min(wk.running[0][0], wk.watch[0][0] if wk.watch else math.inf, wk.recheck)
        had = len(candidates)
        advance(w, nxt)
        schedule(w)
        for p in sorted(pending):
            if p != w:
                schedule(p)
        pending.clear()
        if not rules - {"steal"}:
            continue
        if "remaining" in rules and not wk.running and not wk.queue:  # asked each time it runs dry
            rebalance(w, t)
        if not wk.running and not wk.queue:
            idle.add(w)
            if "half_busiest" in rules:  # asked once, when the worker runs out (as the Ray pool does)
                half_busiest(w, t)
        if "tail" in rules and idle and candidates and (w in idle or len(candidates) > had):
            tail_moves(t)
        idle = {i for i in idle if not (workers[i].running or workers[i].queue)}
    worker_of = [0] * len(lengths)
    for pieces_w, pieces in reversed(list(enumerate(assignment))):
        for g, _ in pieces:
            worker_of[g] = pieces_w  # a split group: its first piece's worker
    timeline = Timeline(busy=[wk.busy for wk in workers], finish=finish, worker=worker_of,
                        occupancy=[wk.occupancy if wk.busy else [] for wk in workers])
    return timeline, moved
