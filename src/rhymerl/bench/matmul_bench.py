"""`rhymerl bench matmul`: the engine's bf16 matmuls on AMX tiles against oneDNN's prepacked matmul.

Every matmul of one forward (each layer's qkv, o_proj, gate/up and down, then the lm_head), in order, for
a step of `rows` tokens: the weights stream from memory as in a real step (the model is far larger than
the caches). The two kernels alternate `repeats` times and each keeps its median; the table also gives
the largest difference between their outputs, relative to the largest output.
"""

from __future__ import annotations

import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from rhymerl.bench.console import table_console
from rhymerl.bench.progress import Progress
from rhymerl.engine.backends import native
from rhymerl.engine.backends.cpu_weights import model_weights
from rhymerl.errors import UserError
from rhymerl.model.decoder import Linear
from rhymerl.model.fetch import resolve_model_dir
from rhymerl.model.weights import load_decoder


def _forward_linears(model) -> list[Linear]:
    out = []
    for b in model.layers:
        out += [b.self_attn.qkv_proj, b.self_attn.o_proj, b.mlp.gate_up_proj, b.mlp.down_proj]
    return out + [model.lm_head]


def run(model_name: str = "smollm2-135m", rows=(1, 8, 32, 64, 96, 128), repeats: int = 7, seed: int = 0) -> dict:
    if repeats < 1:
        raise UserError(f"--repeats must be at least 1, got {repeats}")
    ops = native.ops()
    if ops is None or not ops.tile_linear_supported():
        # not a bug: this machine cannot run the bench (as --device cuda without a GPU), one line says why
        raise UserError("bench matmul needs the fused CPU kernels on a CPU with AMX-BF16 tiles "
                        "(ops.tile_linear_supported() is false here)")
    progress = Progress("matmul", 1 + len(rows))
    progress.stage(f"loading {model_name} and packing its weights")
    model = load_decoder(resolve_model_dir(model_name), torch.bfloat16, "cpu")  # no tokenizer needed
    weights = model_weights(model)
    if not weights.packable():
        raise UserError("bench matmul: oneDNN has no prepacked bf16 matmul on this CPU")
    if not weights.tiles_fit():
        raise UserError(f"bench matmul: --model {model_name} has a weight that the tile layout does not take")
    linears = _forward_linears(model)
    g = torch.Generator().manual_seed(seed)
    results = {}
    with torch.inference_mode():
        onednn = [weights.onednn(lin) for lin in linears]
        tiles = [weights.tiles(lin, ops.pack_tiles) for lin in linears]
        for m in rows:
            progress.stage(f"{m} rows: oneDNN vs tiles, {repeats} repeats")
            xs = [torch.randn(m, lin.in_features, generator=g).to(torch.bfloat16) for lin in linears]

            def run_onednn():
                return [torch.ops.mkldnn._linear_pointwise(x, w, lin.bias, "none", [], "")
                        for x, w, lin in zip(xs, onednn, linears)]

            def run_tiles():
                return [ops.tile_linear(x, t, lin.bias) for x, t, lin in zip(xs, tiles, linears)]

            times = {"onednn": [], "tiles": []}
            outs = {"onednn": run_onednn(), "tiles": run_tiles()}  # warm-up, and the outputs compared
            for _ in range(repeats):
                for name, fn in (("onednn", run_onednn), ("tiles", run_tiles)):
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
            diff = max(float((a.float() - b.float()).abs().max()) / max(float(a.float().abs().max()), 1e-30)
                       for a, b in zip(outs["onednn"], outs["tiles"]))
            onednn_ms = statistics.median(times["onednn"]) * 1e3
            tiles_ms = statistics.median(times["tiles"]) * 1e3
            results[str(m)] = {"onednn_ms": round(onednn_ms, 2), "tiles_ms": round(tiles_ms, 2),
                               "speedup": round(onednn_ms / tiles_ms, 3), "max_rel_diff": round(diff, 5)}
    progress.done()
    return {"model": model_name, "dtype": "bf16", "device": "cpu", "threads": torch.get_num_threads(),
            "matmuls_per_forward": len(linears), "repeats": repeats, "rows": results}


def print_table(summary: dict, console: Console | None = None) -> None:
    console = console or table_console()
    t = Table(title=f"one forward's {summary['matmuls_per_forward']} matmuls: {summary['model']} bf16, "
                    f"{summary['threads']} threads, median of {summary['repeats']}")
    for c in ("rows", "oneDNN ms", "tiles ms", "speedup", "max rel diff"):
        t.add_column(c, justify="right")
    for m, r in summary["rows"].items():
        t.add_row(m, str(r["onednn_ms"]), str(r["tiles_ms"]), f"{r['speedup']}x", str(r["max_rel_diff"]))
    console.print(t)
