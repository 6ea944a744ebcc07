"""One worker's continuous batching as a timing model: when each request finishes (torch-free).

The engine keeps a fixed number of slots. A step decodes one token for every running sequence and costs
`cost(n, n)` seconds for n running sequences (`rhymerl.cost_model.CostModel`); a request that finishes frees
its slot, which the next queued request takes for the next step. Given each request's length (the tokens it
decodes) in admission order, `run_worker` gives every request's finish time exactly. Between two finishes the
batch does not change, so it advances a whole run of equal steps at once: O(N log slots), not O(steps).

Prefill is optional (`prefill`: seconds per request, paid when the request is admitted, before the next
decode step). Left out, a worker's time is decode only: GRPO siblings share their prompt's prefill through
prefix sharing, and with short prompts and long responses decode is nearly all of a rollout.

Long contexts (`ContextCost`): a decode step also attends over every running sequence's keys, so a step
costs `cost(n, n) + per_key x (the keys the n sequences attend to)`: a sequence that has decoded j tokens adds
j + 1 keys. Between two finishes the batch does not change, so a run of k equal steps is still priced in
closed form (the keys grow by n per step). Prompts are left out of the keys (short against reasoning
responses). `per_key` is measured (`rhymerl bench pipe`: SDPA on the model's shapes) and extrapolated past
the measured contexts: attention's cost is linear in the keys.

The planner runs this model on predicted lengths (a worker's predicted finish), the simulator on true ones:
one model of a worker, not two.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

Cost = Callable[..., float]  # cost(tokens, seqs) -> seconds of one forward, like CostModel


@dataclass(frozen=True)
class ContextCost:
    """A forward-time model plus attention's cost of the context: `forward(tokens, seqs)` seconds of a step
    at short contexts (a `CostModel`), `per_key` seconds per key each decoding sequence attends to, and
    `prefill_per_pair` seconds per (query, key) pair of a causal prefill (a migrated request re-prefills its
    generated tokens: n (n + 1) / 2 pairs, far cheaper each than a decode step's keys, being matrix work).
    Callable like `forward`, so it goes wherever a cost model goes; `per_key_cost` reads its term."""

    forward: Cost
    per_key: float = 0.0
    prefill_per_pair: float = 0.0

    def __call__(self, tokens: int, seqs: int = 1) -> float:
        return self.forward(tokens, seqs)


def per_key_cost(cost: Cost) -> float:
    """The attention term of a cost model: `ContextCost.per_key`, 0.0 for a plain one (contexts unpriced)."""
    return cost.per_key if isinstance(cost, ContextCost) else 0.0


def run_cost(n: int, first: float, last: float, key_base: float, step_cost: Sequence[float],
             per_key: float) -> float:
    """Seconds of the decode steps `first` .. `last` - 1 with `n` sequences running, whose keys at step j
    are n x (j + 1) - key_base (key_base: the sum of their admission steps)."""
    k = last - first
    cost = k * step_cost[n]
    if per_key:
        cost += per_key * (n * (first + 1 + last) * k / 2 - k * key_base)
    return cost



def steps_to_reach(clock: float, now: float, n: int, first: float, most: int, key_base: float,
                   step_cost: Sequence[float], per_key: float) -> int:
    """The fewest whole decode steps from step `first` (at most `most`) that take a worker at `clock` to `now`
    or past it (`run_cost`): where its next step boundary is (a migration waits for it). Costs grow with the
    steps, so a binary search."""
    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi) // 2
        if clock + run_cost(n, first, first + mid, key_base, step_cost, per_key) >= now:
            hi = mid
        else:
            lo = mid + 1
    return lo

def reprefill_cost(cost: Cost, step_cost: Sequence[float], slots: int, tokens: float) -> float:
    """Seconds to re-prefill `tokens` generated tokens (a migrated or deferred request, the prompt left out):
    each at a full decode batch's per-token cost (a prefill is at least as efficient), plus the causal
    attention's pairs when `cost` prices them (`ContextCost.prefill_per_pair`)."""
    pair = cost.prefill_per_pair if isinstance(cost, ContextCost) else 0.0
    return tokens * step_cost[slots] / slots + pair * tokens * (tokens + 1) / 2


def decode_costs(cost: Cost, slots: int) -> list[float]:
    """Seconds of one decode step with n running sequences, for n = 0..slots (index 0 is 0.0).

    Tabulated once per plan or simulation: `CostModel.__call__` interpolates, and a worker's timeline asks
    for a step cost at every finish."""
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    return [0.0] + [float(cost(n, n)) for n in range(1, slots + 1)]


@dataclass
class WorkerRun:
    """One worker's run of its requests, in admission order. Times in seconds from the run's start.

    start[i]: when request i's first decode step begins; finish[i]: when its last one ends; end: when the
    worker runs out of work; occupancy: (time, running sequences from then on) at every change, ending with
    (end, 0): the batch size over time, for a Gantt chart."""

    start: list[float]
    finish: list[float]
    end: float
    occupancy: list[tuple[float, int]]


def run_worker(lengths: Sequence[float], slots: int, step_cost: Sequence[float],
               prefill: Sequence[float] | None = None, per_key: float = 0.0,
               done: Sequence[float] | None = None) -> WorkerRun:
    """Continuous batching of requests decoding `lengths` tokens each (admitted in this order) on `slots`
    slots, a step of n running sequences costing `step_cost[n]` seconds (`decode_costs`) plus `per_key` per
    key attended (see the module doc). A length below 1 counts as 1: every response decodes at least one
    token (its end-of-sequence). `done[i]`: tokens request i already holds (a continuation: it attends to them
    too)."""
    if len(step_cost) < slots + 1:
        raise ValueError(f"step_cost has {len(step_cost)} entries, needs slots + 1 = {slots + 1}")
    if prefill is not None and len(prefill) != len(lengths):
        raise ValueError(f"{len(lengths)} lengths but {len(prefill)} prefill times")
    n = len(lengths)
    start, finish = [0.0] * n, [0.0] * n
    occupancy: list[tuple[float, int]] = []
    running: list[tuple[float, int]] = []  # heap of (the step count at which it finishes, request index)
    step, clock, queued, key_base = 0.0, 0.0, 0, 0.0
    admitted = [0.0] * n  # the step each request was admitted at, less the tokens it brought
    while True:
        while queued < n and len(running) < slots:  # refill the free slots before the next step
            if prefill is not None:
                clock += prefill[queued]
            start[queued], admitted[queued] = clock, step - (done[queued] if done is not None else 0.0)
            key_base += admitted[queued]
            heapq.heappush(running, (step + max(float(lengths[queued]), 1.0), queued))
            queued += 1
        if not running:
            break
        if not occupancy or occupancy[-1][1] != len(running):
            occupancy.append((clock, len(running)))
        next_finish = running[0][0]
        # the run of equal steps up to it
        clock += run_cost(len(running), step, next_finish, key_base, step_cost, per_key)
        step = next_finish
        while running and running[0][0] == step:
            i = heapq.heappop(running)[1]
            finish[i] = clock
            key_base -= admitted[i]
    occupancy.append((clock, 0))
    return WorkerRun(start, finish, clock, occupancy)


def worker_time(lengths: Sequence[float], slots: int, step_cost: Sequence[float], per_key: float = 0.0) -> float:
    """When a worker running `lengths` in this order (no prefill) runs out of work: `run_worker(...).end`
    without the per-request lists, for the planner's many trial assignments."""
    running: list[tuple[float, float]] = []  # heap of (finish step, admission step)
    step, clock, key_base = 0.0, 0.0, 0.0
    queued, n = 0, len(lengths)
    while True:
        while queued < n and len(running) < slots:
            heapq.heappush(running, (step + max(float(lengths[queued]), 1.0), step))
            key_base += step
            queued += 1
        if not running:
            return clock
        next_finish = running[0][0]
        clock += run_cost(len(running), step, next_finish, key_base, step_cost, per_key)
        step = next_finish
        while running and running[0][0] == step:
            key_base -= heapq.heappop(running)[1]
