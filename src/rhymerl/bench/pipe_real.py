"""`rhymerl bench pipe`, part (b): HistoPipe's schedules timed on real workers (`rhymerl.bench.pipe_bench`
runs them after its simulation, part (a)).

What they roll out is a `RealWorkload`: a built-in task's first prompts, with its generations, slots, token
limit and temperature. `real_workload` picks it: `--trace rhyming` (or `--real-data repeat`) takes the
`repeat` task as `rhymerl train` recorded it into `histopipe/traces/repeat.jsonl` (answers from a few tokens
to about 80, the prompt says how long; 192 tokens, T=0.6; 8 generations), with slots for at least
`MIN_WAVES` waves per worker, so that admission order and schedule can matter; otherwise the arithmetic task
as before (16 prompts x 4 on 16 slots: one wave per Ray worker). Options given override either.

`run_real`: one `RolloutWorker` behind a `LocalPool` on the real model and the workload's prompts.
The workload's `history_epochs` epochs (FIFO, their own seeds; `record_history`) are recorded into the history
so that predictions exist; then the timed epoch's groups run with `admission="fifo"` and `"longest_first"`,
alternating `repeats` times with the same request ids and seed, the median rollout seconds of each reported,
and the tokens checked identical (keyed randomness: only the timing may change).

`run_ray`: two Ray workers (`RayPool`) on the same prompts: the history's epochs recorded, then every
schedule of `rollout.schedule` (static, least_loaded, histopipe, with `rollout.tier2` as the bench's
`--no-tier2` leaves it) and histopipe with each migration rule (`rollout.migration_rule`: half_busiest, the
paper's tail, and remaining with the siblings' early warning, the rule the simulator puts closest to the
bound) on the second epoch's groups, `repeats` rounds in rotating order, the median makespan (the
call's wall time) and the spread of the runs (slowest - fastest), bubble ratio (1 - the workers' busy time /
(workers x makespan)) and finish gap of each, tokens checked identical across all of them, and each plan.
The bench's cost model is every worker's and the plan's: one file, one plan in every run (`histopipe.pricing`).
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

from rhymerl.config import RolloutSection  # torch-free, like the two below
from rhymerl.cost_model import CostModel
from rhymerl.data.dataset import BUILTIN_TASKS, builtin_examples  # torch-free, like this module's top
from rhymerl.engine.sampling_params import SamplingParams  # torch-free
from rhymerl.errors import UserError


def log(msg: str) -> None:
    """A progress line on stderr, as the whole bench writes them."""
    print(f"[bench pipe] {msg}", file=sys.stderr, flush=True)


def rounded(x):
    """Floats to 4 decimals (a non-finite one to None), through dicts: the bench JSON's figures."""
    if isinstance(x, float):
        return round(x, 4) if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    return x


RHYMING = "rhyming"  # `--trace rhyming`: the calibrated workload (simulated) and the recorded task (real)
RECORDED_TRACE = Path(__file__).resolve().parent.parent / "histopipe" / "traces" / "repeat.jsonl"
MIN_WAVES = 4  # the rhyming real runs: requests per worker >= MIN_WAVES x slots
MAX_DRAFT_TOKENS = 32  # HistoSpec's draft cap in these runs, in either dtype (as every recorded run had it)


@dataclass(frozen=True)
class RealWorkload:
    """What the real runs roll out: the first `prompts` prompts of built-in `task` x `num_generations`, on
    `slots` slots per worker, at most `max_tokens` tokens each, sampled at `temperature`."""

    task: str = "arithmetic"
    prompts: int = 16
    num_generations: int = 4
    slots: int = 16
    max_tokens: int = 128
    temperature: float = 1.0
    history_epochs: int = 1  # epochs recorded into the history before the timed one

    def waves(self, workers: int) -> float:
        """Requests per worker over its slots: how many times its slots fill (at least 1)."""
        return self.prompts * self.num_generations / (max(workers, 1) * self.slots)


# The recorded run's prompts, token limit and temperature (docs/notebook/2026-11-27.md, "the repeat task's
# trace"), with 8 generations (the run had 4) for more requests per worker: 96 on 2 x 12 slots is 4 waves on
# each Ray worker, 8 on one worker. One epoch of history: three (`--real-history-epochs 3`, the timed epoch
# then sees each prompt a 4th time, as a training run's 4th epoch does) made histopipe's plan no better on a
# quiet seed-0 run and the bench 16.6 minutes long (docs/notebook/2026-11-28-b.md).
RECORDED = RealWorkload("repeat", prompts=12, num_generations=8, slots=12, max_tokens=192, temperature=0.6)


def real_workload(trace=None, real_data: str | None = None, ray_workers: int = 2, **given) -> RealWorkload:
    """The real runs' workload: `real_data` (a built-in task) if given, else "repeat" under `--trace rhyming`,
    else "arithmetic"; "repeat" with the recorded run's settings (`RECORDED`, its slots cut to keep
    `MIN_WAVES` waves on `ray_workers` workers), any other task with `RealWorkload`'s defaults. `given`:
    `RealWorkload` fields set by options (None: not given), which win over both. The prompts are the task's
    first ones for the bench's `--seed` (0, the default, gives the recorded run's, whose `run.seed` was 0)."""
    task = real_data or ("repeat" if str(trace) == RHYMING else "arithmetic")
    if task not in BUILTIN_TASKS:
        raise UserError(f"--real-data {task}: not a built-in task; choose one of {', '.join(BUILTIN_TASKS)}")
    unknown = set(given) - {f.name for f in fields(RealWorkload)}
    if unknown:
        raise TypeError(f"real_workload: unknown fields {sorted(unknown)}")
    base = RECORDED if task == "repeat" else RealWorkload(task)
    workload = replace(base, **{k: v for k, v in given.items() if v is not None})
    if task == "repeat" and given.get("slots") is None:
        per_worker = workload.prompts * workload.num_generations // max(ray_workers, 1)
        workload = replace(workload, slots=max(1, min(workload.slots, per_worker // MIN_WAVES)))
    return workload


def task_prompts(tokenizer, task: str, n: int, seed: int = 0) -> list[list[int]]:
    """Built-in `task`'s first `n` prompts, chat-encoded (as `rhymerl train` encodes them, same seed)."""
    from rhymerl.model.pretrained import chat_prompt_ids

    return [chat_prompt_ids(tokenizer, e.prompt) for e in builtin_examples(task, n, seed)]


def record_history(pool, groups, prompts: Sequence[Sequence[int]], num_generations: int, epochs: int,
                   temperature: float, max_tokens: int, seed: int) -> int:
    """Roll out `epochs` epochs of `groups(tag)` on `pool` and record them into its history (so that the timed
    epoch has predictions and drafts); epoch 1 samples with seed + 1000 under tag "e1" (what a single epoch
    always was), epoch k > 1 under tag "h<k>" with seed + 1000 + k (keyed draws: other responses). Returns
    the tokens recorded."""
    if epochs < 1:
        raise UserError(f"--real-history-epochs must be at least 1, got {epochs}")
    tokens = 0
    for k in range(1, epochs + 1):
        tag, key = ("e1", seed + 1000) if k == 1 else (f"h{k}", seed + 1000 + k)
        done = pool.rollout(groups(tag), SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=key))
        for i, p in enumerate(prompts):
            pool.record(p, [o.token_ids for o in done.outputs[i * num_generations:(i + 1) * num_generations]])
        tokens += sum(len(o.token_ids) for o in done.outputs)
    return tokens


def arithmetic_prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    """The built-in arithmetic task's first `n` prompts, chat-encoded (as `rhymerl bench spec`)."""
    return task_prompts(tokenizer, "arithmetic", n, seed)


def policy_and_prompts(model: str, prompts: Sequence[Sequence[int]] | None, num_prompts: int, seed: int,
                       device: str, task: str = "arithmetic"):
    """(fp32 policy, tokenizer, model directory, prompt ids) of the real runs: `prompts` given, no tokenizer
    is loaded (a tokenizer-less test model); else built-in `task`'s first `num_prompts`. Torch is
    imported here, not at the top: the simulation (part a) runs without it."""
    import torch

    from rhymerl.model.fetch import resolve_model_dir
    from rhymerl.model.pretrained import load_pretrained
    from rhymerl.model.weights import load_decoder

    if prompts is None:
        policy, tokenizer, model_dir = load_pretrained(model, "fp32", device)
        return policy, tokenizer, model_dir, task_prompts(tokenizer, task, num_prompts, seed)
    model_dir = resolve_model_dir(model)
    return load_decoder(model_dir, torch.float32, device), None, model_dir, [list(p) for p in prompts]


def run_real(model: str, prompts: Sequence[Sequence[int]] | None = None, *, num_prompts: int = 16,
             num_generations: int = 4, slots: int = 16, max_tokens: int = 128, temperature: float = 1.0,
             repeats: int = 3, seed: int = 0, dtype: str = "auto", device: str | None = None,
             speculative: str = "histospec", cost_model: CostModel | None = None, task: str = "arithmetic",
             history_epochs: int = 1) -> dict:
    """Part (b): one worker, FIFO vs longest-first admission on the same groups (see the module doc), after
    `history_epochs` epochs recorded.

    `model`: a built-in name or a model directory. `prompts`: token ids (then no tokenizer is loaded: a
    tokenizer-less test model); default built-in `task`'s first `num_prompts`. `cost_model`: HistoSpec's,
    measured by the first worker when None and reused by the second."""
    from rhymerl.history import HistoryStore
    from rhymerl.model.pretrained import default_device, resolve_dtype
    from rhymerl.rollout import LocalPool, RolloutGroup, RolloutWorker, WorkerConfig

    if repeats < 1:
        raise UserError(f"--repeats must be at least 1, got {repeats}")
    device = device or default_device()
    dtype = resolve_dtype(dtype, device)
    policy, tokenizer, _, prompts = policy_and_prompts(model, prompts, num_prompts, seed, device, task)
    max_len = max(map(len, prompts)) + max_tokens + 1
    history = HistoryStore()
    pools = {}
    for admission in ("fifo", "longest_first"):
        section = RolloutSection(num_slots=slots, dtype=dtype, speculative=speculative,
                                 max_draft_tokens=MAX_DRAFT_TOKENS, admission_order=admission)
        config = WorkerConfig(section, max_model_len=max_len)
        worker = RolloutWorker(policy, tokenizer, config, cost_model=cost_model)
        if speculative == "histospec" and cost_model is None:
            cost_model = worker.engine.cost_model  # measured once; the second worker reuses it
        pools[admission] = LocalPool(worker, history)

    def groups(tag: str) -> list:
        return [RolloutGroup(p, [f"{tag}-p{i}-g{g}" for g in range(num_generations)]) for i, p in enumerate(prompts)]

    # The history's epochs, so that longest-first has predictions (the two pools share one history).
    recorded = record_history(pools["fifo"], groups, prompts, num_generations, history_epochs, temperature,
                              max_tokens, seed)
    log(f"real: {history_epochs} epoch(s) recorded ({len(prompts)} prompts x {num_generations}, {recorded} tokens)")
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
            log(f"real: repeat {r + 1}/{repeats} {admission}: {seconds[admission][-1]:.2f} s")
    identical &= tokens["fifo"] == tokens["longest_first"]
    if not identical:
        log("real: WARNING: FIFO and longest-first generated different tokens")
    out = {mode: {"median_s": round(statistics.median(s), 3), "runs_s": [round(x, 3) for x in s]}
           for mode, s in seconds.items()}
    out["speedup"] = round(out["fifo"]["median_s"] / out["longest_first"]["median_s"], 3)
    out["identical"] = identical
    out.update({"model": str(model), "task": task, "dtype": dtype, "device": str(device), "prompts": len(prompts),
                "num_generations": num_generations, "slots": slots, "max_tokens": max_tokens,
                "temperature": temperature, "repeats": repeats, "speculative": speculative,
                "history_epochs": history_epochs, "tokens": sum(map(len, tokens["fifo"]))})
    return out


# (name, rollout.schedule, rollout.migration_rule or None: migration off). histopipe prices requests in
# predicted forwards replayed from the history (`histopipe.pricing`, `RayPool.pricing`); "histopipe_tokens" in tokens
RAY_VARIANTS = (("static", "static", None), ("least_loaded", "least_loaded", None),
                ("histopipe", "histopipe", None), ("histopipe_tokens", "histopipe", None),
                ("histopipe+migration", "histopipe", "half_busiest"), ("histopipe+tail", "histopipe", "tail"),
                ("histopipe+remaining+early", "histopipe", "remaining+early"))


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


def plan_text(plan: list, num_generations: int) -> str:  # one line: workers by " / ", a piece "g:n"
    return " / ".join(",".join(str(g) if len(idx) == num_generations else f"{g}:{len(idx)}" for g, idx in share)
                      for share in plan)


def run_ray(model: str, prompts: Sequence[Sequence[int]] | None = None, *, num_workers: int = 2,
            num_prompts: int = 16, num_generations: int = 4, slots: int = 16, max_tokens: int = 128,
            temperature: float = 1.0, repeats: int = 3, seed: int = 0, dtype: str = "auto",
            device: str | None = None, speculative: str = "histospec", cost_model: CostModel | None = None,
            variants: Sequence[tuple[str, str, str | None]] = RAY_VARIANTS, task: str = "arithmetic",
            tier2: bool = True, history_epochs: int = 1) -> dict:
    """Part (b), two Ray workers: every schedule (and histopipe with each migration rule) on the same groups
    (see the module doc); `tier2`: histopipe may split a long group (`rollout.tier2`). Arguments as
    `run_real`'s (`cost_model`: every worker's and the plan's; None: the first worker measures one); a Ray
    cluster is started unless this process is connected to one. A schedule's "plan": its first round's."""
    from rhymerl.history import HistoryStore
    from rhymerl.model.pretrained import default_device, resolve_dtype
    from rhymerl.rollout import RolloutGroup, WorkerConfig
    from rhymerl.rollout.factory import make_pool

    if repeats < 1:
        raise UserError(f"--repeats must be at least 1, got {repeats}")
    device = device or default_device()
    dtype = resolve_dtype(dtype, device)
    policy, tokenizer, model_dir, prompts = policy_and_prompts(model, prompts, num_prompts, seed, device, task)
    # schedule: the pool starts on histopipe (tier2 needs it); each variant below sets its own
    section = RolloutSection(backend="ray", num_workers=num_workers, num_slots=slots, dtype=dtype,
                             speculative=speculative, max_draft_tokens=MAX_DRAFT_TOKENS, schedule="histopipe",
                             tier2=tier2)
    config = WorkerConfig(section, max_model_len=max(map(len, prompts)) + max_tokens + 1)
    pool = make_pool(config, "", policy, tokenizer, model_dir, HistoryStore(), seed=seed, device=device,
                     cost_model=cost_model)
    try:
        def groups(tag: str) -> list:
            return [RolloutGroup(p, [f"{tag}-p{i}-g{g}" for g in range(num_generations)])
                    for i, p in enumerate(prompts)]

        # the history's epochs give histopipe its predictions
        record_history(pool, groups, prompts, num_generations, history_epochs, temperature, max_tokens, seed)
        log(f"real, {num_workers} Ray workers: {history_epochs} epoch(s) recorded")
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + 2000)
        runs: dict[str, list[dict]] = {name: [] for name, _, _ in variants}
        plans: dict[str, list] = {name: [] for name, _, _ in variants}  # each call's plan, as `split` made it
        reference, identical = None, True
        for r in range(repeats):
            for name, schedule, rule in variants[r % len(variants):] + variants[:r % len(variants)]:
                pool.schedule, pool.migration, pool.migration_rule = schedule, rule is not None, rule or "half_busiest"
                pool.pricing = "tokens" if name == "histopipe_tokens" else "replayed"  # replayed: from the history
                plan = pool.split(groups("e2"), num_workers, max_tokens)  # as the call plans it (deterministic)
                t0 = time.perf_counter()
                result = pool.rollout(groups("e2"), params)
                runs[name].append(call_figures(result, time.perf_counter() - t0))
                # tier 2: groups the plan cut into pieces on more than one worker
                runs[name][-1]["split_groups"] = sum(len({w for w, share in enumerate(plan) for h, _ in share
                                                          if h == g}) > 1 for g in range(len(prompts)))
                plans[name].append([[[g, list(idx)] for g, idx in share] for share in plan])
                got = [o.token_ids for o in result.outputs]
                reference = got if reference is None else reference
                identical &= got == reference
                log(f"real, {num_workers} Ray workers: repeat {r + 1}/{repeats} {name}: "
                    f"{runs[name][-1]['makespan_s']:.2f} s, {runs[name][-1]['migrations']} migrations; plan (groups "
                    f"per worker, g:n a piece) {plan_text(plans[name][-1], num_generations)}")
    finally:
        pool.close()
    if not identical:
        log("real: WARNING: the schedules generated different tokens")
    out = {}
    for name, rs in runs.items():
        out[name] = {key: statistics.median(x[key] for x in rs) for key in rs[0]}
        out[name]["runs_s"] = [x["makespan_s"] for x in rs]
        out[name]["spread_s"] = max(out[name]["runs_s"]) - min(out[name]["runs_s"])
        out[name]["plan"] = plans[name][0]  # per worker, [group, request indices] in admission order
        out[name]["plan_same_each_round"] = all(p == plans[name][0] for p in plans[name])
    for name in out:
        out[name]["speedup_vs_static"] = out["static"]["makespan_s"] / out[name]["makespan_s"] \
            if "static" in out else None
        out[name]["speedup_vs_least_loaded"] = out["least_loaded"]["makespan_s"] / out[name]["makespan_s"] \
            if "least_loaded" in out else None
    out = rounded(out)
    out.update({"identical": identical, "workers": num_workers, "model": str(model), "task": task, "dtype": dtype,
                "device": str(device), "prompts": len(prompts), "num_generations": num_generations, "slots": slots,
                "max_tokens": max_tokens, "temperature": temperature, "repeats": repeats,
                "speculative": speculative, "tier2": tier2, "history_epochs": history_epochs,
                "tokens": sum(map(len, reference))})
    return out
