"""Notebook 2026-11-27-f-realplan: the replayed rates (`histopipe.pricing.ReplayedRates`) on epoch 1's recorded
tokens beside the rates the calls ran at, and whether they rank the prompts as epoch 2 drafted them.

    PYTHONPATH=src python docs/notebook/data/2026-11-27-f-realplan-rates.py docs/notebook/data/2026-11-27-f-realplan-identity.jsonl \
        docs/notebook/data/2026-11-27-e-plan-per-worker.jsonl docs/notebook/data/2026-11-27-pipe-cost-zen4.json

The identity file: `scripts/pipe_plan_identity.py --out`'s objects, one a run (epoch 1's responses, the same tokens in every
run); the jsonl: notebook 2026-11-27-e-plan's per-worker runs (epoch 2's forwards per request, 10 calls).
"""
import json
import statistics
import sys

from rhymerl.bench.pipe_bench import load_cost_model
from rhymerl.histopipe.pricing import ReplayedRates
from rhymerl.histopipe.replay import draftable_runs, replay_walk
from rhymerl.history import HistoryStore


def spearman(a, b):
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        for k, i in enumerate(order):
            r[i] = k
        return r
    ra, rb = ranks(a), ranks(b)
    return statistics.correlation(ra, rb)


ident = json.loads(open(sys.argv[1]).readline())  # the first run: it holds the responses
cost = load_cost_model(sys.argv[3])
prompts = [[i] for i in range(len(ident["epoch1_responses"]))]  # stand-in ids: the rates read tokens only
history = HistoryStore()
for p, rs in zip(prompts, ident["epoch1_responses"]):
    history.record_rollout(p, rs)
replayed = ReplayedRates(32).rates(history, prompts, cost, ident["slots"])
print("replayed (zen4 cost, 12 slots):", [round(r, 2) for r in replayed])
for k in (1, 2, 4, 8, 32):  # the rate at a fixed draft length
    rates = []
    for rs in ident["epoch1_responses"]:
        runs = draftable_runs([0], rs, 32)
        walks = [replay_walk(r, k) for r in runs]
        rates.append(sum(map(len, rs)) / sum(f for f, _ in walks))
    print(f"replayed at k={k}:", [round(r, 2) for r in rates])
e2 = {}
for line in open(sys.argv[2]):
    d = json.loads(line)
    if "requests" in d:
        t, f = [0] * 12, [0] * 12
        for q in d["requests"]:
            t[q["p"]] += q["len"]
            f[q["p"]] += q["fwd"]
        e2[(d["run"], d["schedule"])] = [a / b for a, b in zip(t, f)]
mean2 = [statistics.mean(v[p] for v in e2.values()) for p in range(12)]
print("epoch 2, mean of", len(e2), "calls:", [round(r, 2) for r in mean2])
print("measured epoch 1 (this run):", ident["epoch1_tokens_per_forward"])
print("spearman replayed vs epoch-2 mean:", round(spearman(replayed, mean2), 3))
print("spearman this run's epoch-1 measured vs epoch-2 mean:", round(spearman(ident["epoch1_tokens_per_forward"], mean2), 3))
for (run, sched), v in e2.items():
    print(f"  spearman replayed vs {run}/{sched}: {spearman(replayed, v):.3f}")
rr = ReplayedRates(32)
runs = [draftable_runs(p, rs, 32) for p, rs in zip(prompts, ident["epoch1_responses"])]
for slots in (1, 4, 12):
    print(f"the call's draft length at {slots} slots: k = {rr.draft_length(runs, cost, slots)}")

# Each plan's makespan in forwards against epoch 2's forwards per request in each of the ten calls (flat step,
# 12 slots; a piece "g:n" of a split group takes its first n requests): what the plan would have given had
# the requests drafted as they did in that call.
from rhymerl.histopipe.batching import worker_time  # noqa: E402

draws = []
for line in open(sys.argv[2]):
    d = json.loads(line)
    if "requests" in d:
        draws.append([q["fwd"] for q in d["requests"]])


def parse(text):
    out = []
    for share in text.split(" / "):
        out.append([(int(x.split(":")[0]), int(x.split(":")[1]) if ":" in x else 8) for x in share.split(",") if x])
    return out


plans = {"static": "0,1,2,3,4,5 / 6,7,8,9,10,11", "least_loaded": "0,2,4,6,8,10 / 1,3,5,7,9,11",
         "histopipe (replayed)": ident["plan_forwards"], "histopipe (measured, this run)": ident["plan_measured"]}
for line in open(sys.argv[2]):
    d = json.loads(line)
    if d.get("schedule") == "histopipe" and d.get("round", 0) == 0:
        plans[f"histopipe (measured, {d['run']})"] = " / ".join(",".join(str(g) if len(idx) == 8 else f"{g}:{len(idx)}"
                                                                         for g, idx in share) for share in d["plan"])
flat = [0.0] + [1.0] * 12
for name, text in plans.items():
    spans = [max(worker_time([fw[g * 8 + i] for g, n in share for i in range(n)], 12, flat) for share in parse(text))
             for fw in draws]
    print(f"{name}: {text}: mean makespan {statistics.mean(spans):.1f} forwards over {len(draws)} calls")
