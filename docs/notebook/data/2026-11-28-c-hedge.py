"""Scratch driver of notebook 2026-11-28-c-hedge (not library code): issue 32's sync step on the rhyming
workload, a plan and a per-worker admission order, then `fleet.simulate_fleet` with a migration rule.

    PYTHONPATH=src python docs/notebook/data/2026-11-28-c-hedge.py WORKERS SEED PLAN/ORDER[,PLAN/ORDER...] \
        [RULES] [TRACE]

RULES: comma-separated `fleet` rules (default half_busiest). TRACE: print the last TRACE requests to finish,
each with its starts and moves (from a copy of fleet.py with two log lines added at run time).
HEDGE_CACHE=DIR keeps each (workers, seed)'s steps and plans there (a 1,024-worker load takes ~25 s).

PLAN: hp (histopipe, tier 2: `plan_pieces` as `bench pipe` runs it), st (static), orc (oracle),
  split<k>:<theta> (tier 2, then groups predicted < theta cut into pieces of k), eq (hp with each worker's
  request count capped at the mean), hy<theta> (groups predicted >= theta by hp's LPT, the rest to the fewest
  requests), res<r>:<share> (LPT with r of the workers filled to share), psf (LPT priced under shortest-first
  admission), stt2 (static, tier 2's cut groups to the fewest requests), mix<s> (hp on sqrt E[L^2] under
  (1 - s) own + s prior).
ORDER (each worker's pieces): plan (as planned: longest predicted first for hp), sf (shortest predicted
  first, by the piece's longest predicted member), sfpt (by the group's point prediction, what
  `RolloutWorker.admission_order` reads), crit<theta> (pieces predicted >= theta first, longest first, then
  shortest first), cf<theta> (those first, then arrival order), shuf (seeded random), tlf (true longest first,
  per request), tlfg (per piece by its true longest), lfshift (longest predicted first, the shifted-up groups
  keyed by their true longest).
"""

import heapq
import inspect
import json
import math
import os
import pickle
import random
import sys
import types
from statistics import NormalDist

from rhymerl.bench.pipe_rhyming import rhyming_steps
from rhymerl.cost_model import CostModel
from rhymerl.histopipe import fleet
from rhymerl.histopipe.batching import ContextCost, decode_costs, per_key_cost, worker_time
from rhymerl.histopipe.metrics import summary
from rhymerl.histopipe.pieces import split_groups
from rhymerl.histopipe.plan import _rounds, balance_makespan, improve, plan_pieces
from rhymerl.histopipe.simulate import run_plan
from rhymerl.histopipe.workload import Rhyming

COST = "docs/notebook/data/2026-11-27-pipe-cost-zen4.json"
d = json.load(open(COST))
cm = ContextCost(CostModel.from_dict(d), d["per_key_s"], d["prefill_per_pair_s"])
slots = 32
SC, PK = decode_costs(cm, slots), per_key_cost(cm)


def cost(n):  # a request's decode seconds at a full batch's per-token share, its own attention included
    return n * SC[slots] / slots + PK * n * (n + 1) / 2


def cached(name, make):
    cache = os.environ.get("HEDGE_CACHE")
    path = os.path.join(cache, name + ".pkl") if cache else None
    if path and os.path.exists(path):
        return pickle.load(open(path, "rb"))
    value = make()
    if path:
        pickle.dump(value, open(path, "wb"))
    return value


def load(W, seed):
    def make():
        steps, _, live = rhyming_steps(Rhyming(), W, slots, seed, 1)
        keys, lengths, predicted, point = steps[0]
        sizes = [len(g) for g in lengths]
        return dict(keys=keys, lengths=lengths, predicted=predicted, point=point, live=live,
                    hp=plan_pieces(sizes, W, "histopipe", predicted, cm, slots=slots),
                    orc=plan_pieces(sizes, W, "oracle", predicted, cm, slots=slots, true_lengths=lengths),
                    st=plan_pieces(sizes, W, "static", predicted, cm, slots=slots))
    return cached(f"steps_{W}_{seed}", make)


# ---------------------------------------------------------------- plans

def tier2_pieces(D, W):
    lengths = D["predicted"]
    pieces = split_groups(lengths, W, slots, cm, 0.8)
    return pieces, [[lengths[g][i] for i in idx] for g, idx in pieces]


def place(pieces, pl, W):
    asg = balance_makespan(pl, W, slots, SC, _rounds(None, W), PK)
    return [[pieces[p] for p in ws] for ws in asg]


def plan_split(D, W, k, theta):
    lengths = D["predicted"]
    out = []
    for g, idx in tier2_pieces(D, W)[0]:
        ls = lengths[g]
        if len(idx) == len(ls) and max(ls) < theta and k < len(ls):
            n = math.ceil(len(ls) / k)
            order = sorted(idx, key=lambda i: (-ls[i], i))
            out += [(g, tuple(sorted(order[j::n]))) for j in range(n)]
        else:
            out.append((g, idx))
    return place(out, [[lengths[g][i] for i in idx] for g, idx in out], W)


def plan_eq(D, W):
    pieces, pl = tier2_pieces(D, W)
    cap = math.ceil(sum(map(len, pl)) / W)
    rank = sorted(range(len(pl)), key=lambda p: (-max(pl[p]), -sum(pl[p]), p))
    position = {p: i for i, p in enumerate(rank)}
    workers, count = [[] for _ in range(W)], [0] * W

    def finish(ps):
        if sum(len(pl[p]) for p in ps) > cap:
            return math.inf
        return worker_time([n for p in ps for n in pl[p]], slots, SC, PK)

    heap = [(0.0, w) for w in range(W)]
    for p in rank:
        skipped = []
        while True:
            if not heap:  # nothing fits: the fewest requests
                skipped.sort(key=lambda s: (count[s[1]], s[0]))
                t, w = skipped.pop(0)
                break
            t, w = heapq.heappop(heap)
            if count[w] + len(pl[p]) <= cap:
                break
            skipped.append((t, w))
        workers[w].append(p)
        count[w] += len(pl[p])
        heapq.heappush(heap, (worker_time([n for q in workers[w] for n in pl[q]], slots, SC, PK), w))
        for s in skipped:
            heapq.heappush(heap, s)
    improve(workers, finish, position, _rounds(None, W))
    return [[pieces[p] for p in ws] for ws in workers]


def fill_fewest(out, groups, lengths, W):
    count = [sum(len(i) for _, i in ps) for ps in out]
    heap = [(count[w], w) for w in range(W)]
    heapq.heapify(heap)
    for g, idx in groups:
        _, w = heapq.heappop(heap)
        out[w].append((g, idx))
        count[w] += len(idx)
        heapq.heappush(heap, (count[w], w))
    return out


def plan_hybrid(D, W, theta):
    lengths = D["predicted"]
    crit = [g for g in range(len(lengths)) if max(lengths[g]) >= theta]
    sub = [lengths[g] for g in crit]
    pieces = split_groups(sub, W, slots, cm, 0.8)
    placed = place(pieces, [[sub[g][i] for i in idx] for g, idx in pieces], W)
    out = [[(crit[g], idx) for g, idx in ps] for ps in placed]
    cs = set(crit)
    return fill_fewest(out, [(g, tuple(range(len(lengths[g])))) for g in range(len(lengths)) if g not in cs],
                       lengths, W)


def plan_reserve(D, W, r, share):
    pieces, pl = tier2_pieces(D, W)
    rank = sorted(range(len(pl)), key=lambda p: (-max(pl[p]), -sum(pl[p]), p))
    nres = round(r * W)
    capw = [1.0] * (W - nres) + [share] * nres
    workers = [[] for _ in range(W)]
    heap = [(0.0, w) for w in range(W)]
    for p in rank:
        _, w = heapq.heappop(heap)
        workers[w].append(p)
        heapq.heappush(heap, (worker_time([n for q in workers[w] for n in pl[q]], slots, SC, PK) / capw[w], w))
    return [[pieces[p] for p in ws] for ws in workers]


def plan_sforder(D, W):
    pieces, pl = tier2_pieces(D, W)
    rank = sorted(range(len(pl)), key=lambda p: (-max(pl[p]), -sum(pl[p]), p))
    position = {p: len(rank) - i for i, p in enumerate(rank)}  # lists shortest first

    def finish(ps):
        return worker_time([n for p in ps for n in pl[p]], slots, SC, PK)

    workers = [[] for _ in range(W)]
    heap = [(0.0, w) for w in range(W)]
    for p in rank:
        _, w = heapq.heappop(heap)
        workers[w].insert(0, p)
        heapq.heappush(heap, (finish(workers[w]), w))
    improve(workers, finish, position, _rounds(None, W))
    return [[pieces[p] for p in ws] for ws in workers]


def plan_st_tier2(D, W):
    lengths = D["predicted"]
    pieces = tier2_pieces(D, W)[0]
    cut = {g for g, idx in pieces if len(idx) < len(lengths[g])}
    out = [[(g, idx) for g, idx in ws if g not in cut] for ws in D["st"]]
    return fill_fewest(out, sorted([p for p in pieces if p[0] in cut],
                                   key=lambda p: -max(lengths[p[0]][i] for i in p[1])), lengths, W)


def plan_mixture(D, W, s):
    mu, sig = D["live"]._lognormal()[2]  # the prior: a prompt without history
    nd, n = NormalDist(mu, sig), 2000
    e2 = sum(min(math.exp(nd.inv_cdf((k + 0.5) / n)), 16384) ** 2 for k in range(n)) / n
    mixed = [[math.sqrt((1 - s) * x * x + s * e2) for x in ps] for ps in D["predicted"]]
    return plan_pieces([len(g) for g in D["lengths"]], W, "histopipe", mixed, cm, slots=slots)


def get_plan(D, W, seed, name):
    if name in ("hp", "st", "orc"):
        return D[name]
    if name.startswith("split"):
        k, theta = name[5:].split(":")
        return cached(f"plan_{W}_{seed}_{name}", lambda: plan_split(D, W, int(k), float(theta)))
    makers = {"eq": lambda: plan_eq(D, W), "psf": lambda: plan_sforder(D, W), "stt2": lambda: plan_st_tier2(D, W)}
    if name in makers:
        return cached(f"plan_{W}_{seed}_{name}", makers[name])
    if name.startswith("hy"):
        return plan_hybrid(D, W, float(name[2:]))
    if name.startswith("res"):
        r, share = name[3:].split(":")
        return cached(f"plan_{W}_{seed}_{name}", lambda: plan_reserve(D, W, float(r), float(share)))
    if name.startswith("mix"):
        return cached(f"plan_{W}_{seed}_{name}", lambda: plan_mixture(D, W, float(name[3:])))
    raise ValueError(f"unknown plan {name!r}")


# ---------------------------------------------------------------- admission orders

def pmax(D, piece):
    g, idx = piece
    return max(D["predicted"][g][i] for i in idx)


def singles(ps):
    return [(g, (i,)) for g, idx in ps for i in idx]


def order(D, P, v):
    if v == "plan":
        return P
    if v == "sf":
        return [sorted(ps, key=lambda p: pmax(D, p)) for ps in P]
    if v == "sfpt":
        return [sorted(ps, key=lambda p: D["point"][p[0]]) for ps in P]
    if v == "shuf":
        rng = random.Random(0)
        return [rng.sample(ps, len(ps)) for ps in P]
    if v.startswith("crit") or v.startswith("cf"):
        theta = float(v[4:] if v.startswith("crit") else v[2:])
        out = []
        for ps in P:
            first = sorted([p for p in ps if pmax(D, p) >= theta], key=lambda p: -pmax(D, p))
            rest = [p for p in ps if pmax(D, p) < theta]
            out.append(first + (sorted(rest, key=lambda p: pmax(D, p)) if v.startswith("crit") else rest))
        return out
    if v == "tlf":
        return [sorted(singles(ps), key=lambda p: -D["lengths"][p[0]][p[1][0]]) for ps in P]
    if v == "tlfg":
        return [sorted(ps, key=lambda p: -max(D["lengths"][p[0]][i] for i in p[1])) for ps in P]
    if v == "lfshift":
        def key(p):
            ls = D["lengths"][p[0]]
            shifted = sum(ls) / len(ls) > 2 * D["point"][p[0]]
            return -max(ls[i] for i in p[1]) if shifted else -pmax(D, p)
        return [sorted(ps, key=key) for ps in P]
    raise ValueError(f"unknown order {v!r}")


# ---------------------------------------------------------------- runs

def traced_fleet():
    """fleet.simulate_fleet from a copy of its source with a log of each admission and move."""
    src = inspect.getsource(fleet)
    src = src.replace("            r = wk.queue.popleft()\n",
                      "            r = wk.queue.popleft()\n            LOG.append(('start', reqs[r], w, wk.clock))\n")
    src = src.replace("        for r in rs:\n            if r in s.admitted:",
                      "        for r in rs:\n            LOG.append(('move', reqs[r], src, dst, now, "
                      "(s.step - s.admitted[r]) if r in s.admitted else 0))\n            if r in s.admitted:")
    mod = types.ModuleType("fleet_traced")
    mod.LOG = []
    exec(compile(src, "fleet_traced", "exec"), mod.__dict__)
    return mod


def run(D, assignment, rule, label, trace=0):
    lengths, predicted, live, keys = D["lengths"], D["predicted"], D["live"], D["keys"]
    per_req = [p if isinstance(p, list) else [p] * len(g) for p, g in zip(predicted, lengths)]
    live.clear_observed()
    sim = traced_fleet() if trace else fleet
    if rule == "none":
        tl, moved = run_plan(lengths, assignment, slots=slots, cost_model=cm), 0
    else:
        tl, moved = sim.simulate_fleet(lengths, assignment, slots=slots, cost_model=cm, predicted=per_req,
                                       migration=rule, predictor=live, keys=keys)
    s = summary(tl, lengths, slots, cm)
    print(f"{label} {rule}: makespan/lb {s['makespan_over_lb']:.4f} moved {moved}", flush=True)
    if trace:
        lb, events = s["lower_bound"], {}
        for e in sim.LOG:
            events.setdefault(e[1], []).append(e)
        last = sorted(((f, g, i) for g, fs in enumerate(tl.finish) for i, f in enumerate(fs)), reverse=True)
        for f, g, i in last[:trace]:
            print(f"   finish {f / lb:.3f} L {lengths[g][i]} predicted {per_req[g][i]:.0f} (group point "
                  f"{D['point'][g]:.0f}; group {sorted(lengths[g])})")
            for e in events.get((g, i), []):
                print(f"      start w{e[2]} at {e[3] / lb:.3f}" if e[0] == "start" else
                      f"      moved w{e[2]}->w{e[3]} at {e[4] / lb:.3f} holding {e[5]:.0f} tokens")
    return s["makespan_over_lb"]


if __name__ == "__main__":
    W, seed = int(sys.argv[1]), int(sys.argv[2])
    rules = sys.argv[4].split(",") if len(sys.argv) > 4 else ["half_busiest"]
    trace = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    D = load(W, seed)
    for spec in sys.argv[3].split(","):
        plan_name, order_name = spec.split("/")
        assignment = order(D, get_plan(D, W, seed, plan_name), order_name)
        for rule in rules:
            run(D, assignment, rule, f"W{W} s{seed} {spec}", trace)
