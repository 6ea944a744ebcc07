"""Rollout as a stream over a `RayPool`'s workers (`rollout.stream`, with `rollout.mode=one_step_off`).

A step's groups are split as `RayPool.rollout` splits them (`RayPool.split`, `rollout.schedule`) and each
worker's share is queued on its actor at once, behind whatever that actor still runs: a worker whose share of
step t is done starts its share of step t+1 right away, with no round trip to the driver, while the others
finish step t. `collect` returns a step once all of its groups are in, so the loop trains step t while the
early workers already roll out t+1.

Each share carries its place in its actor's queue (Ray does not keep a threaded actor's calls in submission
order; `WorkerActor.stream_rollout` does) and the reference to the weights version it is to run on: the
worker loads that version first if it holds another. So a weight load never races a rollout (it happens
between two shares, on the worker's compute thread), the driver never waits for a worker to be idle before
publishing new weights (`publish`: into the object store only), and a share run again after a failure, or run
out of submission order, still runs on its own version. Every token of a step is sampled by that step's
version (the loop asks for the same version as without the stream, so the tokens are the same), and each
output's `versions` records it per token.

`rollout.defer_tail`: a training step gives every worker a share, and each share takes what the same worker's
previous training share deferred (that share's second return object, a top-level argument that Ray resolves
when it is ready) and runs it first (`rollout/deferral.py`); those requests' outputs come back with this step,
their ids missing from the step they were deferred from (`RolloutResult.deferred`). A request deferred by a
worker that was dropped goes to the first worker's next share.

Migration (`rollout.migration`, `rollout.migration_rule` half_busiest or remaining; docs/design.md, section 4;
simulated by `histopipe/stream_fleet.py`): `collect` watches the replies of every step in flight. A worker whose
shares are all answered has run out of work it may start (its next share waits for weights not yet published):
it takes requests of the workers running the oldest step still running (those whose oldest pending share is of
that step). half_busiest: half of the unfinished requests of the one with the most in that share; remaining: from
the one whose share has the most predicted tokens left (`_tokens_left`; `rebalance.donors`, the next of up to
`fleet.DONORS_ASKED` when no move from it pays), its requests with the most predicted work left while each move
pays (`rebalance.pool_moves`, on the donor, priced on its cost model as `stream_fleet` prices it, the idle
worker's weights load included when the version it holds, which the driver tells the donor, is not the step's).
Handed over at the donor's next step boundary
(`RolloutWorker.hand_over`) and sent to the idle worker as a share of the step they belong to, on that step's
weights (it loads them if it holds another: a worker holds one version, so a migrated share of an older step
costs it a load, and its next own share one more; `stream_fleet` prices them), the moved requests adopted first
and never re-run (`RolloutWorker.rollout`'s `carry`: their tokens are all of their own step's version). Keyed draws: the same tokens as without migration; each token's version is
recorded as before. Not with `rollout.defer_tail` (`config/sections.py`).

Faults: a worker whose actor dies is replaced as in `RayPool.rollout` (`RayPool.replace_worker`; the fresh actor
starts on the pool's weights and loads each share's own version) and every share it still owed, of every step in
flight, runs again (keyed randomness: the same tokens). `rollout.worker_timeout_s` applies to `RayPool.rollout`
only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError

from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.engine.sequence import Continuation, RequestOutput
from rhymerl.histopipe.fleet import DONORS_ASKED
from rhymerl.histopipe.predict import LengthPredictor
from rhymerl.histopipe.rebalance import donors
from rhymerl.model.pretrained import parse_dtype
from rhymerl.rollout.ray_actor import to_store
from rhymerl.rollout.ray_pool import RayPool
from rhymerl.rollout.types import RolloutGroup, RolloutResult, WorkerStats


@dataclass
class StreamedStep:
    """One submitted step: its groups, the weights version its shares run on, and its shares (groups in
    admission order, each with its history slice) pending on a worker or done."""

    groups: list[RolloutGroup]
    params: SamplingParams
    step: int | None
    version: int
    weights: ray.ObjectRef | None  # None: the version the pool's workers started on
    shares: list[tuple[list[RolloutGroup], dict]] = field(default_factory=list)
    pending: dict[int, tuple[int, ray.ObjectRef, ray.ObjectRef]] = field(default_factory=dict)  # share -> (worker,
    # reply, what it deferred)
    done: dict[int, tuple[list[RequestOutput], WorkerStats]] = field(default_factory=dict)
    defer: bool = False  # rollout.defer_tail: its shares may defer their tails into the next step's
    carry: dict[int, list[tuple["StreamedStep", int]]] = field(default_factory=dict)  # share -> earlier shares
    # whose deferred requests it runs first
    moved: dict[int, list[Continuation]] = field(default_factory=dict)  # a migration's share -> its requests

    def deferred(self, k: int) -> ray.ObjectRef | list:
        """What share `k` deferred: its reply's object while pending, the list once done."""
        return self.pending[k][2] if k in self.pending else self.done[k][1].deferred


class RayStream:
    """Submit steps to a `RayPool`'s workers ahead of time and collect each when its groups are all in (see
    the module doc). `publish` replaces the pool's `load_weights`."""

    def __init__(self, pool: RayPool, max_staleness: int = 1):
        self.pool, self.max_staleness = pool, max_staleness
        self._in_flight: list[StreamedStep] = []  # submitted and not collected, in submission order
        # the weights the next shares run on, once published; before, the version the pool's workers hold
        self._published: tuple[int, ray.ObjectRef] | None = None
        self._queued: dict[int, int] = {}  # worker -> shares sent to its actor (the next one's `seq`)
        # worker -> the weights version of the last share sent to it: the version it holds once all are answered
        # (a share loads its own version first); before any, the version the pool started it on
        self._held: dict[int, int] = {}
        # rollout.defer_tail: worker -> its last training share (step, share), whose deferred requests its next
        # training share runs first
        self._last_train: dict[int, tuple[StreamedStep, int]] = {}
        self._initial = (pool.weights_version, pool.weights_ref)  # a migrated share of a step on them needs them

    def publish(self, params: dict[str, torch.Tensor], version: int) -> None:
        """Weights `version`, for the shares submitted from now on: put in the object store once (as
        `RayPool.load_weights` puts them); no worker is interrupted or waited for."""
        self._published = (version, ray.put(to_store(params, parse_dtype(self.pool.config.rollout.dtype))))

    def submit(self, groups: list[RolloutGroup], params: SamplingParams, step: int | None = None,
               train: bool = False, defer: bool = False) -> StreamedStep:
        """Queue each worker's share of `groups` on the current weights version; `step` as in `RayPool.rollout`
        (the admission order's step number). The history slices are the pool's history as of now.
        `train`: a training step's (with `rollout.defer_tail`: every worker gets a share, which first runs what
        the worker's previous training share deferred); `defer`: its shares may defer their tails."""
        pool = self.pool
        version, weights = self._published or (pool.weights_version, None)
        s = StreamedStep(list(groups), params, step, version, weights, defer=defer)
        orphans = [src for w, src in self._last_train.items() if w not in pool.workers] if train else []
        for w, picked in zip(pool.workers, pool.shares(s.groups, params.max_tokens)):
            if picked or train:
                s.shares.append((picked, pool.history.export(g.prompt_ids for g in picked)))
                k = len(s.shares) - 1
                if train:  # a dropped worker's deferred requests go to the first worker's share
                    # only shares that may defer: an argument still pending holds back every later call to the
                    # actor (a migration's hand_over waited for the end of the share it was to take from)
                    srcs = ([self._last_train[w]] if w in self._last_train else []) + (orphans if k == 0 else [])
                    s.carry[k] = [src for src in srcs if src[0].defer]
                    self._last_train[w] = (s, k)
                self._send(s, k, w)
        if train:
            self._last_train = {w: src for w, src in self._last_train.items() if w in pool.workers}
        self._in_flight.append(s)
        return s

    def _send(self, s: StreamedStep, k: int, worker: int) -> None:
        share, history = s.shares[k]
        seq = self._queued.get(worker, 0)
        self._queued[worker] = seq + 1
        carry = [src.deferred(j) for src, j in s.carry.get(k, [])]  # top-level arguments: Ray resolves them
        carry += [s.moved[k]] if k in s.moved else []
        weights = s.weights if s.weights is not None or k not in s.moved else self._initial[1]
        ref, deferred = self.pool.actors[worker].stream_rollout.remote(
            seq, weights, s.version, share, s.params, history, s.step, s.defer, self.max_staleness, *carry)
        s.pending[k] = (worker, ref, deferred)
        self._held[worker] = s.version

    def collect(self, s: StreamedStep) -> RolloutResult:
        """Wait until every group of `s` is in; the step's result. Its wall interval runs from the first of its
        shares to start on a worker to the last to finish (a streamed step has no call of its own)."""
        while s.pending:  # with migration, any step's reply may free a worker: each is taken as it comes
            by_ref = {ref: (t, k) for t in (self._in_flight if self.pool.migration else [s])
                      for k, (_, ref, _) in t.pending.items()}
            ready, _ = ray.wait(list(by_ref), num_returns=1)
            t, k = by_ref[ready[0]]
            worker = t.pending[k][0]
            try:
                t.done[k] = ray.get(ready[0])
                del t.pending[k]
            except RayActorError as e:
                self._failed(worker, f"died ({type(e).__name__})")
            else:
                if self.pool.migration:
                    self._migrate(worker)
        self._in_flight.remove(s)
        s.carry.clear()  # its shares are done: nothing is sent again, so the earlier steps need not stay alive
        by_id = {o.request_id: o for k in sorted(s.done) for o in s.done[k][0]}
        stats = [s.done[k][1] for k in sorted(s.done)]
        deferred = [c.request_id for w in stats for c in w.deferred]
        own = [rid for g in s.groups for rid in g.request_ids]
        missing = set(own) - by_id.keys() - set(deferred)
        if missing:
            raise RuntimeError(f"rollout stream: requests {sorted(missing)[:3]} came back from no worker (every "
                               f"request of a step must come back once, or be deferred)")
        mine = set(own)  # then the requests of earlier steps that these shares carried
        outputs = [by_id[rid] for rid in own if rid in by_id] + [o for o in by_id.values() if o.request_id not in mine]
        return RolloutResult(outputs, stats, s.version, started=min(w.started for w in stats),
                             finished=max(w.finished for w in stats), deferred=deferred)

    def rollout(self, groups: list[RolloutGroup], params: SamplingParams, step: int | None = None) -> RolloutResult:
        """Submit and collect at once (validation): queued behind the shares in flight."""
        return self.collect(self.submit(groups, params, step))

    def _failed(self, worker: int, why: str) -> None:
        """`worker` died: replace it (or drop it) and send every share it owed, of every step in flight, again
        (to its replacement, or else to the least busy worker), in submission order."""
        restarted = self.pool.replace_worker(worker, why)
        self._queued.pop(worker, None)  # a fresh actor counts its shares from 0
        self._held.pop(worker, None)  # and holds the pool's weights
        for s in self._in_flight:
            for k in [k for k, (w, *_) in s.pending.items() if w == worker]:
                self._send(s, k, worker if restarted else self._least_busy())

    def _migrate(self, idle: int) -> None:
        """`idle` has no share pending: requests of the oldest step still running, by `rollout.migration_rule`,
        sent to `idle` as a share of the step each belongs to (see the module doc)."""
        if idle not in self.pool.actors or any(w == idle for t in self._in_flight for w, *_ in t.pending.values()):
            return
        running = next((t for t in self._in_flight if t.pending), None)
        if running is None:
            return
        first: dict[int, StreamedStep] = {}  # worker -> the step of the oldest share it owes (the one it runs)
        for t in self._in_flight:
            for w, *_ in t.pending.values():
                first.setdefault(w, t)
        load: dict[int, int] = {}  # worker -> its requests in the pending shares of `running` it owes
        for k, (w, *_) in running.pending.items():
            if first[w] is running:
                load[w] = load.get(w, 0) + len(running.moved.get(k, [])) + sum(len(g.request_ids)
                                                                              for g in running.shares[k][0])
        if not load:
            return
        rule = self.pool.migration_rule
        if rule == "remaining":  # latest predicted end first, the next when no move from it pays
            left = self._tokens_left(running, load)
            asked = donors([left.get(w) for w in range(max(*left, idle) + 1)], idle)[:DONORS_ASKED]
        else:
            asked = [max(sorted(load), key=load.__getitem__)]
            if load[asked[0]] < 2:
                return
        moved = []
        held = self._held.get(idle, self.pool.weights_version)  # the donor prices idle's load when it differs
        for donor in asked:
            try:
                moved = ray.get(self.pool.actors[donor].hand_over.remote(None, rule, receiver_version=held),
                                timeout=self.pool.timeout_s)
            except (RayActorError, GetTimeoutError):
                continue  # the donor's fault is for its share's reply to report
            if moved:
                break
        owner = {rid: t for t in self._in_flight for g in t.groups for rid in g.request_ids}
        for t in self._in_flight:  # the donor may have moved on to its next share: each request to its own step
            mine = [c for c in moved if owner.get(c.request_id) is t]
            if mine:
                t.shares.append(([], self.pool.history.export(c.prompt_ids for c in mine)))
                t.moved[len(t.shares) - 1] = mine
                self._send(t, len(t.shares) - 1, idle)
                self.pool.migrations += len(mine)

    def _tokens_left(self, running: StreamedStep, load: dict[int, int]) -> dict[int, float]:
        """Per worker of `load`, the predicted tokens its share of `running` has left (rule "remaining"): its
        groups' predicted lengths from the pool's history, and its moved requests' predicted lengths past what
        they hold (`LengthPredictor.predict_past`), less that. The driver sees shares, not the workers' progress,
        as `ray_call.RayCall` (the sync pool's rule)."""
        shares = [(w, running.shares[k][0], running.moved.get(k, [])) for k, (w, *_) in running.pending.items()
                  if w in load]
        prompts = [g.prompt_ids for _, groups, _ in shares for g in groups]
        prompts += [c.prompt_ids for _, _, moved in shares for c in moved]
        predictor = LengthPredictor.from_history(self.pool.history, prompts, cap=running.params.max_tokens)
        left: dict[int, float] = {}
        for w, groups, moved in shares:
            left[w] = (left.get(w, 0.0) + sum(predictor.predict(g.prompt_ids) * len(g.request_ids) for g in groups)
                       + sum(predictor.predict_past(c.prompt_ids, len(c.output_ids)) - len(c.output_ids)
                             for c in moved))
        return left

    def _least_busy(self) -> int:
        owed = {w: 0 for w in self.pool.workers}
        for s in self._in_flight:
            for w, *_ in s.pending.values():
                if w in owed:
                    owed[w] += 1
        return min(owed, key=owed.__getitem__)
