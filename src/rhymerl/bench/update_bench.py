"""`rhymerl bench update`: seconds per policy update in one process and at 2 ranks (`train.world_size=2`, FSDP2
and DDP over gloo on a CPU, NCCL on CUDA), and the bytes each rank hands to the collectives per update.

Every setup updates the same model on the same synthetic batches: the default job's shape (prompts_per_step x
num_generations completions, lengths drawn between half and all of max_completion_length, random prompts of
`prompt_len` tokens, non-zero advantages), `warmup` untimed updates then `steps` timed ones, the median
reported. One process uses every core; 2 ranks get half each (on 2 cores: one thread a rank), so on a CPU
the ratio is the collectives' and processes' overhead, not a speed-up. Ranks split micro-batches, and
`train.micro_batch_size` is per rank: the default 8 cuts the default job's 16 sequences into 2 micro-batches,
one a rank (with 16, one rank would run the batch and the other only a zero-weighted copy). `one_1thread`
is the one process on one thread, what each of the 2 ranks has on 2 cores: on a machine shared with other
work, two threads that wait on each other at every operation can be slowed far more than two processes of
one thread, and this setup tells that apart from the ranks' own cost. A rank's time includes gathering the
full weights into the driver's copy (the weight sync's source); one process has no such copy to make.

Exactness: every setup starts from the same weights and runs the same batches, so each multi-rank setup's
losses, grad norms and metrics per update, and its final weights, are compared with one process's (`exactness`;
`--check` fails the command when one is past 1e-5: the issue's goal for fp32, docs/design.md section 4).

Volumes are counted in rank 0 by `rl.sharding.CommCounter` (each collective's full tensor: an all-gather's
output, a reduce-scatter's input, an all-reduce's tensor) over one timed update; the weights' gather after
the update (FSDP: every parameter once, through DTensor's own collectives, which the counter does not see)
is the parameters' size, computed. A ring all-reduce of B bytes sends about 2 (N-1)/N B per rank; an
all-gather or reduce-scatter (N-1)/N B: at N GPUs, time ~ those bytes / the link's bandwidth.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from rhymerl.bench.console import device_fields, table_console
from rhymerl.bench.progress import Progress
from rhymerl.config import TrainSection
from rhymerl.model.fetch import resolve_model_dir
from rhymerl.model.weights import load_decoder
from rhymerl.process import deterministic_algorithms, setup_process
from rhymerl.rl.logprobs import Sample
from rhymerl.rl.ranks import RankGroup
from rhymerl.rl.trainer import PolicyTrainer

# name -> (ranks, strategy, torch threads of the one process: None = every core)
SETUPS = {"one": (1, None, None), "one_1thread": (1, None, 1), "fsdp2": (2, "fsdp", None), "ddp2": (2, "ddp", None)}
TEMPERATURE = 1.0


def batch(step: int, prompts: int, generations: int, prompt_len: int, max_len: int, vocab: int) -> list[Sample]:
    """Step `step`'s synthetic batch: `prompts` groups of `generations` completions, keyed by the step."""
    g = torch.Generator().manual_seed(step)
    out = []
    for _ in range(prompts):
        prompt = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
        for _ in range(generations):
            n = int(torch.randint(max_len // 2, max_len + 1, (1,), generator=g))
            comp = torch.randint(0, vocab, (n,), generator=g).tolist()
            old = (-torch.rand(n, generator=g) * 3).tolist()
            out.append(Sample(prompt, comp, old, float(torch.randn(1, generator=g)), temperature=TEMPERATURE))
    return out


def run_setup(name: str, model, cfg: TrainSection, batches: list, warmup: int, progress: Progress) -> dict:
    ranks, strategy, threads = SETUPS[name]
    progress.stage(f"{name}: start")
    all_threads = torch.get_num_threads()
    torch.set_num_threads(threads or all_threads)
    if ranks == 1:
        device = "cuda" if torch.cuda.is_available() else "cpu"  # the ranks' devices: one GPU each, or the CPU
        trainer = PolicyTrainer(copy.deepcopy(model).to(device).train(), cfg, TEMPERATURE, cfg.micro_batch_size * 8)
    else:
        trainer = RankGroup(copy.deepcopy(model), TrainSection(**{**cfg.__dict__, "world_size": ranks,
                                                                  "strategy": strategy}),
                            TEMPERATURE, cfg.micro_batch_size * 8, count_comm=True)
    times, comm, every = [], {}, []
    try:
        for i, b in enumerate(batches):
            progress.stage(f"{name}: update {i + 1}/{len(batches)}" + (" (warm-up)" if i < warmup else ""))
            t0 = time.perf_counter()
            with deterministic_algorithms():
                metrics = trainer.update(b)
            every.append({k: v for k, v in metrics.items() if not k.startswith("comm_bytes/")})
            if i >= warmup:
                times.append(time.perf_counter() - t0)
                comm = {k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith("comm_bytes/")}
        weights = torch.cat([p.detach().flatten().cpu() for p in trainer.model.parameters()])
    finally:
        trainer.close()
        torch.set_num_threads(all_threads)
    return {"ranks": ranks, "strategy": strategy, "update_s": statistics.median(times), "update_s_all": times,
            "comm_bytes": comm, "pg_loss_last": metrics["actor/pg_loss"], "_metrics": every, "_weights": weights}


def exactness(one: dict, other: dict) -> dict:
    """How far `other`'s updates are from one process's, from the same weights on the same batches: the
    largest |a - b| / max(1, |a|) over the updates of the loss, the grad norm and every metric, and the final
    weights' ||w2 - w1|| / ||w1||. The goal (docs/design.md, section 4): each <= 1e-5 in fp32."""
    def rel(keys):
        return max(abs(a[k] - b[k]) / max(1.0, abs(a[k])) for a, b in zip(one["_metrics"], other["_metrics"])
                   for k in keys)
    w1, w2 = one["_weights"], other["_weights"]
    return {"pg_loss_rel": rel(["actor/pg_loss"]), "grad_norm_rel": rel(["actor/grad_norm"]),
            "metrics_rel": rel(one["_metrics"][0].keys()), "weights_rel": float((w2 - w1).norm() / w1.norm())}


def run(model: str = "smollm2-135m", dtype: str = "fp32", prompts: int = 2, generations: int = 8,
        prompt_len: int = 64, max_completion_length: int = 128, micro_batch_size: int = 8, steps: int = 3,
        warmup: int = 1, setups: tuple[str, ...] = tuple(SETUPS), progress: Progress | None = None) -> dict:
    """The summary dict whose JSON is the bench's last line."""
    progress = progress or Progress("update", total=len(setups) * (steps + warmup + 1))
    setup_process(0, "cpu")
    progress.stage("load the model")
    decoder = load_decoder(resolve_model_dir(model), torch.float32, "cpu")
    cfg = TrainSection(micro_batch_size=micro_batch_size, dtype=dtype, total_steps=steps + warmup)
    batches = [batch(s, prompts, generations, prompt_len, max_completion_length, decoder.cfg.vocab_size)
               for s in range(steps + warmup)]
    results = {name: run_setup(name, decoder, cfg, batches, warmup, progress) for name in setups}
    progress.done()
    param_bytes = sum(p.numel() * p.element_size() for p in decoder.parameters())
    base = results.get("one", {}).get("update_s")
    for r in results.values():
        r["vs_one"] = r["update_s"] / base if base else None
        if r["strategy"] == "fsdp":
            r["comm_bytes"]["weights_gather_computed"] = param_bytes
        if base and r["ranks"] > 1:
            r["exactness"] = exactness(results["one"], r)
    for r in results.values():
        del r["_metrics"], r["_weights"]
    return {"bench": "update", "model": model, "dtype": dtype, "prompts": prompts, "generations": generations,
            "prompt_len": prompt_len, "max_completion_length": max_completion_length,
            "micro_batch_size": micro_batch_size, "steps": steps, "warmup": warmup, "param_bytes": param_bytes,
            "machine": device_fields("cpu"), "setups": results}


def missed(summary: dict, tol: float = 1e-5) -> list[str]:
    """The exactness figures past `tol` (`--check`), one line each; [] when every one is within."""
    return [f"{name}: {k} {v:.2e} > {tol:g}" for name, r in summary["setups"].items()
            for k, v in r.get("exactness", {}).items() if v > tol]


def print_table(summary: dict, console: Console | None = None) -> None:
    console = console or table_console()
    m = summary["machine"]
    t = Table(title=f"policy update by world size: {summary['model']} {summary['dtype']}, {summary['prompts']} x "
                    f"{summary['generations']} completions of <= {summary['max_completion_length']} tokens, "
                    f"micro_batch_size {summary['micro_batch_size']}, median of {summary['steps']} after "
                    f"{summary['warmup']} warm-up, on {m.get('cpu', m['device'])}")
    for col in ("setup", "s / update", "vs one", "all-gather MB", "reduce-scatter MB", "all-reduce MB",
                "weights gather MB", "loss rel", "grad norm rel", "weights rel"):
        t.add_column(col, justify="right")
    mb = lambda v: f"{v / 1e6:.1f}" if v is not None else "-"  # noqa: E731
    for name, r in summary["setups"].items():
        c = r["comm_bytes"]
        t.add_row(name, f"{r['update_s']:.2f}", f"{r['vs_one']:.3f}x" if r["vs_one"] else "-",
                  mb(c.get("all_gather")), mb(c.get("reduce_scatter")), mb(c.get("all_reduce")),
                  mb(c.get("weights_gather_computed")),
                  *(f"{e[k]:.1e}" if e else "-" for e in [r.get("exactness")] for k in ("pg_loss_rel", "grad_norm_rel",
                                                                                        "weights_rel")))
    console.print(t)
    console.print("volumes: bytes rank 0 hands to each collective per update (an all-gather's output, a "
                  "reduce-scatter's input); the weights' gather is the parameters' size, computed; rel: the largest "
                  "|a - b| / max(1, |a|) over the updates against one (loss, grad norm), the final ||w2 - w1|| / ||w1||")
