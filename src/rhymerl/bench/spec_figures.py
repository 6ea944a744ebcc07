"""The figures of `rhymerl bench spec` (`rhymerl.bench.spec_bench`) from its runs' outputs and counters:
tokens/s and speed-ups (fastest runs, and paired by round), acceptance, forwards, where the steps' time went,
token identity."""

from __future__ import annotations

import math


def identity(a, b) -> float:
    """The share of outputs whose tokens are the same in `a` and `b` (paired by position)."""
    return sum(x.token_ids == y.token_ids for x, y in zip(a, b)) / max(len(a), 1)


def ms_per_forward(stats: list, part: str) -> float:
    """Milliseconds per forward pass, over the runs' EngineStats, of the forward itself ("forward") or of the
    rest of the step ("other")."""
    seconds = sum(x.forward_s if part == "forward" else x.busy_s - x.forward_s for x in stats)
    return round(1e3 * seconds / max(sum(x.forward_passes for x in stats), 1), 2)


def paired(rounds: list[dict], mode: str, base: str) -> float:
    """Geometric mean over the rounds of runs of `mode`'s tokens/s over `base`'s in the same round."""
    return round(math.exp(sum(math.log(r[mode] / r[base]) for r in rounds) / len(rounds)), 3)


def speedup(spec_tokens: int, spec_s: float, plain_tokens: int, plain_s: float) -> float:
    """HistoSpec tokens/s over plain tokens/s."""
    return round((spec_tokens / spec_s) / (plain_tokens / plain_s), 3)


def figures(runs: list[dict], pairs: list[dict], dtype: str) -> dict:
    """Epoch 2's figures, totals over the epoch seeds' fastest runs (`_SpecBench.epoch2`)."""
    plain_all = [o for r in runs for o in r["off"][0]]  # every epoch's outputs, for the identity rate
    spec_all = [o for r in runs for o in r["histospec"][0]]
    plain_s, spec_s = sum(r["off"][1] for r in runs), sum(r["histospec"][1] for r in runs)
    ps = [r["off"][2][0] for r in runs]
    ss = [r["histospec"][2][0] for r in runs]
    sp = [r["histospec"][2][1] for r in runs]
    tokens_plain, tokens_spec = sum(x.generated_tokens for x in ps), sum(x.generated_tokens for x in ss)
    drafted, accepted = sum(x.drafted for x in sp), sum(x.accepted for x in sp)
    verify_steps = sum(x.verify_steps for x in sp)
    return {
        "tokens_plain": tokens_plain, "tokens_spec": tokens_spec,
        "plain_s": round(plain_s, 2), "spec_s": round(spec_s, 2),
        "plain_tok_s": round(tokens_plain / plain_s, 1), "spec_tok_s": round(tokens_spec / spec_s, 1),
        "speedup": speedup(tokens_spec, spec_s, tokens_plain, plain_s),
        # The same from each pair of adjacent runs (geometric mean of their ratios), beside every run's
        # tokens/s: the fastest-run figure above is robust to noise, which only adds time, and this one to
        # the machine's slow drift, which moves both runs of a pair alike.
        "speedup_paired": paired(pairs, "histospec", "off"),
        "runs_tok_s": {"plain": [round(r["off"], 1) for r in pairs], "spec": [round(r["histospec"], 1) for r in pairs]},
        "accept_rate": round(accepted / max(drafted, 1), 3),
        "mean_accepted_len": round(accepted / max(verify_steps, 1), 2),
        "tokens_per_forward": round(tokens_spec / max(sum(x.seq_steps for x in ss), 1), 3),
        "forwards_plain": sum(x.forward_passes for x in ps), "forwards_spec": sum(x.forward_passes for x in ss),
        "drafted": drafted, "accepted": accepted,
        "accepted_by_source": {k: sum(x.accepted_by_source[k] for x in sp) for k in sp[0].accepted_by_source},
        "draft_time_share": round(sum(x.draft_s for x in sp) / max(sum(x.busy_s for x in ss), 1e-9), 3),
        # Where the steps' time went: the model's forwards, and the rest (scheduling, drafting, sampling,
        # the tree walk, the commit), in ms per forward.
        "plain_ms_per_forward": ms_per_forward(ps, "forward"), "spec_ms_per_forward": ms_per_forward(ss, "forward"),
        "plain_other_ms_per_step": ms_per_forward(ps, "other"), "spec_other_ms_per_step": ms_per_forward(ss, "other"),
        f"identity_rate_{dtype}": round(identity(plain_all, spec_all), 3),  # of the timed runs
    }


def reward_aware_figures(runs: list[dict], pairs: list[dict]) -> dict:
    """The reward-aware runs' figures, beside the plain and plain-priority HistoSpec runs of the same rounds."""
    ra, ra_sp = [r["reward_aware"][2][0] for r in runs], [r["reward_aware"][2][1] for r in runs]
    ra_drafted, ra_accepted = sum(x.drafted for x in ra_sp), sum(x.accepted for x in ra_sp)
    ra_tokens, ra_s = sum(x.generated_tokens for x in ra), sum(r["reward_aware"][1] for r in runs)
    tokens_plain, plain_s = sum(r["off"][2][0].generated_tokens for r in runs), sum(r["off"][1] for r in runs)
    plain_all = [o for r in runs for o in r["off"][0]]
    return {
        "tok_s": round(ra_tokens / ra_s, 1), "speedup": speedup(ra_tokens, ra_s, tokens_plain, plain_s),
        "vs_histospec_paired": paired(pairs, "reward_aware", "histospec"),
        "runs_tok_s": [round(r["reward_aware"], 1) for r in pairs],
        "accept_rate": round(ra_accepted / max(ra_drafted, 1), 3), "drafted": ra_drafted,
        "accepted": ra_accepted,
        "tokens_per_forward": round(ra_tokens / max(sum(x.seq_steps for x in ra), 1), 3),
        "identity_vs_plain": round(identity(plain_all, [o for r in runs for o in r["reward_aware"][0]]), 3)}
