"""Which rollout worker runs which GRPO group, and in what order (docs/design.md, section 5).

One interface, `plan`, for every policy, used by the real scheduler and by the simulator alike:

- `static`: equal contiguous split of the batch, in arrival order (what verl does);
- `least_loaded`: each group, in arrival order, to the worker with the least outstanding work (what OpenRLHF
  and slime do). They know no lengths: every request of a step is submitted at once and the router counts
  each worker's outstanding requests, so the fair baseline balances request counts (`balance="requests"`,
  the default; with equal groups it is a round robin). `balance="predicted"` balances predicted tokens
  instead: an ablation (length-aware but unsorted), not what the peers run;
- `histopipe`: groups ranked longest predicted first, each to the worker whose predicted finish is
  earliest (LPT list scheduling), then a local-improvement pass that moves or swaps groups off the worker
  that finishes last. A worker's predicted finish is the continuous-batching model (`batching.worker_time`)
  on the predicted lengths with the measured cost model, so it knows that a step's time depends on how
  many sequences run: a worker holding one long group decodes its tail at a small batch;
- `oracle`: the same as `histopipe` on the true lengths of every request (simulation only).

`plan` keeps a GRPO group whole on one worker (its siblings share the prompt's prefill and draft from each
other). `plan_pieces` adds tier 2 for `histopipe` and `oracle`: a long group may be cut into pieces on
several workers (`pieces.split_groups`), the pieces then placed like groups. `predicted` may give one length
per group or, per group, one per request (`LengthPredictor.predict_group`: the group's spread, so that its
longest member is costed as such).
Each worker's list is its admission order: arrival order for the baselines, longest predicted first for
`histopipe` and `oracle`, so that the longest requests do not start last and form the tail.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import TypeVar

from rhymerl.histopipe.batching import Cost, decode_costs, per_key_cost, worker_time
from rhymerl.histopipe.pieces import Piece, split_groups

POLICIES = ("static", "least_loaded", "histopipe", "oracle")
SCHEDULES = POLICIES[:3]  # rollout.schedule's choices: the policies a real pool can run (oracle needs the future)
# rollout.admission_order's choices: the order a worker's groups enter its slots (`rhymerl.rollout.worker`):
# as given, longest predicted first (`admission_order`), or alternating shortest / longest first by step
ADMISSION_ORDERS = ("fifo", "longest_first", "alternate")
T = TypeVar("T")


def plan(groups: Sequence[int], num_workers: int, policy: str = "histopipe",
         predicted: Sequence[float] | None = None, cost_model: Cost | None = None, *,
         slots: int | None = None, true_lengths: Sequence[Sequence[float]] | None = None,
         balance: str = "requests", improve_rounds: int | None = None) -> list[list[int]]:
    """Assign groups to workers: for each worker, the indices of its groups in admission order.

    Args:
        groups: the number of requests in each group, in arrival order.
        num_workers: rollout workers (some may get nothing when there are fewer groups).
        policy: one of POLICIES (see the module doc).
        predicted: each group's predicted response length (`LengthPredictor.predict`), one per group, or
            its requests' (`predict_group`): `histopipe` needs it, `least_loaded` with
            `balance="predicted"` reads it.
        cost_model: `cost(tokens, seqs)` seconds of one forward (`CostModel`): `histopipe` and `oracle`.
        slots: a worker's slot count (sequences it runs at once): `histopipe` and `oracle`.
        true_lengths: per group, each request's true length: `oracle` only (the simulator passes it for
            `oracle` and for nothing else, so no other policy can peek).
        balance: `least_loaded`'s measure of work, "requests" (the fair baseline) or "predicted".
        improve_rounds: `histopipe`/`oracle`: most moves of the local-improvement pass (default 4 x workers,
            at most IMPROVE_ROUNDS_MAX).
    """
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if policy == "static":
        return static_split(len(groups), num_workers)
    if policy == "least_loaded":
        if balance == "requests":
            return least_loaded(groups, num_workers)
        if balance == "predicted":
            _need(predicted, "predicted", policy, len(groups))
            return least_loaded([sum(ls) for ls in _per_request(predicted, groups)], num_workers)
        raise ValueError(f"balance must be 'requests' or 'predicted', got {balance!r}")
    if policy in ("histopipe", "oracle"):
        lengths = _known_lengths(groups, policy, predicted, cost_model, slots, true_lengths)
        return balance_makespan(lengths, num_workers, slots, decode_costs(cost_model, slots),
                                _rounds(improve_rounds, num_workers), per_key_cost(cost_model))
    raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")


def plan_pieces(groups: Sequence[int], num_workers: int, policy: str = "histopipe",
                predicted: Sequence[float | Sequence[float]] | None = None, cost_model: Cost | None = None, *,
                slots: int | None = None, true_lengths: Sequence[Sequence[float]] | None = None,
                tier2: bool = True, split_at: float = 0.8, **kwargs) -> list[list[Piece]]:
    """`plan` with tier 2: per worker, its pieces (group, request indices) in admission order. `histopipe`
    and `oracle` with `tier2` cut long groups (`pieces.split_groups`, `split_at`) and place the pieces;
    every other case is `plan`'s whole groups. kwargs: `plan`'s."""
    if policy not in ("histopipe", "oracle") or not tier2:
        assignment = plan(groups, num_workers, policy, predicted, cost_model, slots=slots,
                          true_lengths=true_lengths, **kwargs)
        return [[(g, tuple(range(groups[g]))) for g in ws] for ws in assignment]
    lengths = _known_lengths(groups, policy, predicted, cost_model, slots, true_lengths)
    pieces = split_groups(lengths, num_workers, slots, cost_model, split_at)
    piece_lengths = [[lengths[g][i] for i in idx] for g, idx in pieces]
    assignment = balance_makespan(piece_lengths, num_workers, slots, decode_costs(cost_model, slots),
                                  _rounds(kwargs.get("improve_rounds"), num_workers), per_key_cost(cost_model))
    return [[pieces[p] for p in ws] for ws in assignment]


IMPROVE_ROUNDS_MAX = 256  # the local-improvement pass's default cap: each round costs O(groups of two workers^2)
IMPROVE_GAIN = 1e-3  # a move or swap must bring the pair this share below the last finish: no hair-splitting


def _rounds(improve_rounds: int | None, num_workers: int) -> int:
    return min(4 * num_workers, IMPROVE_ROUNDS_MAX) if improve_rounds is None else improve_rounds


def _per_request(predicted, groups: Sequence[int]) -> list[list[float]]:
    """Per group, each request's predicted length: a group's single prediction repeated, or its list."""
    out = []
    for p, size in zip(predicted, groups):
        if isinstance(p, (int, float)):
            out.append([float(p)] * size)
        elif len(p) != size:
            raise ValueError(f"a group of {size} requests has {len(p)} predicted lengths")
        else:
            out.append([float(n) for n in p])
    return out


def _known_lengths(groups, policy, predicted, cost_model, slots, true_lengths) -> list[list[float]]:
    """The per-request lengths `histopipe` (predicted) or `oracle` (true) plans on, checked."""
    if cost_model is None or slots is None:
        raise ValueError(f"policy {policy!r} needs cost_model and slots")
    if policy == "histopipe":
        _need(predicted, "predicted", policy, len(groups))
        return _per_request(predicted, groups)
    _need(true_lengths, "true_lengths", policy, len(groups))
    return [[float(n) for n in ls] for ls in true_lengths]


def _need(values, name: str, policy: str, n: int) -> None:
    if values is None:
        raise ValueError(f"policy {policy!r} needs {name}")
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries for {n} groups")


def static_split(num_groups: int, num_workers: int) -> list[list[int]]:
    """Equal contiguous split in arrival order; the first (num_groups % num_workers) workers get one more."""
    base, extra = divmod(num_groups, num_workers)
    out, first = [], 0
    for w in range(num_workers):
        size = base + (w < extra)
        out.append(list(range(first, first + size)))
        first += size
    return out


def least_loaded(work: Sequence[float], num_workers: int) -> list[list[int]]:
    """Each group in arrival order to the worker with the least work assigned so far (ties: lowest index);
    `work` is each group's amount (its request count, or its predicted tokens)."""
    heap = [(0.0, w) for w in range(num_workers)]
    out: list[list[int]] = [[] for _ in range(num_workers)]
    for g, amount in enumerate(work):
        load, w = heapq.heappop(heap)
        out[w].append(g)
        heapq.heappush(heap, (load + amount, w))
    return out


def admission_order(requests: Sequence[T], predicted: Sequence[float]) -> list[T]:
    """The requests longest predicted first (ties keep arrival order): inside one worker, so that the longest
    do not start last. Keyed sampling makes the tokens the same in any order; only the timing changes."""
    if len(requests) != len(predicted):
        raise ValueError(f"{len(requests)} requests but {len(predicted)} predictions")
    order = sorted(range(len(requests)), key=lambda i: -predicted[i])  # sorted() is stable
    return [requests[i] for i in order]


def balance_makespan(lengths: Sequence[Sequence[float]], num_workers: int, slots: int,
                     step_cost: Sequence[float], improve_rounds: int, per_key: float = 0.0) -> list[list[int]]:
    """`histopipe`'s and `oracle`'s assignment, on per-request lengths of each group (predicted or true):
    LPT list scheduling by predicted finish, then `improve` (see the module doc)."""
    # A group ends with its longest request; ties go to the group with more work.
    rank = sorted(range(len(lengths)), key=lambda g: (-max(lengths[g], default=0.0), -sum(lengths[g]), g))
    position = {g: i for i, g in enumerate(rank)}
    workers: list[list[int]] = [[] for _ in range(num_workers)]

    def finish(groups: list[int]) -> float:
        return worker_time([n for g in groups for n in lengths[g]], slots, step_cost, per_key)

    heap = [(0.0, w) for w in range(num_workers)]
    for g in rank:  # longest first, so each worker's list is longest first too
        _, w = heapq.heappop(heap)
        workers[w].append(g)
        heapq.heappush(heap, (finish(workers[w]), w))
    improve(workers, finish, position, improve_rounds)
    return workers


def improve(workers: list[list[int]], finish: Callable[[list[int]], float], position: dict[int, int],
            rounds: int, targets: int = 4) -> None:
    """Local improvement of an assignment, in place: up to `rounds` times, take the worker that finishes
    last and apply the best move of one of its groups to, or swap with a group of, one of the `targets`
    workers that finish first, if it brings both below the last finish. Lists stay in `position` order.
    Ties are broken by a stated key, not by the order candidates are met: the pair's later finish (to 9
    significant digits of the last finish, so that summation noise cannot decide), then the lower worker
    id, then the moved group's rank, then the swapped one's (a move before a swap): equal finishes are
    common (the makespan is often one long group's chain, which any assignment of the rest ties)."""
    times = [finish(ws) for ws in workers]
    for _ in range(rounds):
        src = max(range(len(workers)), key=lambda w: (times[w], -w))  # ties: the lowest id
        worst = times[src]

        def rounded(t: float) -> float:
            return round(t / worst, 9) if worst > 0 else t

        dsts = [w for w in heapq.nsmallest(targets + 1, range(len(workers)), key=lambda w: (times[w], w))
                if w != src][:targets]
        best = None  # (its tie key, dst, new src list, new dst list, their times)
        for dst in dsts:
            for g in workers[src]:
                rest = [x for x in workers[src] if x != g]
                for h in [None, *workers[dst]]:  # None: a move; a group: a swap
                    new_src = rest if h is None else sorted(rest + [h], key=position.__getitem__)
                    new_dst = sorted([x for x in workers[dst] if x != h] + [g], key=position.__getitem__)
                    t_dst = finish(new_dst)
                    if t_dst >= worst or (best is not None and rounded(t_dst) > best[0][0]):
                        continue  # cannot beat what we have: skip the other half's timing
                    t_src = finish(new_src)
                    later = max(t_src, t_dst)
                    if later >= worst * (1 - IMPROVE_GAIN):
                        continue
                    key = (rounded(later), dst, position[g], -1 if h is None else position[h])
                    if best is None or key < best[0]:
                        best = (key, dst, new_src, new_dst, t_src, t_dst)
        if best is None:
            return
        _, dst, workers[src], workers[dst], times[src], times[dst] = best
