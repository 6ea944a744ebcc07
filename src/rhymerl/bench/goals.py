"""The GPU goals of issue 34 beside the figures a run measured: `scripts/gpu_check.sh`'s summary.

It reads the last JSON line of `rhymerl bench engine` (one file per model) and `rhymerl bench spec`, and
pytest's closing line, and prints one row per goal (target, measured, baseline of the same run, met or not),
then one JSON object as the last line. A goal whose figure a run does not hold (a bench that failed, a mode
not run) is "not measured", never met.

    python -m rhymerl.bench.goals --engine ENGINE.json [--engine ...] --spec SPEC.json --tests PYTEST.log
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

PARTIAL = "[bench spec] rows so far: "  # the prefix of `bench spec`'s stderr line holding its finished rows
ENGINE_MODEL = "qwen2.5-1.5b-random"  # the engine goals' model
HF_MODES = ("eager", "static", "compiled")


@dataclass
class Goal:
    name: str
    target: str
    measured: float | None  # None: the run holds no such figure
    baseline: str  # what it is measured against, with its figure where there is one
    met: bool | None  # None: not measured


def last_json(text: str) -> dict | None:
    """The last line of `text` that parses as a JSON object (a bench's summary), or None."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def partial_rows(text: str) -> dict | None:
    """The last "rows so far" line of `bench spec`'s stderr (`spec_bench.PARTIAL`): the temperatures it
    finished, for a run cut short before its JSON line. None where there is none."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith(PARTIAL):
            try:
                return json.loads(line[len(PARTIAL):])
            except json.JSONDecodeError:
                return None
    return None


def pytest_counts(text: str) -> dict:
    """passed / failed / skipped / error counts from pytest's closing line (zeros where absent)."""
    lines = [l for l in text.strip().splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", l)]
    counts = {k: 0 for k in ("passed", "failed", "skipped", "error")}
    for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", lines[-1] if lines else ""):
        counts["error" if word.startswith("error") else word] = int(n)
    return counts


def _at_least(name, target, measured, baseline) -> Goal:
    return Goal(name, f">= {target}", measured, baseline, None if measured is None else measured >= target)


def engine_goals(engine: dict | None) -> list[Goal]:
    """Batch 1 at 60% of the bandwidth bound; 1.5x transformers' fastest mode at batch 1, 3x at batch 32."""
    rows = (engine or {}).get("batches", {})
    goals = []
    one = rows.get("1", {})
    bound = one.get("bound_tok_s")
    goals.append(_at_least("engine batch 1: share of the bandwidth bound", 0.60, one.get("ours_of_bound"),
                           f"bound {bound} tok/s" if bound else "bound not measured"))
    for batch, target in (("1", 1.5), ("32", 3.0)):
        row = rows.get(batch, {})
        rates = {m: row.get("hf_tok_s" if m == "eager" else f"hf_{m}_tok_s") for m in HF_MODES}
        rates = {m: r for m, r in rates.items() if r}
        fastest = max(rates, key=rates.get) if rates else None
        ours = row.get("ours_tok_s")
        ratio = round(ours / rates[fastest], 3) if fastest and ours else None
        base = f"transformers {fastest} {rates[fastest]} tok/s" if fastest else "no transformers mode ran"
        goals.append(_at_least(f"engine batch {batch}: x transformers' fastest mode", target, ratio, base))
    return goals


def spec_goals(spec: dict | None) -> list[Goal]:
    """2x at T=0.3 on the full batch, 3x in the tail, never below 0.98x (paired) at T=0.3, 0.6 and 1.0."""
    temps = (spec or {}).get("temperatures", {})
    t03 = temps.get("0.3", {})
    plain = f"plain {t03.get('plain_tok_s')} tok/s" if t03 else "T=0.3 not run"
    goals = [_at_least("HistoSpec T=0.3 full batch: speed-up", 2.0, t03.get("speedup"), plain),
             _at_least("HistoSpec T=0.3 tail: speed-up", 3.0, t03.get("tail_speedup"),
                       f"plain tail {t03.get('plain_tail_tok_s')} tok/s" if t03 else "T=0.3 not run")]
    paired = {t: temps.get(t, {}).get("speedup_paired") for t in ("0.3", "0.6", "1.0")}
    lowest = None if None in paired.values() else min(paired.values())
    repeats = (spec or {}).get("repeats")
    goals.append(_at_least("HistoSpec never slower: lowest paired speed-up, T=0.3/0.6/1.0", 0.98, lowest,
                           f"plain, same rounds ({repeats} repeats)" if repeats else "not run"))
    return goals


def host_goal(engines: list[dict]) -> Goal:
    """A plain 32-slot step under 0.5 ms of host time outside the forward (the smallest over the runs)."""
    figures = [(e.get("model"), e["batches"]["32"]["ours_host_ms"]) for e in engines
               if "ours_host_ms" in e.get("batches", {}).get("32", {})]
    best = min(figures, key=lambda f: f[1]) if figures else None
    return Goal("plain 32-slot step: host ms outside the forward", "< 0.5", best[1] if best else None,
                f"{best[0]}" if best else "no batch-32 run", None if best is None else best[1] < 0.5)


def summary(engines: list[dict], spec: dict | None, tests: dict | None, exits: dict | None = None) -> dict:
    """Every goal, with the tests' counts, the stages' exit statuses and how many goals were met."""
    engine = next((e for e in engines if e.get("model") == ENGINE_MODEL), None)
    goals = engine_goals(engine) + spec_goals(spec) + [host_goal(engines)]
    return {"goals": [asdict(g) for g in goals], "met": sum(g.met is True for g in goals), "of": len(goals),
            "not_measured": sum(g.met is None for g in goals), "tests": tests, "exits": exits or {},
            "device": next((x.get("gpu") for x in [*engines, spec or {}] if x.get("gpu")), None)}


def print_table(result: dict, out=None) -> None:
    """One row per goal, then the tests' counts (to `out`, stdout by default)."""
    out = out or sys.stdout
    width = max(len(g["name"]) for g in result["goals"])
    print(f"{'goal':<{width}}  {'target':>7}  {'measured':>9}  met  baseline (same run)", file=out)
    for g in result["goals"]:
        met = {True: "yes", False: "NO", None: "-"}[g["met"]]
        measured = "-" if g["measured"] is None else g["measured"]
        print(f"{g['name']:<{width}}  {g['target']:>7}  {measured!s:>9}  {met:>3}  {g['baseline']}", file=out)
    tests = result["tests"] or {}
    print(f"tests: {tests}; goals met: {result['met']} of {result['of']} ({result['not_measured']} not measured)",
          file=out)
    if result.get("exits"):
        print("stages' exit status (124: out of time): "
              + ", ".join(f"{k} {v}" for k, v in result["exits"].items()), file=out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rhymerl.bench.goals", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", type=Path, action="append", default=[], help="a `bench engine` output")
    p.add_argument("--spec", type=Path, help="a `bench spec` output")
    p.add_argument("--spec-progress", type=Path, help="its stderr: the temperatures it finished, when it was cut short")
    p.add_argument("--tests", type=Path, help="pytest's output")
    p.add_argument("--exits", default="", help="NAME=STATUS,...: each stage's exit status")
    args = p.parse_args(argv)

    def read(path):
        return path.read_text(errors="replace") if path and path.is_file() else ""

    engines = [j for j in (last_json(read(f)) for f in args.engine) if j]
    exits = dict(item.split("=", 1) for item in args.exits.split(",") if "=" in item)
    exits = {k: int(v) if v.lstrip("-").isdigit() else v for k, v in exits.items()}
    spec = last_json(read(args.spec)) or partial_rows(read(args.spec_progress))
    result = summary(engines, spec, pytest_counts(read(args.tests)) if args.tests else None,
                     exits)
    print_table(result)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
