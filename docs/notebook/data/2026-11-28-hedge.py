"""Hedge experiments for issue 32 at 1,024 workers (notebook 2026-11-28-hedge): histopipe's plan with every
group cut into pieces of at most m members (spread), and/or a shuffled admission order per worker, under
half_busiest / remaining+early migration. Usage: [RULES=half_busiest,...] PYTHONPATH=src python THIS SEED WORKERS [VARIANTS...]
(VARIANT: base, spreadM, static, each optionally with :shuffle)"""
import json, os, random, sys, time

from rhymerl.bench.pipe_bench import context_cost, load_cost_model
from rhymerl.bench.pipe_rhyming import rhyming_steps
from rhymerl.bench.pipe_sim import figures
from rhymerl.histopipe.batching import ContextCost
from rhymerl.histopipe.fleet import simulate_fleet
from rhymerl.histopipe.plan import plan_pieces
from rhymerl.histopipe.simulate import run_plan
from rhymerl.histopipe.workload import Rhyming

COST = "docs/notebook/data/2026-11-27-pipe-cost-zen4.json"
seed, w = int(sys.argv[1]), int(sys.argv[2])
variants = sys.argv[3:] or ["base"]
cm = load_cost_model(COST)
pk, pp, _ = context_cost("auto", COST, "smollm2-135m", "fp32", None, 32)
cost = ContextCost(cm, pk, pp)
steps, info, live = rhyming_steps(Rhyming(), w, 32, seed, 0)
keys, lengths, predicted, _ = steps[0]
sizes = [len(g) for g in lengths]


def fig(tl):
    return figures(tl, lengths, 32, cost)


t0 = time.perf_counter()
oracle = fig(run_plan(lengths, plan_pieces(sizes, w, "oracle", predicted, cost, slots=32, true_lengths=lengths),
                      slots=32, cost_model=cost))
out = {"seed": seed, "workers": w, "oracle_over_lb": oracle["makespan_over_lb"]}


def rules(name, plan):
    for rule in [None] + os.environ.get("RULES", "half_busiest,remaining+early").split(","):
        live.clear_observed()
        if rule is None:
            f = fig(run_plan(lengths, plan, slots=32, cost_model=cost))
        else:
            tl, _ = simulate_fleet(lengths, plan, slots=32, cost_model=cost, predicted=predicted, migration=rule,
                                   predictor=live, keys=keys)
            f = fig(tl)
        out[f"{name}+{rule}" if rule else name] = [round(f["makespan_over_lb"], 4),
                                                   round(oracle["makespan_s"] / f["makespan_s"], 4)]
        print(f"{w} seed {seed} {name}+{rule}: {f['makespan_over_lb']:.3f} x lb, "
              f"{oracle['makespan_s'] / f['makespan_s']:.3f} of oracle ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr, flush=True)


def shuffled(plan, s):
    out = []
    for k, ws in enumerate(plan):
        ws = list(ws)
        random.Random(s * 100003 + k).shuffle(ws)
        out.append(ws)
    return out


for v in variants:
    if v == "static":
        rules("static", plan_pieces(sizes, w, "static"))
        continue
    name, _, order = v.partition(":")
    spread = int(name[6:]) if name.startswith("spread") else None
    kw = {"spread": spread} if spread else {}
    plan = plan_pieces(sizes, w, "histopipe", predicted, cost, slots=32, **kw)
    if order == "shuffle":
        plan = shuffled(plan, seed)
    rules(v, plan)
print(json.dumps(out))
