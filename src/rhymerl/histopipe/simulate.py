"""A discrete-event simulation of one rollout step on many workers (DESIGN section 4, "Simulator").

Driven by each request's true length and the measured cost model, so that policies can be compared at 8,
64 or 1,024 workers without the hardware. The assignment comes from `rhymerl.histopipe.plan.plan`, the code
the real scheduler calls (no second copy of the policies), and each worker batches continuously like a real
engine (`rhymerl.histopipe.batching.run_worker`: fixed slots, a finished request's slot refilled for the next
step, a step of n running sequences costing cost(n, n)). Every worker starts at time 0: sync mode, the
whole step's groups assigned at once. `simulate_steps` runs a trace of steps, predicting each step's lengths
from the ones before it (`LengthPredictor`) as a training run would.

Prefill is left out unless `prefill` gives each group's seconds (say `cost_model(prompt_len, 1)`), paid once
per group when its first request is admitted: its siblings share the prompt's prefill.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rhymerl.histopipe.batching import Cost, decode_costs, run_worker
from rhymerl.histopipe.plan import plan
from rhymerl.histopipe.predict import LengthPredictor, rank_report, summarise
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


def run_plan(lengths: Sequence[Sequence[int]], assignment: Sequence[Sequence[int]], *, slots: int,
             cost_model: Cost, prefill: Sequence[float] | None = None) -> Timeline:
    """Run a given assignment (per worker, its groups in admission order) on the true `lengths`."""
    _check_assignment(assignment, len(lengths))
    if prefill is not None and len(prefill) != len(lengths):
        raise ValueError(f"{len(lengths)} groups but {len(prefill)} prefill times")
    step_cost = decode_costs(cost_model, slots)
    finish = [[0.0] * len(g) for g in lengths]
    worker = [-1] * len(lengths)
    busy: list[list[tuple[float, float]]] = []
    occupancy: list[list[tuple[float, int]]] = []
    for w, groups in enumerate(assignment):
        requests = [(g, i) for g in groups for i in range(len(lengths[g]))]
        pay = None if prefill is None else [prefill[g] if i == 0 else 0.0 for g, i in requests]
        run = run_worker([lengths[g][i] for g, i in requests], slots, step_cost, pay)
        for (g, i), t in zip(requests, run.finish):
            finish[g][i] = t
        for g in groups:
            worker[g] = w
        # Continuous batching never idles while work is queued: one busy interval, from 0 to the last finish.
        busy.append([(0.0, run.end)] if requests else [])
        occupancy.append(run.occupancy if requests else [])
    return Timeline(busy=busy, finish=finish, worker=worker, occupancy=occupancy)


def _check_assignment(assignment: Sequence[Sequence[int]], num_groups: int) -> None:
    seen = sorted(g for groups in assignment for g in groups)
    if seen != list(range(num_groups)):
        raise ValueError(f"the assignment must hold each of the {num_groups} groups exactly once")


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
