"""What a training step logs about its rollout and its batch (verl's metric names), as pure functions of
the step's results: `rollout_metrics` (engine, HistoSpec, timeline), `length_report` (HistoPipe's premise,
"lengths rhyme"), `batch_metrics` / `group_metrics` (rewards, advantages, lengths) and `val_metrics`."""

from __future__ import annotations

from typing import Sequence

import torch

from rhymerl.histopipe.predict import LengthPredictor, rank_report
from rhymerl.history import HistoryStore
from rhymerl.rollout.timeline import timeline_metrics
from rhymerl.rollout.types import RolloutResult


def merged(results: Sequence[RolloutResult]) -> RolloutResult:
    """One step's rollouts (several with dynamic sampling) as one: outputs and worker stats concatenated, the
    wall interval from the first call's start to the last one's finish (the driver's time between calls then
    counts as idle in the bubble ratio)."""
    if len(results) == 1:
        return results[0]
    return RolloutResult([o for r in results for o in r.outputs], [w for r in results for w in r.workers],
                         results[0].weights_version, started=results[0].started, finished=results[-1].finished)


def rollout_metrics(prefix: str, result: RolloutResult) -> dict:
    """`<prefix>/...`: throughput, tokens per forward, prefill (computed and shared), migrations, HistoSpec's
    acceptance and draft time, and the timeline's bubble ratio, finish gap, per worker and perf/throughput."""
    s = result.engine_totals()
    m = {f"{prefix}/tokens_per_s": s.generated_tokens / max(s.busy_s, 1e-9),
         f"{prefix}/tokens_per_forward": s.tokens_per_seq_forward,
         f"{prefix}/forward_passes": s.forward_passes,
         # prompt tokens computed, and those copied from a sequence holding the same prefix
         f"{prefix}/prefill_tokens": s.prompt_tokens, f"{prefix}/prefill_shared_tokens": s.shared_prompt_tokens,
         # requests moved between workers (rollout.migration) and their re-prefill's share of forward time
         f"{prefix}/migrations": s.migrations, f"{prefix}/migration_prefill_s": s.migration_prefill_s}
    sp = result.spec_totals()
    if sp is not None:
        m |= {f"{prefix}/spec_accept_rate": sp.accept_rate, f"{prefix}/spec_drafted": sp.drafted,
              f"{prefix}/spec_accepted": sp.accepted, f"{prefix}/spec_mean_accepted_len": sp.mean_accepted_len,
              f"{prefix}/draft_time_share": sp.draft_s / max(s.busy_s, 1e-9)}
        m |= {f"{prefix}/spec_accepted_{src}": v for src, v in sp.accepted_by_source.items()}
    return m | timeline_metrics(result, prefix)


def finished(outputs) -> list[bool]:
    """Per output, whether it ended on its own (EOS or a stop string) rather than at the length limit: the
    scorer gives a cut-off completion no format reward."""
    return [o.finish_reason != "length" for o in outputs]


def staleness_metrics(version: int, outputs: Sequence, result: RolloutResult | None = None,
                      max_staleness: int | None = None) -> dict:
    """`rollout/staleness_mean` and `_max` over the trained tokens: how many versions the weights `version`
    the step trains from are past the weights that sampled each token (`RequestOutput.versions`; 0 in sync).
    verl logs one figure per step; a stream with deferral mixes versions within a step and even a response.
    With the step's `result`: `rollout/deferred` (its requests left for the next step) and `rollout/rerun`
    (deferred ones run again from scratch). `max_staleness` (`rollout.max_staleness`, one rule for every
    mode): a token trained further past its weights is an error."""
    ages = [version - v for o in outputs for v in o.versions]
    m = {} if result is None else {"rollout/deferred": len(result.deferred),
                                   "rollout/rerun": sum(w.reruns for w in result.workers)}
    if not ages:  # no tokens (or a pool that stamps no versions)
        return m
    if max_staleness is not None and max(ages) > max_staleness:
        raise RuntimeError(f"step {version + 1}: a token is trained {max(ages)} versions after the weights that "
                           f"sampled it, past rollout.max_staleness={max_staleness}")
    return m | {"rollout/staleness_mean": sum(ages) / len(ages), "rollout/staleness_max": max(ages)}


def length_report(history: HistoryStore, prompt_ids: Sequence[list[int]], group_lengths: Sequence[list[int]],
                  cap: int | None = None) -> dict:
    """HistoPipe's premise checked every step (call it before the history records the step): the rank
    correlation between the length the scheduler's predictor (`LengthPredictor`, the censored lognormal, its
    lengths at `cap` = max_completion_length taken as lower bounds) predicts for each prompt that has a
    history and its group's mean length now, and the share of prompts whose rank moved far. The same
    predictor the Ray pool's `histopipe` schedule plans with, so the metric reports what the scheduler
    sees."""
    seen = [i for i, ids in enumerate(prompt_ids) if ids in history]
    if len(seen) < 2:
        return {}
    predictor = LengthPredictor.from_history(history, [prompt_ids[i] for i in seen], cap=cap)
    predicted = predictor.predict_many([prompt_ids[i] for i in seen])
    report = rank_report(predicted, [sum(group_lengths[i]) / len(group_lengths[i]) for i in seen])
    out = {"histopipe/prompts_with_history": len(seen), "histopipe/moved_far": report["moved_far"]}
    if report["rank_corr"] == report["rank_corr"]:  # NaN when every length ties
        out["histopipe/rank_corr"] = report["rank_corr"]
    return out


def batch_metrics(rewards: torch.Tensor, correct: Sequence[float], formatted: Sequence[float], adv: torch.Tensor,
                  lengths: Sequence[int], clipped: Sequence[bool], prompt_lengths: Sequence[int]) -> dict:
    """verl's critic/ and response_length/ metrics of the completions a step trains on. rewards, adv: [N];
    correct, formatted, lengths, clipped (finish_reason "length"): one per completion; prompt_lengths: one
    per prompt."""
    n = len(lengths)
    ls = torch.tensor(lengths, dtype=torch.float32)  # [N]
    return {
        "critic/rewards/mean": rewards.mean().item(), "critic/rewards/max": rewards.max().item(),
        "critic/rewards/min": rewards.min().item(),
        "critic/score/mean": sum(correct) / n, "critic/format/mean": sum(formatted) / n,
        "critic/advantages/max": adv.max().item(), "critic/advantages/min": adv.min().item(),
        "response_length/mean": ls.mean().item(), "response_length/max": ls.max().item(),
        "response_length/min": ls.min().item(), "response_length/clip_ratio": sum(clipped) / n,
        "prompt_length/mean": sum(prompt_lengths) / len(prompt_lengths),
    }


def group_metrics(groups: Sequence[tuple], rewards: torch.Tensor, adv: torch.Tensor) -> dict:
    """`batch_metrics` of the groups a step trains on, each (prompt, outputs, rewards, correct, formatted)."""
    outs = [o for _, g, *_ in groups for o in g]
    return batch_metrics(rewards, [c for g in groups for c in g[3]], [f for g in groups for f in g[4]], adv,
                         [len(o.token_ids) for o in outs], [o.finish_reason == "length" for o in outs],
                         [len(g[0].ids) for g in groups])


def val_metrics(scored, result: RolloutResult) -> dict:
    """val/ metrics of a validation rollout (one response per prompt) and its `RewardBatch` `scored`."""
    outs = result.outputs
    m = {"val/accuracy": sum(scored.correct) / len(outs), "val/reward/mean": sum(scored.rewards) / len(outs),
         "val/response_length/mean": sum(len(o.token_ids) for o in outs) / len(outs),
         "val/reward_errors": scored.errors}
    return m | scored.metrics("val") | rollout_metrics("val", result)
