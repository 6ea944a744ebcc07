"""Tier 2 of HistoPipe's placement: a long group split over several workers (docs/design.md, section 4,
"HistoPipe, part by part": Plan, tier 1 and tier 2).

A GRPO group's siblings normally share one worker: they share the prompt's prefill and draft from each
other (HistoSpec). But a group whose requests are long enough decodes for longer, on one worker, than the
whole step should take: at a batch of its own size, each of its steps costs more than at batch 1. RhymeRL
gives such groups more workers, sized on profiled time curves; here the curve is the worker model itself
(`batching.worker_time` with the measured cost model, attention included): a group is cut into the fewest
pieces k such that its longest piece, run alone on a worker, fits in `split_at` x the step's target (the
lower bound of the step on the predicted lengths, `metrics.lower_bound`), or takes at most `ALONE_SLACK`
more than its longest request alone (no split can beat that request), its requests dealt longest first
round-robin so that the pieces are alike. Siblings in one piece still share a worker, and draft from each
other there.
"""

from __future__ import annotations

from collections.abc import Sequence

from rhymerl.histopipe.batching import Cost, decode_costs, per_key_cost, worker_time
from rhymerl.histopipe.metrics import lower_bound

Piece = tuple[int, tuple[int, ...]]  # (group index, the indices of its requests in this piece)
ALONE_SLACK = 1.1  # a piece within 10% of its longest request's time alone is not split further


def split_groups(lengths: Sequence[Sequence[float]], num_workers: int, slots: int, cost_model: Cost,
                 split_at: float = 0.8) -> list[Piece]:
    """Each group whole, or cut into pieces (see the module doc); `lengths[g]`: its requests' (predicted)
    lengths. Pieces of one group are listed together, longest piece first."""
    if split_at <= 0:
        raise ValueError(f"split_at must be > 0, got {split_at}")
    step_cost, per_key = decode_costs(cost_model, slots), per_key_cost(cost_model)
    target = split_at * lower_bound(lengths, num_workers, slots, cost_model)
    out: list[Piece] = []
    for g, ls in enumerate(lengths):
        order = sorted(range(len(ls)), key=lambda i: (-ls[i], i))
        fits = max(target, ALONE_SLACK * worker_time([ls[order[0]]], slots, step_cost, per_key)) if ls else 0.0
        k = 1
        while k < len(ls) and worker_time([ls[i] for i in order[::k]], slots, step_cost, per_key) > fits:
            k += 1
        out += [(g, tuple(sorted(order[j::k]))) for j in range(k)]
    return out
