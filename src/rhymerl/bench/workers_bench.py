"""`rhymerl bench workers`: seconds per GRPO step with the rollout in this process (`local1`), in one Ray
actor (`ray1`) and in two (`ray2`): issue 23's benchmark.

Each setup is a `TrainingRun` of the same config (the default job, unless `overrides` say otherwise) with
only `rollout.backend` and `rollout.num_workers` changed: the same prompts and seeds, so in fp32 the three
roll out the same tokens and train the same weights step for step (`same_rollouts` checks the response
lengths and rewards agree). One Ray cluster serves the whole bench (`ray_pool.connect(ray.address)`; '' = a
fresh local one, as a training run starts); the setups run one after the other in this process, each pool
closed before the next starts. A setup runs `warmup` steps, then `steps` timed ones (`train_step`: rollout,
reward, update, weight sync; no validation, no checkpoint); its figures are medians over its timed steps
of every repeat (with `repeats` > 1 the setups alternate order, as local1 ray1 ray2 ray2 ray1 local1 ...,
so that a machine's slow drift does not favour one).

Inside the rollout call, measured here around the pool (the loop only reports the call's total): the
workers' own span (first start to last finish, from `WorkerStats`), the history slices the driver exports
(`HistoryStore.export`), and the rest of the call (`rollout_dispatch_s`: pickling requests and outputs,
Ray's scheduling and transfers; about nothing in process). Ray's overhead at one worker is (ray1 - local1)
/ local1 of the step time, from the medians and paired (each timed step of ray1 over the same step of
local1); its parts are the differences of the medians, the largest named.

HistoSpec's cost model: local1 measures it, as a run does at start-up, and ray1 reuses it, so that the two
draft alike and differ only by where the worker runs; ray2's workers, on half the cores each, measure
their own. On 2 cores the two Ray workers get one torch thread each: ray2 shows the cost of splitting a
small machine, not a speed-up. On CUDA each Ray worker takes a GPU of its own: ray2 is skipped (and says so)
where there is only one.
"""

from __future__ import annotations

import gc
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from rhymerl.bench.console import device_fields, table_console
from rhymerl.bench.progress import Progress
from rhymerl.config import load_config
from rhymerl.cost_model import CostModel
from rhymerl.errors import UserError
from rhymerl.rl.loop import TrainingRun

SETUPS = {"local1": ("local", 1), "ray1": ("ray", 1), "ray2": ("ray", 2)}  # name -> (backend, workers)
# Per step: the loop's timings, then the parts of the rollout call measured by `RolloutProbe`.
PARTS = ("step_s", "rollout_s", "reward_s", "update_s", "sync_s", "other_s", "rollout_worker_s",
         "rollout_dispatch_s", "history_export_s", "bubble_ratio")
LOOP_TIMINGS = {"rollout_s": "timing_s/rollout", "reward_s": "timing_s/reward", "update_s": "timing_s/update",
                "sync_s": "timing_s/sync"}


class RolloutProbe:
    """Times a run's rollout calls from the driver: wraps `run.pool.rollout` and the history store's `export`
    (instance attributes: the bench measures the loop as it is, without hooks in it). `calls[-1]` is the
    last call's {call_s, export_s, worker_s, dispatch_s, bubble}."""

    def __init__(self, run: TrainingRun):
        self.calls: list[dict] = []
        self._export_s = 0.0
        rollout, export = run.pool.rollout, run.history.export

        def timed_export(prompts):
            t0 = time.perf_counter()
            try:
                return export(prompts)
            finally:
                self._export_s += time.perf_counter() - t0

        def timed_rollout(groups, params, *args, **kwargs):
            self._export_s = 0.0
            t0 = time.perf_counter()
            result = rollout(groups, params, *args, **kwargs)
            self.calls.append(call_figures(result.workers, time.perf_counter() - t0, self._export_s))
            return result

        run.history.export, run.pool.rollout = timed_export, timed_rollout


def call_figures(workers: list, call_s: float, export_s: float) -> dict:
    """One rollout call's parts from its `WorkerStats`: the workers' span (first start to last finish),
    the rest of the call besides the export (dispatch), and the bubble ratio 1 - busy worker-time / (workers
    x call time) (issue 23; the loop's `rollout/bubble_ratio` is preferred where it logs one)."""
    ran = [w for w in workers if w.finished > 0]
    span = max(w.finished for w in ran) - min(w.started for w in ran) if ran else 0.0
    busy = sum(w.finished - w.started for w in ran)
    count = max(len({w.worker for w in workers}), 1)
    return {"call_s": call_s, "export_s": export_s, "worker_s": span, "dispatch_s": call_s - span - export_s,
            "bubble": 1.0 - busy / (count * call_s) if call_s > 0 else 0.0}


def step_figures(metrics: dict, step_s: float, call: dict) -> dict:
    """One timed step's figures (`PARTS`)."""
    row = {"step_s": step_s, **{k: metrics[key] for k, key in LOOP_TIMINGS.items()}}
    row["other_s"] = step_s - sum(row[k] for k in LOOP_TIMINGS)  # the loop's bookkeeping and metrics
    row.update(rollout_worker_s=call["worker_s"], rollout_dispatch_s=call["dispatch_s"],
               history_export_s=call["export_s"],
               bubble_ratio=metrics.get("rollout/bubble_ratio", call["bubble"]))
    return row


def run_setup(name: str, overrides: list[str], out_dir: Path, steps: int, warmup: int, progress: Progress,
              cost_model: CostModel | None) -> tuple[list[dict], list[tuple], CostModel | None, dict]:
    """One setup's run: (timed steps' figures, each step's (mean response length, mean reward), the cost
    model its first worker used, facts about the run)."""
    backend, workers = SETUPS[name]
    cfg = load_config(None, overrides + [f"rollout.backend={backend}", f"rollout.num_workers={workers}",
                                         f"run.output_dir={out_dir}"])
    run = TrainingRun(cfg, cost_model=cost_model)
    try:
        state = (run.pool.spec_state() or [None])[0]
        if cost_model is None and state and "cost" in state:
            cost_model = CostModel.from_dict(state["cost"])
        probe = RolloutProbe(run)
        threads = getattr(run.pool, "threads", None) or torch.get_num_threads()  # a Ray worker's share
        facts = {"workers": workers, "threads_per_worker": threads,
                 "dtype": run.dtypes["rollout"], "device": next(run.model.parameters()).device.type,
                 "prompts_per_step": run.cfg.train.prompts_per_step,  # as the run resolved it (0 = by the machine)
                 "bubble_from": "bench"}
        rows, rollouts = [], []
        for step in range(warmup + steps):
            timed = step >= warmup
            progress.stage(f"{name}: {'step' if timed else 'warm-up step'} "
                           f"{step - warmup + 1 if timed else step + 1}/{steps if timed else warmup}")
            t0 = time.perf_counter()
            m = run.train_step(step)
            step_s = time.perf_counter() - t0
            run.logger.log(step + 1, m | {"timing_s/step": step_s})
            rollouts.append((m["response_length/mean"], m["critic/rewards/mean"]))
            if "rollout/bubble_ratio" in m:
                facts["bubble_from"] = "loop"
            if timed:
                rows.append(step_figures(m, step_s, probe.calls[-1]))
        return rows, rollouts, cost_model, facts
    finally:
        run.pool.close()  # the Ray pool's actors end here (train_step, not run, drove it); the cluster stays
        run.logger.close()
        del run
        gc.collect()


def _median(rows: list[dict], key: str) -> float:
    return round(statistics.median(r[key] for r in rows), 4)


def run(overrides: list[str] = (), steps: int = 4, warmup: int = 1, repeats: int = 1, dtype: str = "auto",
        out: str | Path | None = None, progress: Progress | None = None) -> dict:
    """The whole bench: the summary dict whose JSON is its last line. `overrides`: config `key=value`s on top
    of the default job (any key but rollout.backend, rollout.num_workers and run.output_dir, which each
    setup sets); `out`: keep the runs' directories there (default: a temporary folder, removed)."""
    if steps < 1 or warmup < 0 or repeats < 1:
        raise UserError(f"bench workers: needs steps >= 1, warmup >= 0, repeats >= 1; got steps={steps}, "
                        f"warmup={warmup}, repeats={repeats}")
    base = [f"train.total_steps={warmup + steps}", f"rollout.dtype={dtype}", f"train.dtype={dtype}", "val.every=0",
            "run.save_every=0", "run.progress=false", "run.tensorboard=false", *overrides]
    cfg = load_config(None, base)  # a bad key fails here, before Ray starts
    names, skipped = setups_that_fit()
    progress = progress or Progress("workers", 1 + repeats * len(names) * (1 + warmup + steps))
    for name, why in skipped.items():
        progress.note(f"{name} skipped: {why}")
    progress.stage(f"Ray cluster ({cfg.ray.address or 'a fresh local one'})")
    from rhymerl.rollout import ray_pool  # the optional backend's import, where this bench chooses it

    ray_pool.connect(cfg.ray.address)
    timed: dict[str, list[dict]] = {name: [] for name in names}
    rollouts: dict[str, list] = {name: [] for name in names}
    facts: dict[str, dict] = {}
    costs: dict[int, CostModel | None] = {}  # by workers: local1 and ray1 share one (see the module doc)
    with tempfile.TemporaryDirectory(prefix="rhymerl-workers-") as tmp:
        root = Path(out) if out is not None else Path(tmp)
        for r in range(repeats):
            for name in names if r % 2 == 0 else reversed(names):
                workers = SETUPS[name][1]
                progress.stage(f"{name} (repeat {r + 1}/{repeats}): start-up (model, {workers} worker(s)"
                               f"{', cost model' if costs.get(workers) is None else ''})")
                rows, seen, cost, facts[name] = run_setup(name, base, root / f"{name}-r{r}", steps, warmup,
                                                          progress, costs.get(workers))
                costs[workers] = cost
                timed[name] += rows
                rollouts[name].append(seen)
                progress.note(f"{name}: {statistics.median(x['step_s'] for x in rows):.2f} s/step (median so far "
                              f"{_median(timed[name], 'step_s')})")
    progress.done()
    return summarise(cfg, timed, rollouts, facts, steps, warmup, repeats) | ({"skipped": skipped} if skipped else {})


def setups_that_fit() -> tuple[list[str], dict[str, str]]:
    """The setups this machine runs, and why any other is skipped: on CUDA each Ray worker takes a GPU of
    its own, so ray2 needs two (a Ray actor asking for a GPU the cluster lacks would wait forever)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else None
    names = [name for name, (_, workers) in SETUPS.items() if gpus is None or workers <= gpus]
    return names, {name: f"needs {SETUPS[name][1]} GPUs, this machine has {gpus}" for name in SETUPS
                   if name not in names}


def summarise(cfg, timed: dict[str, list[dict]], rollouts: dict[str, list], facts: dict[str, dict], steps: int,
              warmup: int, repeats: int) -> dict:
    """The JSON's figures (see the module doc)."""
    out: dict = {}
    for name, rows in timed.items():
        out[name] = {**{k: _median(rows, k) for k in PARTS}, **facts[name],
                     "steps_s": [round(x["step_s"], 3) for x in rows]}
    local, ray1 = out["local1"], out["ray1"]
    out["ray1_overhead"] = round((ray1["step_s"] - local["step_s"]) / local["step_s"], 4)
    pairs = [b["step_s"] / a["step_s"] for a, b in zip(timed["local1"], timed["ray1"])]
    out["ray1_overhead_paired"] = round(statistics.median(pairs) - 1.0, 4)
    parts = {k: round(ray1[k] - local[k], 4) for k in ("rollout_worker_s", "rollout_dispatch_s", "history_export_s",
                                                      "reward_s", "update_s", "sync_s", "other_s")}
    out["ray1_overhead_parts_s"] = parts
    out["ray1_overhead_main"] = max(parts, key=parts.get)
    if "ray2" in out:
        out["ray2_over_local1"] = round(out["ray2"]["step_s"] / local["step_s"], 4)
    first = rollouts["local1"][0]
    out["same_rollouts"] = all(seen == first for runs in rollouts.values() for seen in runs)
    r = cfg.rollout
    out["config"] = {"model": cfg.model.name, "dtype": local["dtype"], "steps": steps, "warmup": warmup,
                     "repeats": repeats, "prompts_per_step": facts["local1"]["prompts_per_step"],
                     "num_generations": r.num_generations, "max_completion_length": r.max_completion_length,
                     "num_slots": r.num_slots, "speculative": r.speculative, "seed": cfg.run.seed}
    out["machine"] = {"cpu_cores": os.cpu_count(), **device_fields(facts["local1"]["device"])}
    return out


def print_table(summary: dict, console: Console | None = None) -> None:
    console = console or table_console()
    c, m = summary["config"], summary["machine"]
    where = m.get("gpu") or f"{m['cpu_cores']} CPU cores ({m.get('cpu', '')})"
    t = Table(title=f"GRPO step by rollout setup: {Path(c['model']).name} {c['dtype']}, {c['prompts_per_step']} x "
                    f"{c['num_generations']} per step, max_completion_length={c['max_completion_length']}, "
                    f"median of {c['steps']} steps x {c['repeats']} after {c['warmup']} warm-up, on {where}")
    for col in ("setup", "workers x threads", "step s", "vs local1", "rollout s", "worker span s", "dispatch s",
                "history export s", "reward s", "update s", "sync s", "bubble"):
        t.add_column(col, justify="right")
    for name in (n for n in SETUPS if n in summary):
        r = summary[name]
        t.add_row(name, f"{r['workers']} x {r['threads_per_worker']}", f"{r['step_s']:.3f}",
                  f"{r['step_s'] / summary['local1']['step_s']:.3f}x", f"{r['rollout_s']:.3f}",
                  f"{r['rollout_worker_s']:.3f}", f"{r['rollout_dispatch_s']:.3f}", f"{r['history_export_s']:.4f}",
                  f"{r['reward_s']:.3f}", f"{r['update_s']:.3f}", f"{r['sync_s']:.3f}", f"{r['bubble_ratio']:.3f}")
    console.print(t)
    parts = summary["ray1_overhead_parts_s"]
    console.print(f"Ray's overhead at 1 worker: {100 * summary['ray1_overhead']:+.1f}% of the step (paired "
                  f"{100 * summary['ray1_overhead_paired']:+.1f}%; goal under 5%); the largest part: "
                  f"{summary['ray1_overhead_main']} ({parts[summary['ray1_overhead_main']]:+.3f} s); all parts, "
                  f"ray1 - local1: " + ", ".join(f"{k} {v:+.3f}" for k, v in parts.items()))
    for name, why in summary.get("skipped", {}).items():
        console.print(f"{name} skipped: {why}")
    if m.get("cpu_cores") and m["cpu_cores"] <= 2 and "gpu" not in m:
        console.print(f"ray2 on {m['cpu_cores']} cores: each worker has one torch thread, so ray2 measures the cost "
                      f"of splitting this machine ({summary['ray2_over_local1']:.3f}x local1), not a speed-up")
    console.print(f"same rollouts in every setup (response lengths and rewards, step by step): "
                  f"{summary['same_rollouts']}")
