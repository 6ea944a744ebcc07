"""Is histopipe's real plan the same whatever the timing of epoch 1? (issue 32's real runs; `histopipe.pricing`)

    PYTHONPATH=src OMP_NUM_THREADS=1 python scripts/pipe_plan_identity.py --cost-from FILE [--out FILE.json]

`bench pipe`'s real set-up (the recorded `repeat` task, 12 prompts x 8, 2 Ray workers, fp32, every worker's
HistoSpec on the `--cost-from` model): epoch 1 is rolled out and recorded, then the plan of epoch 2's groups
is made, without running it, under `pricing="replayed"` (the rates replayed from the recorded tokens under
HistoSpec's drafting, `ReplayedRates`, in its default unit: plain full-batch steps) and
`pricing="measured"` (epoch 1's own tokens per forward, the rule before). Prints one JSON object: epoch 1's
tokens per forward per prompt and drafted tokens per worker (the timing-driven counts), both rate vectors,
both plans and epoch 1's responses. Run it twice: the tokens are the same (keyed draws), the timing is not.
"""

from __future__ import annotations

import argparse
import json
import sys

from rhymerl.bench.pipe_bench import load_cost_model
from rhymerl.bench.pipe_real import MAX_DRAFT_TOKENS, plan_text, policy_and_prompts, real_workload
from rhymerl.config import RolloutSection
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.histopipe.pricing import ReplayedRates
from rhymerl.history import HistoryStore
from rhymerl.rollout import RolloutGroup, WorkerConfig
from rhymerl.rollout.factory import make_pool


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cost-from", required=True, help="a CostModel JSON file (as bench pipe --cost-from)")
    ap.add_argument("--out", default=None, help="also write the JSON object here")
    args = ap.parse_args()
    w = real_workload("rhyming", None, 2)
    n = w.num_generations
    policy, tokenizer, model_dir, prompts = policy_and_prompts("smollm2-135m", None, w.prompts, 0, "cpu", w.task)
    section = RolloutSection(backend="ray", num_workers=2, num_slots=w.slots, dtype="fp32", speculative="histospec",
                             max_draft_tokens=MAX_DRAFT_TOKENS, schedule="histopipe", tier2=True)
    config = WorkerConfig(section, max_model_len=max(map(len, prompts)) + w.max_tokens + 1)
    cost = load_cost_model(args.cost_from)
    pool = make_pool(config, "", policy, tokenizer, model_dir, HistoryStore(), seed=0, device="cpu", cost_model=cost)
    groups = [RolloutGroup(p, [f"e2-p{i}-g{g}" for g in range(n)]) for i, p in enumerate(prompts)]
    try:
        first = pool.rollout([RolloutGroup(p, [f"e1-p{i}-g{g}" for g in range(n)]) for i, p in enumerate(prompts)],
                             SamplingParams(temperature=w.temperature, max_tokens=w.max_tokens, seed=1000))
        for i, p in enumerate(prompts):
            pool.record(p, [o.token_ids for o in first.outputs[i * n:(i + 1) * n]])
        print("epoch 1 recorded", file=sys.stderr)
        out = {"cost_from": args.cost_from, "slots": w.slots, "tokens": sum(len(o.token_ids) for o in first.outputs),
               "epoch1_tokens_per_forward": [
                   round(sum(len(o.token_ids) for o in first.outputs[i * n:(i + 1) * n])
                         / max(sum(o.forwards for o in first.outputs[i * n:(i + 1) * n]), 1), 3)
                   for i in range(len(prompts))],
               "epoch1_drafted_per_worker": [s.spec.drafted if s.spec else 0 for s in first.workers],
               "epoch1_forwards_per_worker": [s.engine.forward_passes for s in first.workers],
               "measured_rates": [round(pool.rates.rate(p), 3) for p in prompts],
               "replayed_rates": [round(r, 3) for r in pool.replayed.rates(pool.history, prompts, cost, w.slots)],
               "replayed_unit": pool.replayed.unit,
               "replayed_tokens_per_forward": [round(r, 3) for r in ReplayedRates(MAX_DRAFT_TOKENS, unit="forwards").rates(
                   pool.history, prompts, cost, w.slots)]}
        out["epoch1_responses"] = [pool.history.responses(p) for p in prompts]  # to replay offline
        for pricing in ("replayed", "measured"):
            pool.pricing = pricing
            plan = pool.split(groups, 2, w.max_tokens)
            out[f"plan_{pricing}"] = plan_text([[[g, list(idx)] for g, idx in share] for share in plan], n)
        print(json.dumps(out), flush=True)
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                f.write(json.dumps(out) + "\n")
    finally:
        pool.close()


if __name__ == "__main__":
    main()
