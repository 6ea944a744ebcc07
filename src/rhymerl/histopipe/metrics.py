"""How much of a rollout step was bubbles, from its timeline (docs/design.md, section 4).

Plain functions of a `Timeline`, simulated or measured, so that both are judged the same way:

- makespan: when the last worker runs out of work;
- lower bound: no schedule can beat max(the longest request decoded alone, the total work spread over every
  worker at its best throughput);
- bubble ratio: 1 - busy worker-time / (workers x makespan); a measured step uses its call's wall time;
- finish gap: from the first worker to finish to the last (a worker given nothing finishes at 0);
- tail time: the time spent on the last 10% of requests to finish (in verl, about half the rollout).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rhymerl.histopipe.batching import Cost, decode_costs, per_key_cost
from rhymerl.histopipe.timeline import Timeline


def makespan(timeline: Timeline) -> float:
    """When the last worker runs out of work (seconds from the step's start)."""
    return max(timeline.worker_ends(), default=0.0)


def lower_bound(lengths: Sequence[Sequence[int]], num_workers: int, slots: int, cost_model: Cost) -> float:
    """A bound no schedule of these requests can beat on `num_workers` workers of `slots` slots, decode only:
    max(the longest request at one step of batch 1 per token, every token at the best per-token cost of a
    step of up to `slots` sequences, spread evenly over the workers).

    The best per-token cost is min over n of cost(n, n) / n: the full batch's for a measured model (a step's
    cost grows slower than its rows), and taking the minimum keeps the bound a bound for any cost model.
    With a `ContextCost`, attention is added to both terms: a request of L tokens attends to
    L (L + 1) / 2 keys in all, at `per_key` each whatever the batch (no schedule avoids it).
    """
    step_cost = decode_costs(cost_model, slots)
    tokens = [max(int(n), 1) for group in lengths for n in group]  # a response decodes at least one token
    if not tokens:
        return 0.0
    # The longest request needs that many steps, none cheaper than the cheapest step: a step of one sequence
    # for a measured model (non-decreasing); the minimum keeps it a bound for any cost model.
    per_key = per_key_cost(cost_model)
    longest = max(tokens)
    alone = longest * min(step_cost[1:]) + per_key * longest * (longest + 1) / 2
    per_token = min(step_cost[n] / n for n in range(1, slots + 1))
    spread = (sum(tokens) * per_token + per_key * sum(n * (n + 1) / 2 for n in tokens)) / num_workers
    return max(alone, spread)


def busy_time(timeline: Timeline) -> float:
    """Worker-seconds spent busy, summed over workers."""
    return sum(end - start for ivs in timeline.busy for start, end in ivs)


def bubble_ratio(timeline: Timeline, span: float | None = None) -> float:
    """1 - busy worker-time / (workers x span): the share of the workers' time spent idle. `span`: the step's
    wall time, the makespan by default; a measured step passes its rollout call's, which also counts the time
    before its workers' first request and after their last (the pool's own overhead)."""
    span = makespan(timeline) if span is None else span
    if span <= 0 or timeline.num_workers == 0:
        return 0.0
    return 1.0 - busy_time(timeline) / (timeline.num_workers * span)


def finish_gap(timeline: Timeline) -> float:
    """From the first worker to run out of work to the last (a worker given nothing finishes at 0)."""
    ends = timeline.worker_ends()
    return max(ends) - min(ends) if ends else 0.0


def tail_time(timeline: Timeline, share: float = 0.1) -> float:
    """Time spent on the last `share` of requests to finish: from the moment only ceil(share x N) requests
    are left to the makespan."""
    times = timeline.finish_times()
    if not times:
        return 0.0
    done = len(times) - math.ceil(share * len(times))  # requests finished when the tail begins
    return makespan(timeline) - (times[done - 1] if done > 0 else 0.0)


def summary(timeline: Timeline, lengths: Sequence[Sequence[int]], slots: int, cost_model: Cost) -> dict:
    """Every metric of one step: makespan, lower_bound, makespan_over_lb, bubble, finish_gap, tail_time and
    tail_share (tail time / makespan). `lengths` are the true lengths (for the lower bound)."""
    span = makespan(timeline)
    bound = lower_bound(lengths, timeline.num_workers, slots, cost_model)
    tail = tail_time(timeline)
    return {"makespan": span, "lower_bound": bound, "makespan_over_lb": span / bound if bound > 0 else math.nan,
            "bubble": bubble_ratio(timeline), "finish_gap": finish_gap(timeline), "tail_time": tail,
            "tail_share": tail / span if span > 0 else 0.0}
