"""Notebook 2026-11-27-e-plan: per-prompt tokens per forward of epoch 1 across runs, the credibility weight K
they give, and histopipe's plan on them with K = 0 (the old pricing) and K = 120 (PRIOR_FORWARDS).

    PYTHONPATH=src python docs/notebook/data/2026-11-27-e-plan-rates.py docs/notebook/data/2026-11-27-e-plan-per-worker.jsonl
"""
import json
import statistics
import sys
from types import SimpleNamespace

from rhymerl.cost_model import CostModel
from rhymerl.histopipe.batching import worker_time
from rhymerl.histopipe.plan import plan_pieces
from rhymerl.histopipe.pricing import FlatStepCost, TokensPerForward

SLOTS, N, P = 12, 8, 12
FLAT = [0.0] + [1.0] * SLOTS
runs: dict[str, list[dict]] = {}
for line in open(sys.argv[1]):
    d = json.loads(line)
    runs.setdefault(d["run"], []).append(d)


def rates(reqs):
    t, f = [0] * P, [0] * P
    for r in reqs:
        if r["fwd"] > 0 and r["len"]:
            t[r["p"]] += r["len"]
            f[r["p"]] += r["fwd"]
    return [max(1.0, a / b) for a, b in zip(t, f)], f


e1 = {name: rates(rs[0]["epoch1"]) for name, rs in runs.items()}
print("prompt | " + " | ".join(f"{n} ({runs[n][0]['commit']})" for n in runs) + " | sd")
for p in range(P):
    xs = [e1[n][0][p] for n in runs]
    print(p, " | ".join(f"{x:.2f}" for x in xs), f"| {statistics.stdev(xs):.2f}")
F = [statistics.mean(e1[n][1][p] for n in runs) for p in range(P)]
R = [[e1[n][0][p] for n in runs] for p in range(P)]
within = statistics.mean(statistics.variance(r) for r in R)
between = statistics.variance([statistics.mean(r) for r in R]) - within / len(runs)
unit = statistics.mean(statistics.variance(R[p]) * F[p] for p in range(P))
print(f"run-to-run variance {within:.3f}, prompts' true-rate variance {between:.3f}, K = {unit / between:.0f} forwards")

cost = FlatStepCost(CostModel([1, 64], [1, 2], [[0.010, 0.011], [0.030, 0.050]]), SLOTS)
for name, rs in runs.items():
    pred = rs[1]["predicted"]
    outs = [SimpleNamespace(prompt_ids=[q["p"]], token_ids=[0] * q["len"], forwards=q["fwd"]) for q in rs[0]["epoch1"]]
    for k in (0.0, 120.0):
        tpf = TokensPerForward(prior_forwards=k)
        tpf.observe(outs)
        fw = [tpf.forwards([g], p) for g, p in enumerate(pred)]
        plan = plan_pieces([N] * P, 2, "histopipe", fw, cost, slots=SLOTS, tier2=True)
        pf = [round(worker_time([fw[g][i] for g, idx in s for i in idx], SLOTS, FLAT)) for s in plan]
        print(f"{name} K={k:g}: {' / '.join(','.join(str(g) for g, _ in s) for s in plan)}, predicted forwards {pf}")
