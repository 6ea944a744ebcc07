"""Plain-decoding simulation of bench pipe's real workload on its recorded lengths (2026-11-28-b-repeat-lengths.json):
one worker FIFO vs longest-first, two workers split by static / least_loaded / LPT on history statistics.
Step time: the saved Zen 4 cost model's one-token row. Run from the repository root."""
import json, statistics
L = json.load(open("docs/notebook/data/2026-11-28-b-repeat-lengths.json"))
cm = json.load(open("docs/notebook/data/2026-11-27-pipe-cost-zen4.json"))
cm = cm.get("cost_model", cm)
seqs, t1 = cm["seqs"], [row[0] for row in cm["seconds"]]
def cost(n):
    for (a, ta), (b, tb) in zip(zip(seqs, t1), zip(seqs[1:], t1[1:])):
        if n <= b: return ta + (tb - ta) * (n - a) / (b - a)
    return t1[-1]
def run(order, lens, slots=12):
    queue, active, t = list(order), [], 0.0
    while queue or active:
        while queue and len(active) < slots: active.append(lens[queue.pop(0)])
        t += cost(len(active)); active = [x - 1 for x in active if x > 1]
    return t
for seed in (0, 1, 2):
    e1, e2 = L[f"{seed}-e1"], L[f"{seed}-e2"]
    lens = [x for g in e2 for x in g]
    pred_g = {}
    for name, stat in (("mean", statistics.mean), ("q75", lambda g: sorted(g)[5]), ("max", max), ("median", statistics.median)):
        pred = [stat(e1[i]) for i in range(12) for _ in range(8)]
        order = sorted(range(96), key=lambda r: (-pred[r], r))
        pred_g[name] = run(order, lens)
    fifo = run(list(range(96)), lens)
    oracle = run(sorted(range(96), key=lambda r: -lens[r]), lens)
    print(seed, f"fifo {fifo:.2f}", " ".join(f"lf-{k} {v:.2f} ({fifo/v:.3f}x)" for k, v in pred_g.items()), f"oracle {oracle:.2f} ({fifo/oracle:.3f}x)")
print("two workers, 12 slots each")
def split_lpt(work):
    loads, shares = [0.0, 0.0], [[], []]
    for g in sorted(range(12), key=lambda g: -work[g]):
        w = loads.index(min(loads)); shares[w].append(g); loads[w] += work[g]
    return shares
for seed in (0, 1, 2):
    e1, e2 = L[f"{seed}-e1"], L[f"{seed}-e2"]
    lens = {(g, k): e2[g][k] for g in range(12) for k in range(8)}
    def mk(shares, order):  # order: "fifo" | "lf" (by e1 mean) | "oracle"
        out = []
        for share in shares:
            reqs = [(g, k) for g in share for k in range(8)]
            if order == "lf": reqs.sort(key=lambda r: -statistics.mean(e1[r[0]]))
            if order == "oracle": reqs.sort(key=lambda r: -lens[r])
            idx = {r: i for i, r in enumerate(reqs)}
            out.append(run(list(range(len(reqs))), [lens[r] for r in reqs]))
        return max(out), out
    static = [list(range(6)), list(range(6, 12))]
    ll = [list(range(0, 12, 2)), list(range(1, 12, 2))]
    hp = split_lpt([sum(e1[g]) for g in range(12)])
    orc = split_lpt([sum(e2[g]) for g in range(12)])
    row = {"static": mk(static, "fifo"), "ll": mk(ll, "fifo"), "hp-fifo": mk(hp, "fifo"), "hp-lf": mk(hp, "lf"), "orc-split-oracle-order": mk(orc, "oracle")}
    base = row["static"][0]
    print(seed, " ".join(f"{k} {v[0]:.1f} [{v[1][0]:.1f}/{v[1][1]:.1f}] ({base/v[0]:.3f}x)" for k, v in row.items()))
print("LPT split by other statistics of epoch 1 (plain decoding sim, vs static)")
for seed in (0, 1, 2):
    e1, e2 = L[f"{seed}-e1"], L[f"{seed}-e2"]
    lens = {(g, k): e2[g][k] for g in range(12) for k in range(8)}
    def mk(shares):
        return max(run(list(range(len(share) * 8)), [lens[(g, k)] for g in share for k in range(8)]) for share in shares)
    base = mk([list(range(6)), list(range(6, 12))])
    stats = {"sum": sum, "median": statistics.median, "trim-max": lambda g: sum(sorted(g)[:-1]),
             "capless": lambda g: sum(x for x in g if x < 192) / max(1, sum(x < 192 for x in g))}
    print(seed, " ".join(f"{k} {base / mk(split_lpt([f(e1[g]) for g in range(12)])):.3f}x" for k, f in stats.items()),
          f"oracle-sum {base / mk(split_lpt([sum(e2[g]) for g in range(12)])):.3f}x")
H = L
print("LPT split by history of 1 vs 4 epochs (plain decoding sim, vs static); timed epoch e2")
for seed in (0, 1, 2):
    e2 = L[f"{seed}-e2"]
    lens = {(g, k): e2[g][k] for g in range(12) for k in range(8)}
    def mk(shares):
        return max(run(list(range(len(share) * 8)), [lens[(g, k)] for g in share for k in range(8)]) for share in shares)
    base = mk([list(range(6)), list(range(6, 12))])
    hist1 = L[f"{seed}-e1"]
    hist4 = [hist1[g] + H[f"{seed}-h2"][g] + H[f"{seed}-h3"][g] + H[f"{seed}-h4"][g] for g in range(12)]
    r = {}
    for name, hist in (("1 epoch", hist1), ("4 epochs", hist4)):
        for sname, f in (("mean", statistics.mean), ("median", statistics.median)):
            r[f"{name} {sname}"] = base / mk(split_lpt([f(hist[g]) for g in range(12)]))
    print(seed, " ".join(f"{k} {v:.3f}x" for k, v in r.items()))
