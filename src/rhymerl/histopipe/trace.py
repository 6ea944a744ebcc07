"""Length traces: every `rhymerl train` run writes, per step, each prompt's response lengths
(`RUN_DIR/lengths.jsonl`, one JSON line per step), which the simulator replays with a measured cost model.

A line: {"step": 3, "groups": [{"prompt": "<prompt_key>", "lengths": [37, 52, ...]}, ...]}.
"""

from __future__ import annotations

import json
from pathlib import Path

from rhymerl.atomic_file import atomic_write

TRACE_FILE = "lengths.jsonl"


class TraceWriter:
    """Appends one line per step to `run_dir/lengths.jsonl`. With `resume_step`, the lines of later steps (a
    run killed after them but before its checkpoint) are dropped first, so that a resumed run's trace has
    every step once."""

    def __init__(self, run_dir: str | Path, resume_step: int | None = None):
        self.path = Path(run_dir) / TRACE_FILE
        if resume_step is not None and self.path.exists():
            kept = [row for row in read_trace(self.path) if row["step"] <= resume_step]
            with atomic_write(self.path) as f:
                f.writelines(json.dumps(row) + "\n" for row in kept)

    def write(self, step: int, groups: list[tuple[str, list[int]]]) -> None:
        """Step `step`'s groups: (prompt key, the response lengths of its group)."""
        row = {"step": step, "groups": [{"prompt": key, "lengths": list(lengths)} for key, lengths in groups]}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


def read_trace(path: str | Path) -> list[dict]:
    """The steps of a trace file (a run directory or the file itself), in order; a torn last line (a run
    killed while writing it) is skipped."""
    path = Path(path)
    if path.is_dir():
        path = path / TRACE_FILE
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
