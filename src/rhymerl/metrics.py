"""Per-step training metrics: one JSON line per step, mirrored to TensorBoard and optionally wandb.

A run directory holds

    metrics.jsonl     {"step": 7, "critic/rewards/mean": 0.41, ...}  one line per logged step
    tensorboard/      TensorBoard event files (scalars under the verl-style metric names)
    wandb_run_id      only with wandb: the run id, so a resumed run continues the same wandb run

metrics.jsonl is the source of truth (the report and the CLI read it); TensorBoard and wandb are views.
Values are written as strict JSON: NaN and +-inf become null.

Resuming from a checkpoint at step S: a killed run may have logged steps past S, which are logged again after
the resume. MetricsLogger(resume_step=S) therefore trims metrics.jsonl to the rows with step <= S and tells
TensorBoard to purge its events from step S+1 on, so no step appears twice.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from rhymerl.atomic_file import atomic_write

try:
    import wandb
except ImportError:  # optional: only needed with wandb=True
    wandb = None

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_run_id"


class MetricsLogger:
    """Appends per-step metrics to run_dir/metrics.jsonl, TensorBoard (run_dir/tensorboard/) and optionally wandb.

    tensorboard: also write TensorBoard scalars. wandb: also log to wandb (project wandb_project, with config
    as the run config); raises ImportError at construction if wandb is not installed. resume_step: the step of
    the checkpoint a run resumes from; rows logged after it by the previous run are dropped (see module doc).
    Usable as a context manager; close() flushes and closes everything.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        tensorboard: bool = True,
        wandb: bool = False,
        wandb_project: str = "rhymerl",
        config: dict | None = None,
        resume_step: int | None = None,
    ):
        use_wandb = wandb
        # The parameter shadows the module; fetch the module explicitly.
        wandb_module = globals()["wandb"]
        if use_wandb and wandb_module is None:
            raise ImportError("wandb logging was requested but wandb is not installed: pip install wandb")

        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        _prepare_metrics_file(self.path, resume_step)
        self._file = open(self.path, "a", encoding="utf-8")

        self._tb = None
        if tensorboard:
            self._tb = EventFileWriter(str(self.run_dir / TENSORBOARD_DIR), flush_secs=30)
            if resume_step is not None:
                # Same mechanism as torch's SummaryWriter(purge_step=...): TensorBoard hides every earlier
                # event with step >= S+1, i.e. what the killed run logged past the checkpoint.
                purge = resume_step + 1
                self._tb.add_event(event_pb2.Event(step=purge, wall_time=time.time(), file_version="brain.Event:2"))
                self._tb.add_event(
                    event_pb2.Event(
                        step=purge,
                        wall_time=time.time(),
                        session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START),
                    )
                )

        self._wandb_run = None
        if use_wandb:
            self._wandb_run = _init_wandb(wandb_module, self.run_dir, wandb_project, config)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Record metrics for one step: a JSONL line (flushed at once), TensorBoard scalars and wandb.

        Values may be Python numbers or numpy/torch scalars (anything with .item() or float()); strings are
        kept in the JSONL only. A "step" key in metrics is ignored in favour of the step argument.
        """
        step = int(step)
        row: dict[str, Any] = {"step": step}
        numeric: dict[str, float] = {}
        for key, value in metrics.items():
            if key == "step":
                continue
            value = _plain(key, value)
            if isinstance(value, str):
                row[key] = value
                continue
            numeric[key] = float(value)
            # Strict JSON has no NaN/inf; null keeps the row readable by any JSON tool.
            row[key] = value if math.isfinite(value) else None

        # One write per line so a crash can tear at most the last line, which read_metrics skips.
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()

        if self._tb is not None:
            summary = summary_pb2.Summary(
                value=[summary_pb2.Summary.Value(tag=key, simple_value=value) for key, value in numeric.items()]
            )
            self._tb.add_event(event_pb2.Event(step=step, wall_time=time.time(), summary=summary))
            # A step takes seconds to minutes, so flushing each one costs nothing and keeps TensorBoard live.
            self._tb.flush()

        if self._wandb_run is not None:
            self._wandb_run.log(numeric, step=step)

    def close(self) -> None:
        """Flush and close the JSONL file, the TensorBoard writer and the wandb run. Safe to call twice."""
        if not self._file.closed:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """The rows of run_dir/metrics.jsonl in file order (nulls stay None).

    An unparseable last line (a write torn by a crash) is ignored; an unparseable line elsewhere raises
    ValueError naming the file and line. Raises FileNotFoundError if the file does not exist.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        raise FileNotFoundError(f"no metrics file at {path}")
    rows, _ = _parse_lines(path)
    return rows


def _parse_lines(path: Path) -> tuple[list[dict], bool]:
    """(rows, whether the last line was torn) of a metrics file; raises ValueError on corruption mid-file."""
    lines = path.read_text(encoding="utf-8").splitlines()
    # Blank lines carry nothing; dropping them also keeps the "last line" check meaningful.
    lines = [(number, line) for number, line in enumerate(lines, start=1) if line.strip()]
    rows = []
    torn = False
    for index, (number, line) in enumerate(lines):
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError("not a JSON object")
        except ValueError as err:
            if index == len(lines) - 1:
                torn = True
                break
            raise ValueError(f"{path}:{number}: corrupt metrics line ({err})") from err
        rows.append(row)
    return rows, torn


def _prepare_metrics_file(path: Path, resume_step: int | None) -> None:
    """Trim rows past resume_step and any torn last line, so appending continues a clean file."""
    if not path.exists():
        return
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        if size:
            f.seek(-1, os.SEEK_END)
        ends_clean = size == 0 or f.read(1) == b"\n"
    # Without this, the next line would be glued onto a torn one and both would be lost.
    if resume_step is None and ends_clean:
        return
    rows, _ = _parse_lines(path)
    if resume_step is not None:
        rows = [row for row in rows if row.get("step", resume_step) <= resume_step]
    text = "".join(json.dumps(row) + "\n" for row in rows)
    # Atomic: a crash while trimming leaves either the old file or the new one, never a half-written mix.
    with atomic_write(path) as f:
        f.write(text)


def _plain(key: str, value: Any) -> float | int | str:
    """A metric value as a Python float/int/str; numpy and torch scalars go through .item()."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float, str)):
        return value
    if hasattr(value, "item"):
        return _plain(key, value.item())
    try:
        return float(value)
    except (TypeError, ValueError) as err:
        raise TypeError(f"metric {key!r} has a non-numeric value {value!r} of type {type(value).__name__}") from err


def _init_wandb(wandb_module, run_dir: Path, project: str, config: dict | None):
    """Start (or, when run_dir already has one, resume) the wandb run tied to run_dir."""
    id_file = run_dir / WANDB_ID_FILE
    run_id = id_file.read_text().strip() if id_file.exists() else None
    # wandb ignores steps at or below the last one it recorded, so steps re-logged after a resume keep the
    # values of the killed run there; metrics.jsonl and TensorBoard hold the re-logged ones.
    run = wandb_module.init(
        project=project, dir=str(run_dir), config=config, id=run_id, resume="allow", name=run_dir.name
    )
    if run_id is None:
        id_file.write_text(run.id + "\n")
    return run
