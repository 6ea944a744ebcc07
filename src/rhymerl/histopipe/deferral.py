"""Deferral of a step's tail (the paper's "defer to the next step after KV recomputation"; docs/design.md,
section 4, "HistoPipe, part by part": Deferral). Torch-free: the simulator and the rollout worker share it.

The rule is the paper's migration rule (issue 32; `fleet.py`'s `tail`): a request is in its group's tail when
its group has at most `tail_size` (10%, rounded up) of its requests unfinished, and it has grown past
`threshold` (1.2 x its prompt's predicted longest member, from the history). A worker stops such a request at
its next step boundary; the request continues in the worker's share of the next step (re-prefilled: prompt +
the tokens so far), and its group trains at the step where it completes. A deferred request still counts as
unfinished in its group (it has not ended). A request is deferred at most once, so every request ends.

One staleness rule bounds it (`continues`): a deferred request whose oldest token would be trained more than
`max_staleness` versions after the weights that sampled it is run again from scratch instead.

`defer_on_worker` is that rule on one worker's share, in engine steps (each running request gains one token
a step, a freed slot is refilled before the next step): which requests it defers and at how many tokens. The
simulator (`simulate.simulate_run`) prices the resulting share with `batching.run_worker`.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

TAIL_SHARE = 0.1  # a group's tail: its last 10% of unfinished requests (issue 32)
GROW = 0.2  # ... grown past 1.2 x the prompt's predicted longest member


def tail_size(group_size: int, share: float = TAIL_SHARE) -> int:
    """How many of a group's unfinished requests make its tail (at least 1 for a group of any size)."""
    return math.ceil(share * group_size)


def threshold(predicted_longest: float, grow: float = GROW) -> float:
    """The length past which a tail request is deferred (or migrated): (1 + grow) x the prompt's predicted
    longest member."""
    return (1 + grow) * predicted_longest


def continues(oldest_version: int, train_version: int, max_staleness: int) -> bool:
    """Whether a deferred request whose oldest token was sampled by `oldest_version` may continue when the
    step that would train it trains from `train_version`; if not it is run again from scratch."""
    return train_version - oldest_version <= max_staleness


def defer_on_worker(lengths: Sequence[float], groups: Sequence[int], thresholds: Sequence[float],
                    tails: Sequence[int], slots: int, done: Sequence[float] | None = None,
                    deferrable: Sequence[bool] | None = None) -> list[float | None]:
    """One worker's share, requests in admission order: `lengths[i]` its full length (tokens), `groups[i]` its
    group (any hashable id; `tails[i]` that group's `tail_size`, `thresholds[i]` its `threshold`), `done[i]`
    tokens it already has (a continuation), `deferrable[i]` whether it may be deferred (default: all).
    Returns per request the tokens it holds when deferred, or None when it runs to its end here.

    In engine steps: a request admitted at step a holds done + (k - a) tokens after step k; at each boundary,
    after the step's finishes, every running deferrable request past its threshold whose group has at most
    its tail unfinished (deferred ones counted) is stopped and its slot refilled."""
    n = len(lengths)
    done = [0.0] * n if done is None else done
    deferrable = [True] * n if deferrable is None else deferrable
    unfinished: dict = {}
    for g in groups:
        unfinished[g] = unfinished.get(g, 0) + 1
    cut: list[float | None] = [None] * n
    running: dict[int, float] = {}  # request -> the step it was admitted at
    finishes: list[tuple[float, int]] = []  # heap of (step, request)
    crossings: list[tuple[float, int]] = []  # heap of (step, request): when a deferrable one passes its threshold
    crossed: dict = {}  # group -> its running requests past their threshold
    step, queued = 0.0, 0
    while True:
        while queued < n and len(running) < slots:
            i = queued
            running[i] = step
            heapq.heappush(finishes, (step + max(float(lengths[i]) - done[i], 1.0), i))
            if deferrable[i]:
                past = math.floor(thresholds[i]) + 1 - done[i]  # the first step count holding > threshold
                if past < max(float(lengths[i]) - done[i], 1.0):
                    heapq.heappush(crossings, (step + max(past, 0.0), i))
            queued += 1
        if not running:
            return cut
        step = min(finishes[0][0], crossings[0][0] if crossings else math.inf)
        touched = set()
        while finishes and finishes[0][0] <= step:
            i = heapq.heappop(finishes)[1]
            if i in running:  # not deferred before
                del running[i]
                unfinished[groups[i]] -= 1
                crossed.get(groups[i], set()).discard(i)
                touched.add(groups[i])
        while crossings and crossings[0][0] <= step:
            i = heapq.heappop(crossings)[1]
            if i in running:
                crossed.setdefault(groups[i], set()).add(i)
                touched.add(groups[i])
        for g in touched:
            if crossed.get(g) and unfinished[g] <= tails[next(iter(crossed[g]))]:
                for i in sorted(crossed.pop(g)):
                    cut[i] = done[i] + step - running.pop(i)
