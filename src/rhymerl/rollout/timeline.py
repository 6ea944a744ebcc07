"""What a real rollout call did, worker by worker: its timeline, the bubble metrics of it, and the run's
`RUN_DIR/timeline.jsonl`.

Each worker reports, per request, when it was admitted to a slot and when it finished (`RequestSpan`,
`time.time()`), and the pool stamps the whole call's wall interval (`RolloutResult.started` / `finished`).
From these `timeline_row` makes plain data, times relative to the call's start, and `to_timeline` the
`rhymerl.histopipe.timeline.Timeline` that the simulator's metrics and Gantt chart take, so that a measured
step and a simulated one are judged and drawn by the same code.

A line of timeline.jsonl: {"step": 3, "span_s": 4.1, "workers": [0, 1], "requests": [{"id": "train-s2-p0-g0",
"worker": 0, "start": 0.012, "end": 2.9, "tokens": 57}, ...]}; `workers` lists the worker ids of the call
(rows of a Gantt chart), `span_s` the call's wall time.
"""

from __future__ import annotations

import json
from pathlib import Path

from rhymerl.atomic_file import atomic_write
from rhymerl.histopipe.metrics import bubble_ratio, finish_gap
from rhymerl.histopipe.timeline import Timeline
from rhymerl.histopipe.trace import read_trace
from rhymerl.rollout.types import RolloutResult

TIMELINE_FILE = "timeline.jsonl"
_TAIL_BYTES = 1 << 20  # enough for the last line of a step of thousands of requests


def call_interval(result: RolloutResult) -> tuple[float, float]:
    """The call's wall interval (`time.time()`): as the pool stamped it, else (a pool that did not) from its
    workers' first start to their last finish."""
    if result.finished > result.started > 0:
        return result.started, result.finished
    ran = [w for w in result.workers if w.finished > 0]
    if not ran:
        return 0.0, 0.0
    return min(w.started for w in ran), max(w.finished for w in ran)


def timeline_row(result: RolloutResult) -> dict:
    """The call's timeline as plain data: {"span_s", "workers", "requests": [{"id", "worker", "start", "end",
    "tokens"}]}, times in seconds from the call's start. Times are clipped into [0, span_s]: the workers of a
    cluster read other machines' clocks, which may be a little off."""
    origin, finish = call_interval(result)
    span = finish - origin
    workers = sorted({w.worker for w in result.workers})

    def rel(t: float) -> float:
        return round(min(max(t - origin, 0.0), span), 6)

    requests = [{"id": s.request_id, "worker": w.worker, "start": rel(s.start), "end": rel(s.end), "tokens": s.tokens}
                for w in result.workers for s in w.spans]
    return {"span_s": round(span, 6), "workers": workers, "requests": requests}


def to_timeline(row: dict) -> Timeline:
    """A `timeline_row` (or a line of timeline.jsonl) as a `Timeline`: one row per worker in `row["workers"]`'
    order, each request a group of its own."""
    index = {w: i for i, w in enumerate(row["workers"])}
    reqs = row["requests"]
    return Timeline.from_requests(len(index), [index[r["worker"]] for r in reqs], [r["start"] for r in reqs],
                                  [r["end"] for r in reqs])


def timeline_metrics(result: RolloutResult, prefix: str = "rollout") -> dict:
    """The call's bubble metrics: `{prefix}/bubble_ratio` (1 - busy worker-time / (workers x the call's wall
    time); a worker is busy while at least one of its requests runs), `{prefix}/finish_gap_s` (from the first
    worker to run out of work to the last), per worker `{prefix}/worker{i}/busy_s`, `.../tokens` and
    `.../requests`, and the generated tokens per second per worker over the call's wall time: verl's name
    `perf/throughput` for the training rollout (prefix "rollout"), `{prefix}/perf/throughput` for another
    (validation), which must not overwrite it in the step's row. Nothing for a call of no requests."""
    row = timeline_row(result)
    if not row["requests"] or row["span_s"] <= 0:
        return {}
    timeline = to_timeline(row)
    span, workers = row["span_s"], row["workers"]
    tokens = sum(r["tokens"] for r in row["requests"])
    throughput_key = "perf/throughput" if prefix == "rollout" else f"{prefix}/perf/throughput"
    m = {f"{prefix}/bubble_ratio": bubble_ratio(timeline, span=span), f"{prefix}/finish_gap_s": finish_gap(timeline),
         throughput_key: tokens / (len(workers) * span)}
    for i, w in enumerate(workers):
        mine = [r for r in row["requests"] if r["worker"] == w]
        m |= {f"{prefix}/worker{w}/busy_s": sum(b - a for a, b in timeline.busy[i]),
              f"{prefix}/worker{w}/tokens": sum(r["tokens"] for r in mine), f"{prefix}/worker{w}/requests": len(mine)}
    return m


def append_timeline(run_dir: str | Path, step: int, result: RolloutResult) -> None:
    """Append step `step`'s timeline to `run_dir/timeline.jsonl`. Lines of step `step` or later already there
    (a run killed after writing them but before its checkpoint, now resumed) and a torn last line are dropped
    first, so that a resumed run's file holds every step once, as lengths.jsonl does
    (`rhymerl.histopipe.trace.TraceWriter`). Only the file's tail is read while it is in order."""
    path = Path(run_dir) / TIMELINE_FILE
    if path.exists() and not _last_step_before(path, step):
        kept = [row for row in read_trace(path) if row["step"] < step]
        with atomic_write(path) as f:
            f.writelines(json.dumps(row) + "\n" for row in kept)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"step": step} | timeline_row(result)) + "\n")


def read_timeline(path: str | Path) -> list[dict]:
    """The steps of a timeline file (a run directory or the file itself), in order; a torn last line is
    skipped."""
    path = Path(path)
    return read_trace(path / TIMELINE_FILE if path.is_dir() else path)


def _last_step_before(path: Path, step: int) -> bool:
    """Whether `path` is empty or ends with a whole line of a step before `step` (then appending keeps it in
    order); False also when its last line cannot be read from the tail (the caller then rewrites it)."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size == 0:
            return True
        f.seek(max(0, size - _TAIL_BYTES))
        tail = f.read()
    if not tail.endswith(b"\n"):
        return False
    lines = tail[:-1].split(b"\n")
    if len(lines) < 2 and size > len(tail):  # the last line began before the tail
        return False
    try:
        return json.loads(lines[-1])["step"] < step
    except (ValueError, KeyError, TypeError):
        return False
