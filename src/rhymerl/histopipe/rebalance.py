"""Migration by predicted remaining work (`rollout.migration_rule=remaining`; docs/design.md, section 4,
"HistoPipe, part by part": Migration). Torch-free: the simulator (`fleet.py`) and the rollout worker share it.

Why: on reasoning-length workloads a late worker is late because it holds a few long requests still RUNNING
(each on time for its prediction, or a mispredicted group), not because it has many; a count of requests
("half_busiest") or of waiting ones ("steal") points at the wrong donor and moves the wrong requests.

The rule, asked each time a worker runs dry (no request running or waiting):
- a request's remaining work is its predicted remaining decode priced by the cost model
  (`remaining_work`): (length - done) x its share of a step at its batch, plus attention over the keys it
  has yet to attend to (per_key x the sum of its context over the steps left). `length` is the live
  censored prediction given what it has done (`LengthPredictor.predict_past`), never below done + 1;
- the donor is the worker whose predicted end (now + the sum of its requests' remaining work) is latest,
  or the next latest when no move from that one pays (`donors`);
- the donor gives the dry worker its requests with the most remaining work first, each one only when the
  move shortens the later of the two (`moves`): with D the donor's time to run what it keeps and R the
  receiver's to run what it took, it moves when max(D', R') < max(D, R), D' and R' after the move. Both are
  priced as batches (`Batch`, `batches`): the requests' steps at the batch they run in (a step of n costs
  step_cost[n], so a thin batch pays nearly a whole step per token), plus each one's attention (its own
  keys, whatever the batch), plus on the receiver each moved request's re-prefill (the tokens it has
  generated, `batching.reprefill_cost`) and its weights load when it holds another version (the stream:
  `stream_fleet.LOAD_S` in the simulator, the donor's measured last load on a rollout worker). A request the
  move would not pay for stays; so does a donor's last request when the receiver is idle (the re-prefill
  makes it worse), and a move from a batch whose step costs the same with one sequence fewer (nothing is
  saved there). Pricing both sides at the donor's per-token share step_cost[n] / n (the sums D - W and
  R + P + W, what `moves` does without `Batch`es) underprices a receiver's thin batch and overprices the
  donor's saving; where attention dominates a step the two differ little (docs/design.md,
  section 4, "Migration by predicted remaining work", has the measured figures).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from rhymerl.histopipe.batching import Cost, decode_costs, per_key_cost, reprefill_cost, worker_time


def tokens_left(done: float, length: float) -> float:
    """The tokens a request holding `done` and predicted to end at `length` has yet to decode (at least 1)."""
    return max(float(length), float(done) + 1.0) - done


def attention_work(done: float, length: float, per_key: float) -> float:
    """Seconds of attention left for that request: `per_key` per key it attends to (done + 1 .. length keys
    over its steps), whatever batch it runs in (each sequence attends to its own keys)."""
    left = tokens_left(done, length)
    return per_key * left * (2 * done + 1 + left) / 2


def remaining_work(done: float, length: float, step_share: float, per_key: float = 0.0) -> float:
    """Seconds of decode left for a request that holds `done` tokens and is predicted to end at `length`
    (taken as at least done + 1): each token costs `step_share` (its share of a step, step_cost[n] / n at
    a batch of n) plus its attention (`attention_work`, written out here: the simulator asks this often)."""
    length = max(float(length), float(done) + 1.0)
    left = length - done
    return left * step_share + per_key * left * (done + 1 + length) / 2


@dataclass(frozen=True)
class Batch:
    """What a worker's continuous batch costs it to run some of a donor's requests (`moves` prices the donor
    and the receiver so): request i has `lefts[i]` tokens to decode, `attention[i]` seconds of attention
    (`attention_work`: each sequence attends to its own keys, whatever its batch) and `prefills[i]` seconds to
    pay before it runs on this worker (a re-prefill on the receiver; on the donor, what a queued moved-in
    request still owes). They run on `slots` slots, a step of n sequences costing `step_cost[n]`: a thin batch
    pays nearly a whole step per token, so the per-token price `step_cost[n] / n` of the donor's full batch
    does not hold for the few requests a receiver takes, nor for the donor's last ones. `load`: seconds of
    switching weights before the first (the receiver's weights load; 0 when it holds the version), `own`:
    seconds of other work first."""

    lefts: Sequence[float]
    attention: Sequence[float]
    prefills: Sequence[float]
    step_cost: Sequence[float]
    slots: int
    load: float = 0.0
    own: float = 0.0

    def time(self, held: Sequence[int]) -> float:
        """Seconds until the worker is done with the requests `held` (indices, in admission order)."""
        if not held:
            return self.own
        lefts = sorted(max(self.lefts[i], 1.0) for i in held)
        if len(lefts) <= self.slots:  # all in one batch, which thins as they finish (`batching.worker_time`)
            steps = sum((b - a) * self.step_cost[len(lefts) - j]
                        for j, (a, b) in enumerate(zip([0.0] + lefts, lefts)))
        else:
            steps = worker_time([self.lefts[i] for i in held], self.slots, self.step_cost)
        return self.own + self.load + sum(self.prefills[i] + self.attention[i] for i in held) + steps


def batches(done: Sequence[float], lengths: Sequence[float], prefills: Sequence[float], owed: Sequence[float],
            step_cost: Sequence[float], slots: int, per_key: float = 0.0) -> tuple[Batch, Batch]:
    """A donor's requests (holding `done` tokens, predicted to end at `lengths`) priced for `moves` as the
    donor's `Batch` of what it keeps (`owed`: what a queued moved-in request still has to re-prefill there)
    and a receiver's of what it takes (`prefills`: the re-prefill a move costs; no load, no work of its own)."""
    lefts = [tokens_left(d, n) for d, n in zip(done, lengths)]
    attention = [attention_work(d, n, per_key) for d, n in zip(done, lengths)]
    return Batch(lefts, attention, owed, step_cost, slots), Batch(lefts, attention, prefills, step_cost, slots)


def donors(ends: Sequence[float | None], receiver: int, now: float = 0.0) -> list[int]:
    """The workers a receiver asks, latest predicted end first (`ends[w]`; None: no work to give), never
    `receiver`, only those ending after it (its own end, or `now` when it has none); ties to the lower
    index. A donor whose requests no move pays for (one long request alone) is passed for the next."""
    mine = ends[receiver] if ends[receiver] is not None else now
    return sorted((w for w, e in enumerate(ends) if w != receiver and e is not None and e > mine),
                  key=lambda w: (-ends[w], w))


def moves(works: Sequence[float], prefills: Sequence[float], donor_left: float | None = None,
          receiver_left: float = 0.0, donor: Batch | None = None, receiver: Batch | None = None) -> list[int]:
    """Which of a donor's requests (their remaining `works` at the donor's batch and re-prefill prices
    `prefills`, seconds) a receiver takes: largest remaining work first, each only when it shortens the later
    of the two (see the module doc). Priced as batches when `donor` and `receiver` are given (`Batch`: the
    donor's time with the requests it keeps, the receiver's with those it took, its load included), else as
    sums: the donor's `donor_left` (default: the sum of `works`) less each work taken, the receiver's
    `receiver_left` plus each work and re-prefill taken. Indices, in the order taken."""
    if len(works) != len(prefills):
        raise ValueError(f"{len(works)} works but {len(prefills)} re-prefill prices")
    if (donor is None) != (receiver is None):
        raise ValueError("price both sides as batches (donor and receiver) or neither")
    kept = list(range(len(works)))
    d = donor.time(kept) if donor is not None else sum(works) if donor_left is None else donor_left
    r = receiver.time([]) if receiver is not None else receiver_left
    taken: list[int] = []
    for i in sorted(range(len(works)), key=lambda i: (-works[i], i)):
        if works[i] <= 0:
            continue
        if donor is not None:
            d_after, r_after = donor.time([j for j in kept if j != i]), receiver.time(taken + [i])
        else:
            d_after, r_after = d - works[i], r + prefills[i] + works[i]
        if max(d_after, r_after) < max(d, r):
            taken.append(i)
            kept.remove(i)
            d, r = d_after, r_after
    return taken


def pool_moves(running: Sequence, waiting: Sequence, predictor, cost: Cost, slots: int, load: float = 0.0,
               renewed: Sequence[float] | None = None) -> list:
    """The rule on a rollout worker asked to hand over (`RolloutWorker.hand_over`, rule "remaining") for a
    receiver that has run dry, priced as the simulator prices it (`fleet.py`, `stream_fleet.py`: the same
    functions on the same state). `running`: the worker's running requests (its batch), `waiting`: those
    queued or held, in admission order (anything with `prompt_ids` and `output_ids`, the tokens it holds: a
    waiting continuation holds some, and owes their re-prefill wherever it runs). `predictor`: the call's
    live `LengthPredictor`; a request's length is `predict_past`'s given its tokens, or a waiting one's
    `renewed[k]` when given and non-zero (the early warning's, `early_warning`). `cost`: the worker's cost
    model (seconds of a step by its shape, a `CostModel` or a `batching.ContextCost`), tabulated by
    `batching.decode_costs` over `slots`. Each request's remaining work at the batch's per-token share orders
    the moves; both sides are priced as batches (`Batch`), the receiver's re-prefills
    (`batching.reprefill_cost`) and `load` (seconds of switching weights first: 0 when it holds the
    requests' version) included. The requests to move, in `moves`' order."""
    requests = list(running) + list(waiting)
    given = [0.0] * len(running) + (list(renewed) if renewed is not None else [0.0] * len(waiting))
    if len(given) != len(requests):
        raise ValueError(f"{len(waiting)} waiting requests but {len(given) - len(running)} renewed lengths")
    done = [float(len(q.output_ids)) for q in requests]
    ends = [n or predictor.predict_past(q.prompt_ids, d) for q, d, n in zip(requests, done, given)]
    step_cost, per_key = decode_costs(cost, slots), per_key_cost(cost)
    prefills = [reprefill_cost(cost, step_cost, slots, d) for d in done]
    owed = [0.0] * len(running) + prefills[len(running):]  # a waiting one re-prefills on either side
    n = max(len(running), 1)
    works = [remaining_work(d, e, step_cost[n] / n, per_key) for d, e in zip(done, ends)]
    kept, taken = batches(done, ends, prefills, owed, step_cost, slots, per_key)
    return [requests[i] for i in moves(works, prefills, donor=kept, receiver=replace(taken, load=load))]
