"""HistoPipe: length-aware rollout scheduling from each prompt's history (docs/design.md, section 3). Torch-free.

The parts, one module each:

- `predict`: `LengthPredictor`, each prompt's response length from its last rollouts (a prior for new
  prompts, updated as their first siblings finish), and the rank statistics of the per-step report
  (`spearman`, `moved_far_share`, `rank_report`); `censored`: its lognormal fit, lengths at the cap taken as
  lower bounds;
- `batching`: one worker's continuous batching as a timing model (`run_worker`): when each request finishes,
  given lengths, slots and the cost model. The planner runs it on predicted lengths, the simulator on true ones;
- `plan`: which worker runs which GRPO group, and in what order (`plan`, policies `static`, `least_loaded`,
  `histopipe`, `oracle`; `admission_order` inside one worker); `plan_pieces` with tier 2 (`pieces`: a long
  group split over several workers);
- `timeline`: what a rollout step did, simulated or measured (`Timeline`: busy intervals, finish times);
- `simulate`: a discrete-event simulation of a step on many workers (`simulate`), through the same `plan`;
  `fleet`: every worker on one clock, so that requests can migrate (`simulate_fleet`); `deferral`: the
  paper's tail rule (which requests migrate or are deferred to the next step) and the staleness bound;
- `workload`: the seeded, calibrated `rhyming` length workload (`Rhyming`);
- `metrics`: makespan, its lower bound, bubble ratio, first-to-last finish gap, tail time (`summary`).

Import the names from their modules (`from rhymerl.histopipe.plan import plan`); this package file stays thin.
"""
