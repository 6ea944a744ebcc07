"""Issue 32's real goal taken apart per worker: for each schedule, each Ray worker's planned work (predicted
tokens, forwards and seconds, as `RayPool` plans them) beside what it did (tokens, engine forwards, HistoSpec's
tokens per sequence-forward, prefill tokens, busy and wall seconds). Counts are load-independent; seconds are not.

    PYTHONPATH=src OMP_NUM_THREADS=1 python scripts/pipe_per_worker.py [--schedules static,least_loaded,histopipe]
        [--cost-from FILE]

`--cost-from`: a `CostModel` JSON file (as `bench pipe --cost-from`) given to every worker's speculator;
without it each worker measures its own at start-up. The first JSON line also holds each worker's cost model
as its speculator holds it after epoch 1 (`cost`: a plain full-batch step and one verifying 8 drafts a
sequence; `ratio`: the online correction's measured/predicted by (batch bucket, drafting)) and epoch 1's
per-worker counts.

histopipe plans in the replayed units (`histopipe.pricing.ReplayedRates`: each prompt's rate replayed from its
recorded tokens under HistoSpec's drafting; `pred_units` per worker, `pred_forwards` at the replayed tokens per
forward), histopipe_tokens in tokens (the old pricing). Prints one JSON object per (round, schedule) on stdout; progress on stderr.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time

from rhymerl.bench.pipe_real import MAX_DRAFT_TOKENS, RECORDED, policy_and_prompts
from rhymerl.bench.pipe_bench import load_cost_model
from rhymerl.config import RolloutSection
from rhymerl.cost_model import CostModel
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.histopipe.batching import decode_costs, worker_time
from rhymerl.histopipe.predict import LengthPredictor
from rhymerl.histopipe.pricing import ReplayedRates
from rhymerl.history import HistoryStore
from rhymerl.rollout import RolloutGroup, WorkerConfig
from rhymerl.rollout.factory import make_pool


def per_request(outputs, n: int) -> list[dict]:
    """Each request's prompt index, length, forwards it took part in and HistoSpec's drafted/accepted."""
    return [{"p": i // n, "len": len(o.token_ids), "fwd": o.forwards,
             "drafted": o.spec.drafted if o.spec else 0, "accepted": o.spec.accepted if o.spec else 0}
            for i, o in enumerate(outputs)]


def worker_cost(state: dict | None, slots: int) -> dict | None:
    """A worker's speculator cost model in two figures (a plain full batch; the same batch verifying 8 draft
    tokens a sequence) and its online correction (`Speculator._ratio`, when the state holds it)."""
    if not state or "cost" not in state:
        return None
    cost = CostModel.from_dict(state["cost"])
    return {"plain_s": round(cost.step(slots, slots), 4), "draft8_s": round(cost.step(slots, slots, 8 * slots, 8), 4),
            "measured": cost.measured, "ratio": state.get("ratio"), "idle": state.get("idle")}


def worker_counts(stats) -> dict:
    """A worker's call counts (load-independent): tokens, forwards, drafted, accepted."""
    e, sp = stats.engine, stats.spec
    return {"worker": stats.worker, "tokens": e.generated_tokens, "forwards": e.forward_passes,
            "drafted": sp.drafted if sp else 0, "accepted": sp.accepted if sp else 0, "busy_s": round(e.busy_s, 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schedules", default="static,least_loaded,histopipe,histopipe_tokens")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=RECORDED.prompts)
    ap.add_argument("--cost-from", default=None, help="a CostModel JSON file for every worker (default: measured)")
    args = ap.parse_args()
    w = RECORDED
    slots = max(1, min(w.slots, args.prompts * w.num_generations // 2 // 4))
    policy, tokenizer, model_dir, prompts = policy_and_prompts("smollm2-135m", None, args.prompts, 0, "cpu", w.task)
    section = RolloutSection(backend="ray", num_workers=2, num_slots=slots, dtype="fp32", speculative="histospec",
                             max_draft_tokens=MAX_DRAFT_TOKENS, schedule="histopipe", tier2=True)
    config = WorkerConfig(section, max_model_len=max(map(len, prompts)) + w.max_tokens + 1)
    cost_model = load_cost_model(args.cost_from) if args.cost_from else None
    pool = make_pool(config, "", policy, tokenizer, model_dir, HistoryStore(), seed=0, device="cpu",
                     cost_model=cost_model)

    def groups(tag):
        return [RolloutGroup(p, [f"{tag}-p{i}-g{g}" for g in range(w.num_generations)]) for i, p in enumerate(prompts)]

    try:
        first = pool.rollout(groups("e1"), SamplingParams(temperature=w.temperature, max_tokens=w.max_tokens, seed=1000))
        n = w.num_generations
        for i, p in enumerate(prompts):
            pool.record(p, [o.token_ids for o in first.outputs[i * n:(i + 1) * n]])
        print("epoch 1 recorded", file=sys.stderr)
        print(json.dumps({"epoch1": per_request(first.outputs, n), "cost_from": args.cost_from, "slots": slots,
                          "epoch1_responses": [pool.history.responses(p) for p in prompts],  # to replay offline
                          "worker_costs": [worker_cost(s, slots) for s in pool.spec_state()],
                          "epoch1_workers": [worker_counts(s) for s in first.workers]}), flush=True)
        params = SamplingParams(temperature=w.temperature, max_tokens=w.max_tokens, seed=2000)
        cost = pool._plan_cost()
        step_cost, flat = decode_costs(cost, slots), [0.0] + [1.0] * slots
        predictor = LengthPredictor.from_history(pool.history, prompts, cap=w.max_tokens)
        rates = copy.deepcopy(pool.rates)  # epoch 1's tokens per forward (pricing="measured", the rule before)
        replayed = pool.replayed.rates(pool.history, prompts, cost, slots)  # pricing="replayed": from the tokens
        per_fwd = ReplayedRates(MAX_DRAFT_TOKENS, unit="forwards").rates(pool.history, prompts, cost, slots)
        print(json.dumps({"replayed_rates": [round(x, 3) for x in replayed], "unit": pool.replayed.unit,
                          "replayed_tokens_per_forward": [round(x, 3) for x in per_fwd]}), flush=True)
        for r in range(args.rounds):
            for schedule in args.schedules.split(","):
                pool.schedule, pool.migration = schedule.removesuffix("_tokens"), False  # histopipe_tokens: the old pricing
                pool.pricing, pool.rates = ("tokens" if schedule.endswith("_tokens") else "replayed"), copy.deepcopy(rates)
                gs = groups("e2")
                plan = pool.split(gs, 2, w.max_tokens)
                t0 = time.perf_counter()
                result = pool.rollout(gs, params)
                wall = time.perf_counter() - t0
                by_id = {o.request_id: o for o in result.outputs}
                rows = []
                for wk, share in enumerate(plan):
                    pred = [predictor.predict_group(prompts[g], n)[i] for g, idx in share for i in idx]
                    units_pred = [predictor.predict_group(prompts[g], n)[i] / replayed[g]
                                  for g, idx in share for i in idx]  # as histopipe prices them
                    fwd_pred = [predictor.predict_group(prompts[g], n)[i] / per_fwd[g] for g, idx in share for i in idx]
                    ids = [gs[g].request_ids[i] for g, idx in share for i in idx]
                    actual = [len(by_id[x].token_ids) for x in ids]
                    st = next(s for s in result.workers if s.worker == wk)
                    e, sp = st.engine, st.spec
                    rows.append({
                        "worker": wk, "requests": len(ids), "groups": [g for g, _ in share],
                        "pred_tokens": round(sum(pred)), "pred_forwards": round(worker_time(fwd_pred, slots, flat)),
                        "pred_units": round(worker_time(units_pred, slots, flat)), "pred_s": round(worker_time(pred, slots, step_cost), 3),
                        "true_len_model_s": round(worker_time(actual, slots, step_cost), 3),
                        "tokens": e.generated_tokens, "forwards": e.forward_passes, "seq_steps": e.seq_steps,
                        "tok_per_seq_fwd": round(e.tokens_per_seq_forward, 3),
                        "prompt_tokens": e.prompt_tokens, "shared_prompt_tokens": e.shared_prompt_tokens,
                        "tokens_forwarded": e.tokens_forwarded,
                        "drafted": sp.drafted if sp else 0, "accepted": sp.accepted if sp else 0,
                        "busy_s": round(e.busy_s, 3), "forward_s": round(e.forward_s, 3),
                        "wall_s": round(st.finished - st.started, 3),
                        "s_per_forward": round(e.busy_s / max(e.forward_passes, 1), 4)})
                predicted = [predictor.predict_group(p, n) for p in prompts]
                print(json.dumps({"round": r, "schedule": schedule, "makespan_s": round(wall, 3), "workers": rows,
                                  "plan": plan, "predicted": predicted,
                                  "requests": per_request(result.outputs, n)}),
                      flush=True)
                print(f"{schedule}: {wall:.2f} s", file=sys.stderr)
    finally:
        pool.close()


if __name__ == "__main__":
    main()
