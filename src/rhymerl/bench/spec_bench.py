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

import json
import sys
import time
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from rhymerl.bench.console import device_fields, table_console
from rhymerl.bench.goals import PARTIAL
from rhymerl.bench.graph_capture import GraphCaptures
from rhymerl.bench.progress import Progress
from rhymerl.bench.spec_engines import SpecEngines
from rhymerl.bench.spec_figures import figures, identity, reward_aware_figures, speedup
from rhymerl.bench.spec_inputs import history_of_run, load_prompts
from rhymerl.data.dataset import BUILTIN_TASKS
from rhymerl.engine.engine import Engine
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.errors import UserError
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


@dataclass
class SpecBenchConfig:
    """What `rhymerl bench spec` runs: its options (`rhymerl bench spec --help` words each)."""

    model_name: str = "smollm2-135m"
    dtype: str = "auto"
    temperatures: tuple[float, ...] = (0.3, 0.6, 1.0)
    num_prompts: int = 16
    num_generations: int = 8
    slots: int = 32
    max_tokens: int = 256
    data: str | None = None
    identity_prompts: int = 16  # 0 = no fp32 identity check
    identity_max_tokens: int = 96
    seed: int = 0
    draft_rule: str = "cost"
    max_draft_tokens: int | None = None  # None: as a training run in this dtype (DEFAULT_MAX_DRAFT_TOKENS)
    history_from: str | None = None  # a training run's directory: its policy, history and prompts
    repeats: int = 3
    epoch_seeds: int = 1
    device: str | None = None
    reward_aware: bool = False


class _SpecBench:
    """One `bench spec` run: the model(s) and prompts loaded, the engines' shapes measured, then per
    temperature the epochs and their figures (`temperature`)."""

    def __init__(self, cfg: SpecBenchConfig):
        if cfg.repeats < 1:
            raise UserError(f"--repeats must be at least 1, got {cfg.repeats}")
        if cfg.epoch_seeds < 1:
            raise UserError(f"--epoch-seeds must be at least 1, got {cfg.epoch_seeds}")
        self.cfg = cfg
        self.run_history, self.model_name = None, cfg.model_name
        if cfg.history_from is not None:
            self.run_history, ckpt = history_of_run(cfg.history_from)
            self.model_name = str(ckpt)  # the run's policy at that checkpoint: a Hugging Face directory
        self.dtype = resolve_dtype(cfg.dtype, cfg.device or default_device())  # the JSON names what ran
        # as a training run in this dtype
        self.max_draft_tokens = cfg.max_draft_tokens or DEFAULT_MAX_DRAFT_TOKENS[self.dtype]
        separate_fp32 = bool(cfg.identity_prompts) and self.dtype != "fp32"  # progress: the stages, counted
        per_temp = ((self.run_history is None) + (2 + cfg.reward_aware) * cfg.epoch_seeds * cfg.repeats + 1
                    + separate_fp32 + bool(cfg.identity_prompts))
        self.progress = Progress("spec", 3 + separate_fp32 + bool(cfg.identity_prompts)
                                 + len(cfg.temperatures) * per_temp)
        self.progress.stage(f"loading {self.model_name} ({self.dtype}{' and fp32' if separate_fp32 else ''})")
        self.model, tokenizer, _ = load_pretrained(self.model_name, self.dtype, cfg.device)
        self.device = next(self.model.parameters()).device
        if self.run_history is not None:  # most recently used
            self.prompts = [self.run_history.prompt(k) for k in self.run_history.keys()][-cfg.num_prompts:]
        else:
            self.prompts = load_prompts(tokenizer, cfg.data, cfg.num_prompts, cfg.seed)
        self.max_len = max(map(len, self.prompts)) + cfg.max_tokens
        self.fp32 = None  # the identity check's model (and the fp32 tail's, when the timed runs are not fp32)
        if cfg.identity_prompts:
            self.fp32 = self.model if self.dtype == "fp32" else load_pretrained(self.model_name, "fp32", self.device)[0]
        self.identity_len = max(map(len, self.prompts[:cfg.identity_prompts]), default=0) + cfg.identity_max_tokens
        self.engines = SpecEngines(tokenizer, cfg.draft_rule, self.max_draft_tokens)

    def make(self, m, spec: str, history=None, n_slots: int | None = None, length: int | None = None,
             aware: bool = False) -> Engine:
        return self.engines.make(m, spec, history, n_slots=n_slots or self.cfg.slots, length=length or self.max_len,
                                 aware=aware)

    def measure(self) -> dict:
        """Untimed, before any timed run: every engine shape's cost model and graphs. Returns the ceiling, a perfect
        drafter's speed-up by those costs (`CostModel.ceiling`: no drafter beats it), full batch and tails."""
        timed = {"full": (self.model, self.cfg.slots), "tail": (self.model, TAIL)}  # by name
        if self.fp32 is not None and self.fp32 is not self.model:
            timed["tail_fp32"] = (self.fp32, TAIL)
        shapes = [(m, n_slots, self.max_len) for m, n_slots in timed.values()]
        if self.fp32 is not None:
            shapes.append((self.fp32, 8, self.identity_len))  # the identity check
        for m, n_slots, length in shapes:
            self.progress.stage(f"measuring the cost model ({n_slots} slots, {length} tokens, "
                                f"{'fp32' if m is self.fp32 else self.dtype})")
            self.make(m, "histospec", n_slots=n_slots, length=length)
        # every draw kind the runs use (greedy at T=0; one temperature's graphs serve the others)
        self.captures = GraphCaptures([r.backend for r in self.engines.runners.values()], max(map(len, self.prompts)),
                                      [SamplingParams(temperature=t) for t in self.cfg.temperatures])
        ceiling = {}
        for name, (m, n_slots) in timed.items():
            cost = self.engines.costs[(id(m), n_slots, self.max_len)]
            speedup, t = cost.ceiling(n_slots, self.max_draft_tokens + 1)
            ceiling[name] = {"speedup": round(speedup, 3), "tokens_per_seq": t}
        return ceiling

    def temperature(self, temp: float) -> dict:
        """The figures of one temperature: epoch 2's timed rounds, the long tail, the fp32 identity check."""
        cfg = self.cfg
        history = self.run_history if self.run_history is not None else self.epoch1(temp)
        epoch2 = [SamplingParams(temperature=temp, max_tokens=cfg.max_tokens, seed=cfg.seed + 2000 + k)
                  for k in range(cfg.epoch_seeds)]
        runs, pairs = self.epoch2(temp, history, epoch2)
        row = figures(runs, pairs, self.dtype)
        row = {"entropy": round(mean_entropy(self.model, self.prompts, runs[0]["off"][0], cfg.num_generations,
                                             temp), 3), **row}
        if cfg.reward_aware:
            row["reward_aware"] = reward_aware_figures(runs, pairs)
        if cfg.epoch_seeds > 1:
            row["speedup_by_seed"] = [speedup(r["histospec"][2][0].generated_tokens, r["histospec"][1],
                                               r["off"][2][0].generated_tokens, r["off"][1]) for r in runs]
        row.update(self.tails(temp, history, runs[0]["off"][0], epoch2[0]))
        return row

    def epoch1(self, temp: float) -> HistoryStore:
        """Epoch 1, plain decoding with its own seed, recorded as the history (as the previous RL step)."""
        cfg = self.cfg
        history = HistoryStore()
        self.progress.stage(f"T={temp}: epoch 1 (the history)")
        epoch1 = SamplingParams(temperature=temp, max_tokens=cfg.max_tokens, seed=cfg.seed + 1000)
        outs1, _ = rollout(self.make(self.model, "off"), self.prompts, cfg.num_generations, epoch1)
        n = cfg.num_generations
        for i, p in enumerate(self.prompts):
            history.record_rollout(p, [o.token_ids for o in outs1[i * n : (i + 1) * n]])
        return history

    def epoch2(self, temp: float, history: HistoryStore, epoch2: list[SamplingParams]) -> tuple[list, list]:
        """Plain and HistoSpec alternate `repeats` times per epoch seed, each keeping its fastest run: this
        machine's speed drifts by several percent over minutes, and noise only ever adds time. With several
        epoch seeds the figures are totals over the seeds: in bf16 the two sides sample different responses
        (see identity_rate_bf16), and one sample's lengths move tokens/s by a few percent either way. With
        --reward-aware, a third run in every round drafts reward-aware: the same cost model (measured once)
        and so the same budget as the plain-priority HistoSpec run beside it, a paired comparison.
        Returns (per epoch seed: {mode: (outputs, seconds, (EngineStats, SpecStats))} of the fastest run,
        every round's tokens/s by mode)."""
        cfg = self.cfg
        modes = ("off", "histospec", "reward_aware")[:2 + cfg.reward_aware]
        runs, pairs = [], []
        for params in epoch2:
            best: dict[str, tuple] = {}
            for rep in range(cfg.repeats):
                tok_s = {}
                for mode in modes:
                    self.progress.stage(f"T={temp}: epoch 2 seed {params.seed} repeat {rep + 1}/{cfg.repeats}: "
                                        f"{'plain' if mode == 'off' else mode}")
                    engine = self.make(self.model, "off" if mode == "off" else "histospec", history,
                                       aware=mode == "reward_aware")
                    outs, seconds = rollout(engine, self.prompts, cfg.num_generations, params)
                    stats = engine.take_stats()  # (EngineStats, SpecStats or None)
                    tok_s[mode] = stats[0].generated_tokens / seconds
                    if mode not in best or seconds < best[mode][1]:
                        best[mode] = (outs, seconds, stats)
                pairs.append(tok_s)
            runs.append(best)
        return runs, pairs

    def tails(self, temp: float, history: HistoryStore, plain: list, params: SamplingParams) -> dict:
        """The long tail (first epoch seed): the TAIL longest requests of the plain run, alone in TAIL slots,
        plain vs HistoSpec. In bf16 the two runs of those requests diverge (a 1-token and a many-token forward
        round differently), so they generate different lengths and the bf16 figure compares different work;
        in fp32 they generate the same tokens (checked), so the fp32 figure is like for like. Then the fp32
        identity check on a subset of the prompts."""
        cfg, n = self.cfg, self.cfg.num_generations
        longest = sorted(range(len(plain)), key=lambda k: -len(plain[k].token_ids))[:TAIL]
        tail_prompts = [self.prompts[k // n] for k in longest]
        tail_ids = [f"{k // n}-{k % n}" for k in longest]
        self.progress.stage(f"T={temp}: the tail ({len(longest)} longest requests), plain vs HistoSpec x {cfg.repeats}")
        out = _tail(lambda mode: self.make(self.model, mode, history, n_slots=TAIL), tail_prompts, tail_ids, params,
                    "", cfg.repeats)
        fp32 = self.fp32
        if fp32 is None:
            return out
        if fp32 is not self.model:
            self.progress.stage(f"T={temp}: the tail in fp32, plain vs HistoSpec x {cfg.repeats}")
            out.update(_tail(lambda mode: self.make(fp32, mode, history, n_slots=TAIL), tail_prompts, tail_ids,
                             params, "_fp32", cfg.repeats))
        self.progress.stage(f"T={temp}: identity check (fp32, {min(cfg.identity_prompts, len(self.prompts))} "
                            f"prompts x 2)")
        sub = self.prompts[:cfg.identity_prompts]
        p32 = SamplingParams(temperature=temp, max_tokens=cfg.identity_max_tokens, seed=cfg.seed + 2000)
        a, _ = rollout(self.make(fp32, "off", n_slots=8, length=self.identity_len), sub, 2, p32)
        b, _ = rollout(self.make(fp32, "histospec", history, n_slots=8, length=self.identity_len), sub, 2, p32)
        out["identity_rate"] = round(identity(a, b), 3)
        out["identity_n"] = len(a)
        return out


def run(cfg: SpecBenchConfig) -> dict:
    """The bench (see the module doc): its summary, the figures per temperature."""
    bench = _SpecBench(cfg)
    ceiling = bench.measure()
    results, started = {}, time.perf_counter()
    for temp in cfg.temperatures:
        row = results[str(temp)] = bench.temperature(temp)
        # The whole bench takes minutes per temperature: say where it is (stderr; stdout is the table and
        # the JSON line).
        print(f"[bench spec] T={temp}: plain {row['plain_tok_s']} tok/s, HistoSpec {row['spec_tok_s']} tok/s "
              f"({row['speedup']}x), tail {row['tail_speedup']}x, identity fp32 {row.get('identity_rate', '-')} "
              f"({time.perf_counter() - started:.0f} s so far)", file=sys.stderr, flush=True)
        # and the rows so far as JSON, for a run cut short (`rhymerl.bench.goals` reads the last such line)
        print(PARTIAL + json.dumps({**device_fields(bench.device), "repeats": cfg.repeats, "partial": True,
                                    "temperatures": results}), file=sys.stderr, flush=True)
    bench.progress.done()
    data = cfg.data
    return {"model": bench.model_name, "dtype": bench.dtype, **device_fields(bench.device),
            "slots": cfg.slots, "num_prompts": len(bench.prompts), "num_generations": cfg.num_generations,
            "max_tokens": cfg.max_tokens, "draft_rule": cfg.draft_rule, "max_draft_tokens": bench.max_draft_tokens,
            "reward_aware_drafting": cfg.reward_aware, "repeats": cfg.repeats,
            "epoch_seeds": cfg.epoch_seeds, "ceiling": ceiling, **bench.captures.fields(),
            "data": f"history-from:{cfg.history_from}" if cfg.history_from else (
                f"builtin:{data or 'arithmetic'}" if data is None or data in BUILTIN_TASKS else data),
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
    if "graphs_captured" in summary:  # a CUDA backend: its captures, untimed, before the timed runs
        console.print(f"graphs: {summary['graphs_captured']} captured before the timed runs "
                      f"({summary['graphs_capture_s']} s of captures; capture_every_shape {summary['capture_s']} s), "
                      f"{summary['graphs_captured_later']} captured and {summary['shapes_first_run_later']} shapes "
                      f"first run by the timed runs")
    for name, c in summary["ceiling"].items():
        console.print(f"ceiling ({name.replace('_', ' ')}): a perfect drafter, every sequence committing "
                      f"{c['tokens_per_seq']} tokens per forward, would be {c['speedup']}x plain by the measured "
                      f"forward costs")
