"""A discrete-event simulation of one rollout step on many workers (docs/design.md, section 3, HistoPipe).

Driven by each request's true length and the measured cost model, so that policies can be compared at 8,
64 or 1,024 workers without the hardware. The assignment comes from `rhymerl.histopipe.plan.plan`, the code
the real scheduler calls (no second copy of the policies), and each worker batches continuously like a real
engine (`rhymerl.histopipe.batching.run_worker`: fixed slots, a finished request's slot refilled for the next
step, a step of n running sequences costing cost(n, n)). Every worker starts at time 0: sync mode, the
whole step's groups assigned at once. `simulate_steps` runs a trace of steps, predicting each step's lengths
from the ones before it (`LengthPredictor`) as a training run would.

Prefill is left out unless `prefill` gives each group's seconds (say `cost_model(prompt_len, 1)`), paid once
per group when its first request is admitted: its siblings share the prompt's prefill.

`simulate_run` runs several steps in a row, in `rollout.mode` `sync` or `one_step_off`, each
step planned by the same `plan` and run by the same `run_worker`. Weights version v is what the update of
step v-1 produces (version 0: the initial weights); the update of step s starts once step s's rollout has
fully finished (and the update before it has, the trainer being one), and takes `train_s` seconds.

- `sync`: step t+1 runs on version t: every worker waits for the update of step t;
- `one_step_off`: step t+1 runs on version t-1, one update behind. A worker may start its step-(t+1) share
  once (a) it has finished its own step-t share and (b) version t-1 exists, i.e. the update of step t-1 has
  finished (steps 1 and 2 run on version 0). So a worker that finishes early starts the next step while the
  others finish theirs and while the trainer updates: its bubble is filled. This is the loop's
  `rollout.stream` (`ready_times`); without the stream the loop starts step t+1 only once all of step t is in.

Both are one rule, a lag: step t's share on worker w starts at max(w's end of its step t-1 share, the end of
the update of step t - lag), lag 1 for sync (which implies the whole of step t-1 has finished), 2 for
one_step_off. In one_step_off, `histopipe` and `oracle` admit as rhymerl's `rollout.admission_order=alternate`
does: odd steps (numbered from 1) shortest predicted first (each worker's planned order reversed), even steps
longest first; the baselines keep arrival order, and sync keeps the plan's longest-first order.

With `defer_tail` (the loop's `rollout.defer_tail`) each step but the last defers its tail (`deferral.py`) into
the same worker's share of the next step, where it runs first: kept within `max_staleness` (re-prefilled, then
decoding the rest) or run again from scratch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from rhymerl.histopipe.batching import Cost, WorkerRun, decode_costs, per_key_cost, reprefill_cost, run_worker
from rhymerl.histopipe.deferral import continues, defer_on_worker, tail_size, threshold
from rhymerl.histopipe.pieces import Piece
from rhymerl.histopipe.plan import plan
from rhymerl.histopipe.predict import LengthPredictor, rank_report, summarise
from rhymerl.histopipe.stream_fleet import LOAD_S, simulate_stream
from rhymerl.histopipe.timeline import Timeline


def simulate(lengths: Sequence[Sequence[int]], num_workers: int, policy: str, *, slots: int,
             cost_model: Cost, predicted: Sequence[float] | None = None,
             prefill: Sequence[float] | None = None, **plan_kwargs) -> Timeline:
    """Simulate one step: `lengths[g]` are the true lengths of group g's requests (arrival order), planned by
    `policy` from `predicted` (one length per group; `histopipe` needs it), then run on `num_workers`
    workers of `slots` slots each. Only `oracle` is shown the true lengths. `plan_kwargs` go to `plan`."""
    assignment = plan([len(g) for g in lengths], num_workers, policy, predicted, cost_model, slots=slots,
                      true_lengths=lengths if policy == "oracle" else None, **plan_kwargs)
    return run_plan(lengths, assignment, slots=slots, cost_model=cost_model, prefill=prefill)


def run_plan(lengths: Sequence[Sequence[int]], assignment: Sequence[Sequence[int | Piece]], *, slots: int,
             cost_model: Cost, prefill: Sequence[float] | None = None) -> Timeline:
    """Run a given assignment (per worker, its groups, or pieces of groups, in admission order) on the true
    `lengths`."""
    timeline = Timeline(busy=[[] for _ in assignment], finish=[], worker=[], occupancy=[[] for _ in assignment])
    _append_step(timeline, lengths, assignment, [0.0] * len(assignment), decode_costs(cost_model, slots), slots,
                 prefill, per_key_cost(cost_model))
    return timeline


def as_pieces(assignment: Sequence[Sequence[int | Piece]], lengths: Sequence[Sequence[int]]) -> list[list[Piece]]:
    """An assignment of whole groups (indices) or pieces, as pieces: (group, its request indices)."""
    return [[(item, tuple(range(len(lengths[item])))) if isinstance(item, int) else item for item in items]
            for items in assignment]


class _Carry(NamedTuple):
    """A request deferred into a worker's next share: its group's index in the timeline, its index in the
    group, its full length, the tokens it keeps (0: run again) and its re-prefill seconds."""

    group: int
    index: int
    length: float
    done: float
    prefill: float


@dataclass
class _Defer:
    """How a step defers its tail (`deferral.py`): per group of the step its `threshold` and `tail_size`;
    whether a deferred request keeps its tokens (`deferral.continues`), and the run's counts so far."""

    thresholds: list[float]
    tails: list[int]
    keeps: bool
    deferred: int = 0
    rerun: int = 0
    rerun_tokens: float = 0.0


def _append_step(timeline: Timeline, lengths: Sequence[Sequence[int]], assignment: Sequence[Sequence[int | Piece]],
                 ready: Sequence[float], step_cost: Sequence[float], slots: int,
                 prefill: Sequence[float] | None = None, per_key: float = 0.0,
                 carried: list[list[_Carry]] | None = None, defer: _Defer | None = None,
                 cost_model: Cost | None = None) -> list[float | None]:
    """Run one step's `assignment` on the true `lengths`, worker w starting at `ready[w]`, and append it to
    `timeline` (its groups after the ones already there). Returns each worker's end (None: given nothing).
    A split group's worker in the timeline is its first piece's. `carried[w]`: requests of earlier steps that
    worker w runs first (and replaced by what this step defers, when `defer` is given; `cost_model` prices
    their re-prefill)."""
    assignment = as_pieces(assignment, lengths)
    _check_assignment(assignment, lengths)
    if prefill is not None and len(prefill) != len(lengths):
        raise ValueError(f"{len(lengths)} groups but {len(prefill)} prefill times")
    first = len(timeline.finish)
    timeline.finish.extend([0.0] * len(g) for g in lengths)
    timeline.worker.extend([-1] * len(lengths))
    ends: list[float | None] = []
    for w, pieces in enumerate(assignment):
        old = carried[w] if carried is not None else []
        # (timeline group, index, full length, tokens held, prefill seconds, deferrable)
        items = [(c.group, c.index, c.length, c.done, c.prefill, False) for c in old]
        # a group's prefill is paid where its first request runs (each piece of a split group pays its own)
        items += [(first + g, i, float(lengths[g][i]), 0.0, 0.0 if prefill is None or i != idx[0] else prefill[g],
                   defer is not None) for g, idx in pieces for i in idx]
        if carried is not None:
            carried[w] = []
        if not items:
            ends.append(None)
            continue
        cut = [None] * len(items)
        if defer is not None:
            cut = defer_on_worker([x[2] for x in items], [x[0] for x in items],
                                  [defer.thresholds[x[0] - first] if x[5] else 0.0 for x in items],
                                  [defer.tails[x[0] - first] if x[5] else 0 for x in items], slots,
                                  [x[3] for x in items], [x[5] for x in items])
        run: WorkerRun = run_worker([(x[2] if c is None else c) - x[3] for x, c in zip(items, cut)], slots, step_cost,
                                    [x[4] for x in items] if any(x[4] for x in items) else None, per_key,
                                    [x[3] for x in items])
        at = ready[w]
        for (g, i, length, *_), c, t in zip(items, cut, run.finish):
            if c is None:
                timeline.finish[g][i] = at + t
                continue
            defer.deferred += 1
            if not defer.keeps:  # run again from scratch on the next step's weights
                defer.rerun, defer.rerun_tokens = defer.rerun + 1, defer.rerun_tokens + c
            kept = c if defer.keeps else 0.0
            carried[w].append(_Carry(g, i, length, kept, reprefill_cost(cost_model, step_cost, slots, kept)))
        for g, _ in pieces:
            if timeline.worker[first + g] < 0:
                timeline.worker[first + g] = w
        # Continuous batching never idles while work is queued: one busy interval per step, from its start to
        # its last finish, merged with the previous step's when the worker went on without a pause.
        busy = timeline.busy[w]
        if busy and busy[-1][1] >= at:
            busy[-1] = (busy[-1][0], at + run.end)
        else:
            busy.append((at, at + run.end))
        timeline.occupancy[w].extend((at + t, n) for t, n in run.occupancy)
        ends.append(at + run.end)
    return ends


def _check_assignment(assignment: Sequence[Sequence[Piece]], lengths: Sequence[Sequence[int]]) -> None:
    seen = sorted((g, i) for pieces in assignment for g, idx in pieces for i in idx)
    if seen != [(g, i) for g, ls in enumerate(lengths) for i in range(len(ls))]:
        raise ValueError(f"the assignment must hold each of the {len(lengths)} groups exactly once")


@dataclass
class SimulatedStep:
    """One step of `simulate_steps`: its timeline, each group's predicted length, and the rank report over
    the groups whose prompt had a history (`rank_report`; None when fewer than two had)."""

    timeline: Timeline
    predicted: list[float]
    ranking: dict | None


def simulate_steps(steps: Sequence[Sequence[tuple[str, Sequence[int]]]], num_workers: int, policy: str, *,
                   slots: int, cost_model: Cost, predictor: LengthPredictor | None = None,
                   **plan_kwargs) -> list[SimulatedStep]:
    """Simulate a trace step by step: `steps[t]` lists step t's groups as (prompt key, its requests' true
    lengths). Each step is planned from the predictor's view of the steps before it, then its lengths are
    recorded into the predictor (a fresh `LengthPredictor()` unless one is given, which is updated)."""
    predictor = LengthPredictor() if predictor is None else predictor
    out = []
    for step in steps:
        keys = [key for key, _ in step]
        lengths = [list(ls) for _, ls in step]
        predicted = predictor.predict_many(keys)
        known = [i for i, key in enumerate(keys) if key in predictor and lengths[i]]
        timeline = simulate(lengths, num_workers, policy, slots=slots, cost_model=cost_model,
                            predicted=predicted, **plan_kwargs)
        # The actual side summarised like the prediction, so that both rank the same quantity.
        ranking = rank_report([predicted[i] for i in known],
                              [summarise(lengths[i], predictor.statistic) for i in known]) \
            if len(known) >= 2 else None
        for key, ls in zip(keys, lengths):
            predictor.record(key, ls)
        out.append(SimulatedStep(timeline, predicted, ranking))
    return out


MODES = ("sync", "one_step_off")
_LAG = {"sync": 1, "one_step_off": 2}  # step t waits for the update of step t - lag (see the module doc)


def ready_times(worker_end: Sequence[float], updates: Sequence[tuple[float, float]], step: int,
                mode: str, save_every: int = 0) -> list[float]:
    """When each worker may start its share of step `step` (from 1) in `mode`: once it has finished its share
    of the step before (`worker_end`) and the weights the step runs on exist, at the end of the update of step
    `step - lag` (`updates`, one (start, end) per step so far; version 0 exists at time 0). This is what
    rhymerl's loop does in one_step_off with `rollout.stream` (rl/streamed_rollout.py: a worker's share of
    step t+1 is queued behind its share of t and runs on the weights step t trains from), less the driver's
    overheads; tests/rl/test_stream.py replays a real run's shares and updates through it. With `save_every`
    (the loop's run.save_every) the step right after a checkpoint runs on the checkpoint's weights, as in sync
    mode (a checkpoint holds its own step's weights only, so a resume repeats it)."""
    lag = 1 if save_every > 0 and (step - 1) % save_every == 0 and step > 1 else _LAG[mode]
    k = step - lag  # the update whose weights this step runs on (none before step 1)
    weights = updates[k - 1][1] if k >= 1 else 0.0
    return [max(end, weights) for end in worker_end]


@dataclass
class SimulatedRun:
    """A run of steps (`simulate_run`): one timeline over the whole run (step t's groups after step t-1's),
    each step's rollout (start, end), each step's update (start, end), and `total`, when the last update
    ends: the run's wall time. Mean time per step: `total / len(rollouts)`."""

    timeline: Timeline
    rollouts: list[tuple[float, float]]
    updates: list[tuple[float, float]]
    deferred: int = 0  # requests deferred into the next step (`defer_tail`)
    rerun: int = 0  # ... of which run again from scratch (`max_staleness`)
    rerun_tokens: float = 0.0  # the tokens those had generated, thrown away
    moved: int = 0  # requests moved between workers (`migration`)

    @property
    def total(self) -> float:
        return self.updates[-1][1] if self.updates else 0.0


def simulate_run(steps: Sequence[Sequence[Sequence[int]]], num_workers: int, policy: str, *, mode: str = "sync",
                 slots: int, cost_model: Cost, predicted: Sequence[Sequence[float]] | None = None,
                 train_s: float = 0.0, assignments: Sequence[Sequence[Sequence[int]]] | None = None,
                 save_every: int = 0, defer_tail: bool = False, max_staleness: int = 1,
                 migration: str | None = None, load_s: float = LOAD_S, predictor=None, keys=None,
                 **plan_kwargs) -> SimulatedRun:
    """Simulate `steps[t]` (step t+1's groups, each its requests' true lengths) one after another in `mode`
    (MODES; see the module doc), each planned by `policy` from `predicted[t]` (one length per group), the
    update of each step taking `train_s` seconds. `plan_kwargs` go to `plan`. `assignments`: each step's
    plan when already made by `plan` for `policy` (a bench running several modes plans once). `save_every`:
    the loop's run.save_every, whose checkpoints make the next step wait for the last update (`ready_times`).
    `defer_tail` (the loop's `rollout.defer_tail`, needs `predicted`): each step but the last and those that
    end in a checkpoint defers its tail (`deferral.py`) into the same worker's share of the next step, run
    first there; a deferred request's oldest token is trained `lag` versions after its weights (the mode's
    lag below), so it keeps its tokens when that is at most `max_staleness`, else it runs again from scratch.
    `migration` (one_step_off, the loop's `rollout.migration` with the stream; `stream_fleet.STREAM_MIGRATIONS`):
    all workers on one clock (`stream_fleet.simulate_stream`), a worker out of work it may start taking requests
    of the oldest step still running; its run's `moved` counts them, and a share of another weights version than
    its worker holds first loads it (`load_s` seconds; without migration no load is priced); `predictor`, `keys`:
    the live predictor rule remaining prices with (`simulate_stream`)."""
    if mode not in _LAG:
        raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    if train_s < 0:
        raise ValueError(f"train_s must be >= 0, got {train_s}")
    for name, given in (("predictions", predicted), ("assignments", assignments)):
        if given is not None and len(given) != len(steps):
            raise ValueError(f"{len(steps)} steps but {len(given)} lists of {name}")
    if max_staleness < _LAG[mode] - 1:
        raise ValueError(f"max_staleness {max_staleness} is below {mode}'s own staleness {_LAG[mode] - 1}")
    if defer_tail and predicted is None:
        raise ValueError("defer_tail needs the predictions (each group's predicted longest member)")
    if migration is not None and (mode != "one_step_off" or defer_tail or save_every):
        raise ValueError("migration in a run of steps is the stream's: one_step_off, without defer_tail or "
                         "save_every (sync steps migrate in fleet.simulate_fleet)")
    if migration is not None:
        plans = [_step_assignment(t, lengths, num_workers, policy, mode, slots, cost_model, predicted, assignments,
                                  plan_kwargs) for t, lengths in enumerate(steps, start=1)]
        pieces = [as_pieces(a, ls) for a, ls in zip(plans, steps)]
        per_request = None if predicted is None else [  # each request's predicted length, per group
            [list(p) if isinstance(p, Sequence) else [p] * len(g) for p, g in zip(ps, ls)]
            for ps, ls in zip(predicted, steps)]
        timeline, rollouts, updates, moved = simulate_stream(steps, pieces, slots=slots, cost_model=cost_model,
                                                             predicted=per_request, migration=migration,
                                                             train_s=train_s, load_s=load_s,
                                                             predictor=predictor, keys=keys)
        return SimulatedRun(timeline, rollouts, updates, moved=moved)
    step_cost, per_key = decode_costs(cost_model, slots), per_key_cost(cost_model)
    timeline = Timeline(busy=[[] for _ in range(num_workers)], finish=[], worker=[],
                        occupancy=[[] for _ in range(num_workers)])
    carried: list[list[_Carry]] = [[] for _ in range(num_workers)]
    counts = _Defer([], [], continues(0, _LAG[mode], max_staleness))
    worker_end = [0.0] * num_workers
    rollouts: list[tuple[float, float]] = []
    updates: list[tuple[float, float]] = []
    for t, lengths in enumerate(steps, start=1):
        assignment = _step_assignment(t, lengths, num_workers, policy, mode, slots, cost_model, predicted,
                                      assignments, plan_kwargs)
        ready = ready_times(worker_end, updates, t, mode, save_every)
        defers = defer_tail and t < len(steps) and not (save_every > 0 and t % save_every == 0)
        if defers:
            counts.thresholds = [threshold(max(p) if isinstance(p, Sequence) else p) for p in predicted[t - 1]]
            counts.tails = [tail_size(len(g)) for g in lengths]
        ends = _append_step(timeline, lengths, assignment, ready, step_cost, slots, per_key=per_key,
                            carried=carried, defer=counts if defers else None, cost_model=cost_model)
        done = [e for e in ends if e is not None]
        start = min((r for r, e in zip(ready, ends) if e is not None), default=max(ready))
        end = max(done, default=start)
        worker_end = [old if e is None else e for old, e in zip(worker_end, ends)]
        rollouts.append((start, end))
        begin = max(end, updates[-1][1] if updates else 0.0)  # one trainer: updates in turn
        updates.append((begin, begin + train_s))
    return SimulatedRun(timeline, rollouts, updates, counts.deferred, counts.rerun, counts.rerun_tokens)


def _step_assignment(t: int, lengths, num_workers: int, policy: str, mode: str, slots: int, cost_model: Cost,
                     predicted, assignments, plan_kwargs: dict) -> list:
    """Step t's (from 1) per-worker admission order in `simulate_run`: `assignments[t - 1]` or `plan`'s, each
    worker's reversed on odd steps in one_step_off for histopipe and oracle (see the module doc)."""
    assignment = [list(gs) for gs in assignments[t - 1]] if assignments is not None else plan(
        [len(g) for g in lengths], num_workers, policy, None if predicted is None else predicted[t - 1],
        cost_model, slots=slots, true_lengths=lengths if policy == "oracle" else None, **plan_kwargs)
    if mode == "one_step_off" and policy in ("histopipe", "oracle") and t % 2 == 1:
        assignment = [groups[::-1] for groups in assignment]  # odd steps: shortest predicted first
    return assignment
