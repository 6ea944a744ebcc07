"""Training report: PNG plots and a short summary from a run's metrics.jsonl.

write_report(run_dir) draws

    reward.png           training reward / correctness per step, validation accuracy / reward where evaluated
    response_length.png  mean and max response length (and the truncated share, if logged)
    speculation.png      speculative decoding: acceptance rate, tokens per forward, rollout tokens/s
    timing.png           seconds per step, stacked by phase (timing_s/*)
    timeline.png         a Gantt chart of the workers in the last step, and in the slowest when it is another
                         (RUN_DIR/timeline.jsonl; `rhymerl.histopipe.gantt`, as `bench pipe` draws)

skipping any plot whose metrics were never logged. summary(run_dir) gives the few numbers the CLI prints.
"""

from __future__ import annotations

import math
import os
import statistics
from pathlib import Path

import matplotlib

# Headless: the report runs on training boxes and in CI, where no display exists.
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (must follow matplotlib.use)

from rhymerl.histopipe.gantt import gantt_figure  # noqa: E402
from rhymerl.errors import UserError  # noqa: E402
from rhymerl.metrics import METRICS_FILE, read_metrics  # noqa: E402
from rhymerl.rollout.timeline import TIMELINE_FILE, read_timeline, to_timeline  # noqa: E402

REPORT_DIR = "report"


class ReportInputError(UserError):
    """A run directory whose metrics cannot be reported, or an output path that cannot take the report."""


class MissingMetricsError(ReportInputError, FileNotFoundError):
    """No run directory, no metrics.jsonl, or no rows in it (a FileNotFoundError too, as it always was)."""


# Phases in pipeline order, so the stacks read bottom-up like a step runs; other timing_s/* keys follow.
TIMING_PHASES = ("rollout", "reward", "update", "sync", "val", "save")
TIMING_TOTAL = "timing_s/step"
# Beyond this many steps one bar per step turns into a blur (and many thousands of patches); use an area plot.
MAX_TIMING_BARS = 300


def write_report(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> list[Path]:
    """Write the report PNGs for run_dir into out_dir (default run_dir/report/); returns the paths written.

    Raises ReportInputError (a UserError) naming the file if run_dir/metrics.jsonl is missing, corrupt, holds
    no rows or a value that is not a number, or if out_dir is an existing file.
    """
    rows = _load(run_dir)
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / REPORT_DIR
    if out.exists() and not out.is_dir():
        raise ReportInputError(f"--out {out}: is an existing file; the report writes its PNGs into a directory: "
                               f"name a directory (it is created if missing)")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, plot in (
        ("reward.png", _plot_reward),
        ("response_length.png", _plot_response_length),
        ("speculation.png", _plot_speculation),
        ("timing.png", _plot_timing),
    ):
        fig = plot(rows)
        if fig is None:
            continue
        path = out / name
        try:
            fig.savefig(path, dpi=110, bbox_inches="tight")
        finally:
            plt.close(fig)
        written.append(path)
    timeline = _write_timeline(Path(run_dir), out)
    return written + ([timeline] if timeline is not None else [])


def _write_timeline(run_dir: Path, out: Path) -> Path | None:
    """timeline.png from run_dir/timeline.jsonl: the last step, and the slowest (longest rollout call) when
    that is another; None when the run wrote no timeline."""
    rows = read_timeline(run_dir / TIMELINE_FILE) if (run_dir / TIMELINE_FILE).exists() else []
    if not rows:
        return None
    picked = [(rows[-1], "last step")]
    slowest = max(rows, key=lambda row: row["span_s"])
    if slowest["step"] != rows[-1]["step"]:
        picked.append((slowest, "slowest step"))
    fig = gantt_figure([to_timeline(row) for row, _ in picked],
                       [f"step {row['step']} ({why}), {len(row['requests'])} requests" for row, why in picked],
                       spans=[row["span_s"] for row, _ in picked], worker_labels=[row["workers"] for row, _ in picked])
    path = out / "timeline.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def summary(run_dir: str | os.PathLike) -> dict:
    """Headline numbers of a run; a value is None when its metric was never logged.

    Keys: steps (training steps logged; the step-0 row, the run's starting point, is not one), last_step,
    reward_first, reward_last, reward_max (critic/rewards/mean), val_accuracy_last (val/accuracy),
    step_time_median_s (timing_s/step), accept_rate_mean (rollout/spec_accept_rate). Raises
    ReportInputError as write_report does.
    """
    rows = _load(run_dir)
    _, rewards = _series(rows, "critic/rewards/mean")
    _, val_accuracy = _series(rows, "val/accuracy")
    _, step_times = _series(rows, TIMING_TOTAL)
    _, accept = _series(rows, "rollout/spec_accept_rate")
    return {
        "steps": sum(1 for row in rows if row["step"] > 0),
        "last_step": rows[-1]["step"],
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "reward_max": max(rewards) if rewards else None,
        "val_accuracy_last": val_accuracy[-1] if val_accuracy else None,
        "step_time_median_s": statistics.median(step_times) if step_times else None,
        "accept_rate_mean": statistics.fmean(accept) if accept else None,
    }


def _load(run_dir: str | os.PathLike) -> list[dict]:
    """Rows merged per step and sorted by step.

    Merging lets a trainer log one step in several calls (e.g. training metrics, then validation); a later
    value for the same step and key wins.
    """
    path = Path(run_dir) / METRICS_FILE
    if not Path(run_dir).is_dir():
        raise MissingMetricsError(f"{run_dir}: no such run directory (rhymerl report takes the directory a "
                               f"`rhymerl train` run wrote, which holds {METRICS_FILE})")
    try:
        rows = read_metrics(run_dir)
    except FileNotFoundError:
        raise MissingMetricsError(f"{path}: missing; is {run_dir} a training run's directory?") from None
    except ValueError as e:  # a corrupt line mid-file, or bytes that are not UTF-8
        raise ReportInputError(f"{path}: unreadable: {e}") from None
    by_step: dict[int, dict] = {}
    for number, row in enumerate(rows, 1):
        _check_row(path, number, row)
        if row.get("step") is not None:
            by_step.setdefault(row["step"], {}).update(row)
    if not by_step:
        raise MissingMetricsError(f"{path}: no metrics rows with a 'step'; nothing to report")
    return [by_step[step] for step in sorted(by_step)]


def _check_row(path: Path, number: int, row: dict) -> None:
    """A row's step is a non-negative integer and every value a number (or null): a string where a metric
    belongs would otherwise be skipped silently, and the plot drawn without it."""
    step = row.get("step")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise ReportInputError(f"{path}: row {number}: 'step' must be a non-negative integer, got {step!r}")
    for key, value in row.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ReportInputError(f"{path}: row {number} (step {step}): metric {key!r} is "
                                   f"{type(value).__name__} {value!r:.40}, expected a number; the file was "
                                   f"edited or not written by rhymerl")


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that hold a finite number under key."""
    steps, values = [], []
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            steps.append(row["step"])
            values.append(float(value))
    return steps, values


def _line_panel(ax, rows: list[dict], keys_labels, *, title: str, ylabel: str, markers: bool = False) -> bool:
    """Plot the present keys on ax as lines; returns whether anything was drawn."""
    drawn = False
    for key, label in keys_labels:
        steps, values = _series(rows, key)
        if steps:
            ax.plot(steps, values, label=label, marker="o" if markers else None, markersize=4)
            drawn = True
    if drawn:
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best")
    return drawn


def _panels(rows: list[dict], specs) -> plt.Figure | None:
    """A figure with one stacked panel per spec whose metrics are present, or None if none are.

    spec = (keys_labels, title, ylabel, markers).
    """
    present = [spec for spec in specs if any(_series(rows, key)[0] for key, _ in spec[0])]
    if not present:
        return None
    fig, axes = plt.subplots(len(present), 1, figsize=(9, 3.2 * len(present)), sharex=True, squeeze=False)
    for ax, (keys_labels, title, ylabel, markers) in zip(axes[:, 0], present):
        _line_panel(ax, rows, keys_labels, title=title, ylabel=ylabel, markers=markers)
    # Panels share the step axis, so only the bottom one is labelled.
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    return fig


def _plot_reward(rows: list[dict]) -> plt.Figure | None:
    return _panels(
        rows,
        [
            (
                [("critic/rewards/mean", "reward (mean)"), ("critic/score/mean", "correctness (mean)")],
                "Training reward",
                "reward",
                False,
            ),
            # Validation runs every few steps only: markers make the sparse points visible.
            (
                [("val/accuracy", "val accuracy"), ("val/reward/mean", "val reward (mean)")],
                "Validation",
                "accuracy / reward",
                True,
            ),
        ],
    )


def _plot_response_length(rows: list[dict]) -> plt.Figure | None:
    fig = _panels(
        rows,
        [
            (
                [("response_length/mean", "mean"), ("response_length/max", "max")],
                "Response length",
                "tokens",
                False,
            )
        ],
    )
    steps, clip = _series(rows, "response_length/clip_ratio")
    if fig is not None and steps:
        # The truncated share explains a max pinned at the length limit; a second axis keeps its 0..1 scale.
        ax = fig.axes[0]
        twin = ax.twinx()
        twin.plot(steps, clip, color="tab:red", linestyle="--", label="clip ratio (truncated)")
        twin.set_ylabel("clip ratio")
        twin.set_ylim(0, 1)
        lines, labels = ax.get_legend_handles_labels()
        twin_lines, twin_labels = twin.get_legend_handles_labels()
        # One legend for both axes, on the twin because it is drawn on top and would hide one on ax.
        ax.get_legend().remove()
        twin.legend(lines + twin_lines, labels + twin_labels, loc="best")
    return fig


def _plot_speculation(rows: list[dict]) -> plt.Figure | None:
    return _panels(
        rows,
        [
            ([("rollout/spec_accept_rate", "accept rate")], "Draft acceptance rate", "accepted / drafted", False),
            ([("rollout/tokens_per_forward", "tokens / forward")], "Tokens per target forward", "tokens", False),
            ([("rollout/tokens_per_s", "tokens / s")], "Rollout throughput", "tokens / s", False),
        ],
    )


def _timing_keys(rows: list[dict]) -> list[str]:
    """timing_s/* keys present in rows, known phases first in pipeline order, timing_s/step excluded."""
    present = {key for row in rows for key in row if key.startswith("timing_s/") and key != TIMING_TOTAL}
    known = [f"timing_s/{phase}" for phase in TIMING_PHASES if f"timing_s/{phase}" in present]
    return known + sorted(present - set(known))


def _plot_timing(rows: list[dict]) -> plt.Figure | None:
    keys = [key for key in _timing_keys(rows) if _series(rows, key)[0]]
    if not keys:
        return None
    steps = [row["step"] for row in rows]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    bottom = [0.0] * len(rows)
    # Phases absent at a step (validation, saving) count 0 there.
    layers = []
    for key in keys:
        layer = []
        for row in rows:
            value = row.get(key)
            layer.append(float(value) if isinstance(value, (int, float)) and math.isfinite(value) else 0.0)
        layers.append(layer)
    labels = [key.removeprefix("timing_s/") for key in keys]
    bars = len(rows) <= MAX_TIMING_BARS
    if bars:
        for layer, label in zip(layers, labels):
            ax.bar(steps, layer, bottom=bottom, width=0.85, label=label)
            bottom = [b + v for b, v in zip(bottom, layer)]
    else:
        ax.stackplot(steps, layers, labels=labels)
    total_steps, totals = _series(rows, TIMING_TOTAL)
    if total_steps:
        # The step total above the stack shows time no phase accounts for; steps-mid lines it up with the bars.
        ax.plot(
            total_steps,
            totals,
            color="black",
            linewidth=1,
            drawstyle="steps-mid" if bars else "default",
            label="step total",
        )
    ax.set_title("Time per step by phase")
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig
