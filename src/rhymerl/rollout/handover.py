"""A rollout worker's side of migration (`RolloutWorker.hand_over`): the request another thread leaves for the
generating thread's next step boundary, and each rule's pick among the engine's unfinished requests (the tail
rule itself, shared with the simulator and deferral, is `histopipe.deferral`; rule "remaining"'s pricing,
shared with the simulator, `histopipe.rebalance`)."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

from rhymerl.engine.sequence import Continuation, Status
from rhymerl.histopipe.deferral import tail_size, threshold
from rhymerl.histopipe.fleet import POOL_MIGRATIONS
from rhymerl.histopipe.rebalance import pool_moves

HANDOVER_RULES = POOL_MIGRATIONS  # what `RolloutWorker.hand_over` takes (see there)


class HandoverRequest:
    """One `RolloutWorker.hand_over` call waiting for the generating thread's next step boundary (with
    rule "tail": for the first boundary where a request qualifies)."""

    def __init__(self, n: int | None, rule: str, tail_share: float, grow: float, receiver_version: int | None = None):
        if rule not in HANDOVER_RULES:
            raise ValueError(f"hand_over rule must be one of {HANDOVER_RULES}, got {rule!r}")
        self.n, self.rule, self.tail_share, self.grow = n, rule, tail_share, grow
        self.receiver_version = receiver_version  # the weights version the receiver holds (None: the donor's)
        self.taken: list[Continuation] = []
        self.done = threading.Event()

    def load(self, load_s: float, version: int) -> float:
        """The receiver's weights load, priced by a donor holding `version` whose last load took `load_s`
        seconds: that, when the receiver holds another version (one donor's load stands for another's: the
        same model on the same kind of machine), else 0."""
        held = self.receiver_version
        return load_s if held is not None and held != version else 0.0


def half_busiest_picks(unfinished: list, n: int | None, predicted_length: Callable[[list[int]], float]) -> list:
    """Rule "half_busiest"'s pick (see `RolloutWorker.hand_over`): up to `n` (default half) of `unfinished`,
    keeping one, waiting ones first from the back of the queue, then running ones furthest past their
    `predicted_length`."""
    n = len(unfinished) // 2 if n is None else min(n, len(unfinished) - 1)
    waiting = [q for q in unfinished if q.status == Status.WAITING][::-1]
    running = sorted((q for q in unfinished if q.status != Status.WAITING),
                     key=lambda q: predicted_length(q.prompt_ids) - len(q.output_ids))
    return (waiting + running)[:max(n, 0)]


def remaining_picks(unfinished: list, predictor, cost, slots: int, load: float) -> list:
    """Rule "remaining"'s pick: `rebalance.pool_moves` over the engine's running requests, then its waiting ones
    in queue order (as the simulator lists a worker's), on the worker's cost model, the receiver paying
    `load`."""
    running = [q for q in unfinished if q.status != Status.WAITING]
    waiting = [q for q in unfinished if q.status == Status.WAITING]
    return pool_moves(running, waiting, predictor, cost, slots, load)


def tail_picks(unfinished: list, given: Counter, predict_longest: Callable[[list[int], int], float],
               request: HandoverRequest) -> list:
    """The running requests the paper's rule would move now, furthest past their threshold first (see
    `RolloutWorker.hand_over`): `unfinished` the engine's, `given` the call's requests per prompt (a tuple),
    `predict_longest(prompt, size)` the group's predicted longest member from its history."""
    running = [q for q in unfinished if q.status != Status.WAITING]
    if len(running) < 2:
        return []
    left = Counter(tuple(q.prompt_ids) for q in unfinished)
    past = []
    for q in running:
        key = tuple(q.prompt_ids)
        if left[key] <= tail_size(given[key], request.tail_share):
            longest = predict_longest(q.prompt_ids, max(given[key], 1))
            over = len(q.output_ids) - threshold(longest, request.grow)
            if over > 0:
                past.append((-over, q.request_id, q))
    return [q for _, _, q in sorted(past, key=lambda x: x[:1])]
