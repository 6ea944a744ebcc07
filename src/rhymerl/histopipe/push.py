"""Pushing waiting requests off a worker its live predictions call late (migration component "push",
simulated only: `fleet.simulate_fleet(migration="half_busiest+push")`; docs/design.md, section 4, "HistoPipe,
part by part": Pushing). Torch-free.

Why: on the rhyming workload at 1,024 workers every migrating rule waits for a worker to run dry before any
work moves, and the workers that hold a group whose lengths shifted up (all eight members run to the cap where
the history said 1,000 tokens) are found by their siblings' early warning (`early_warning.py`) at about a fifth
of the step, long before any worker runs dry. Pushing moves work then: at each of its events a worker whose
predicted end is well past the earliest predicted end of the fleet gives that worker waiting requests (no
tokens to re-prefill), its renewed siblings first (so a shifted group's members start on several workers
instead of sharing one batch, where their attention adds up), then the back of its queue, each while the move
shortens the later of the two.

Not in the Ray pool: there a worker takes requests only once its own share is done (`RayCall._migrate` sends a
share to an idle worker), and a push needs a busy worker to adopt requests into the share it runs.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import TypeVar

T = TypeVar("T", bound=Hashable)

# The rules with a push, which only the simulator runs: `bench pipe --migrations` offers them beside
# `fleet.MIGRATIONS` (not by default: at 1,024 workers a push row takes ~8x half_busiest's simulation time).
PUSH_MIGRATIONS = ("half_busiest+push",)
GAP = 1.1  # push only while the donor's predicted end is past GAP x the earliest predicted end
PER_LOOK = 4  # requests a worker may give at one of its events
KEEP = 1  # renewed members of a group a worker keeps (running ones counted); the rest are given first


def give_order(queue: Sequence[T], group: Callable[[T], Hashable], renewed: Callable[[T], float],
               running: dict[Hashable, int], keep: int = KEEP) -> list[T]:
    """The order in which a worker gives its waiting `queue` away: the renewed requests (`renewed(r)` > 0)
    past the first `keep` of their group on the worker (`running[g]` of g's members already run there), in
    queue order; then the rest from the back of the queue (they would start last), kept renewed ones last."""
    held = dict(running)
    first, kept = [], []
    for r in queue:
        if not renewed(r):
            continue
        g = group(r)
        if held.get(g, 0) < keep:
            held[g] = held.get(g, 0) + 1
            kept.append(r)
        else:
            first.append(r)
    skip = set(first) | set(kept)
    return first + [r for r in reversed(queue) if r not in skip] + kept


def pays(donor_end: float, receiver_end: float, work: float, gap: float = GAP) -> bool:
    """Whether a donor predicted to end at `donor_end` gives a request of `work` seconds to a receiver predicted
    to end at `receiver_end`: the donor is past `gap` x the receiver's end and the move leaves the receiver
    earlier than the donor (so it shortens the later of the two without swapping them)."""
    return donor_end >= gap * receiver_end and receiver_end + work < donor_end - work


def pushes(order: Sequence[T], donor: int, ends: "Ends", work: Callable[[T], float],
           takes: Callable[[int], bool]) -> Iterator[tuple[T, int]]:
    """The moves of one look: each of `order`'s requests in turn (`give_order`; seconds `work(r)`) to the
    worker with the earliest end that `takes` requests, while `pays`; `ends` records each move as made."""
    for r in order[:PER_LOOK]:
        v, x = ends.earliest(donor), work(r)
        if v is None or ends.end[donor] is None or not takes(v) or not pays(ends.end[donor], ends.end[v], x):
            return
        ends.set(donor, ends.end[donor] - x)
        ends.set(v, ends.end[v] + x)
        yield r, v


class Ends:
    """The workers' predicted ends, `end[w]` (None: no work left), and with `heap` a lazy min-heap of them:
    `earliest(but)` is the worker other than `but` with the earliest end (None: none)."""

    def __init__(self, count: int, heap: bool = True):
        self.end: list[float | None] = [None] * count
        self._heap: list[tuple[float, int]] = []
        self._kept = heap

    def set(self, w: int, end: float | None) -> None:
        self.end[w] = end
        if end is not None and self._kept:
            heapq.heappush(self._heap, (end, w))

    def earliest(self, but: int) -> int | None:
        heap, found = self._heap, None
        while heap and (self.end[heap[0][1]] != heap[0][0] or heap[0][1] == but):
            top = heapq.heappop(heap)
            found = top if top[1] == but and self.end[but] == top[0] else found  # but's own entry: put back
        v = heap[0][1] if heap else None
        if found is not None:
            heapq.heappush(heap, found)
        return v
