"""`rhymerl bench e2e --compare history`: the paper's own measure, the same GRPO job with history on and off;
`--compare stream`: the same job in one_step_off with `rollout.stream` on and off, history as `--history` says.

Both runs train the same model on the same prompts with the same seed, on the same Ray workers and in the same
rollout mode (`--mode`); with `--compare history` they differ only in whether rollout uses history:

- on: HistoSpec drafts (`rollout.speculative=histospec`), HistoPipe's split by predicted length
  (`rollout.schedule=histopipe`), and in the tail migration (`rollout.migration=true`, sync) or, in one_step_off,
  the stream (`rollout.stream=true`: a worker done with step t starts step t+1; migration off, which the stream
  replaces);
- off: plain decoding, verl's equal contiguous split (`static`), no migration, no stream.

With `--compare stream` both runs are one_step_off with the history settings of one side above (`--history`,
less the stream and migration), one with the stream and one without; `stream_speedup` is the second's median
seconds per step over the first's.

History changes how fast a rollout runs, never what it samples (docs/design.md, section 6), so in fp32 and sync
mode the two reward curves are identical and `reward_curve_max_abs_diff` is 0. `history_speedup` is the off
run's median seconds per step over the on run's, after the first `--skip-steps` steps (the first epoch has no
history, and the first steps hold the workers' start-up). No TRL run here: `bench e2e` without `--compare` is
the comparison with TRL.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from rhymerl.bench.console import table_console
from rhymerl.bench.progress import Progress
from rhymerl.config import load_config
from rhymerl.errors import UserError
from rhymerl.metrics import read_metrics
from rhymerl.model.fetch import resolve_model_dir
from rhymerl.rl.loop import TrainingRun

HISTORY = {"on": ["rollout.speculative=histospec", "rollout.schedule=histopipe"],
           "off": ["rollout.speculative=off", "rollout.schedule=static"]}
COMPARES = ("history", "stream")


def sides(compare: str, mode: str, history: str = "on") -> dict[str, list[str]]:
    """The two runs' settings, the faster one expected first (see the module doc)."""
    if compare == "stream":
        same = HISTORY[history] + ["rollout.migration=false"]
        return {"stream": same + ["rollout.stream=true"], "no_stream": same + ["rollout.stream=false"]}
    tail = ["rollout.stream=true", "rollout.migration=false"] if mode == "one_step_off" else ["rollout.migration=true"]
    return {"on": HISTORY["on"] + tail, "off": HISTORY["off"] + ["rollout.migration=false", "rollout.stream=false"]}

# Per step, from the run's metrics.jsonl: what the table and the JSON line show.
STEP_FIGURES = {"step_s": "timing_s/step", "rollout_s": "timing_s/rollout", "update_s": "timing_s/update",
                "reward": "critic/rewards/mean", "response_length": "response_length/mean",
                "bubble_ratio": "rollout/bubble_ratio"}


def _steps(run_dir: Path) -> list[dict]:
    """Each step's figures (STEP_FIGURES) from a finished run; a checkpoint's write is not counted in its step."""
    rows = [r for r in read_metrics(run_dir) if "timing_s/step" in r]
    out = []
    for r in rows:
        step = {name: r.get(key) for name, key in STEP_FIGURES.items()}
        step["step_s"] = r["timing_s/step"] - r.get("timing_s/save", 0.0)
        out.append(step)
    return out


def run_side(overrides: list[str], out_dir: Path) -> list[dict]:
    """One run of the job (the config `overrides`), its per-step figures."""
    run = TrainingRun(load_config(None, overrides + [f"run.output_dir={out_dir}"]))
    return _steps(run.run())


def _median_after(steps: list[dict], key: str, skip: int) -> float:
    return round(statistics.median(s[key] for s in steps[skip:]), 3)


def run(model: str = "smollm2-135m", dtype: str = "fp32", data: str = "arithmetic", num_prompts: int = 8,
        prompts_per_step: int = 4, num_generations: int = 8, max_completion_length: int = 256, num_slots: int = 8,
        num_workers: int = 2, epochs: int = 3, mode: str = "sync", temperature: float = 1.0, learning_rate: float = 1e-5,
        skip_steps: int = 2, seed: int = 0, overrides: list[str] = (), compare: str = "history",
        history: str = "on") -> dict:
    """Both runs (`sides`), the expected faster first; the summary whose JSON is the bench's last line."""
    if compare == "stream" and mode != "one_step_off":
        raise UserError(f"bench e2e --compare stream: the stream is a one_step_off mode, got --mode {mode}")
    if num_prompts % prompts_per_step:
        raise UserError(f"bench e2e --compare {compare}: --num-prompts ({num_prompts}) must be a multiple of "
                        f"--prompts-per-step ({prompts_per_step}): every epoch is whole steps")
    steps = epochs * (num_prompts // prompts_per_step)
    if steps <= skip_steps:
        raise UserError(f"bench e2e --compare {compare}: {steps} steps leave none after --skip-steps {skip_steps}: "
                        f"raise --epochs or --num-prompts")
    common = [f"data.task={data}", f"data.num_train_prompts={num_prompts}", "val.every=0",
              f"train.prompts_per_step={prompts_per_step}", f"rollout.num_generations={num_generations}",
              f"rollout.max_completion_length={max_completion_length}", f"rollout.num_slots={num_slots}",
              f"train.learning_rate={learning_rate}", f"train.total_steps={steps}", f"train.dtype={dtype}",
              f"rollout.dtype={dtype}", f"rollout.temperature={temperature}", f"rollout.mode={mode}",
              "rollout.backend=ray", f"rollout.num_workers={num_workers}", f"run.seed={seed}", "run.save_every=0",
              "run.progress=false", "run.tensorboard=false", *overrides]
    runs = sides(compare, mode, history)
    for extra in runs.values():  # a bad key or value fails here, before the model or Ray starts
        load_config(None, common + extra)
    progress = Progress(f"e2e-{compare}", 2 * steps)
    common.insert(0, f"model.name={resolve_model_dir(model)}")
    results = {}
    # The runs' directories hold their final checkpoints and no figure reported here: removed at the end.
    with tempfile.TemporaryDirectory(prefix="rhymerl-e2e-history-") as tmp:
        for side, extra in runs.items():
            progress.stage(f"{side}: {steps} steps on {num_workers} Ray workers, {mode}", units=steps)
            results[side] = run_side(common + extra, Path(tmp) / side)
    progress.done()
    on, off = results.values()  # the expected faster run first
    diff = max(abs(a["reward"] - b["reward"]) for a, b in zip(on, off))
    on_s, off_s = _median_after(on, "step_s", skip_steps), _median_after(off, "step_s", skip_steps)
    figures = {f"{side}_s_per_step": _median_after(results[side], "step_s", skip_steps) for side in runs}
    figures |= {f"{side}_rollout_s": _median_after(results[side], "rollout_s", skip_steps) for side in runs}
    return {"compare": compare, "history": history if compare == "stream" else None, "model": model, "dtype": dtype, "data": data, "mode": mode, "num_workers": num_workers,
            "device": "cuda" if torch.cuda.is_available() else "cpu", "threads": torch.get_num_threads(),
            "num_prompts": num_prompts, "prompts_per_step": prompts_per_step, "num_generations": num_generations,
            "max_completion_length": max_completion_length, "num_slots": num_slots, "steps": steps,
            "skip_steps": skip_steps, "sides": runs, **figures, f"{compare}_speedup": round(off_s / on_s, 3),
            "reward_curve_max_abs_diff": round(diff, 6), "runs": results}


def print_table(summary: dict, console: Console | None = None) -> None:
    console = console or table_console()
    names = list(summary["sides"])
    title = "history on vs off" if summary["compare"] == "history" else " vs ".join(names)
    t = Table(title=f"{title}: {summary['model']} {summary['dtype']}, {summary['data']}, "
                    f"{summary['num_workers']} Ray workers, {summary['mode']}, {summary['steps']} steps "
                    f"(medians after the first {summary['skip_steps']})")
    for c in ("run", "s/step", "rollout s/step", "per step (s)", "final reward"):
        t.add_column(c, justify="right")
    for side in names:
        steps = summary["runs"][side]
        t.add_row(side if summary["compare"] == "stream" else f"history {side}", str(summary[f"{side}_s_per_step"]), str(summary[f"{side}_rollout_s"]),
                  " ".join(f"{s['step_s']:.1f}" for s in steps), f"{steps[-1]['reward']:.3f}")
    console.print(t)
    compare = summary["compare"]
    console.print(f"{compare}_speedup ({names[1]} / {names[0]}) = {summary[f'{compare}_speedup']}x; reward curves "
                  f"max |diff| = {summary['reward_curve_max_abs_diff']}")
