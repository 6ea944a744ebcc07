"""`rhymerl bench engine`: our engine vs transformers `generate` on the same model, prompts and sampling, and
against the memory-bandwidth bound.

Tokens/s counts generated tokens up to and including EOS (or the length limit). transformers generates a
batch of `b` prompts at a time, left-padded, until its longest response ends: that is how a CPU user of
TRL without vLLM rolls out; it runs in the `--hf-modes` asked for (`rhymerl.bench.hf_generate`: eager, static
KV cache, static cache + torch.compile), on the first `--hf-batches` batches only (a rate is a rate, and its
eager mode is slow). Our engine runs the prompts through `b` slots with continuous batching; on a GPU it
captures a graph for every step shape first (`capture_s`, apart from the timed run).

Beside the rates: where a step's time goes (`step_fields`), and `kernels_per_step`, what a plain decode step
launches in the static step a CUDA graph replays (the forward, the draws and the walk), counted from its op
trace (`op_trace`) on any device, and
`kernels_per_verify_step`, a HistoSpec verification step's (trees of `VERIFY_TOKENS` tokens) at the same rows.

The bound: a decoding forward reads every weight once, so it cannot take less than weight bytes / memory
bandwidth (the bandwidth measured here, by a large copy on the device). At batch b that caps throughput at
b tokens per such forward; KV-cache reads and idle slots only lower the real figure.
"""

from __future__ import annotations

import statistics
import time

import torch
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM

from rhymerl.bench.console import device_fields, table_console
from rhymerl.bench.hf_generate import error_text, hf_generate, mode_keys, parse_hf_modes, warm_up
from rhymerl.bench.progress import Progress
from rhymerl.engine.backends import CudaBackend
from rhymerl.engine.backends.op_trace import OpTrace
from rhymerl.engine.backends.static_step import MIN_KEYS, StaticShapes, StaticStep, bucket_of
from rhymerl.engine.engine import Engine
from rhymerl.engine.kv_cache import KVCache
from rhymerl.engine.model_runner import ModelRunner
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.engine.stats import EngineStats
from rhymerl.errors import UserError
from rhymerl.model.pretrained import chat_prompt_ids, default_device, load_pretrained, parse_dtype, resolve_dtype
from rhymerl.tasks.arithmetic import make_problems, prompt_text

# 4 requests per slot from batch 8 up, as in an RL rollout (prompts x generations >> slots)
DEFAULT_PROMPTS = {1: 8, 8: 32, 32: 128, 128: 512}
DEFAULT_BATCHES = {"cpu": (1, 8, 32), "cuda": (1, 8, 32, 128)}
HF_BATCHES = 2  # transformers' side: at most this many batches per batch size (`run`)
VERIFY_TOKENS = 8  # `kernels_per_verify_step`: a verification step's trees, a token and 7 drafts (a bucket)


def default_batches(device: str | torch.device) -> list[int]:
    """The batch sizes run when `--batches` is not given: up to 128 on a GPU, up to 32 on a CPU (where 128
    slots of 256 tokens would take most of an hour)."""
    return list(DEFAULT_BATCHES["cuda" if torch.device(device).type == "cuda" else "cpu"])


def measure_bandwidth(device: str | torch.device, nbytes: int | None = None, repeats: int = 5) -> float:
    """The device's memory bandwidth in GB/s (1e9 bytes), measured: the best of `repeats` copies of an
    `nbytes` tensor (1 GiB on CUDA, 256 MiB on a CPU: far beyond the caches either way), counting the bytes
    read plus the bytes written."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    nbytes = nbytes or (1 << 30 if cuda else 1 << 28)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)  # ones, not empty: the pages exist before timing
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of dst
    best = float("inf")
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        if cuda:
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    if cuda:
        torch.cuda.empty_cache()  # hand the 2 GiB back: the engine checks its KV cache against free memory
    return 2 * nbytes / best / 1e9


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a decoding forward reads: every parameter once (a tied embedding is one matrix, read
    in full by the lm_head), except an untied input embedding, of which a forward gathers only its tokens' rows."""
    seen, total = set(), 0
    untied_embed = getattr(model, "embed_tokens", None)
    if untied_embed is not None and untied_embed.weight is getattr(getattr(model, "lm_head", None), "weight", None):
        untied_embed = None
    skip = {id(untied_embed.weight)} if untied_embed is not None else set()
    for p in model.parameters():  # parameters() yields a shared Parameter once
        if id(p) not in skip and p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


BACKENDS = ("auto", "static")  # `--backend`: the device's own (`select_backend`), or the CUDA graphs' steps run eagerly


class StepClock:
    """The host's time of each engine step (`EngineStats.host_s`, step by step), read between two steps
    (`Engine.generate`'s `between_steps`): its median is a load spike's-proof figure where the mean is not
    (`ours_host_ms_median`)."""

    def __init__(self, engine: Engine):
        self.engine, self.host_s = engine, []
        self._last: tuple[float, int] | None = None

    def __call__(self) -> None:
        s = self.engine.stats
        now = (s.host_s, s.forward_passes)
        if self._last is not None and now[1] == self._last[1] + 1:  # one forward since: a step's figure
            self.host_s.append(now[0] - self._last[0])
        self._last = now

    def median_ms(self) -> float | None:
        """The median step's host milliseconds; None before two steps."""
        return round(1e3 * statistics.median(self.host_s), 3) if self.host_s else None


def ours_generate(model, tokenizer, prompts, batch: int, params: SamplingParams, max_model_len: int,
                  backend: str = "auto") -> tuple[int, float, Engine, ModelRunner, tuple[int, float, int], StepClock]:
    """(generated tokens, seconds, the engine, the model runner it ran on, (graphs captured, seconds, shapes
    run) before the timed run, the timed run's per-step host times). The bench builds the runner and hands it to the
    engine, so that it can read the runner's backend: with `backend` "static", the CUDA backend's static mode
    on any device (the fixed-shape steps a GPU's graphs replay, run eagerly: on a CPU, the host's work of a
    GPU step, measurable there). Where that replays CUDA graphs, every step shape is captured first, untimed,
    with the draws of `params`' kind (`capture_every_shape`), as transformers' compiled path compiles in its
    warm-up: in RL the engine lives across steps, so captures are a start-up cost. `graphs_captured_timed`
    and `shapes_first_run_timed` (`step_fields`) show that the timed run captured nothing (the second also
    in "static" mode, where a CPU runs the shapes a GPU captures)."""
    if backend not in BACKENDS:
        raise UserError(f"bench engine: --backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    cache = KVCache.for_model(model, batch, max_model_len)
    runner = ModelRunner(model, cache, backend=CudaBackend(model, cache, "static") if backend == "static" else None)
    engine = Engine(model, tokenizer, num_slots=batch, max_model_len=max_model_len, runner=runner)
    capture = (0, 0.0, 0)
    if isinstance(runner.backend, CudaBackend):
        seconds = runner.backend.capture_every_shape(max(map(len, prompts)), [params])[1]
        # counted after the captures: the timed run's are the rest
        capture = (runner.backend.captured, seconds, runner.backend.first_runs)
    engine.take_stats()  # the timed run's counters start here
    clock = StepClock(engine)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params, between_steps=clock)
    seconds = time.perf_counter() - t0
    clock()  # the last step's figure
    return sum(len(o.token_ids) for o in outs), seconds, engine, runner, capture, clock


def kernels_per_step(runner: ModelRunner, rows: int, tokens: int = 1) -> int:
    """Kernels a plain decode step of `rows` slots launches in the static step a CUDA graph replays (forward,
    draws at temperature 1 and walk: `StaticStep.draw`): the computing aten ops of its op trace (`op_trace`),
    countable on any device. Run on a step of padding alone,
    which changes no committed key or value. `tokens` > 1: a HistoSpec verification step's, each row a tree
    of that many tokens, on a small cache of its own with room for their drafts. `runner`: the engine's,
    which the bench built (`ours_generate`)."""
    cache, model = runner.cache, runner.model
    if tokens > 1:
        cache = KVCache.for_model(model, cache.kv.shape[1], MIN_KEYS, tokens - 1)
    shapes = StaticShapes(cache)
    step = StaticStep(model, cache, False, bucket_of(rows, shapes.rows), tokens, shapes.keys[0])
    step.load([], [])
    with torch.inference_mode():  # a warm-up, as before a capture: the sampler makes its constants once
        step.draw(step.run(), SamplingParams())
    with torch.inference_mode(), OpTrace() as trace:
        step.draw(step.run(), SamplingParams())
    return trace.launches


def step_fields(stats: EngineStats, backend, capture: tuple[int, float, int] = (0, 0.0, 0),
                clock: StepClock | None = None) -> dict:
    """Where a step's time goes: in the forward and outside it (scheduling, drafting, sampling, commits); on a
    GPU, where the forward only queues its work, the wait for the device's results, and the host's time
    outside the forward (`ours_host_ms`: outside the forward, less that wait; on a CPU the two are one); and
    what the CUDA backend did (`capture`: graphs captured before the timed run, their seconds and the
    (bucket, draw kind) pairs run by then; then the graphs captured and the pairs first run during it, which
    should be none, replays, parts run eagerly). `stats`: the engine's
    counters of the timed run; `backend`: its runner's; `clock`: its per-step host times, whose median is
    `ours_host_ms_median`."""
    steps = max(stats.forward_passes, 1)
    outside = stats.busy_s - stats.forward_s
    out = {"ours_step_ms": round(1e3 * stats.busy_s / steps, 3),
           "ours_outside_forward_ms": round(1e3 * outside / steps, 3),
           "ours_host_ms": round(1e3 * stats.host_s / steps, 3)}
    if clock is not None and clock.host_s:
        out["ours_host_ms_median"] = clock.median_ms()
    if stats.device_wait_s:  # a GPU: the forward only queues work, the draws wait for it; the rest is the host's
        out.update(ours_device_wait_ms=round(1e3 * stats.device_wait_s / steps, 3),
                   ours_host_share=round(1 - stats.device_wait_s / max(stats.busy_s, 1e-9), 3))
    if isinstance(backend, CudaBackend):
        out.update(graphs_captured=capture[0], capture_s=round(capture[1], 2),
                   graphs_captured_timed=backend.captured - capture[0],
                   shapes_first_run_timed=backend.first_runs - capture[2], graph_replays=backend.replays,
                   eager_parts=backend.eager_parts)
    return out


def run(model_name: str = "smollm2-135m", dtype: str = "auto", batches=None, num_prompts: int | None = None,
        max_tokens: int = 256, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
        skip_hf: bool = False, device: str | None = None, hf_modes: str | list[str] = "eager",
        hf_batches: int = HF_BATCHES, backend: str = "auto") -> dict:
    """Our engine vs transformers `generate` in each of `hf_modes` (a list, or `--hf-modes`' text; none with
    `skip_hf`) at each batch size (default: `default_batches` of the device), with the bandwidth bound; the
    bench's summary (JSON-able). transformers runs `hf_batches` batches of the batch size at most (its
    `hf_prompts` first prompts): a rate is a rate, and its eager mode is the slow side (minutes at batch 1
    on a GPU for all of ours). `backend`: in BACKENDS (`ours_generate`)."""
    if backend not in BACKENDS:
        raise UserError(f"bench engine: --backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    if hf_batches < 1:
        raise UserError(f"bench engine: --hf-batches must be at least 1, got {hf_batches}")
    try:
        params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed)
    except ValueError as e:  # its range checks, naming the field: before the model loads
        raise UserError(f"bench engine: {e} (--temperature, --top-p, --max-tokens)") from None
    try:
        hf_modes = parse_hf_modes(hf_modes if isinstance(hf_modes, str) else ",".join(hf_modes), skip_hf)
    except ValueError as e:
        raise UserError(f"bench engine: {e}") from None
    batches = list(batches or default_batches(device or default_device()))
    dtype = resolve_dtype(dtype, device or default_device())  # the JSON names what ran
    warmed = [m for m in hf_modes if m != "eager"]  # the modes warmed up per batch size
    progress = Progress("engine", 3 + bool(hf_modes) + len(batches) * (1 + len(hf_modes) + len(warmed)))
    progress.stage(f"loading {model_name} ({dtype})")
    model, tokenizer, model_dir = load_pretrained(model_name, dtype, device)
    device = next(model.parameters()).device
    progress.stage(f"measuring the memory bandwidth ({device.type})")
    bandwidth, wbytes = measure_bandwidth(device), weight_bytes(model)
    bound_forward_s = wbytes / (bandwidth * 1e9)
    progress.note(f"{bandwidth:.1f} GB/s, {wbytes / 1e6:.1f} MB of weights: >= {1e3 * bound_forward_s:.3f} ms per forward")
    if hf_modes:
        progress.stage("loading the transformers model")
    hf_model = None if not hf_modes else \
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=parse_dtype(dtype)).to(device).eval()
    eos_ids = sorted(Engine(model, tokenizer, num_slots=1, max_model_len=8).eos_token_ids)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    counts = {b: num_prompts or DEFAULT_PROMPTS.get(b, 4 * b) for b in batches}
    # At least 128 problems, as before batch 128 existed: the same prompt set, hence the same max_model_len.
    problems = make_problems(max(128, *counts.values()), seed=seed)
    all_prompts = [chat_prompt_ids(tokenizer, prompt_text(p)) for p in problems]
    max_model_len = max(map(len, all_prompts)) + max_tokens
    # Warm both sides up once (first calls pay for allocator and kernel set-up); the static modes warm up per
    # batch size below.
    progress.stage("warm-up")
    warm, greedy8 = all_prompts[:2], SamplingParams(temperature=0, max_tokens=8)
    Engine(model, tokenizer, num_slots=2, max_model_len=max_model_len).generate(warm, greedy8)
    eager_error = None
    if "eager" in hf_modes:
        try:
            hf_generate(hf_model, warm, 2, greedy8, pad_id, eos_ids)
        except Exception as e:  # reported in every row, not a crash of the whole bench
            eager_error = error_text(e)
    results = {}
    for b in batches:
        prompts = all_prompts[: counts[b]]
        progress.stage(f"batch {b}: our engine, {len(prompts)} prompts")
        tok, sec, engine, runner, capture, clock = ours_generate(model, tokenizer, prompts, b, params, max_model_len,
                                                                 backend)
        ours_tok_s = tok / sec
        if capture[1]:
            progress.note(f"batch {b}: every step shape captured before the timed run, {capture[1]:.1f} s")
        bound_tok_s = b / bound_forward_s
        row = {"prompts": len(prompts), "ours_tokens": tok, "ours_s": round(sec, 2), "ours_tok_s": round(ours_tok_s, 1),
               "ours_forwards": engine.stats.forward_passes,
               "ours_forward_ms": round(1e3 * engine.stats.forward_s / max(engine.stats.forward_passes, 1), 3),
               "bound_tok_s": round(bound_tok_s, 1), "ours_of_bound": round(ours_tok_s / bound_tok_s, 3),
               **step_fields(engine.stats, runner.backend, capture, clock),
               "kernels_per_step": kernels_per_step(runner, b),
               "kernels_per_verify_step": kernels_per_step(runner, b, VERIFY_TOKENS)}
        hf_prompts = prompts[: hf_batches * b]
        if hf_modes:
            row["hf_prompts"] = len(hf_prompts)
        for mode in hf_modes:
            row.update(_hf_row(mode, hf_model, hf_prompts, b, params, pad_id, eos_ids, max_model_len, ours_tok_s,
                               progress, eager_error if mode == "eager" else None))
        results[str(b)] = row
    progress.done()
    return {"model": model_name, "dtype": dtype, **device_fields(device), "backend": backend, "max_tokens": max_tokens,
            "temperature": temperature, "top_p": top_p, "hf_modes": hf_modes,
            "bandwidth_gb_s": round(bandwidth, 1), "weight_bytes": wbytes,
            "bound_forward_ms": round(1e3 * bound_forward_s, 4), "batches": results}


def _hf_row(mode, hf_model, prompts, b, params, pad_id, eos_ids, max_model_len, ours_tok_s, progress, error) -> dict:
    """One mode's figures at batch `b`, or `{prefix}_error` when the mode fails (its warm-up included)."""
    prefix, speedup_key = mode_keys(mode)
    try:
        if error:
            raise RuntimeError(error)
        if mode != "eager":
            # Untimed and per batch size: a compiled static cache compiles (and captures) per batch shape.
            progress.stage(f"batch {b}: transformers {mode}, warm-up")
            warm_up(hf_model, prompts, b, params, pad_id, eos_ids, mode, max_model_len)
        progress.stage(f"batch {b}: transformers {mode}, {len(prompts)} prompts")
        htok, hsec = hf_generate(hf_model, prompts, b, params, pad_id, eos_ids, mode, max_model_len)
    except Exception as e:  # a mode that fails (no compiler, say) is a figure of its own, not a crash
        progress.note(f"batch {b}: transformers {mode} failed: {error_text(e)}")
        return {f"{prefix}_error": error or error_text(e)}
    return {f"{prefix}_tokens": htok, f"{prefix}_s": round(hsec, 2), f"{prefix}_tok_s": round(htok / hsec, 1),
            speedup_key: round(ours_tok_s / (htok / hsec), 2)}


def print_table(summary: dict, console: Console | None = None) -> None:
    """One row per batch size: ours, each transformers mode and our speedup over it, the bandwidth bound."""
    console = console or table_console()
    where = summary.get("gpu") or f"{summary['threads']} threads"
    title = (f"rollout throughput: {summary['model']} {summary['dtype']}, T={summary['temperature']}, "
             f"max_tokens={summary['max_tokens']}, {where}")
    if "bandwidth_gb_s" in summary:
        title += (f"\nbound: {summary['weight_bytes'] / 1e6:.1f} MB of weights / {summary['bandwidth_gb_s']} GB/s "
                  f"(measured) = {summary['bound_forward_ms']} ms per forward")
    t = Table(title=title)
    modes = summary.get("hf_modes", ["eager"])
    cols = ["batch", "prompts", "ours tok", "ours tok/s", "ours ms/step", "of it fwd", "host ms", "host ms med",
            "kernels/step", "kernels/verify", "capture s (untimed)"]
    for mode in modes:
        cols += [f"hf {mode} tok/s", f"vs {mode}"]
    for col in cols + ["bound tok/s", "% of bound"]:
        t.add_column(col, justify="right")
    errors = []
    for b, r in summary["batches"].items():
        cells = [b, str(r["prompts"]), str(r["ours_tokens"]), str(r["ours_tok_s"]), str(r.get("ours_step_ms", "-")),
                 str(r.get("ours_forward_ms", "-")), str(r.get("ours_host_ms", "-")),
                 str(r.get("ours_host_ms_median", "-")), str(r.get("kernels_per_step", "-")),
                 str(r.get("kernels_per_verify_step", "-")), str(r.get("capture_s", "-"))]
        for mode in modes:
            prefix, speedup_key = mode_keys(mode)
            if f"{prefix}_error" in r:
                errors.append(f"batch {b}, hf {mode}: {r[f'{prefix}_error']}")
            cells += [str(r.get(f"{prefix}_tok_s", "error" if f"{prefix}_error" in r else "-")),
                      f"{r[speedup_key]}x" if speedup_key in r else "-"]
        of_bound = r.get("ours_of_bound")
        cells += [str(r.get("bound_tok_s", "-")), f"{100 * of_bound:.1f}%" if of_bound is not None else "-"]
        t.add_row(*cells)
    console.print(t)
    for line in errors:
        console.print(line, markup=False)
