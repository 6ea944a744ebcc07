"""What one rollout step did, simulated or measured: the input of the bubble metrics and the Gantt charts.

Plain data (`as_dict` / `from_dict`), so a real step's timeline can be written beside its metrics and a
simulated one compared with it by the same functions (`rhymerl.histopipe.metrics`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Timeline:
    """One rollout step on several workers; times in seconds from the step's start.

    busy: per worker, its busy intervals (start, end), sorted and disjoint; [] for a worker given nothing.
    finish: per group, when each of its requests finished.
    worker: per group, the worker that ran it.
    occupancy: per worker, (time, running sequences from then on) at every change; optional (for charts).
    start: per group, when each of its requests was admitted to a slot; optional ([]: not recorded).
    """

    busy: list[list[tuple[float, float]]]
    finish: list[list[float]]
    worker: list[int]
    occupancy: list[list[tuple[float, int]]] = field(default_factory=list)
    start: list[list[float]] = field(default_factory=list)

    @classmethod
    def from_requests(cls, num_workers: int, worker: list[int], start: list[float], end: list[float]) -> "Timeline":
        """A measured step: request i ran on worker `worker[i]` (0 <= worker[i] < num_workers) from `start[i]`
        to `end[i]`, each request a group of its own. A worker is busy while at least one of its requests runs:
        its busy intervals are the union of its requests'."""
        if not len(worker) == len(start) == len(end):
            raise ValueError(f"one worker, start and end per request: got {len(worker)}, {len(start)}, {len(end)}")
        bad = [w for w in worker if not 0 <= w < num_workers]
        if bad:
            raise ValueError(f"worker indices must lie in [0, {num_workers}), got {bad[:5]}")
        if any(e < s for s, e in zip(start, end)):
            raise ValueError("a request must end no earlier than it starts")
        busy: list[list[tuple[float, float]]] = [[] for _ in range(num_workers)]
        for s, e, w in sorted(zip(start, end, worker)):
            ivs = busy[w]
            if ivs and s <= ivs[-1][1]:  # overlaps or touches the last interval: extend it
                ivs[-1] = (ivs[-1][0], max(ivs[-1][1], e))
            else:
                ivs.append((s, e))
        return cls(busy=busy, finish=[[float(e)] for e in end], worker=list(worker),
                   start=[[float(s)] for s in start])

    @property
    def num_workers(self) -> int:
        return len(self.busy)

    def worker_ends(self) -> list[float]:
        """When each worker ran out of work (0.0 for a worker given nothing)."""
        return [iv[-1][1] if iv else 0.0 for iv in self.busy]

    def finish_times(self) -> list[float]:
        """Every request's finish time, sorted."""
        return sorted(t for group in self.finish for t in group)

    def as_dict(self) -> dict:
        return {"busy": [[list(iv) for iv in ivs] for ivs in self.busy], "finish": self.finish,
                "worker": self.worker, "occupancy": [[list(p) for p in occ] for occ in self.occupancy],
                "start": self.start}

    @classmethod
    def from_dict(cls, d: dict) -> "Timeline":
        """The inverse of `as_dict`."""
        return cls(busy=[[(float(a), float(b)) for a, b in ivs] for ivs in d["busy"]],
                   finish=[[float(t) for t in g] for g in d["finish"]], worker=[int(w) for w in d["worker"]],
                   occupancy=[[(float(t), int(n)) for t, n in occ] for occ in d.get("occupancy", [])],
                   start=[[float(t) for t in g] for g in d.get("start", [])])
