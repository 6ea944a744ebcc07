"""Notebook 2026-11-27-f-e2efwd (scratch, not a bench): the e2e bench's history-on rollout side without the update: 2 Ray workers, repeat 12x8, 12 slots,
fp32, T=0.6, 192 tokens, draft cap 4, histopipe + migration; N calls, each recorded. Per call and worker:
forwards, tokens, drafted/accepted, and the speculator's ratio / idle counters / cost figures.

    PYTHONPATH=src python docs/notebook/data/2026-11-27-f-e2efwd-pool-repro.py [CALLS] [true|false] [SCHEDULE]
"""
import json, sys, time
from rhymerl.bench.pipe_real import policy_and_prompts
from rhymerl.config import RolloutSection
from rhymerl.cost_model import CostModel
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.history import HistoryStore
from rhymerl.rollout import RolloutGroup, WorkerConfig
from rhymerl.rollout.factory import make_pool

calls = int(sys.argv[1]) if len(sys.argv) > 1 else 4
migration = (sys.argv[2] if len(sys.argv) > 2 else "true") == "true"
schedule = sys.argv[3] if len(sys.argv) > 3 else "histopipe"
policy, tok, model_dir, prompts = policy_and_prompts("smollm2-135m", None, 12, 0, "cpu", "repeat")
section = RolloutSection(backend="ray", num_workers=2, num_slots=12, dtype="fp32", speculative="histospec",
                         max_draft_tokens=4, schedule=schedule, migration=migration)
config = WorkerConfig(section, max_model_len=max(map(len, prompts)) + 193)
pool = make_pool(config, "", policy, tok, model_dir, HistoryStore(), seed=0, device="cpu")
try:
    for c in range(calls):
        gs = [RolloutGroup(p, [f"c{c}-p{i}-g{g}" for g in range(8)]) for i, p in enumerate(prompts)]
        t0 = time.perf_counter()
        res = pool.rollout(gs, SamplingParams(temperature=0.6, max_tokens=192, seed=1000 + c), step=c)
        wall = time.perf_counter() - t0
        for i, p in enumerate(prompts):
            pool.record(p, [o.token_ids for o in res.outputs[i * 8:(i + 1) * 8]])
        rows = []
        for st in res.workers:
            e, sp = st.engine, st.spec
            rows.append({"w": st.worker, "tok": e.generated_tokens, "fwd": e.forward_passes,
                         "tpsf": round(e.tokens_per_seq_forward, 2), "drafted": sp.drafted if sp else 0,
                         "acc": sp.accepted if sp else 0, "busy": round(e.busy_s, 2)})
        states = []
        for s in pool.spec_state():
            if s:
                cm = CostModel.from_dict(s["cost"])
                states.append({"plain12": round(cm.step(12, 12), 4), "d4_12": round(cm.step(12, 12, 48, 4), 4),
                               "ratio": [[b, d, round(r, 2)] for b, d, r in s["ratio"]], "idle": s["idle"]})
        tot = sum(r["fwd"] for r in rows)
        print(json.dumps({"call": c, "wall": round(wall, 2), "fwd": tot, "tokens": sum(r["tok"] for r in rows),
                          "migr": pool.migrations, "workers": rows, "spec": states}), flush=True)
finally:
    pool.close()
    import ray; ray.shutdown()
