"""`rhymerl bench e2e --compare history`: the paper's own measure, the same GRPO job with history on and off;
`--compare stream`: the same job in one_step_off with `rollout.stream` on and off, history as `--history` says.

Both runs train the same model on the same prompts with the same seed, on the same Ray workers and in the same
rollout mode (`--mode`); with `--compare history` they differ only in whether rollout uses history:

- on: HistoSpec drafts (`rollout.speculative=histospec`), HistoPipe's split by predicted length
  (`rollout.schedule=histopipe`), migration in the tail (`rollout.migration=true`) and, in one_step_off, the
  stream (`rollout.stream=true`: a worker done with step t starts step t+1, and migrates inside the stream);
- off: plain decoding, verl's equal contiguous split (`static`), no migration, no stream.

With `--compare stream` both runs are one_step_off with the history settings of one side above (`--history`,
less the stream), one with the stream and one without; `stream_speedup` is the second's median
seconds per step over the first's.

The job (`workload`) is, unless options say otherwise, part 1's rhyming real workload as `bench pipe --trace
rhyming` rolls it out on real workers (`pipe_real.real_workload`, one definition): the `repeat` task's 12 prompts
x 8 at T=0.6, at most 192 tokens, 12 slots a worker; one GRPO step is that bench's one call, for 6 epochs
(HistoSpec's draft cap as a training run sets it on the machine). Each step's figures include the
load-independent counts of where rollout time goes (forwards, tokens per sequence forward, prompt tokens
computed, acceptance, migrations) beside the seconds of rollout, update and weight sync.

History changes how fast a rollout runs, never what it samples (docs/design.md, section 6), so with the rollout
in fp32 (`--dtype fp32`) both runs train on the same samples, and with a deterministic update the two reward
curves are identical: `reward_curve_max_abs_diff` is 0. The update's dtype (`train.dtype`) is `--dtype` unless
`--train-dtype` says otherwise: bf16 (autocast over fp32 master weights) does the same work on both sides,
faster than fp32 where bf16 matmuls are native, and keeps the curves identical in sync mode, where the loss
reads the trainer's own log-probs only. In one_step_off the TIS weights bring the rollout's log-probs into the
loss, and those differ between the two runs in their last bits (the same tokens, computed in batches of other
rows and drafts: up to 4e-5 for smollm2-135m in fp32, docs/notebook/2026-11-28-b.md); an fp32 update keeps
that at rounding level, a bf16 update's roundings can turn it into other weights and, steps later, another
sample (the per-step `pg_loss` and `tis_weight_mean` show where the updates part). `history_speedup` is the off
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
from rhymerl.bench.pipe_real import RECORDED, RHYMING, real_workload
from rhymerl.bench.progress import Progress
from rhymerl.bench.training_process import train_in_process
from rhymerl.config import load_config
from rhymerl.errors import UserError
from rhymerl.metrics import read_metrics
from rhymerl.model.fetch import resolve_model_dir
from rhymerl.model.pretrained import resolve_dtype

HISTORY = {"on": ["rollout.speculative=histospec", "rollout.schedule=histopipe"],
           "off": ["rollout.speculative=off", "rollout.schedule=static"]}
COMPARES = ("history", "stream")
# Part 1's prompts are one step: 6 steps, the last 4 (with history of 2 to 5 epochs) timed. With 2 timed steps
# one noisy step was half the figure: the same update's seconds vary by 20% from step to step on a 2-core VM.
EPOCHS = 6


def sides(compare: str, mode: str, history: str = "on") -> dict[str, list[str]]:
    """The two runs' settings, the faster one expected first (see the module doc)."""
    migrate = f"rollout.migration={'true' if history == 'on' else 'false'}"  # the stream migrates too now
    if compare == "stream":
        same = HISTORY[history] + [migrate]
        return {"stream": same + ["rollout.stream=true"], "no_stream": same + ["rollout.stream=false"]}
    tail = ["rollout.stream=true", migrate] if mode == "one_step_off" else [migrate]
    return {"on": HISTORY["on"] + tail, "off": HISTORY["off"] + ["rollout.migration=false", "rollout.stream=false"]}

# Per step, from the run's metrics.jsonl: what the table and the JSON line show. Seconds first, then the counts
# that do not depend on the machine's load: where a side's rollout time goes (forwards, committed tokens per
# sequence forward, prompt tokens computed, HistoSpec's acceptance, migrations and their re-prefilled tokens).
# Last, what says where two runs' updates part (the reward is read after the rollout, so it moves a step
# later): the loss, the rollout's log-probs against the trainer's, and (one_step_off) the TIS weights, which
# carry the rollout's log-probs into the gradient.
STEP_FIGURES = {"step_s": "timing_s/step", "rollout_s": "timing_s/rollout",
                "rollout_wait_s": "timing_s/rollout_wait", "update_s": "timing_s/update",
                "sync_s": "timing_s/sync", "reward_s": "timing_s/reward", "reward": "critic/rewards/mean",
                "response_length": "response_length/mean", "bubble_ratio": "rollout/bubble_ratio",
                "forwards": "rollout/forward_passes", "tokens_per_forward": "rollout/tokens_per_forward",
                "prefill_tokens": "rollout/prefill_tokens", "accept_rate": "rollout/spec_accept_rate",
                "draft_time_share": "rollout/draft_time_share", "migrations": "rollout/migrations",
                "migration_prefill_s": "rollout/migration_prefill_s", "trained_seqs": "actor/trained_seqs",
                "pg_loss": "actor/pg_loss", "logprob_diff_mean": "actor/logprob_diff_mean",
                "tis_weight_mean": "actor/tis_weight_mean"}


def _steps(run_dir: Path) -> list[dict]:
    """Each step's figures (STEP_FIGURES) from a finished run; a checkpoint's write is not counted in its step.
    `worker_busy_s`: the busiest worker's time with a request running in the step's rollout. `exposed_s`: the
    step's seconds outside the update, the weight sync and the reward: the rollout's wall time and the
    driver's own work (in one_step_off, what of the rollout the overlap did not hide). `driver_s`, for a step
    that rolled out on its own weights (sync, and one_step_off's first step): the rest of the rollout's wall
    time (the Ray calls, the split, history slices, gathering, recording: what the driver adds to the
    workers). None for a step rolled out ahead (one_step_off, `rollout/staleness` 1): its rollout ran during
    the previous step's update, so its busy time is no part of this step's seconds, and the loop's one timer
    before the update (`timing_s/rollout`) holds both the wait for the step's groups and the driver's work
    on them, which cannot be told apart."""
    rows = [r for r in read_metrics(run_dir) if "timing_s/step" in r]
    out = []
    for r in rows:
        step = {name: r.get(key) for name, key in STEP_FIGURES.items()}
        step["step_s"] = r["timing_s/step"] - r.get("timing_s/save", 0.0)
        busy = [v for k, v in r.items() if k.startswith("rollout/worker") and k.endswith("/busy_s")]
        step["worker_busy_s"] = max(busy, default=0.0)
        step["exposed_s"] = step["step_s"] - step["update_s"] - (step["sync_s"] or 0.0) - (step["reward_s"] or 0.0)
        ahead = r.get("rollout/staleness", 0) > 0
        step["driver_s"] = None if ahead else step["rollout_s"] - step["worker_busy_s"]
        step["tokens"] = sum(v for k, v in r.items() if k.startswith("rollout/worker") and k.endswith("/tokens"))
        out.append(step)
    return out


def run_side(overrides: list[str], out_dir: Path) -> list[dict]:
    """One run of the job (the config `overrides`) in a process of its own (`training_process`: nothing of
    the other side's run is in it), its per-step figures."""
    return _steps(train_in_process(overrides, out_dir))


# The JSON line's `{side}_{name}`: the median of each per-step figure after the skipped steps
MEDIANS = {"s_per_step": "step_s", "rollout_s": "rollout_s", "update_s": "update_s", "sync_s": "sync_s",
           "driver_s": "driver_s", "exposed_s": "exposed_s",
           "rollout_wait_s": "rollout_wait_s", "forwards": "forwards", "tokens_per_forward": "tokens_per_forward",
           "prefill_tokens": "prefill_tokens", "migrations": "migrations", "accept_rate": "accept_rate"}


def _median_after(steps: list[dict], key: str, skip: int) -> float | None:
    """The median of `key` over the steps after the first `skip`, those that have it; None if none has."""
    values = [s[key] for s in steps[skip:] if s.get(key) is not None]
    return round(statistics.median(values), 3) if values else None


def workload(num_workers: int = 2, **given) -> dict:
    """The job both runs train: part 1's rhyming real workload (`pipe_real.real_workload` under `--trace
    rhyming`: the `repeat` task's 12 prompts x 8 at T=0.6, 192 tokens, 12 slots a worker on 2 workers), one
    GRPO step being that bench's one call, for `EPOCHS` epochs. HistoSpec's draft cap is a setting of the
    system, not of the workload: None leaves it to the run's machine default (`rollout.max_draft_tokens=0`:
    4 in fp32, 32 in bf16), as `rhymerl train` would run. `given`: options set by the caller (None: not
    given), which win."""
    # a step is one call: its size given, the slots still fill MIN_WAVES times a worker unless given too
    real = real_workload(RHYMING, ray_workers=num_workers, slots=given.get("num_slots"),
                         prompts=given.get("prompts_per_step"), num_generations=given.get("num_generations"))
    base = {"data": real.task, "num_prompts": RECORDED.prompts, "prompts_per_step": real.prompts,
            "num_generations": real.num_generations, "max_completion_length": real.max_tokens,
            "num_slots": real.slots, "temperature": real.temperature, "epochs": EPOCHS,
            "max_draft_tokens": None}
    unknown = set(given) - set(base)
    if unknown:
        raise TypeError(f"workload: unknown options {sorted(unknown)}")
    return base | {k: v for k, v in given.items() if v is not None}


def run(model: str = "smollm2-135m", dtype: str = "fp32", num_workers: int = 2, mode: str = "sync",
        learning_rate: float = 1e-5, skip_steps: int = 2, seed: int = 0, overrides: list[str] = (),
        compare: str = "history", history: str = "on", train_dtype: str | None = None, **given) -> dict:
    """Both runs (`sides`) of the job `workload(num_workers, **given)`, the expected faster first; the summary
    whose JSON is the bench's last line. `dtype` is the rollout's (`rollout.dtype`) and, unless `train_dtype`
    is given, the update's (`train.dtype`; bf16: autocast over fp32 master weights)."""
    train_dtype = train_dtype or dtype
    job = workload(num_workers, **given)
    data, num_prompts, prompts_per_step = job["data"], job["num_prompts"], job["prompts_per_step"]
    num_generations, max_completion_length, num_slots = (job["num_generations"], job["max_completion_length"],
                                                         job["num_slots"])
    epochs, temperature = job["epochs"], job["temperature"]
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
              f"rollout.max_draft_tokens={job['max_draft_tokens'] or 0}",
              f"train.learning_rate={learning_rate}", f"train.total_steps={steps}", f"train.dtype={train_dtype}",
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
    device = "cuda" if torch.cuda.is_available() else "cpu"
    on_s, off_s = _median_after(on, "step_s", skip_steps), _median_after(off, "step_s", skip_steps)
    figures = {f"{side}_{name}": _median_after(results[side], key, skip_steps)
               for side in runs for name, key in MEDIANS.items()}
    figures = {k: v for k, v in figures.items() if v is not None}  # a figure no step has (sync: no rollout wait)
    return {"compare": compare, "history": history if compare == "stream" else None, "model": model,
            "dtype": dtype, "train_dtype": train_dtype, "train_dtype_resolved": resolve_dtype(train_dtype, device),
            "data": data, "mode": mode, "num_workers": num_workers, "device": device,
            "threads": torch.get_num_threads(),
            "num_prompts": num_prompts, "prompts_per_step": prompts_per_step, "num_generations": num_generations,
            "max_completion_length": max_completion_length, "num_slots": num_slots, "temperature": temperature,
            "max_draft_tokens": job["max_draft_tokens"], "steps": steps,
            "skip_steps": skip_steps, "sides": runs, **figures, f"{compare}_speedup": round(off_s / on_s, 3),
            "reward_curve_max_abs_diff": round(diff, 6), "runs": results}


def _train_dtype(summary: dict) -> str:
    """The update's dtype as given, and what auto resolved to"""
    given, resolved = summary["train_dtype"], summary["train_dtype_resolved"]
    return given if given == resolved else f"{given} ({resolved})"


def print_table(summary: dict, console: Console | None = None) -> None:
    console = console or table_console()
    names = list(summary["sides"])
    title = "history on vs off" if summary["compare"] == "history" else " vs ".join(names)
    t = Table(title=f"{title}: {summary['model']}, rollout {summary['dtype']}, update {_train_dtype(summary)}, "
                    f"{summary['data']}, "
                    f"{summary['num_workers']} Ray workers, {summary['mode']}, {summary['steps']} steps "
                    f"(medians after the first {summary['skip_steps']})")
    columns = {"s/step": "s_per_step", "rollout s": "rollout_s", "update s": "update_s", "sync s": "sync_s",
               "forwards": "forwards", "tokens/forward": "tokens_per_forward", "prefill tokens": "prefill_tokens",
               "migrations": "migrations"}
    for c in ("run", *columns, "per step (s)", "final reward"):
        t.add_column(c, justify="right")
    for side in names:
        steps = summary["runs"][side]
        t.add_row(side if summary["compare"] == "stream" else f"history {side}",
                  *(str(summary.get(f"{side}_{key}", "-")) for key in columns.values()),
                  " ".join(f"{s['step_s']:.1f}" for s in steps), f"{steps[-1]['reward']:.3f}")
    console.print(t)
    compare = summary["compare"]
    console.print(f"{compare}_speedup ({names[1]} / {names[0]}) = {summary[f'{compare}_speedup']}x; reward curves "
                  f"max |diff| = {summary['reward_curve_max_abs_diff']}")
