"""Notebook 2026-11-28-replay: the replayed rates (`histopipe.pricing.ReplayedRates`, the code on PYTHONPATH)
on epoch 1's recorded tokens beside what epoch 2 ran (`scripts/pipe_per_worker.py`'s calls), per prompt and
per worker, and the plans each pricing makes.

    PYTHONPATH=src python docs/notebook/data/2026-11-28-replay-rates.py PER_WORKER.jsonl [...] --cost COST.json \
        [--rates-out FILE] [--old-rates FILE]

PER_WORKER.jsonl: `scripts/pipe_per_worker.py`'s output (its first line holds epoch 1's responses; then one line
a schedule). `--rates-out`: write this code's forward rates (run once at the old commit's src to get the old
replay's); `--old-rates`: read them back to set them beside the new. Timing-free figures: rates, plans,
predicted forwards and steps; the measured figures are the calls' (forwards: counts; busy seconds: loaded).
"""
import argparse
import json
import math
import statistics

from transformers import AutoTokenizer

from rhymerl.bench.pipe_real import RECORDED, task_prompts
from rhymerl.cost_model import CostModel
from rhymerl.histopipe.batching import worker_time
from rhymerl.histopipe.plan import plan_pieces
from rhymerl.histopipe.predict import LengthPredictor
from rhymerl.histopipe.pricing import ReplayedRates, speculative_step_cost
from rhymerl.history import HistoryStore
from rhymerl.model.fetch import resolve_model_dir

ap = argparse.ArgumentParser()
ap.add_argument("per_worker", nargs="+")
ap.add_argument("--cost", required=True)
ap.add_argument("--rates-out")
ap.add_argument("--old-rates")
args = ap.parse_args()


def spearman(a, b):
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        for k, i in enumerate(order):
            r[i] = k
        return r
    return statistics.correlation(ranks(a), ranks(b))


files = [[json.loads(x) for x in open(f)] for f in args.per_worker]
head = files[0][0]  # epoch 1's responses: the same tokens in every run (keyed draws)
assert all(f[0]["epoch1_responses"] == head["epoch1_responses"] for f in files)
calls = [dict(d, file=i) for i, f in enumerate(files) for d in f if "workers" in d]
cost = CostModel.from_dict(json.load(open(args.cost)))
slots, n, cap = head["slots"], RECORDED.num_generations, RECORDED.max_tokens
prompts = task_prompts(AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m")), RECORDED.task,
                       RECORDED.prompts, 0)
history = HistoryStore()
for p, rs in zip(prompts, head["epoch1_responses"]):
    history.record_rollout(p, rs)
try:  # the replay before 2026-11-28 had no unit: tokens per forward
    fwd_rates = ReplayedRates(32, unit="forwards").rates(history, prompts, cost, slots)
except TypeError:
    fwd_rates = ReplayedRates(32).rates(history, prompts, cost, slots)
if args.rates_out:
    json.dump(fwd_rates, open(args.rates_out, "w"))
    print("forward rates:", [round(r, 2) for r in fwd_rates])
    raise SystemExit
step_rates = ReplayedRates(32, unit="steps").rates(history, prompts, cost, slots)
old_rates = json.load(open(args.old_rates)) if args.old_rates else None

# What epoch 2 ran, per prompt: tokens per forward, and tokens per plain-step unit (a request's forwards at its
# mean draft width, `CostModel.step` for a full batch drafting that wide, over a plain step's)
plain = cost.step(slots, slots)


def units(fwd, drafted):
    c = drafted / max(fwd, 1)
    return fwd * cost.step(slots, slots, round(c * slots), round(c)) / plain


meas_f, meas_u = [], []
for d in calls:
    t, f, u = [0] * 12, [0] * 12, [0.0] * 12
    for q in d["requests"]:
        t[q["p"]] += q["len"]
        f[q["p"]] += q["fwd"]
        u[q["p"]] += units(q["fwd"], q["drafted"])
    meas_f.append([a / b for a, b in zip(t, f)])
    meas_u.append([a / b for a, b in zip(t, u)])
mf = [statistics.mean(c[p] for c in meas_f) for p in range(12)]
mu = [statistics.mean(c[p] for c in meas_u) for p in range(12)]
print("prompt | old replay t/fwd | new replay t/fwd | epoch 2 t/fwd (mean of %d calls) | new replay t/step | epoch 2 t/step"
      % len(calls))
for p in range(12):
    print(f"{p} | {old_rates[p] if old_rates else float('nan'):.2f} | {fwd_rates[p]:.2f} | {mf[p]:.2f} "
          f"({min(c[p] for c in meas_f):.2f}-{max(c[p] for c in meas_f):.2f}) | {step_rates[p]:.2f} | {mu[p]:.2f}")
if old_rates:
    print("spearman old replay vs epoch 2 t/fwd: %.3f" % spearman(old_rates, mf))
print("spearman new replay vs epoch 2 t/fwd: %.3f" % spearman(fwd_rates, mf))
print("spearman new replay t/step vs epoch 2 t/step: %.3f" % spearman(step_rates, mu))
for name, r in (("old", old_rates), ("new", fwd_rates)):
    if r:
        print(f"mean |log(replayed / epoch 2)| t/fwd, {name}: "
              f"{statistics.mean(abs(math.log(a / b)) for a, b in zip(r, mf)):.3f}")

# The plans: each pricing's as `RayPool.split` makes it; per worker, predicted forwards and steps vs epoch 2's
predictor = LengthPredictor.from_history(history, prompts, cap=cap)
predicted = [predictor.predict_group(p, n) for p in prompts]
flat = speculative_step_cost(cost, slots, True)


def plan(rates):
    return plan_pieces([n] * 12, 2, "histopipe", [[x / r for x in g] for g, r in zip(predicted, rates)], flat,
                       slots=slots, tier2=True)


def text(pl):
    return " / ".join(",".join(str(g) if len(idx) == n else f"{g}:{len(idx)}" for g, idx in share) for share in pl)


plans = {"static": [[(g, list(range(n))) for g in range(6)], [(g, list(range(n))) for g in range(6, 12)]],
         "least_loaded": [[(g, list(range(n))) for g in range(0, 12, 2)], [(g, list(range(n))) for g in range(1, 12, 2)]],
         "histopipe, new replay, forwards": plan(fwd_rates), "histopipe, new replay, steps": plan(step_rates)}
if old_rates:
    plans["histopipe, old replay (the run's)"] = plan(old_rates)


def model_s(wk):  # a worker's steps priced by the cost model at their mean rows and tokens (timing-free)
    f = max(wk["forwards"], 1)
    return f * cost(wk["tokens_forwarded"] / f, wk["seq_steps"] / f)


print("\nper call and worker: forwards, busy s, cost-model s (forwards at their mean width), drafted")
for d in calls:
    print(f"  run {d['file']} {d['schedule']}: makespan {d['makespan_s']} s; " + "; ".join(
        f"w{w['worker']} {w['forwards']} fwd, {w['busy_s']} s busy, {model_s(w):.1f} model s, {w['drafted']} drafted"
        for w in d["workers"]))
ratios = [[w1 / w0 for w0, w1 in (x for x in [[model_s(w) for w in d["workers"]], [w["forwards"] for w in d["workers"]],
                                                [w["busy_s"] for w in d["workers"]]])] for d in calls]
for name, i in (("cost-model s", 0), ("forwards", 1)):
    err = statistics.mean(abs(math.log(r[i] / r[2])) for r in ratios)
    print(f"worker 1 / worker 0 in {name} against in busy s, per call: "
          + ", ".join(f"{r[i]:.2f}/{r[2]:.2f}" for r in ratios) + f"; mean |log| {err:.3f}")
one = [0.0] + [1.0] * slots
for name, pl in plans.items():
    print(f"\n{name}: {text(pl)}")
    for w, share in enumerate(pl):
        reqs = [(g, i) for g, idx in share for i in idx]
        pf = worker_time([predicted[g][i] / fwd_rates[g] for g, i in reqs], slots, one)
        pu = worker_time([predicted[g][i] / step_rates[g] for g, i in reqs], slots, one)
        # epoch 2's per-request forwards and units in each call, run through the same model (flat step)
        mfw = statistics.mean(worker_time([d["requests"][g * n + i]["fwd"] for g, i in reqs], slots, one) for d in calls)
        muw = statistics.mean(worker_time([units(d["requests"][g * n + i]["fwd"], d["requests"][g * n + i]["drafted"])
                                           for g, i in reqs], slots, one) for d in calls)
        line = (f"  worker {w}: predicted {pf:.0f} forwards, {pu:.0f} steps (new replay) | epoch 2 per request "
                f"through the model, mean of calls: {mfw:.0f} forwards, {muw:.0f} steps")
        for run in calls:
            if run["plan"] == [[[g, list(idx)] for g, idx in sh] for sh in pl]:
                wk = run["workers"][w]
                line += f" | ran (run {run['file']}): {wk['forwards']} fwd, {wk['busy_s']} s, {model_s(wk):.1f} model s"
        print(line)
