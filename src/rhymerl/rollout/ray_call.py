"""One `RayPool.rollout` call in flight (`rollout.backend=ray`): its shares sent to the workers, the answers
waited for, the shares of a failed worker sent again, and the tail's migration between workers (see
`ray_pool`'s module doc). The pool owns the actors and the truth of the history; this drives one call."""

from __future__ import annotations

import math
import time
from typing import NamedTuple

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.engine.sequence import Continuation, RequestOutput
from rhymerl.histopipe.predict import LengthPredictor
from rhymerl.histopipe.rebalance import donors
from rhymerl.rollout.types import RolloutGroup, StaleWeightsError, WorkerStats, first_line


class _Sent(NamedTuple):
    """A share sent to a worker: which worker, its reply, and when it counts as late (time.monotonic)."""

    worker: int
    reply: ray.ObjectRef
    deadline: float


def _cause(error: RayTaskError) -> str:
    """'Type: first line' of the exception a remote call raised (Ray wraps it with the remote traceback)."""
    cause = getattr(error, "cause", None) or error
    return f"{type(cause).__name__}: {first_line(cause)}"


class RayCall:
    """One `RayPool.rollout` call in flight, its state explicit: the shares (a share is groups in admission
    order, or continuations moved to an idle worker; share k's history slice is `slices[k]`), the shares sent
    and not answered yet (`pending`, by share) and the answers (`done`, by share). `run` is the event loop:
    wait for the first answer or deadline; an answer is done and may start a migration, an actor that died or
    is late has its shares sent again (`RayPool.replace_worker`). Under the tail rule a migration is a
    standing hand-over asked of a busy worker (`asks`: its reply -> (donor, the idle worker)), answered at the
    first step boundary where one of its requests qualifies, or with nothing when its rollout ends; the call
    waits for every ask's answer, so that none is left to take requests of a later call."""

    def __init__(self, pool, params: SamplingParams, step: int | None):
        # pool: the `RayPool` this call runs on (not imported: the pool imports this module, one way)
        self.pool, self.params, self.step = pool, params, step
        self.shares: list[tuple[list[RolloutGroup], list[Continuation]]] = []
        self.slices: list[dict] = []
        self.pending: dict[int, _Sent] = {}
        self.done: dict[int, tuple[list[RequestOutput], WorkerStats]] = {}
        self.asks: dict[ray.ObjectRef, tuple[int, int]] = {}

    def add_share(self, groups: list[RolloutGroup], moved: list[Continuation]) -> int:
        """A new share and the history slice of its prompts; its index."""
        self.shares.append((groups, moved))
        prompts = [g.prompt_ids for g in groups] + [c.prompt_ids for c in moved]
        self.slices.append(self.pool.history.export(prompts))
        return len(self.shares) - 1

    def send(self, k: int, w: int) -> None:
        """Share k to worker w; one queued behind another share of the same worker waits for it, so its
        deadline starts after that one's."""
        groups, moved = self.shares[k]
        pool = self.pool
        early = pool.migration and pool.migration_rule == "remaining+early"  # the worker admits (early_queue)
        reply = pool.actors[w].rollout.remote(groups, self.params, self.slices[k], pool.weights_version, self.step,
                                              moved, early)
        after = max([time.monotonic()] + [s.deadline for s in self.pending.values() if s.worker == w])
        self.pending[k] = _Sent(w, reply, after + pool.timeout_s if pool.timeout_s else math.inf)

    def run(self) -> dict[int, tuple[list[RequestOutput], WorkerStats]]:
        """Until every share is answered: the answers by share."""
        while self.pending or self.asks:
            first = min((s.deadline for s in self.pending.values()), default=math.inf)
            ready, _ = ray.wait([s.reply for s in self.pending.values()] + list(self.asks), num_returns=1,
                                timeout=None if first == math.inf else max(0.0, first - time.monotonic()))
            for reply in ready:
                if reply in self.asks:
                    self._adopt(reply)
                else:
                    self._receive(reply)
            late = {s.worker for s in self.pending.values() if s.deadline <= time.monotonic()}
            for w in sorted(late):
                self._failed(w, f"did not answer within {self.pool.timeout_s:g}s")
        return self.done

    def _receive(self, reply: ray.ObjectRef) -> None:
        k = next((k for k, s in self.pending.items() if s.reply == reply), None)
        if k is None:  # sent again meanwhile
            return
        try:
            self.done[k] = ray.get(reply)
            del self.pending[k]
        except RayActorError as e:
            self._failed(self.pending[k].worker, f"died ({type(e).__name__})")
        except StaleWeightsError:  # raised through Ray: the caller's mistake, not the worker's fault
            raise
        except RayTaskError as e:  # its rollout raised: as in the local pool, a fresh worker runs it again
            self._failed(self.pending[k].worker, f"raised {_cause(e)}")
        else:
            self._migrate(self.done[k][1].worker)

    def _failed(self, w: int, why: str) -> None:
        """Worker w failed: its shares run again, on w restarted or on the least busy worker."""
        moved = [k for k, s in self.pending.items() if s.worker == w]
        for k in moved:
            del self.pending[k]
        restarted = self.pool.replace_worker(w, why)
        for k in moved:
            self.send(k, w if restarted else self._least_busy())

    def _least_busy(self) -> int:
        return min(self.pool.actors, key=lambda w: sum(s.worker == w for s in self.pending.values()))

    def _migrate(self, idle: int) -> None:
        """The step's tail: `idle` has no share left while others run. With migration on, the busiest worker
        (most pending requests; under rules "remaining" and "remaining+early" the most predicted tokens left)
        hands over some of its unfinished requests (`RayPool.migration_rule`), sent to `idle` as a new share:
        half_busiest's and remaining's at once; the tail rule's when the donor answers (`_adopt`)."""
        pool = self.pool
        if not pool.migration or idle not in pool.actors or any(s.worker == idle for s in self.pending.values()):
            return
        tail = pool.migration_rule == "tail"
        if tail and any(i == idle for _, i in self.asks.values()):
            return  # already waiting for a request
        asked = {d for d, _ in self.asks.values()}  # a worker serves one hand-over at a time
        load: dict[int, int] = {}  # busy worker -> its pending requests
        for k, s in self.pending.items():
            groups, moved = self.shares[k]
            if s.worker not in asked:
                load[s.worker] = load.get(s.worker, 0) + sum(len(g.request_ids) for g in groups) + len(moved)
        if not load:
            return
        donor = max(sorted(load), key=load.__getitem__)
        if pool.migration_rule.startswith("remaining"):  # the latest predicted end (histopipe/rebalance.py)
            left = self._tokens_left(load)
            donor = next(iter(donors([left.get(w) for w in range(max(*left, idle) + 1)], idle)), donor)
        if tail:
            self.asks[pool.actors[donor].hand_over.remote(1, "tail", None)] = (donor, idle)
            return
        try:
            moved = ray.get(pool.actors[donor].hand_over.remote(None, pool.migration_rule), timeout=pool.timeout_s)
        except (RayActorError, GetTimeoutError):
            return  # the donor's fault is for its rollout call to report
        if moved:
            self.send(self.add_share([], moved), idle)
            pool.migrations += len(moved)

    def _tokens_left(self, busy) -> dict[int, float]:
        """Per worker in `busy`, the predicted tokens its pending shares have left to decode (the pool's history,
        `LengthPredictor.predict_past` for what a moved request already holds): the driver sees shares, not the
        workers' progress, so a worker's predicted end is its shares' predicted work."""
        shares = [self.shares[k] for k, s in self.pending.items() if s.worker in busy]
        prompts = [g.prompt_ids for groups, _ in shares for g in groups] + [c.prompt_ids for _, m in shares for c in m]
        predictor = LengthPredictor.from_history(self.pool.history, prompts, cap=self.params.max_tokens)
        left: dict[int, float] = {}
        for k, s in self.pending.items():
            if s.worker in busy:
                groups, moved = self.shares[k]
                left[s.worker] = (left.get(s.worker, 0.0) + sum(predictor.predict(g.prompt_ids) * len(g.request_ids)
                                                                for g in groups)
                                  + sum(predictor.predict_past(c.prompt_ids, len(c.output_ids)) - len(c.output_ids)
                                        for c in moved))
        return left

    def _adopt(self, ask: ray.ObjectRef) -> None:
        """A standing tail hand-over answered: what it took goes to the worker that asked, or, if that one
        has work again or is gone, to the least busy."""
        _, idle = self.asks.pop(ask)
        try:
            moved = ray.get(ask)
        except (RayActorError, RayTaskError):
            return  # the donor's fault is for its rollout call to report (its share runs again, whole)
        if moved:
            busy = idle not in self.pool.actors or any(s.worker == idle for s in self.pending.values())
            self.send(self.add_share([], moved), self._least_busy() if busy else idle)
            self.pool.migrations += len(moved)
