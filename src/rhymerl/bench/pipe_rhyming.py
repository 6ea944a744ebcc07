"""`rhymerl bench pipe --trace rhyming`: the simulated steps of the calibrated workload
(`rhymerl.histopipe.workload`), predicted as a training run would have predicted them.

For W workers of `slots` slots, a step holds `waves` x W x slots requests or more (`Rhyming.prompts_per_step`);
the data set is `epoch_steps` such steps. The predictor (`LengthPredictor` with the workload's cap: the
censored lognormal, the one the scheduler and `histopipe/rank_corr` use) records every step before the first
simulated one (`history_epochs` epochs), then each simulated step is predicted and recorded in turn. The
options (`OPTIONS`) are `--rhyming-KEY VALUE`, each default's source in docs/design.md ("Workload").
"""

from __future__ import annotations

import time
from dataclasses import fields
from statistics import mean

from rhymerl.bench.pipe_real import RHYMING, log  # noqa: F401 (RHYMING: the reserved --trace name)
from rhymerl.histopipe.predict import LengthPredictor, moved_far_share, quantile, rank_report
from rhymerl.histopipe.workload import Rhyming

HELP = {  # --rhyming-KEY: what it sets (the source of each default: docs/design.md, "Workload")
    "median": "median response length, tokens",
    "p99_ratio": "99th percentile over the median, before the cut",
    "cap": "max_completion_length: longer responses are cut there",
    "num_generations": "responses per prompt",
    "shift_share": "share of prompts whose length rank moves far at each epoch",
    "shift_gap": "how far such a move goes at least, as a share of the ranking",
    "drift": "growth of the mean length over --rhyming-drift-steps steps",
    "drift_steps": "steps over which the mean grows by --rhyming-drift",
    "group_spread": "sigma of log-length inside one group (an assumption)",
    "waves": "requests per step >= waves x workers x slots",
    "epoch_steps": "steps per epoch (the data set is epoch_steps x prompts per step)",
    "history_epochs": "epochs recorded before the first simulated step",
}
# (key, type, default, help) per option; the dataclass's annotations are strings (postponed evaluation)
OPTIONS = [(f.name, int if f.type == "int" else float, f.default, HELP[f.name]) for f in fields(Rhyming)]


def rhyming_steps(params: Rhyming, workers: int, slots: int, seed: int, count: int):
    """`count` consecutive simulated steps from `params.first_step()` as (prompt keys, lengths, predicted per
    request, the predicted length per group) each, the first step's figures (median, p99, at the cap,
    rank correlation and moved-far share of prediction vs actual), and the predictor as it was before the
    first simulated step (for the simulation's online updates)."""
    started = time.perf_counter()
    workload = params.workload(params.prompts_per_step(workers, slots), seed)
    predictor = LengthPredictor(cap=params.cap)
    first = params.first_step()
    for t in range(first):
        for key, lengths in workload.step(t):
            predictor.record(key, lengths)
    steps, info = [], {}
    for t in range(first, first + max(count, 1)):
        groups = workload.step(t)
        keys = [k for k, _ in groups]
        lengths = [ls for _, ls in groups]
        predicted = [predictor.predict_group(k, len(ls)) for k, ls in groups]
        point = predictor.predict_many(keys)
        if t == first:
            before = predictor.copy()
            flat = [n for ls in lengths for n in ls]
            actual = [mean(ls) for ls in lengths]
            ranking = rank_report(point, actual)
            info = {"step": t, "groups": len(groups), "median": quantile(flat, 0.5), "p99": quantile(flat, 0.99),
                    "at_cap": sum(n >= params.cap for n in flat) / len(flat),
                    "rank_corr": ranking["rank_corr"], "moved_far": moved_far_share(point, actual),
                    "with_history": sum(k in predictor for k in keys) / len(keys)}
        for key, ls in groups:
            predictor.record(key, ls)
        steps.append((keys, lengths, predicted, point))
    log(f"rhyming workload, {workers} workers: {len(steps)} steps of {len(steps[0][0])} groups from step {first} "
        f"(median {info['median']:.0f}, p99 {info['p99']:.0f}, rank corr {info['rank_corr']:.3f}; "
        f"{time.perf_counter() - started:.1f} s)")
    return steps, info, before
