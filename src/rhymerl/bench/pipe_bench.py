"""`rhymerl bench pipe`: HistoPipe's schedules, simulated from a length trace and timed on real workers.

(a) Simulation (`rhymerl.bench.pipe_sim`, `simulate_trace`): a length trace (by default the one shipped
with the package, `DEFAULT_TRACE`) and a cost model (measured on the model, `measure_cost_model`, or read
from a JSON file, `load_cost_model`): per worker count and policy, one sync step's makespan, bubbles and
speed-ups, then runs of `run_steps` steps in each mode, with Gantt charts; its module doc has the details
and the JSON's "sim" layout.

(b) Real runs (`rhymerl.bench.pipe_real`): one worker, FIFO vs longest-first admission (`run_real`), and
`ray_workers` Ray workers under every schedule, histopipe with each migration rule too (`run_ray`), on the real model
and a built-in task's prompts (`real_workload`: the recorded `repeat` task under `--trace rhyming`, else
arithmetic, or `--real-data`); the tokens are checked identical across all of them. `run` runs both
parts; `print_table` prints their tables.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from rhymerl.bench.console import table_console
# parts (a) and (b), importable from here as before the splits
from rhymerl.bench.pipe_real import (RAY_VARIANTS, arithmetic_prompts, call_figures, log,  # noqa: F401
                                     real_workload, rounded, run_ray, run_real)
from rhymerl.bench.pipe_sim import (DEFAULT_WORKERS, GANTT_MAX_WORKERS, draw_step, draw_steps,  # noqa: F401
                                    read_checked_trace, simulate_modes, simulate_trace, trace_draws, write_gantt)
from rhymerl.bench.pipe_context import measure_per_key
from rhymerl.bench.pipe_rhyming import RHYMING
from rhymerl.bench.progress import Progress
from rhymerl.cost_model import CostModel
from rhymerl.errors import UserError
from rhymerl.histopipe.batching import ContextCost
from rhymerl.histopipe.fleet import MIGRATIONS
from rhymerl.histopipe.plan import POLICIES
from rhymerl.histopipe.workload import Rhyming
from rhymerl.histopipe.predict import summarise  # noqa: F401 (re-exported, as before the split)
from rhymerl.histopipe.push import PUSH_MIGRATIONS
from rhymerl.histopipe.simulate import MODES
from rhymerl.histopipe.trace import read_trace  # noqa: F401 (re-exported, as before the split)

DEFAULT_TRACE = Path(__file__).resolve().parent.parent / "histopipe" / "traces" / "default.jsonl"


def context_cost(spec: str, cost_from: str, model: str, dtype: str, device: str | None,
                 slots: int) -> tuple[float, float, dict]:
    """`--context-cost`: attention's seconds per key per decoding sequence and per prefill pair
    (`batching.ContextCost`), and what the summary says of them. "auto": measured
    (`pipe_context.measure_per_key`, on the model's shapes) when the cost model is (`--cost-from measure`),
    else the cost file's `per_key_s` / `prefill_per_pair_s` (what this bench's JSON holds under cost_model),
    else 0 (contexts unpriced, said so). "measure": measured. "SECONDS[,PAIR_SECONDS]": given."""
    if spec == "auto" and cost_from != "measure":
        saved = json.loads(Path(cost_from).read_text(encoding="utf-8"))
        per_key, per_pair = float(saved.get("per_key_s", 0.0)), float(saved.get("prefill_per_pair_s", 0.0))
        return per_key, per_pair, {"per_key_s": per_key, "prefill_per_pair_s": per_pair,
                                   "how": f"from {cost_from}" if per_key else "contexts unpriced (none in the file)"}
    if spec in ("auto", "measure"):
        measured = measure_per_key(model, dtype, device, seqs=slots)
        return measured["per_key_s"], measured["prefill_per_pair_s"], measured
    try:
        values = [float(x) for x in spec.split(",")]
    except ValueError:
        values = []
    if len(values) not in (1, 2) or not all(v >= 0 for v in values):
        raise UserError(f"--context-cost {spec}: give auto, measure, or SECONDS[,PAIR_SECONDS] (each >= 0)")
    per_key, per_pair = values[0], values[1] if len(values) == 2 else 0.0
    return per_key, per_pair, {"per_key_s": per_key, "prefill_per_pair_s": per_pair,
                               "how": "given" if per_key else "contexts unpriced (--context-cost 0)"}


# ------------------------------------------------------------------------------------------- the cost model

def load_cost_model(source: str | Path) -> CostModel:
    """A `CostModel.as_dict()` JSON file (`--cost-from`); UserError naming it when it is not one."""
    path = Path(source)
    if not path.exists():
        raise UserError(f"--cost-from {source}: no such file; give measure (the default) or a CostModel JSON file")
    try:
        return CostModel.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (ValueError, KeyError, TypeError, IndexError) as e:  # JSONDecodeError and UnicodeDecodeError too
        raise UserError(f"--cost-from {source}: not a cost model (CostModel.as_dict() JSON, as bench pipe's JSON "
                        f"line holds under cost_model): {type(e).__name__}: {e}") from None


def measure_cost_model(model_name: str, dtype: str = "auto", device: str | None = None, slots: int = 32,
                       max_draft_tokens: int = 32, max_model_len: int = 512) -> CostModel:
    """The cost model an engine on `model_name` measures at start-up (with a HistoSpec `Speculator` built
    without one)."""
    from rhymerl.engine.engine import Engine
    from rhymerl.histospec.speculator import Speculator
    from rhymerl.model.pretrained import default_device, load_pretrained, resolve_dtype

    device = device or default_device()
    model, tokenizer, _ = load_pretrained(model_name, resolve_dtype(dtype, device), device)
    engine = Engine(model, tokenizer, num_slots=slots, max_model_len=max_model_len,
                    speculator=Speculator(None, max_draft_tokens=max_draft_tokens))
    return engine.cost_model


def default_out_dir() -> Path:
    """Where the bench writes its charts unless told: `runs/bench-pipe-<UTC time>`, beside `rhymerl train`'s
    run folders, one per run, so that a second run does not overwrite the first."""
    return Path("runs") / time.strftime("bench-pipe-%Y%m%dT%H%M%SZ", time.gmtime())


# ------------------------------------------------------------------------------------------- the bench

def run(trace: str | Path | None = None, cost_from: str = "measure", model: str = "smollm2-135m",
        dtype: str = "auto", device: str | None = None, workers: Sequence[int] = DEFAULT_WORKERS, slots: int = 32,
        real: bool = True, repeats: int = 3, real_prompts: int | None = None, num_generations: int | None = None,
        real_slots: int | None = None, max_tokens: int | None = None, temperature: float | None = None,
        seed: int = 0, ray_workers: int = 2, modes: Sequence[str] = MODES, run_steps: int = 4, train_s: float = 0.0,
        out: str | Path | None = None, rhyming: Rhyming | None = None, context: str = "auto",
        tier2: bool = True, real_data: str | None = None, defer_tail: bool = True, max_staleness: int = 1,
        migrations: Sequence[str] = MIGRATIONS, real_history_epochs: int | None = None) -> dict:
    """The whole bench: the summary dict whose JSON is the bench's last line. With `real`, its "real" entry
    holds the `ray_workers` Ray workers' figures per schedule (`run_ray`; 0: not run) and, under
    "one_worker", one worker's FIFO vs longest-first (`run_real`), both on `real_workload(trace, real_data,
    ...)` (the real_* arguments None: the workload's own). The Gantt charts go to `out` (`default_out_dir()`
    when None), named in the summary's "out". `trace == "rhyming"` (or `rhyming` given): the calibrated
    workload of `rhyming` (default `Rhyming()`), not a file. `context`: `--context-cost`. The cost model
    (`cost_from`: "measure" or a file) prices the simulation and is the real workers' HistoSpec cost model and
    their plan's. `migrations`: the simulated step's rules on histopipe's plan (`fleet.MIGRATIONS` and the
    simulated-only `push.PUSH_MIGRATIONS`; `--migrations`)."""
    if not modes or any(m not in MODES for m in modes):
        raise UserError(f"--modes {','.join(modes)}: choose a comma-separated list of {', '.join(MODES)}")
    unknown = [m for m in migrations if m not in MIGRATIONS + PUSH_MIGRATIONS]
    if unknown:
        raise UserError(f"--migrations {','.join(unknown)}: choose from {', '.join(MIGRATIONS + PUSH_MIGRATIONS)}")
    if str(trace) == RHYMING or rhyming is not None:
        trace, rhyming = RHYMING, rhyming or Rhyming()
    else:
        trace = Path(trace) if trace is not None else DEFAULT_TRACE
        if not trace.exists():
            raise FileNotFoundError(f"--trace {trace}: no such file or run directory (or the built-in {RHYMING})")
        read_checked_trace(trace)  # a bad trace fails before the cost model is measured (simulated: read again)
    workload = real_workload(trace, real_data, ray_workers, prompts=real_prompts, num_generations=num_generations,
                             slots=real_slots, max_tokens=max_tokens, temperature=temperature,
                             history_epochs=real_history_epochs)
    progress = Progress("pipe", (cost_from == "measure") + 2 + real * (1 + (ray_workers > 0)))
    if cost_from == "measure":
        progress.stage(f"measuring the cost model on {model} ({slots} slots)")
        cost_model = measure_cost_model(model, dtype, device, slots)
    else:
        cost_model = load_cost_model(cost_from)
    progress.stage(f"attention's cost per key ({context})")
    per_key, per_pair, context_info = context_cost(context, str(cost_from), model, dtype, device, slots)
    log(f"long contexts: {per_key:.3g} s per key per decoding sequence, {per_pair:.3g} s per prefill pair "
        f"({context_info['how']})")
    priced = ContextCost(cost_model, per_key, per_pair)
    progress.stage(f"simulating {trace} at {', '.join(map(str, workers))} workers")
    out = Path(out) if out is not None else default_out_dir()
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: is an existing file; the bench writes its Gantt charts into a directory")
    sim = simulate_trace(trace, priced, workers, slots, seed=seed, modes=modes, run_steps=run_steps,
                         train_s=train_s, gantt_dir=out, rhyming=rhyming, tier2=tier2, defer_tail=defer_tail,
                         max_staleness=max_staleness, migrations=migrations)
    # "mode": the single step's (sync); the runs' modes are under "modes"
    summary = {"sim": sim.pop("workers"),
               "sim_info": {**sim, "slots": slots, "mode": "sync", "modes": list(modes), "run_steps": run_steps,
                            "train_s": train_s, "defer_tail": defer_tail, "max_staleness": max_staleness,
                            "migrations": list(migrations)},
               "trace": str(trace), "cost_from": str(cost_from),
               "cost_model": cost_model.as_dict() | {"per_key_s": per_key, "prefill_per_pair_s": per_pair},
               "context_cost": context_info,
               "out": str(out)}
    if real:
        w = workload
        sizes = dict(num_prompts=w.prompts, num_generations=w.num_generations, slots=w.slots,
                     max_tokens=w.max_tokens, temperature=w.temperature, task=w.task,
                     history_epochs=w.history_epochs)
        log(f"real runs: {w.task}, {w.prompts} prompts x {w.num_generations} on {w.slots} slots per worker "
            f"({w.waves(1):g} waves on one worker, {w.waves(ray_workers):g} on each of {ray_workers} Ray workers)")
        progress.stage(f"one real worker: {w.history_epochs} epoch(s) recorded, then FIFO vs longest-first x "
                       f"{repeats}")
        one = run_real(model, **sizes, repeats=repeats, seed=seed, dtype=dtype, device=device, cost_model=cost_model)
        summary["real"] = {"one_worker": one}
        if ray_workers > 0:
            progress.stage(f"{ray_workers} Ray workers: {w.history_epochs} epoch(s) recorded, then every schedule "
                           f"x {repeats}")
            summary["real"] |= run_ray(model, num_workers=ray_workers, **sizes, repeats=repeats, seed=seed,
                                       dtype=dtype, device=device, tier2=tier2, cost_model=cost_model)
            summary["real"]["waves"] = w.waves(ray_workers)
    progress.done()
    if any(int(w) <= GANTT_MAX_WORKERS for w in summary["sim"]) and run_steps > 0:
        log(f"Gantt charts (worker counts up to {GANTT_MAX_WORKERS}) in {out}")
    return summary


def print_table(summary: dict, console: Console | None = None) -> None:
    console = console or table_console()
    info = summary["sim_info"]
    if "rhyming" in info:
        r = info["rhyming"]
        source = (f"rhyming workload (seed {info['seed']}: median {r['median']:g}, p99 {r['p99_ratio']:g}x, cap "
                  f"{r['cap']}, {r['num_generations']} per prompt, {r['waves']} waves; rank corr "
                  + ", ".join(f"{v['rank_corr']:.3f}" for v in r["workers"].values()) + ")")
    else:
        source = (f"{Path(summary['trace']).name}, {info['trace_steps']} steps (draws from step "
                  f"{info['draws_from_step']}, {info['groups_with_history']}/{info['trace_groups']} groups with "
                  f"history, rank corr {info['rank_corr']})")
    ctx = summary.get("context_cost", {})
    t = Table(title=f"HistoPipe simulation (sync): {source}, {info['slots']} slots per worker; attention "
                    f"{ctx.get('per_key_s', 0):.3g} s/key ({ctx.get('how', 'unpriced')})")
    for c in ("workers", "groups", "policy", "makespan s", "makespan / lb", "bubble", "finish gap s",
              "tail share", "vs static", "of oracle", "moved"):
        t.add_column(c, justify="right")
    for w, row in summary["sim"].items():
        names = [p for p in POLICIES if p in row] + [p for p in row if p not in POLICIES and p != "modes"
                                                     and isinstance(row[p], dict)]
        for i, policy in enumerate(names):
            r = row[policy]
            t.add_row(w if i == 0 else "", str(row["groups"]) if i == 0 else "", policy, f"{r['makespan_s']:.3f}",
                      f"{r['makespan_over_lb']:.3f}", f"{r['bubble']:.3f}", f"{r['finish_gap_s']:.3f}",
                      f"{r['tail_share']:.3f}",
                      f"{r['speedup_vs_static']:.3f}x" if r.get("speedup_vs_static") else "-",
                      f"{r['share_of_oracle']:.3f}" if "share_of_oracle" in r else "-", str(r.get("moved", "-")))
    console.print(t)
    print_mode_table(summary, console)
    print_real_tables(summary.get("real"), console)


def print_mode_table(summary: dict, console: Console) -> None:
    """The runs' table: per worker count, mode and policy, the mean time per step and the run's bubble."""
    info = summary["sim_info"]
    rows = [(w, mode, policy, r) for w, row in summary["sim"].items()
            for mode, by_policy in row.get("modes", {}).items()
            for policy, r in by_policy.items()]
    if not rows:
        return
    t = Table(title=f"HistoPipe runs of {info['run_steps']} steps per mode, updates of {info['train_s']} s "
                    f"(one_step_off: histopipe/oracle admit shortest first on odd steps, longest on even"
                    + (f"; tails deferred, max_staleness {info['max_staleness']})" if info.get("defer_tail") else ")"))
    for c in ("workers", "mode", "policy", "total s", "s / step", "bubble", "vs static", "vs sync", "deferred",
              "rerun"):
        t.add_column(c, justify="right")
    last = None
    for w, mode, policy, r in rows:
        t.add_row(w if w != last else "", mode, policy, f"{r['total_s']:.3f}", f"{r['step_s']:.3f}",
                  f"{r['bubble']:.3f}", f"{r['speedup_vs_static']:.3f}x" if r.get("speedup_vs_static") else "-",
                  f"{r['speedup_vs_sync']:.3f}x" if r.get("speedup_vs_sync") else "-",
                  str(r.get("deferred", "-")), str(r.get("rerun", "-")))
        last = w
    console.print(t)
    if summary.get("out"):
        console.print(f"Gantt charts: {summary['out']}")


def print_real_tables(real: dict | None, console: Console) -> None:
    """The real runs' tables: the Ray workers' schedules (when run), then one worker's admission orders."""
    if real and "static" in real:
        t = Table(title=f"{real['workers']} Ray workers: {real['model']} {real['dtype']}, {real['prompts']} prompts "
                        f"x {real['num_generations']}, {real['slots']} slots each, max_tokens={real['max_tokens']}, "
                        f"{real['repeats']} repeats, identical tokens: {real['identical']}")
        for c in ("schedule", "makespan s", "runs s", "spread s", "bubble", "finish gap s", "split groups",
                  "migrations", "re-prefill s", "vs static", "vs least_loaded"):
            t.add_column(c, justify="right")
        for name, _, _ in RAY_VARIANTS:
            if name in real:
                r = real[name]
                t.add_row(name, f"{r['makespan_s']:.3f}", " ".join(f"{x:.3f}" for x in r["runs_s"]),
                          f"{r['spread_s']:.3f}", f"{r['bubble']:.3f}", f"{r['finish_gap_s']:.3f}",
                          f"{r['split_groups']:g}", f"{r['migrations']:g}", f"{r['migration_prefill_s']:.3f}",
                          f"{r['speedup_vs_static']:.3f}x",
                          f"{r['speedup_vs_least_loaded']:.3f}x" if r.get("speedup_vs_least_loaded") else "-")
        console.print(t)
    real = (real or {}).get("one_worker")
    if real:
        t = Table(title=f"One real worker: {real['model']} {real['dtype']}, {real['prompts']} prompts x "
                        f"{real['num_generations']}, {real['slots']} slots, max_tokens={real['max_tokens']}, "
                        f"{real['repeats']} repeats")
        for c in ("admission", "median s", "runs s", "speed-up", "identical tokens"):
            t.add_column(c, justify="right")
        t.add_row("fifo", str(real["fifo"]["median_s"]), " ".join(map(str, real["fifo"]["runs_s"])), "1.0x",
                  str(real["identical"]))
        t.add_row("longest_first", str(real["longest_first"]["median_s"]),
                  " ".join(map(str, real["longest_first"]["runs_s"])), f"{real['speedup']}x", str(real["identical"]))
        console.print(t)
