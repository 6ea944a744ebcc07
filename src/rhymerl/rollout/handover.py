"""A rollout worker's side of migration (`RolloutWorker.hand_over`): the request another thread leaves for the
generating thread's next step boundary, and the paper's tail rule's pick among the engine's unfinished
requests (the rule itself, shared with the simulator and deferral, is `histopipe.deferral`)."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

from rhymerl.engine.sequence import Continuation, Status
from rhymerl.histopipe.deferral import tail_size, threshold
from rhymerl.histopipe.fleet import POOL_MIGRATIONS

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
