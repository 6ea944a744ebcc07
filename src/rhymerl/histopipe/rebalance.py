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
  move shortens the later of the two (`moves`): with D the donor's remaining work, R the receiver's, W the
  request's and P its re-prefill price (the tokens it has generated, `batching.reprefill_cost`), it moves
  when max(D - W, R + P + W) < max(D, R), and D, R are updated before the next. A request the move would
  not pay for stays; so does a donor's last request when the receiver is idle (P > 0 makes it worse).
"""

from __future__ import annotations

from collections.abc import Sequence


def remaining_work(done: float, length: float, step_share: float, per_key: float = 0.0) -> float:
    """Seconds of decode left for a request that holds `done` tokens and is predicted to end at `length`
    (taken as at least done + 1): each token costs `step_share` (its share of a step, step_cost[n] / n at
    a batch of n) plus `per_key` per key it attends to (done + 1 .. length keys over its steps)."""
    length = max(float(length), float(done) + 1.0)
    left = length - done
    return left * step_share + per_key * left * (done + 1 + length) / 2


def donors(ends: Sequence[float | None], receiver: int, now: float = 0.0) -> list[int]:
    """The workers a receiver asks, latest predicted end first (`ends[w]`; None: no work to give), never
    `receiver`, only those ending after it (its own end, or `now` when it has none); ties to the lower
    index. A donor whose requests no move pays for (one long request alone) is passed for the next."""
    mine = ends[receiver] if ends[receiver] is not None else now
    return sorted((w for w, e in enumerate(ends) if w != receiver and e is not None and e > mine),
                  key=lambda w: (-ends[w], w))


def moves(works: Sequence[float], prefills: Sequence[float], donor_left: float | None = None,
          receiver_left: float = 0.0) -> list[int]:
    """Which of a donor's requests (their remaining `works` and re-prefill prices `prefills`, seconds) a
    receiver with `receiver_left` seconds of its own work takes: largest remaining work first, each only
    when it shortens the later of the two (see the module doc). `donor_left`: the donor's remaining work
    (default: the sum of `works`). Indices, in the order taken."""
    if len(works) != len(prefills):
        raise ValueError(f"{len(works)} works but {len(prefills)} re-prefill prices")
    d = sum(works) if donor_left is None else donor_left
    r = receiver_left
    taken = []
    for i in sorted(range(len(works)), key=lambda i: (-works[i], i)):
        w, p = works[i], prefills[i]
        if w > 0 and max(d - w, r + p + w) < max(d, r):
            taken.append(i)
            d, r = d - w, r + p + w
    return taken


def pool_moves(requests: Sequence, predictor, slots: int, lengths: Sequence[float] | None = None) -> list:
    """The rule on a rollout worker asked to hand over (`RolloutWorker.hand_over`, rule "remaining") for a
    receiver that has run dry: `requests` its unfinished ones (anything with `prompt_ids` and `output_ids`,
    the tokens it holds), `predictor` the call's live `LengthPredictor`. Priced in tokens, as the pool runs
    short contexts where attention is a small part of a step: a request's remaining work is its predicted
    tokens left (`predict_past`, or `lengths[k]` when given and non-zero: the early warning's renewed length,
    `early_warning`), its re-prefill its held tokens at a full batch's share (1 / `slots` of a decode step
    each, `batching.reprefill_cost`'s token term). The requests to move, in `moves`' order."""
    done = [len(q.output_ids) for q in requests]
    given = list(lengths) if lengths is not None else [0.0] * len(requests)
    if len(given) != len(requests):
        raise ValueError(f"{len(requests)} requests but {len(given)} lengths")
    works = [remaining_work(d, n or predictor.predict_past(q.prompt_ids, d), 1.0)
             for q, d, n in zip(requests, done, given)]
    return [requests[i] for i in moves(works, [d / slots for d in done])]
