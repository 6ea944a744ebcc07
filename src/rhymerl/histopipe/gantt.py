"""Gantt charts of rollout steps, simulated or measured: one band per worker, time across.

The one drawing of a `Timeline`, so that `rhymerl report` (a training run's measured steps,
`RUN_DIR/timeline.jsonl`) and `rhymerl bench pipe` (simulated policies) draw the same picture:

- with request starts (`Timeline.start`), each request is a bar from its admission to a slot to its finish,
  coloured by its group, in the lowest lane of its worker's band free at its start (so a band holds as many
  lanes as the worker ran requests at once, at most its slots);
- without them, the worker's running sequences over time (`Timeline.occupancy`), else its busy intervals.

White is idle. A dashed line marks the makespan, a dotted one the call's end when its wall time (`span`)
is longer; the title gives the bubble ratio and the first-to-last finish gap (`rhymerl.histopipe.metrics`).
Uses matplotlib's object API (no pyplot): no global state, no display.
"""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib import colormaps
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure

from rhymerl.histopipe.metrics import bubble_ratio, finish_gap, makespan
from rhymerl.histopipe.timeline import Timeline

BAND = 0.8  # a worker's band height out of 1 (the rest separates bands)


def gantt_figure(timelines: Sequence[Timeline], titles: Sequence[str], spans: Sequence[float | None] | None = None,
                 worker_labels: Sequence[Sequence] | None = None, max_workers: int = 64) -> Figure:
    """One panel per timeline, stacked, sharing the time axis. `spans`: each step's wall time (None: the
    makespan); `worker_labels`: each timeline's worker names (default 0, 1, ...); at most `max_workers`
    workers are drawn per panel (the title says how many were left out)."""
    if len(titles) != len(timelines):
        raise ValueError(f"one title per timeline: {len(timelines)} timelines, {len(titles)} titles")
    spans = list(spans) if spans is not None else [None] * len(timelines)
    labels = list(worker_labels) if worker_labels is not None else [None] * len(timelines)
    heights = [1.0 + 0.45 * min(max(t.num_workers, 1), max_workers) for t in timelines]
    fig = Figure(figsize=(10, sum(1.2 + h for h in heights)))
    axes = fig.subplots(len(timelines), 1, squeeze=False, sharex=True,
                        gridspec_kw={"height_ratios": heights})[:, 0]
    for ax, timeline, title, span, names in zip(axes, timelines, titles, spans, labels):
        draw_gantt(ax, timeline, title, span=span, worker_labels=names, max_workers=max_workers)
    axes[-1].set_xlabel("seconds from the step's start")
    fig.tight_layout()
    return fig


def draw_gantt(ax, timeline: Timeline, title: str = "", span: float | None = None,
               worker_labels: Sequence | None = None, max_workers: int = 64) -> None:
    """Draw `timeline` on the matplotlib axes `ax` (see the module's description)."""
    shown = min(timeline.num_workers, max_workers)
    colours = colormaps["tab20"].colors
    boxes: list[list[tuple[float, float]]] = []
    faces: list = []

    def bar(x0: float, x1: float, y0: float, h: float, colour) -> None:
        boxes.append([(x0, y0), (x1, y0), (x1, y0 + h), (x0, y0 + h)])
        faces.append(colour)

    if timeline.start:
        for w, requests in enumerate(_requests_by_worker(timeline)[:shown]):
            lanes = _lanes([(s, e) for _, s, e in requests])
            h = BAND / max(max(lanes, default=0) + 1, 1)
            for (g, s, e), lane in zip(requests, lanes):
                bar(s, e, w + (1 - BAND) / 2 + lane * h, h, colours[g % len(colours)])
    elif any(timeline.occupancy):
        peak = max((n for occ in timeline.occupancy for _, n in occ), default=1) or 1
        for w, occ in enumerate(timeline.occupancy[:shown]):
            for (t0, n), (t1, _) in zip(occ, occ[1:]):
                if n > 0:
                    bar(t0, t1, w + (1 + BAND) / 2 - BAND * n / peak, BAND * n / peak, colours[0])
    else:
        for w, ivs in enumerate(timeline.busy[:shown]):
            for s, e in ivs:
                bar(s, e, w + (1 - BAND) / 2, BAND, colours[0])
    ax.add_collection(PolyCollection(boxes, facecolors=faces, edgecolors="white", linewidths=0.3))

    end = makespan(timeline)
    right = max(end, span or 0.0) or 1.0
    ax.axvline(end, color="black", linestyle="--", linewidth=1, label=f"makespan {end:.2f}s")
    if span is not None and span > end + 0.005 * span:  # the call outlasted its workers visibly
        ax.axvline(span, color="grey", linestyle=":", linewidth=1, label=f"call end {span:.2f}s")
    ax.set_xlim(0, right * 1.02)
    ax.set_ylim(shown, 0)  # worker 0 on top
    names = list(worker_labels) if worker_labels is not None else list(range(timeline.num_workers))
    step = max(1, shown // 16)  # at most ~16 tick labels
    ax.set_yticks([w + 0.5 for w in range(0, shown, step)], [f"worker {names[w]}" for w in range(0, shown, step)])
    left_out = f" ({timeline.num_workers - shown} more workers not drawn)" if shown < timeline.num_workers else ""
    ax.set_title(f"{title}{': ' if title else ''}bubble {bubble_ratio(timeline, span=span):.1%}, "
                 f"finish gap {finish_gap(timeline):.2f}s{left_out}")
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")  # outside: bars stay visible


def _requests_by_worker(timeline: Timeline) -> list[list[tuple[int, float, float]]]:
    """Per worker, its requests as (group, start, finish), by start."""
    out: list[list[tuple[int, float, float]]] = [[] for _ in range(timeline.num_workers)]
    for g, (w, starts, ends) in enumerate(zip(timeline.worker, timeline.start, timeline.finish)):
        out[w].extend((g, s, e) for s, e in zip(starts, ends))
    for requests in out:
        requests.sort(key=lambda r: (r[1], r[2]))
    return out


def _lanes(intervals: Sequence[tuple[float, float]]) -> list[int]:
    """Each interval's lane, intervals taken by start: the lowest lane whose last interval ended by then
    (so no two intervals of a lane overlap, and the lanes are as few as the most intervals at one time)."""
    ends: list[float] = []
    out = []
    for s, e in intervals:
        lane = next((i for i, t in enumerate(ends) if t <= s), len(ends))
        if lane == len(ends):
            ends.append(e)
        else:
            ends[lane] = e
        out.append(lane)
    return out
