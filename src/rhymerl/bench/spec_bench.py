"""`rhymerl bench spec`: HistoSpec vs plain decoding on a second epoch of the same prompts.

Epoch 1 (plain decoding, its own seed) fills the history store, as the previous RL step would. Epoch 2
runs the same prompts with a new seed, plain and HistoSpec (alternating, `repeats` times each, the fastest
run of each counts), with identical request ids and seeds,
so the two must produce the same tokens (checked in fp32 on a subset; bf16 rounds a 1-token and a
many-token forward differently, so its identity rate is only reported). With `epoch_seeds` > 1, epoch 2 is
sampled that many times (seeds seed + 2000, seed + 2001, ...) and the figures are totals over them: in
bf16 the two sides' samples differ, and one sample's response lengths move its tokens/s. The long tail: the 4 longest
requests of the plain run, run alone in 4 slots, plain and HistoSpec, in bf16 (where the two runs generate
different tokens, so different amounts of work) and in fp32 (the same tokens: like for like). The ceiling:
what a perfect drafter would gain, by the forward costs measured at start-up (`CostModel.ceiling`), for the
full batch and the tail.

With `history_from=RUN_DIR` the history is a real training run's instead: the policy and the history store of
the run's latest checkpoint (its history.json and Hugging Face weights only: nothing there is unpickled), and
the prompts it holds (the run's training and validation prompts); epoch 2 is then the run's next epoch. That
history carries the run's rewards, so `reward_aware=True` (`--reward-aware`) measures reward-aware drafting
(`rollout.reward_aware_drafting`) against the same figures without it; the bench's own history has no rewards
(every response weighs 1), where the two draft alike.
"""

from __future__ import annotations

import math
import sys
import time

import torch
from rich.console import Console
from rich.table import Table

from rhymerl.bench.console import device_fields, table_console
from rhymerl.bench.progress import Progress
from rhymerl.bench.spec_inputs import history_of_run, load_prompts
from rhymerl.data.dataset import BUILTIN_TASKS
from rhymerl.engine.engine import Engine
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.errors import UserError
from rhymerl.histospec.speculator import Speculator
from rhymerl.model.pretrained import default_device, load_pretrained, resolve_dtype
from rhymerl.rl.losses import entropy_from_logits
from rhymerl.rl.run_settings import DEFAULT_MAX_DRAFT_TOKENS
from rhymerl.history import HistoryStore

TAIL = 4  # the long tail: at most this many sequences still running


def rollout(engine: Engine, prompts: list[list[int]], num_generations: int, params: SamplingParams):
    """One rollout: every prompt num_generations times (request ids "i-g"), timed."""
    batch = [p for p in prompts for _ in range(num_generations)]
    ids = [f"{i}-{g}" for i in range(len(prompts)) for g in range(num_generations)]
    t0 = time.perf_counter()
    outs = engine.generate(batch, params, request_ids=ids)
    return outs, time.perf_counter() - t0


def mean_entropy(model, prompts, outs, num_generations: int, temperature: float, limit: int = 16) -> float:
    """Mean entropy (nats) of the policy's next-token distribution at `temperature` over the response
    tokens of up to `limit` responses, by a dense forward."""
    total, count = 0.0, 0
    for k, o in enumerate(outs[:limit]):
        prompt = prompts[k // num_generations]
        if not o.token_ids:
            continue
        ids = torch.tensor([prompt + o.token_ids], device=next(model.parameters()).device)
        with torch.inference_mode():
            logits = model(ids)[0, len(prompt) - 1 : -1].float() / max(temperature, 1e-6)
        total += float(entropy_from_logits(logits).sum())
        count += len(o.token_ids)
    return total / max(count, 1)


def identity(a, b) -> float:
    return sum(x.token_ids == y.token_ids for x, y in zip(a, b)) / max(len(a), 1)


def _tail(make_engine, prompts, request_ids, params, suffix: str, repeats: int) -> dict:
    """Tokens/s of plain and HistoSpec on the tail requests (`make_engine(mode)`), their ratio, the tokens
    each generated and whether the outputs are token-identical. Like the full batch, the two alternate
    `repeats` times and each keeps its fastest run: a tail run is short, and a single one of each was seen
    to differ by 12% with identical tokens and drafting nearly off."""
    out = {}
    results, best = {}, {}
    for _ in range(repeats):
        for mode, name in (("off", "plain"), ("histospec", "spec")):
            engine = make_engine(mode)
            t0 = time.perf_counter()
            results[name] = engine.generate(prompts, params, request_ids=request_ids)
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
    for name in ("plain", "spec"):
        tokens = sum(len(o.token_ids) for o in results[name])
        out[f"{name}_tail_tok_s{suffix}"] = round(tokens / best[name], 1)
        out[f"{name}_tail_tokens{suffix}"] = tokens
    out[f"tail_speedup{suffix}"] = round(out[f"spec_tail_tok_s{suffix}"] / out[f"plain_tail_tok_s{suffix}"], 3)
    out[f"tail_identity{suffix}"] = round(identity(results["plain"], results["spec"]), 3)
    return out


def _ms_per_forward(stats: list, part: str) -> float:
    """Milliseconds per forward pass, over the runs' EngineStats, of the forward itself ("forward") or of the
    rest of the step ("other")."""
    seconds = sum(x.forward_s if part == "forward" else x.busy_s - x.forward_s for x in stats)
    return round(1e3 * seconds / max(sum(x.forward_passes for x in stats), 1), 2)


def _paired(rounds: list[dict], mode: str, base: str) -> float:
    """Geometric mean over the rounds of runs of `mode`'s tokens/s over `base`'s in the same round."""
    return round(math.exp(sum(math.log(r[mode] / r[base]) for r in rounds) / len(rounds)), 3)


def _speedup(spec_tokens: int, spec_s: float, plain_tokens: int, plain_s: float) -> float:
    """HistoSpec tokens/s over plain tokens/s."""
    return round((spec_tokens / spec_s) / (plain_tokens / plain_s), 3)


def run(model_name="smollm2-135m", dtype="auto", temperatures=(0.3, 0.6, 1.0), num_prompts=16,
        num_generations=8, slots=32, max_tokens=256, data=None, identity_prompts=16, identity_max_tokens=96,
        seed=0, draft_rule="cost", max_draft_tokens=None, history_from=None, repeats=3, epoch_seeds=1, device=None,
        reward_aware=False) -> dict:
    if repeats < 1:
        raise UserError(f"--repeats must be at least 1, got {repeats}")
    if epoch_seeds < 1:
        raise UserError(f"--epoch-seeds must be at least 1, got {epoch_seeds}")
    run_history = None
    if history_from is not None:
        run_history, ckpt = history_of_run(history_from)
        model_name = str(ckpt)  # the run's policy at that checkpoint: a Hugging Face directory
    dtype = resolve_dtype(dtype, device or default_device())  # the JSON names what ran
    max_draft_tokens = max_draft_tokens or DEFAULT_MAX_DRAFT_TOKENS[dtype]  # as a training run in this dtype
    separate_fp32 = bool(identity_prompts) and dtype != "fp32"  # progress: the stages below, counted
    per_temp = (run_history is None) + (2 + reward_aware) * epoch_seeds * repeats + 1 + separate_fp32 + bool(identity_prompts)
    progress = Progress("spec", 3 + separate_fp32 + bool(identity_prompts) + len(temperatures) * per_temp)
    progress.stage(f"loading {model_name} ({dtype}{' and fp32' if separate_fp32 else ''})")
    model, tokenizer, model_dir = load_pretrained(model_name, dtype, device)
    device = next(model.parameters()).device
    if run_history is not None:
        prompts = [run_history.prompt(k) for k in run_history.keys()][-num_prompts:]  # most recently used
    else:
        prompts = load_prompts(tokenizer, data, num_prompts, seed)
    max_len = max(map(len, prompts)) + max_tokens
    fp32 = None  # the identity check's model (and the fp32 tail's, when the timed runs are not fp32 already)
    if identity_prompts:
        fp32 = model if dtype == "fp32" else load_pretrained(model_name, "fp32", device)[0]

    # One cost model per model and engine shape, measured by the first HistoSpec engine of that shape,
    # as a training run measures once at start-up. Re-measuring for every timed run made the run right
    # after the measurement's large forwards the slow one of a pair (one-off A/B at T=1.0, where
    # HistoSpec drafts almost nothing: only the measured-just-before runs lost to plain).
    # Likewise one runner (KV cache, and on a GPU the CUDA graphs captured on it) per engine shape, made by that
    # first HistoSpec engine: every engine of the shape runs on it, so a step shape is captured once, not in
    # every timed run.
    costs, runners = {}, {}

    def make(m, spec, history=None, n_slots=slots, length=max_len, aware=False):
        key = (id(m), n_slots, length)
        speculator = None if spec == "off" else Speculator(costs.get(key), history, draft_rule, max_draft_tokens,
                                                           reward_weighted=aware)
        engine = Engine(m, tokenizer, num_slots=n_slots, max_model_len=length, speculator=speculator,
                        runner=runners.get(key))
        if spec == "histospec":
            costs.setdefault(key, engine.cost_model)
            runners.setdefault(key, engine.runner)
        return engine

    identity_len = max(map(len, prompts[:identity_prompts]), default=0) + identity_max_tokens
    timed = {"full": (model, slots), "tail": (model, TAIL)}  # the timed engine shapes, by name
    if fp32 is not None and fp32 is not model:
        timed["tail_fp32"] = (fp32, TAIL)
    shapes = [(m, n_slots, max_len) for m, n_slots in timed.values()]
    if fp32 is not None:
        shapes.append((fp32, 8, identity_len))  # the identity check
    for m, n_slots, length in shapes:  # measured before any timed run, untimed
        progress.stage(f"measuring the cost model ({n_slots} slots, {length} tokens, "
                       f"{'fp32' if m is fp32 else dtype})")
        make(m, "histospec", n_slots=n_slots, length=length)
    # What this machine allows at all: the speed-up of a perfect drafter by the measured forward costs
    # (`CostModel.ceiling`), for the full batch and for the tails. Where a target is above it, no drafter
    # can reach it here.
    ceiling = {}
    for name, (m, n_slots) in timed.items():
        speedup, t = costs[(id(m), n_slots, max_len)].ceiling(n_slots, max_draft_tokens + 1)
        ceiling[name] = {"speedup": round(speedup, 3), "tokens_per_seq": t}

    results, started = {}, time.perf_counter()
    for temp in temperatures:
        epoch1 = SamplingParams(temperature=temp, max_tokens=max_tokens, seed=seed + 1000)
        if run_history is not None:
            history = run_history
        else:
            history = HistoryStore()
            progress.stage(f"T={temp}: epoch 1 (the history)")
            outs1, _ = rollout(make(model, "off"), prompts, num_generations, epoch1)
            for i, p in enumerate(prompts):
                history.record_rollout(p, [o.token_ids for o in outs1[i * num_generations : (i + 1) * num_generations]])
        # Plain and HistoSpec alternate `repeats` times, each keeping its fastest run: this machine's speed
        # drifts by several percent over minutes, and noise only ever adds time. With several epoch seeds
        # the figures are totals over the seeds: in bf16 the two sides sample different responses (see
        # identity_rate_bf16), and one sample's lengths move tokens/s by a few percent either way.
        epoch2 = [SamplingParams(temperature=temp, max_tokens=max_tokens, seed=seed + 2000 + k) for k in range(epoch_seeds)]
        # With --reward-aware, a third run in every round drafts reward-aware: the same cost model (measured
        # once above) and so the same budget as the plain-priority HistoSpec run beside it, a paired comparison.
        modes = ("off", "histospec", "reward_aware")[:2 + reward_aware]
        runs = []  # per epoch seed: {mode: (outputs, seconds, engine)}
        pairs = []  # every round of runs, in order: their tokens/s by mode
        for params in epoch2:
            best: dict[str, tuple] = {}
            for rep in range(repeats):
                tok_s = {}
                for mode in modes:
                    progress.stage(f"T={temp}: epoch 2 seed {params.seed} repeat {rep + 1}/{repeats}: "
                                   f"{'plain' if mode == 'off' else mode}")
                    engine = make(model, "off" if mode == "off" else "histospec", history,
                                  aware=mode == "reward_aware")
                    outs, seconds = rollout(engine, prompts, num_generations, params)
                    stats = engine.take_stats()  # (EngineStats, SpecStats or None)
                    tok_s[mode] = stats[0].generated_tokens / seconds
                    if mode not in best or seconds < best[mode][1]:
                        best[mode] = (outs, seconds, stats)
                pairs.append(tok_s)
            runs.append(best)
        plain_all = [o for r in runs for o in r["off"][0]]  # every epoch's outputs, for the identity rate
        spec_all = [o for r in runs for o in r["histospec"][0]]
        plain_s, spec_s = sum(r["off"][1] for r in runs), sum(r["histospec"][1] for r in runs)
        ps = [r["off"][2][0] for r in runs]
        ss = [r["histospec"][2][0] for r in runs]
        sp = [r["histospec"][2][1] for r in runs]
        tokens_plain, tokens_spec = sum(x.generated_tokens for x in ps), sum(x.generated_tokens for x in ss)
        drafted, accepted = sum(x.drafted for x in sp), sum(x.accepted for x in sp)
        verify_steps = sum(x.verify_steps for x in sp)
        row = {
            "entropy": round(mean_entropy(model, prompts, runs[0]["off"][0], num_generations, temp), 3),
            "tokens_plain": tokens_plain, "tokens_spec": tokens_spec,
            "plain_s": round(plain_s, 2), "spec_s": round(spec_s, 2),
            "plain_tok_s": round(tokens_plain / plain_s, 1), "spec_tok_s": round(tokens_spec / spec_s, 1),
            "speedup": _speedup(tokens_spec, spec_s, tokens_plain, plain_s),
            # The same from each pair of adjacent runs (geometric mean of their ratios), beside every run's
            # tokens/s: the fastest-run figure above is robust to noise, which only adds time, and this one to
            # the machine's slow drift, which moves both runs of a pair alike.
            "speedup_paired": _paired(pairs, "histospec", "off"),
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
            "plain_ms_per_forward": _ms_per_forward(ps, "forward"), "spec_ms_per_forward": _ms_per_forward(ss, "forward"),
            "plain_other_ms_per_step": _ms_per_forward(ps, "other"), "spec_other_ms_per_step": _ms_per_forward(ss, "other"),
            f"identity_rate_{dtype}": round(identity(plain_all, spec_all), 3),  # of the timed runs
        }
        if reward_aware:
            ra, ra_sp = [r["reward_aware"][2][0] for r in runs], [r["reward_aware"][2][1] for r in runs]
            ra_drafted, ra_accepted = sum(x.drafted for x in ra_sp), sum(x.accepted for x in ra_sp)
            ra_tokens, ra_s = sum(x.generated_tokens for x in ra), sum(r["reward_aware"][1] for r in runs)
            row["reward_aware"] = {
                "tok_s": round(ra_tokens / ra_s, 1), "speedup": _speedup(ra_tokens, ra_s, tokens_plain, plain_s),
                "vs_histospec_paired": _paired(pairs, "reward_aware", "histospec"),
                "runs_tok_s": [round(r["reward_aware"], 1) for r in pairs],
                "accept_rate": round(ra_accepted / max(ra_drafted, 1), 3), "drafted": ra_drafted,
                "accepted": ra_accepted,
                "tokens_per_forward": round(ra_tokens / max(sum(x.seq_steps for x in ra), 1), 3),
                "identity_vs_plain": round(identity(plain_all, [o for r in runs for o in r["reward_aware"][0]]), 3)}
        if epoch_seeds > 1:
            row["speedup_by_seed"] = [_speedup(spec_st.generated_tokens, r["histospec"][1], plain_st.generated_tokens, r["off"][1])
                                      for r, spec_st, plain_st in zip(runs, ss, ps)]
        # The long tail (first epoch seed): the TAIL longest requests of the plain run, alone in TAIL slots,
        # plain vs HistoSpec.
        # In bf16 the two runs of those requests diverge (a 1-token and a many-token forward round
        # differently), so they generate different lengths and the bf16 figure compares different work;
        # in fp32 they generate the same tokens (checked), so the fp32 figure is like for like.
        plain = runs[0]["off"][0]
        longest = sorted(range(len(plain)), key=lambda k: -len(plain[k].token_ids))[:TAIL]
        tail_prompts = [prompts[k // num_generations] for k in longest]
        tail_ids = [f"{k // num_generations}-{k % num_generations}" for k in longest]
        progress.stage(f"T={temp}: the tail ({len(longest)} longest requests), plain vs HistoSpec x {repeats}")
        row.update(_tail(lambda mode: make(model, mode, history, n_slots=TAIL), tail_prompts, tail_ids, epoch2[0], "",
                         repeats))
        if fp32 is not None:
            if fp32 is not model:
                progress.stage(f"T={temp}: the tail in fp32, plain vs HistoSpec x {repeats}")
                row.update(_tail(lambda mode: make(fp32, mode, history, n_slots=TAIL), tail_prompts, tail_ids,
                                 epoch2[0], "_fp32", repeats))
            progress.stage(f"T={temp}: identity check (fp32, {min(identity_prompts, len(prompts))} prompts x 2)")
            sub = prompts[:identity_prompts]
            p32 = SamplingParams(temperature=temp, max_tokens=identity_max_tokens, seed=seed + 2000)
            a, _ = rollout(make(fp32, "off", n_slots=8, length=identity_len), sub, 2, p32)
            b, _ = rollout(make(fp32, "histospec", history, n_slots=8, length=identity_len), sub, 2, p32)
            row["identity_rate"] = round(identity(a, b), 3)
            row["identity_n"] = len(a)
        results[str(temp)] = row
        # The whole bench takes minutes per temperature: say where it is (stderr; stdout is the table and
        # the JSON line).
        print(f"[bench spec] T={temp}: plain {row['plain_tok_s']} tok/s, HistoSpec {row['spec_tok_s']} tok/s "
              f"({row['speedup']}x), tail {row['tail_speedup']}x, identity fp32 {row.get('identity_rate', '-')} "
              f"({time.perf_counter() - started:.0f} s so far)", file=sys.stderr, flush=True)
    progress.done()
    return {"model": model_name, "dtype": dtype, **device_fields(device),
            "slots": slots, "num_prompts": len(prompts), "num_generations": num_generations,
            "max_tokens": max_tokens, "draft_rule": draft_rule, "max_draft_tokens": max_draft_tokens, "reward_aware_drafting": reward_aware,
            "repeats": repeats,
            "epoch_seeds": epoch_seeds, "ceiling": ceiling,
            "data": f"history-from:{history_from}" if history_from else (f"builtin:{data or 'arithmetic'}" if data is None or data in BUILTIN_TASKS else data),
            "temperatures": results}


def print_table(summary: dict, console: Console | None = None) -> None:
    console = console or table_console()
    t = Table(title=f"HistoSpec, epoch 2: {summary['model']} {summary['dtype']}, {summary['num_prompts']} prompts x "
                    f"{summary['num_generations']}, {summary['slots']} slots, max_tokens={summary['max_tokens']}")
    cols = ["T", "entropy", "plain tok/s", "spec tok/s", "speedup", "tail speedup", "tail fp32", "accept",
            "tok/seq/fwd", "identity fp32 check", f"identity {summary['dtype']} runs"]
    for c in cols:
        t.add_column(c, justify="right")
    for temp, r in summary["temperatures"].items():
        t.add_row(temp, str(r["entropy"]), str(r["plain_tok_s"]), str(r["spec_tok_s"]), f"{r['speedup']}x",
                  f"{r['tail_speedup']}x", f"{r['tail_speedup_fp32']}x" if "tail_speedup_fp32" in r else "-",
                  str(r["accept_rate"]), str(r["tokens_per_forward"]),
                  str(r.get("identity_rate", "-")), str(r[f"identity_rate_{summary['dtype']}"]))
    console.print(t)
    for temp, r in summary["temperatures"].items():
        if "reward_aware" in r:
            ra = r["reward_aware"]
            console.print(f"T={temp} reward-aware drafting: {ra['tok_s']} tok/s ({ra['speedup']}x plain), "
                          f"{ra['vs_histospec_paired']}x plain-priority HistoSpec by rounds (same cost model), "
                          f"accept {ra['accept_rate']} vs {r['accept_rate']}, drafted {ra['drafted']} vs "
                          f"{r['drafted']}, tok/seq/fwd {ra['tokens_per_forward']} vs {r['tokens_per_forward']}, "
                          f"identity with plain {ra['identity_vs_plain']}")
    for name, c in summary["ceiling"].items():
        console.print(f"ceiling ({name.replace('_', ' ')}): a perfect drafter, every sequence committing "
                      f"{c['tokens_per_seq']} tokens per forward, would be {c['speedup']}x plain by the measured "
                      f"forward costs")
