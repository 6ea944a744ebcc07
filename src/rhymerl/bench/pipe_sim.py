"""`rhymerl bench pipe`, part (a): HistoPipe's schedules simulated from a length trace (`simulate_trace`;
the bench itself, and part (b) on real workers, are `rhymerl.bench.pipe_bench`).

The inputs: a length trace (`RUN_DIR/lengths.jsonl`, written by every `rhymerl train` run; by default the
one shipped with the package, `pipe_bench.DEFAULT_TRACE`) and a cost model (measured on the model at
start-up, as an engine does, or read from a `CostModel.as_dict()` JSON file). For each worker count W,
one sync-mode step of W workers x `slots` slots draws its groups from the trace, cycling through its steps
and prompts with their recorded lengths until the workers' slots are full. Each drawn group's predicted
length is what a real run would have known when it ran that step: a `LengthPredictor` that has recorded
the trace's earlier steps. The draws start at the trace's first step where some prompt has a history (its
second epoch), so that the predictions are history's and not the prior's, unless no step has one; the
step's arrival order is shuffled (seeded), as a training run's sampler hands out prompts. With `rhyming`
(`--trace rhyming`), the steps come from the calibrated workload instead (`pipe_rhyming.rhyming_steps`:
`waves` waves per worker, each group predicted per request by the censored predictor). Every policy
(`plan.POLICIES`) runs the same groups, planned by `plan_pieces` (tier 2 for `histopipe` and `oracle`
unless `tier2` is off; `histopipe_tier1` keeps groups whole, beside it); `histopipe+half_busiest`,
`histopipe+tail`, `histopipe+remaining` (and `+steal`, `+steal+tail`, `+remaining+early`) run histopipe's plan
with migration (`fleet.simulate_fleet`),
`static+half_busiest` verl's split with the Ray pool's migration (the baseline with migration). Per policy
the makespan over the lower bound, the bubble ratio, the first-to-last finish gap, the speed-up over
`static`, and for `histopipe` and each `histopipe+RULE` its share of `oracle` (oracle makespan / its
makespan) and its speed-up over `least_loaded` (docs/design.md, section 4, says which row is "HistoPipe, the
system" for issue 32's goal). A cost model with attention's term (`batching.ContextCost`) prices long contexts.

Then runs of `run_steps` such steps in a row (`simulate_run`), step 1 the step above and each
next one the next groups of the cycle, in each of `modes` (`sync`, `one_step_off`), each update taking
`train_s` seconds (default 0: the trainer is not part of this bench; then one_step_off's gain is the
workers' bubbles alone). Each step is planned once and run in both modes. Per policy and mode: the run's
wall time (`total_s`, up to its last update), the mean time per step (`step_s` = total / steps), the bubble
ratio over the whole run, the speed-up over `static` and, in one_step_off, over the same policy in sync.
one_step_off runs as the loop does with `rollout.stream` and (unless `defer_tail` is off, `--no-defer-tail`)
`rollout.defer_tail`: each step but the last defers its tail into the next (`simulate_run`), under
`max_staleness`; its entries add `deferred`, `rerun` and `rerun_tokens`.
With `gantt_dir`, one Gantt chart per worker count (up to 64), policy and mode: `gantt_W_POLICY_MODE.png`.

The JSON's "sim" holds, per worker count, the step's figures per policy as before and, under "modes", the
runs': `{"sim": {"64": {"groups": ..., "static": {"makespan_over_lb": ..., "bubble": ...}, ...,
"modes": {"sync": {"static": {"step_s": ..., "bubble": ...}, ...}, "one_step_off": {...}}}}}`.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from statistics import mean

from rhymerl.bench.pipe_real import log, rounded
from rhymerl.cost_model import CostModel
from rhymerl.errors import UserError
from rhymerl.bench.pipe_rhyming import rhyming_steps
from rhymerl.histopipe.fleet import MIGRATIONS, simulate_fleet
from rhymerl.histopipe.metrics import bubble_ratio
from rhymerl.histopipe.metrics import summary as step_summary
from rhymerl.histopipe.plan import POLICIES, plan_pieces
from rhymerl.histopipe.predict import LengthPredictor, rank_report
from rhymerl.histopipe.simulate import MODES, run_plan, simulate_run
from rhymerl.histopipe.stream_fleet import STREAM_MIGRATIONS
from rhymerl.histopipe.trace import read_trace
from rhymerl.histopipe.workload import Rhyming

DEFAULT_WORKERS = (8, 64, 1024)
GANTT_MAX_WORKERS = 64  # more bands than this are no longer legible


def trace_draws(steps: Sequence[dict]) -> tuple[list[tuple[str, list[int], float, bool]], int]:
    """Every group of the trace as (prompt key, its recorded lengths, its predicted length, whether its
    prompt had a history), in trace order from the first step where some prompt had one (see the module
    doc), and that step's index. A prompt's prediction is a `LengthPredictor` (censored at `trace_cap`) on the
    steps before its own."""
    predictor = LengthPredictor(cap=trace_cap(steps))
    draws, first = [], None
    for t, row in enumerate(steps):
        groups = [(g["prompt"], [int(n) for n in g["lengths"]]) for g in row["groups"] if g["lengths"]]
        known = [key in predictor for key, _ in groups]
        predicted = predictor.predict_many([key for key, _ in groups])
        if first is None and any(known):
            first = t
        for (key, lengths), p, k in zip(groups, predicted, known):
            draws.append((key, lengths, p, k, t))
        for key, lengths in groups:
            predictor.record(key, lengths)
    start = 0 if first is None else first
    out = [(key, lengths, p, k) for key, lengths, p, k, t in draws if t >= start]
    if not out:
        raise UserError("the trace holds no group with recorded lengths")
    return out, start


def read_checked_trace(trace: str | Path) -> list[dict]:
    """The steps of a trace (`read_trace`), checked as the simulation reads them: UserError naming `--trace`
    for a trace that is not UTF-8, empty, or not steps of groups with recorded lengths."""
    try:
        steps = read_trace(trace)
    except UnicodeDecodeError as e:
        raise UserError(f"--trace {trace}: not UTF-8 text ({e.reason} at byte {e.start}); a trace is a run's "
                        f"lengths.jsonl") from None
    if not steps:
        raise UserError(f"--trace {trace}: an empty trace (no step); a trace is a run's lengths.jsonl")
    try:
        trace_draws(steps)
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # ValueError: UserError and int() alike
        why = str(e) if isinstance(e, UserError) else f"not a length trace ({type(e).__name__}: {e})"
        raise UserError(f"--trace {trace}: {why}; each line is {{\"step\": N, \"groups\": [{{\"prompt\": KEY, "
                        f"\"lengths\": [...]}}, ...]}}") from None
    return steps


def draw_step(draws: Sequence[tuple[str, list[int], float, bool]], requests: int, seed: int | None = 0,
              start: int = 0):
    """Groups cycled from `draws`, from the cycle's position `start`, until they hold at least `requests`
    requests: (lengths, predicted, with-history flags), in an arrival order shuffled by `seed` (None: the
    cycle's order).

    A training run's sampler hands a step its prompts in random order. The cycle's order would not do for
    the baselines, which split by arrival order: when the cycle's period and the worker count share a
    factor, a round robin puts every copy of a prompt on the same worker."""
    picked, held, i = [], 0, start
    while held < requests:
        picked.append(draws[i % len(draws)])
        held += len(picked[-1][1])
        i += 1
    if seed is not None:
        random.Random(seed).shuffle(picked)
    return [list(d[1]) for d in picked], [d[2] for d in picked], [d[3] for d in picked]


def draw_steps(draws: Sequence[tuple[str, list[int], float, bool]], requests: int, count: int,
               seed: int | None = 0) -> list[tuple[list[list[int]], list[float]]]:
    """`count` consecutive steps of `draw_step` (each from where the one before left the cycle; step k's
    order shuffled by seed + k), as (lengths, predicted): the first is `draw_step(draws, requests, seed)`."""
    out, start = [], 0
    for k in range(count):
        lengths, predicted, _ = draw_step(draws, requests, None if seed is None else seed + k, start)
        out.append((lengths, predicted))
        start += len(lengths)
    return out


def simulate_trace(trace: str | Path, cost_model: CostModel, workers: Sequence[int] = DEFAULT_WORKERS,
                   slots: int = 32, policies: Sequence[str] = POLICIES, seed: int | None = 0,
                   modes: Sequence[str] = MODES, run_steps: int = 4, train_s: float = 0.0,
                   gantt_dir: str | Path | None = None, rhyming: Rhyming | None = None,
                   migrations: Sequence[str] = MIGRATIONS, tier2: bool = True, defer_tail: bool = True,
                   max_staleness: int = 1) -> dict:
    """Part (a): per worker count (a string key, as in the JSON) and policy, the step's figures, and under
    "modes" the runs' (see the module doc); `seed` shuffles each step's arrival order (`draw_step`), or seeds
    the workload with `rhyming` (then `trace` is only its name); with `gantt_dir`, the Gantt charts (created
    if missing). A trace it cannot read: UserError (`read_checked_trace`)."""
    out: dict = {"seed": seed, "workers": {}}
    if rhyming is None:
        rows = read_checked_trace(trace)
        draws, first = trace_draws(rows)
        known = [i for i, d in enumerate(draws) if d[3]]
        ranking = rank_report([draws[i][2] for i in known], [mean(draws[i][1]) for i in known]) \
            if len(known) >= 2 else None
        out |= {"trace_steps": len(rows), "draws_from_step": first, "trace_groups": len(draws),
                "groups_with_history": len(known), "cap": trace_cap(rows),
                "rank_corr": None if ranking is None or math.isnan(ranking["rank_corr"])
                else round(ranking["rank_corr"], 3)}
    else:
        out["rhyming"] = {**asdict(rhyming), "workers": {}}
    for w in workers:
        started = time.perf_counter()
        live = None  # the predictor the simulated workers update as requests finish (`observe_finished`)
        if rhyming is None:
            steps = [(None, ls, ps, ps) for ls, ps in draw_steps(draws, w * slots, max(run_steps, 1), seed)]
        else:
            steps, info, live = rhyming_steps(rhyming, w, slots, seed, run_steps)
            out["rhyming"]["workers"][str(w)] = rounded(info)
        row, first_plans = simulate_row(steps, w, slots, cost_model, policies, migrations, tier2, live)
        if run_steps > 0:
            plans = {p: [first_plans[p]] + [plan_pieces([len(g) for g in ls], w, p, ps, cost_model, slots=slots,
                                                        tier2=tier2, true_lengths=ls if p == "oracle" else None)
                                            for _, ls, ps, _ in steps[1:]]
                     for p in policies}
            row["modes"] = simulate_modes([(ls, ps) for _, ls, ps, _ in steps], w, slots, cost_model, plans, modes,
                                          train_s, gantt_dir if w <= GANTT_MAX_WORKERS else None, defer_tail,
                                          max_staleness, migrations,
                                          live, [k for k, *_ in steps] if steps[0][0] is not None else None)
        out["workers"][str(w)] = rounded(row)
        hp = row.get("histopipe", {})
        log(f"{w} workers x {slots} slots, {row['groups']} groups: "
            + ", ".join(f"{p} {row[p]['makespan_over_lb']:.3f}x lb" for p in row if isinstance(row[p], dict)
                        and "makespan_over_lb" in row[p])
            + (f"; histopipe {hp['speedup_vs_static']:.3f}x static" if hp.get("speedup_vs_static") else "")
            + f" ({time.perf_counter() - started:.1f} s)")
    return out


def simulate_row(steps, w: int, slots: int, cost_model: CostModel, policies: Sequence[str],
                 migrations: Sequence[str], tier2: bool,
                 live: LengthPredictor | None = None) -> tuple[dict, dict]:
    """One step (`steps[0]`: keys, lengths, predicted per group or per request, point predictions) on `w`
    workers: per policy its figures; `histopipe` with tier 2 when `tier2` (and `histopipe_tier1`, whole groups,
    beside it), and with each migration rule (`histopipe+RULE`, `fleet.simulate_fleet`). Returns the row and
    each policy's plan. `live`: the predictor before the step, which the migrating workers update as their
    requests finish (half_busiest's "furthest past predicted" then reads it)."""
    _, lengths, predicted, _ = steps[0]
    row: dict = {"groups": len(lengths), "requests": sum(map(len, lengths))}
    sizes = [len(g) for g in lengths]
    plans = {}
    for policy in policies:  # each planned by the code the real scheduler runs
        plans[policy] = plan_pieces(sizes, w, policy, predicted, cost_model, slots=slots, tier2=tier2,
                                    true_lengths=lengths if policy == "oracle" else None)
        row[policy] = figures(run_plan(lengths, plans[policy], slots=slots, cost_model=cost_model), lengths, slots,
                              cost_model)
    if "histopipe" in policies and tier2:
        whole = plan_pieces(sizes, w, "histopipe", predicted, cost_model, slots=slots, tier2=False)
        row["histopipe_tier1"] = figures(run_plan(lengths, whole, slots=slots, cost_model=cost_model), lengths,
                                         slots, cost_model)
        row["histopipe"]["split_groups"] = len({g for ws in plans["histopipe"] for g, idx in ws
                                                if len(idx) < len(lengths[g])})
    per_request = [p if isinstance(p, list) else [p] * n for p, n in zip(predicted, sizes)]
    keys = steps[0][0]
    # each rule on histopipe's plan; and the Ray pool's rule on verl's split, the baseline with migration
    runs = [("histopipe", rule) for rule in migrations if "histopipe" in policies]
    runs += [("static", "half_busiest")] if "static" in policies and "half_busiest" in migrations else []
    for policy, rule in runs:
        if live is not None:
            live.clear_observed()
        timeline, moved = simulate_fleet(lengths, plans[policy], slots=slots, cost_model=cost_model,
                                         predicted=per_request, migration=rule,
                                         predictor=live if keys is not None else None, keys=keys)
        row[f"{policy}+{rule}"] = figures(timeline, lengths, slots, cost_model) | {"moved": moved}
    base = row["static"]["makespan_s"] if "static" in row else None
    for r in row.values():
        if isinstance(r, dict):
            r["speedup_vs_static"] = base / r["makespan_s"] if base and r["makespan_s"] > 0 else None
    for name in [p for p in row if p.startswith("histopipe")]:  # the plan, and the plan with each rule
        r = row[name]
        if "oracle" in row and r["makespan_s"] > 0:
            r["share_of_oracle"] = row["oracle"]["makespan_s"] / r["makespan_s"]
            if "least_loaded" in row:
                r["speedup_vs_least_loaded"] = row["least_loaded"]["makespan_s"] / r["makespan_s"]
    return row, plans


def figures(timeline, lengths, slots: int, cost_model: CostModel) -> dict:
    """A step's figures as the JSON names them (`metrics.summary`)."""
    s = step_summary(timeline, lengths, slots, cost_model)
    return {"makespan_s": s["makespan"], "lower_bound_s": s["lower_bound"], "makespan_over_lb": s["makespan_over_lb"],
            "bubble": s["bubble"], "finish_gap_s": s["finish_gap"], "tail_share": s["tail_share"]}


def trace_cap(rows: Sequence[dict]) -> int | None:
    """A trace records no cap: its longest length is taken as one when at least 5% of responses share it
    (the shipped trace: 54% at 128); else None (no length known to be cut)."""
    flat = [int(n) for row in rows for g in row["groups"] for n in g["lengths"]]
    top = max(flat, default=0)
    return top if flat and sum(n == top for n in flat) >= 0.05 * len(flat) else None


def simulate_modes(steps, workers: int, slots: int, cost_model: CostModel, plans: dict, modes: Sequence[str],
                   train_s: float, gantt_dir: str | Path | None = None, defer_tail: bool = True,
                   max_staleness: int = 1, migrations: Sequence[str] = MIGRATIONS,
                   live: LengthPredictor | None = None, keys=None) -> dict:
    """Per mode and policy, the run of `steps` ((lengths, predicted) each) on the policy's `plans` (one per
    step): its figures (see the module doc), and with `gantt_dir` its Gantt chart. With `defer_tail`,
    one_step_off defers each step's tail (`rollout.defer_tail`) under `max_staleness` and counts what it
    deferred and ran again. In one_step_off, `POLICY+RULE` for histopipe and static and each rule of
    `migrations` the stream runs (`stream_fleet.STREAM_MIGRATIONS`): the stream with `rollout.migration`
    (without deferral), with the requests it `moved`; `live` and `keys` (each step's prompt keys): the
    predictor the stream's rule remaining prices with, its finishes cleared before each run."""
    out: dict = {}
    stream_rules = [r for r in migrations if r in STREAM_MIGRATIONS]
    for mode in [m for m in MODES if m in modes]:  # sync first: one_step_off's speed-up is over it
        out[mode] = {}
        runs = [(p, None) for p in plans] + [(p, r) for r in stream_rules for p in ("histopipe", "static")
                                             if p in plans and mode == "one_step_off"]
        for policy, rule in runs:
            assignments = plans[policy]
            name = policy if rule is None else f"{policy}+{rule}"
            # one_step_off as the loop runs it with rollout.stream and rollout.defer_tail (or rollout.migration)
            defer = defer_tail and mode == "one_step_off" and rule is None
            if live is not None:
                live.clear_observed()
            run = simulate_run([ls for ls, _ in steps], workers, policy, mode=mode, slots=slots,
                               cost_model=cost_model, train_s=train_s, assignments=assignments,
                               predicted=[ps for _, ps in steps], defer_tail=defer, max_staleness=max_staleness,
                               migration=rule, predictor=live if keys is not None else None, keys=keys)
            out[mode][name] = {"total_s": run.total, "step_s": run.total / len(steps),
                               "bubble": bubble_ratio(run.timeline, span=run.total)}
            if rule is not None:
                out[mode][name]["moved"] = run.moved
            if defer:
                out[mode][name] |= {"deferred": run.deferred, "rerun": run.rerun,
                                      "rerun_tokens": run.rerun_tokens}
            if gantt_dir is not None:
                write_gantt(Path(gantt_dir) / f"gantt_{workers}_{name}_{mode}.png", run,
                            f"{name}, {mode}, {workers} workers x {slots} slots, {len(steps)} steps")
        base = out[mode].get("static", {}).get("total_s")
        for policy, r in out[mode].items():
            r["speedup_vs_static"] = base / r["total_s"] if base and r["total_s"] > 0 else None
            sync = out.get("sync", {}).get(policy) if mode != "sync" else None
            if sync is not None and r["total_s"] > 0:
                r["speedup_vs_sync"] = sync["total_s"] / r["total_s"]
    return out


def write_gantt(path: Path, run, title: str) -> None:
    """One run's Gantt chart as a PNG (`histopipe.gantt`; matplotlib loads only when charts are asked for)."""
    from rhymerl.histopipe.gantt import gantt_figure

    path.parent.mkdir(parents=True, exist_ok=True)
    fig = gantt_figure([run.timeline], [title], spans=[run.total], max_workers=GANTT_MAX_WORKERS)
    fig.savefig(path, dpi=80, bbox_inches="tight")
