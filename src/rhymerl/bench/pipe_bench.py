"""`rhymerl bench pipe`: HistoPipe's schedules, simulated from a length trace and timed on a real worker.

(a) Simulation (`simulate_trace`): a length trace (`RUN_DIR/lengths.jsonl`, written by every `rhymerl train`
run; by default the one shipped with the package, `DEFAULT_TRACE`) and a cost model (measured on the model
at start-up, as an engine does, or read from a `CostModel.as_dict()` JSON file). For each worker count W,
one sync-mode step of W workers x `slots` slots draws its groups from the trace, cycling through its steps
and prompts with their recorded lengths until the workers' slots are full. Each drawn group's predicted
length is what a real run would have known when it ran that step: a `LengthPredictor` that has recorded
the trace's earlier steps. The draws start at the trace's first step where some prompt has a history (its
second epoch), so that the predictions are history's and not the prior's, unless no step has one; the
step's arrival order is shuffled (seeded), as a training run's sampler hands out prompts. Every
policy (`plan.POLICIES`) runs the same groups through `simulate`; per policy the makespan over the lower
bound, the bubble ratio, the first-to-last finish gap, the speed-up over `static`, and for `histopipe` its
share of `oracle` (oracle makespan / histopipe makespan).

(b) Real runs (`run_real`): one `RolloutWorker` behind a `LocalPool` on the real model and the built-in
arithmetic prompts. A first epoch (FIFO, its own seed) is recorded into the history so that predictions
exist; then the second epoch's groups run with `admission="fifo"` and `"longest_first"`, alternating
`repeats` times with the same request ids and seed, the median rollout seconds of each reported, and the
tokens checked identical (keyed randomness: only the timing may change). Then (`run_ray`, 2026-11-25) two Ray
workers (`RayPool`) on the same prompts: a first epoch recorded, then every schedule of `rollout.schedule`
(static, least_loaded, histopipe) and histopipe with migration on the second epoch's groups, `repeats`
rounds in rotating order, the median makespan (the call's wall time), bubble ratio (1 - the workers' busy
time / (workers x makespan)) and finish gap of each, tokens checked identical across all of them.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from rhymerl.bench.console import table_console
from rhymerl.bench.progress import Progress
from rhymerl.cost_model import CostModel
from rhymerl.histopipe.metrics import summary as step_summary
from rhymerl.histopipe.plan import POLICIES
from rhymerl.histopipe.predict import LengthPredictor, rank_report, summarise
from rhymerl.histopipe.simulate import simulate
from rhymerl.histopipe.trace import read_trace

DEFAULT_TRACE = Path(__file__).resolve().parent.parent / "histopipe" / "traces" / "default.jsonl"
DEFAULT_WORKERS = (8, 64, 1024)


def _log(msg: str) -> None:
    print(f"[bench pipe] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------- (a) simulation

def load_cost_model(source: str | Path) -> CostModel:
    """A `CostModel.as_dict()` JSON file."""
    return CostModel.from_dict(json.loads(Path(source).read_text(encoding="utf-8")))


def measure_cost_model(model_name: str, dtype: str = "auto", device: str | None = None, slots: int = 32,
                       max_draft_tokens: int = 32, max_model_len: int = 512) -> CostModel:
    """The cost model an engine on `model_name` measures at start-up (`speculative="histospec"`)."""
    from rhymerl.engine.engine import Engine
    from rhymerl.model.pretrained import default_device, load_pretrained, resolve_dtype

    device = device or default_device()
    model, tokenizer, _ = load_pretrained(model_name, resolve_dtype(dtype, device), device)
    engine = Engine(model, tokenizer, num_slots=slots, max_model_len=max_model_len, speculative="histospec",
                    max_draft_tokens=max_draft_tokens)
    return engine.cost_model


def trace_draws(steps: Sequence[dict]) -> tuple[list[tuple[str, list[int], float, bool]], int]:
    """Every group of the trace as (prompt key, its recorded lengths, its predicted length, whether its
    prompt had a history), in trace order from the first step where some prompt had one (see the module
    doc), and that step's index. A prompt's prediction is a `LengthPredictor` on the steps before its own."""
    predictor = LengthPredictor()
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
        raise ValueError("the trace holds no group with recorded lengths")
    return out, start


def draw_step(draws: Sequence[tuple[str, list[int], float, bool]], requests: int, seed: int | None = 0):
    """Groups cycled from `draws` until they hold at least `requests` requests: (lengths, predicted,
    with-history flags), in an arrival order shuffled by `seed` (None: the cycle's order).

    A training run's sampler hands a step its prompts in random order. The cycle's order would not do for
    the baselines, which split by arrival order: when the cycle's period and the worker count share a
    factor, a round robin puts every copy of a prompt on the same worker."""
    picked, held, i = [], 0, 0
    while held < requests:
        picked.append(draws[i % len(draws)])
        held += len(picked[-1][1])
        i += 1
    if seed is not None:
        random.Random(seed).shuffle(picked)
    return [list(d[1]) for d in picked], [d[2] for d in picked], [d[3] for d in picked]


def simulate_trace(trace: str | Path, cost_model: CostModel, workers: Sequence[int] = DEFAULT_WORKERS,
                   slots: int = 32, policies: Sequence[str] = POLICIES, seed: int | None = 0) -> dict:
    """Part (a): per worker count (a string key, as in the JSON) and policy, the step's figures; `seed`
    shuffles each step's arrival order (`draw_step`)."""
    steps = read_trace(trace)
    if not steps:
        raise ValueError(f"{trace}: an empty trace")
    draws, first = trace_draws(steps)
    known = [i for i, d in enumerate(draws) if d[3]]
    stat = LengthPredictor().statistic
    ranking = rank_report([draws[i][2] for i in known], [summarise(draws[i][1], stat) for i in known]) \
        if len(known) >= 2 else None
    out = {"trace_steps": len(steps), "seed": seed, "draws_from_step": first, "trace_groups": len(draws),
           "groups_with_history": len(known),
           "rank_corr": None if ranking is None or math.isnan(ranking["rank_corr"]) else round(ranking["rank_corr"], 3),
           "workers": {}}
    for w in workers:
        lengths, predicted, _ = draw_step(draws, w * slots, seed)
        started = time.perf_counter()
        row = {"groups": len(lengths), "requests": sum(map(len, lengths))}
        for policy in policies:
            timeline = simulate(lengths, w, policy, slots=slots, cost_model=cost_model, predicted=predicted)
            s = step_summary(timeline, lengths, slots, cost_model)
            row[policy] = {"makespan_s": s["makespan"], "lower_bound_s": s["lower_bound"],
                           "makespan_over_lb": s["makespan_over_lb"], "bubble": s["bubble"],
                           "finish_gap_s": s["finish_gap"], "tail_share": s["tail_share"]}
        base = row["static"]["makespan_s"] if "static" in row else None
        for policy in policies:
            r = row[policy]
            r["speedup_vs_static"] = base / r["makespan_s"] if base and r["makespan_s"] > 0 else None
        if "histopipe" in row and "oracle" in row and row["histopipe"]["makespan_s"] > 0:
            row["histopipe"]["share_of_oracle"] = row["oracle"]["makespan_s"] / row["histopipe"]["makespan_s"]
        out["workers"][str(w)] = _rounded(row)
        hp = row.get("histopipe", {})
        _log(f"{w} workers x {slots} slots, {row['groups']} groups: "
             + ", ".join(f"{p} {row[p]['makespan_over_lb']:.3f}x lb" for p in policies)
             + (f"; histopipe {hp['speedup_vs_static']:.3f}x static" if hp.get("speedup_vs_static") else "")
             + f" ({time.perf_counter() - started:.1f} s)")
    return out


def _rounded(x):
    if isinstance(x, float):
        return round(x, 4) if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    return x


# ------------------------------------------------------------------------------------------- (b) real runs

def arithmetic_prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    """The built-in arithmetic task's first `n` prompts, chat-encoded (as `rhymerl bench spec`)."""
    from rhymerl.model.pretrained import chat_prompt_ids
    from rhymerl.tasks.arithmetic import make_problems, prompt_text

    return [chat_prompt_ids(tokenizer, prompt_text(p)) for p in make_problems(n, seed)]


def run_real(model: str, prompts: Sequence[Sequence[int]] | None = None, *, num_prompts: int = 16,
             num_generations: int = 4, slots: int = 16, max_tokens: int = 128, temperature: float = 1.0,
             repeats: int = 3, seed: int = 0, dtype: str = "auto", device: str | None = None,
             speculative: str = "histospec", cost_model: CostModel | None = None) -> dict:
    """Part (b): one worker, FIFO vs longest-first admission on the same groups (see the module doc).

    `model`: a built-in name or a model directory. `prompts`: token ids (then no tokenizer is loaded: a
    tokenizer-less test model); default the arithmetic task's first `num_prompts`. `cost_model`: HistoSpec's,
    measured by the first worker when None and reused by the second."""
    import torch

    from rhymerl.engine.sampling_params import SamplingParams
    from rhymerl.history import HistoryStore
    from rhymerl.model.pretrained import default_device, load_pretrained, resolve_dtype
    from rhymerl.rollout import LocalPool, RolloutGroup, RolloutWorker, WorkerConfig

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    device = device or default_device()
    dtype = resolve_dtype(dtype, device)
    if prompts is None:
        policy, tokenizer, _ = load_pretrained(model, "fp32", device)
        prompts = arithmetic_prompts(tokenizer, num_prompts, seed)
    else:
        from rhymerl.model.fetch import resolve_model_dir
        from rhymerl.model.weights import load_decoder

        policy, tokenizer = load_decoder(resolve_model_dir(model), torch.float32, device), None
        prompts = [list(p) for p in prompts]
    max_len = max(map(len, prompts)) + max_tokens + 1
    history = HistoryStore()
    pools = {}
    for admission in ("fifo", "longest_first"):
        config = WorkerConfig(num_slots=slots, max_model_len=max_len, dtype=dtype, speculative=speculative,
                              admission=admission)
        worker = RolloutWorker(policy, tokenizer, config, cost_model=cost_model)
        if speculative == "histospec" and cost_model is None:
            cost_model = worker.engine.cost_model  # measured once; the second worker reuses it
        pools[admission] = LocalPool(worker, history)

    def groups(tag: str) -> list:
        return [RolloutGroup(p, [f"{tag}-p{i}-g{g}" for g in range(num_generations)]) for i, p in enumerate(prompts)]

    # Epoch 1: fills the history, so that longest-first has predictions.
    first = pools["fifo"].rollout(groups("e1"), SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                                               seed=seed + 1000))
    for i, p in enumerate(prompts):
        pools["fifo"].record(p, [o.token_ids for o in first.outputs[i * num_generations:(i + 1) * num_generations]])
    _log(f"real: epoch 1 recorded ({len(prompts)} prompts x {num_generations}, "
         f"{sum(len(o.token_ids) for o in first.outputs)} tokens)")
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + 2000)
    seconds: dict[str, list[float]] = {"fifo": [], "longest_first": []}
    tokens: dict[str, list] = {}
    identical = True
    for r in range(repeats):
        for admission in ("fifo", "longest_first") if r % 2 == 0 else ("longest_first", "fifo"):
            t0 = time.perf_counter()
            result = pools[admission].rollout(groups("e2"), params)
            seconds[admission].append(time.perf_counter() - t0)
            got = [o.token_ids for o in result.outputs]
            if admission in tokens:
                identical &= got == tokens[admission]
            tokens[admission] = got
            _log(f"real: repeat {r + 1}/{repeats} {admission}: {seconds[admission][-1]:.2f} s")
    identical &= tokens["fifo"] == tokens["longest_first"]
    if not identical:
        _log("real: WARNING: FIFO and longest-first generated different tokens")
    out = {mode: {"median_s": round(statistics.median(s), 3), "runs_s": [round(x, 3) for x in s]}
           for mode, s in seconds.items()}
    out["speedup"] = round(out["fifo"]["median_s"] / out["longest_first"]["median_s"], 3)
    out["identical"] = identical
    out.update({"model": str(model), "dtype": dtype, "device": str(device), "prompts": len(prompts),
                "num_generations": num_generations, "slots": slots, "max_tokens": max_tokens,
                "temperature": temperature, "repeats": repeats, "speculative": speculative,
                "tokens": sum(map(len, tokens["fifo"]))})
    return out


# (name, rollout.schedule, rollout.migration)
RAY_VARIANTS = (("static", "static", False), ("least_loaded", "least_loaded", False),
                ("histopipe", "histopipe", False), ("histopipe+migration", "histopipe", True))


def call_figures(result, seconds: float) -> dict:
    """A two-worker call's timing: makespan (its wall seconds), bubble ratio (1 - the workers' busy seconds /
    (workers x makespan)) and finish gap (first to last worker finish), from the workers' stamps."""
    busy, ends = {}, {}
    for w in result.workers:
        if w.finished > w.started > 0:
            busy[w.worker] = busy.get(w.worker, 0.0) + w.finished - w.started
            ends[w.worker] = max(ends.get(w.worker, 0.0), w.finished)
    workers = max(len(busy), 1)
    totals = result.engine_totals()
    return {"makespan_s": seconds, "bubble": max(0.0, 1 - sum(busy.values()) / (workers * seconds)),
            "finish_gap_s": max(ends.values()) - min(ends.values()) if ends else 0.0,
            "migrations": totals.migrations, "migration_prefill_s": totals.migration_prefill_s}


def run_ray(model: str, prompts: Sequence[Sequence[int]] | None = None, *, num_workers: int = 2,
            num_prompts: int = 16, num_generations: int = 4, slots: int = 16, max_tokens: int = 128,
            temperature: float = 1.0, repeats: int = 3, seed: int = 0, dtype: str = "auto",
            device: str | None = None, speculative: str = "histospec", cost_model: CostModel | None = None,
            variants: Sequence[tuple[str, str, bool]] = RAY_VARIANTS) -> dict:
    """Part (b), two Ray workers: every schedule (and histopipe with migration) on the same groups (see the
    module doc). Arguments as `run_real`'s; a Ray cluster is started for this process unless it is already
    connected to one."""
    import torch

    from rhymerl.engine.sampling_params import SamplingParams
    from rhymerl.history import HistoryStore
    from rhymerl.model.fetch import resolve_model_dir
    from rhymerl.model.pretrained import default_device, load_pretrained, resolve_dtype
    from rhymerl.model.weights import load_decoder
    from rhymerl.rollout import RolloutGroup, WorkerConfig
    from rhymerl.rollout.factory import make_pool

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    device = device or default_device()
    dtype = resolve_dtype(dtype, device)
    if prompts is None:
        policy, tokenizer, model_dir = load_pretrained(model, "fp32", device)
        prompts = arithmetic_prompts(tokenizer, num_prompts, seed)
    else:
        model_dir = resolve_model_dir(model)
        policy, tokenizer = load_decoder(model_dir, torch.float32, device), None
        prompts = [list(p) for p in prompts]
    config = WorkerConfig(num_slots=slots, max_model_len=max(map(len, prompts)) + max_tokens + 1, dtype=dtype,
                          speculative=speculative)
    pool = make_pool("ray", num_workers, "", policy, tokenizer, model_dir, config, HistoryStore(), seed=seed,
                     device=device, cost_model=cost_model)
    try:
        def groups(tag: str) -> list:
            return [RolloutGroup(p, [f"{tag}-p{i}-g{g}" for g in range(num_generations)])
                    for i, p in enumerate(prompts)]

        first = pool.rollout(groups("e1"), SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                                          seed=seed + 1000))
        for i, p in enumerate(prompts):  # epoch 1 gives histopipe its predictions
            pool.record(p, [o.token_ids for o in first.outputs[i * num_generations:(i + 1) * num_generations]])
        _log(f"real, {num_workers} Ray workers: epoch 1 recorded")
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + 2000)
        runs: dict[str, list[dict]] = {name: [] for name, _, _ in variants}
        reference, identical = None, True
        for r in range(repeats):
            for name, schedule, migration in variants[r % len(variants):] + variants[:r % len(variants)]:
                pool.schedule, pool.migration = schedule, migration
                t0 = time.perf_counter()
                result = pool.rollout(groups("e2"), params)
                runs[name].append(call_figures(result, time.perf_counter() - t0))
                got = [o.token_ids for o in result.outputs]
                reference = got if reference is None else reference
                identical &= got == reference
                _log(f"real, {num_workers} Ray workers: repeat {r + 1}/{repeats} {name}: "
                     f"{runs[name][-1]['makespan_s']:.2f} s, {runs[name][-1]['migrations']} migrations")
    finally:
        pool.close()
    if not identical:
        _log("real: WARNING: the schedules generated different tokens")
    out = {}
    for name, rs in runs.items():
        out[name] = {key: statistics.median(x[key] for x in rs) for key in rs[0]}
        out[name]["runs_s"] = [x["makespan_s"] for x in rs]
    for name in out:
        out[name]["speedup_vs_static"] = out["static"]["makespan_s"] / out[name]["makespan_s"] \
            if "static" in out else None
    out = _rounded(out)
    out.update({"identical": identical, "workers": num_workers, "model": str(model), "dtype": dtype,
                "device": str(device), "prompts": len(prompts), "num_generations": num_generations, "slots": slots,
                "max_tokens": max_tokens, "temperature": temperature, "repeats": repeats,
                "speculative": speculative, "tokens": sum(map(len, reference))})
    return out


# ------------------------------------------------------------------------------------------- the bench

def run(trace: str | Path | None = None, cost_from: str = "measure", model: str = "smollm2-135m",
        dtype: str = "auto", device: str | None = None, workers: Sequence[int] = DEFAULT_WORKERS, slots: int = 32,
        real: bool = True, repeats: int = 3, real_prompts: int = 16, num_generations: int = 4,
        real_slots: int = 16, max_tokens: int = 128, temperature: float = 1.0, seed: int = 0,
        ray_workers: int = 2) -> dict:
    """The whole bench: the summary dict whose JSON is the bench's last line. With `real`, its "real" entry
    holds the `ray_workers` Ray workers' figures per schedule (`run_ray`; 0: not run) and, under
    "one_worker", one worker's FIFO vs longest-first (`run_real`)."""
    trace = Path(trace) if trace is not None else DEFAULT_TRACE
    if not trace.exists():
        raise FileNotFoundError(f"--trace {trace}: no such file or run directory")
    progress = Progress("pipe", (cost_from == "measure") + 1 + real * (1 + (ray_workers > 0)))
    if cost_from == "measure":
        progress.stage(f"measuring the cost model on {model} ({slots} slots)")
        cost_model = measure_cost_model(model, dtype, device, slots)
    else:
        cost_model = load_cost_model(cost_from)
    progress.stage(f"simulating {trace} at {', '.join(map(str, workers))} workers")
    sim = simulate_trace(trace, cost_model, workers, slots, seed=seed)
    summary = {"sim": sim.pop("workers"), "sim_info": {**sim, "slots": slots, "mode": "sync"},
               "trace": str(trace), "cost_from": str(cost_from), "cost_model": cost_model.as_dict()}
    if real:
        progress.stage(f"one real worker: epoch 1, then FIFO vs longest-first x {repeats}")
        one = run_real(model, num_prompts=real_prompts, num_generations=num_generations, slots=real_slots,
                       max_tokens=max_tokens, temperature=temperature, repeats=repeats, seed=seed, dtype=dtype,
                       device=device)
        summary["real"] = {"one_worker": one}
        if ray_workers > 0:
            progress.stage(f"{ray_workers} Ray workers: epoch 1, then every schedule x {repeats}")
            summary["real"] |= run_ray(model, num_workers=ray_workers, num_prompts=real_prompts,
                                       num_generations=num_generations, slots=real_slots, max_tokens=max_tokens,
                                       temperature=temperature, repeats=repeats, seed=seed, dtype=dtype,
                                       device=device)
    progress.done()
    return summary


def print_table(summary: dict, console: Console | None = None) -> None:
    console = console or table_console()
    info = summary["sim_info"]
    t = Table(title=f"HistoPipe simulation (sync): {Path(summary['trace']).name}, {info['trace_steps']} steps "
                    f"(draws from step {info['draws_from_step']}, {info['groups_with_history']}/"
                    f"{info['trace_groups']} groups with history, rank corr {info['rank_corr']}), "
                    f"{info['slots']} slots per worker")
    for c in ("workers", "groups", "policy", "makespan s", "makespan / lb", "bubble", "finish gap s",
              "tail share", "vs static", "of oracle"):
        t.add_column(c, justify="right")
    for w, row in summary["sim"].items():
        for i, policy in enumerate(p for p in POLICIES if p in row):
            r = row[policy]
            t.add_row(w if i == 0 else "", str(row["groups"]) if i == 0 else "", policy, f"{r['makespan_s']:.3f}",
                      f"{r['makespan_over_lb']:.3f}", f"{r['bubble']:.3f}", f"{r['finish_gap_s']:.3f}",
                      f"{r['tail_share']:.3f}",
                      f"{r['speedup_vs_static']:.3f}x" if r.get("speedup_vs_static") else "-",
                      f"{r['share_of_oracle']:.3f}" if "share_of_oracle" in r else "-")
    console.print(t)
    print_real_tables(summary.get("real"), console)


def print_real_tables(real: dict | None, console: Console) -> None:
    """The real runs' tables: the Ray workers' schedules (when run), then one worker's admission orders."""
    if real and "static" in real:
        t = Table(title=f"{real['workers']} Ray workers: {real['model']} {real['dtype']}, {real['prompts']} prompts "
                        f"x {real['num_generations']}, {real['slots']} slots each, max_tokens={real['max_tokens']}, "
                        f"{real['repeats']} repeats, identical tokens: {real['identical']}")
        for c in ("schedule", "makespan s", "runs s", "bubble", "finish gap s", "migrations", "re-prefill s",
                  "vs static"):
            t.add_column(c, justify="right")
        for name, _, _ in RAY_VARIANTS:
            if name in real:
                r = real[name]
                t.add_row(name, f"{r['makespan_s']:.3f}", " ".join(f"{x:.3f}" for x in r["runs_s"]),
                          f"{r['bubble']:.3f}", f"{r['finish_gap_s']:.3f}", f"{r['migrations']:g}",
                          f"{r['migration_prefill_s']:.3f}", f"{r['speedup_vs_static']:.3f}x")
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
