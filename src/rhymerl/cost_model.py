"""The forward-time model (torch-free): how long one engine forward takes for a given batch shape.

An engine measures it once at start-up (`measure`, with a callback that times real forwards), HistoSpec reads
it to decide how many draft tokens a step should verify (docs/design.md, section 7), and `rhymerl bench spec` reads its
ceiling. It is plain data (`as_dict` / `from_dict`), so a measured model can be handed to another engine, saved
beside a checkpoint or sent to a worker process.
"""

from __future__ import annotations

from typing import Callable

# The measured grid: sequences in a step x tokens each sequence feeds. Past MAX_MEASURED_TOKENS tokens in a
# step a row is extrapolated linearly (a forward is then well into its linear regime, and measuring it costs
# seconds).
SEQS_GRID = (1, 4, 16)  # plus the engine's slot count
TOKENS_PER_SEQ_GRID = (1, 2, 4, 8, 16)  # those up to max_draft_tokens, plus max_draft_tokens + 1
MAX_MEASURED_TOKENS = 512
REPEATS = 2  # each point is the fastest of this many forwards: noise only ever adds time


class CostModel:
    """Forward time (seconds) of a step with `seqs` sequences feeding `tokens` tokens in all, from a grid
    measured on this machine: times[i][j] for seqs_grid[i] sequences x per_seq_grid[j] tokens each.
    Bilinear interpolation in (sequences, tokens per sequence), linear extrapolation past the grid, and
    the grid is made non-decreasing first (measurement noise must not make a bigger step look cheaper).
    `measured`: timed on this machine (`measure`), so HistoSpec corrects it online against the steps it
    times; a grid written by hand (tests, a fixed model) is taken as is.
    """

    def __init__(self, seqs_grid: list[int], per_seq_grid: list[int], times: list[list[float]],
                 measured: bool = False):
        self.seqs_grid, self.per_seq_grid = list(seqs_grid), list(per_seq_grid)
        self.measured = measured
        rows = [_cummax(r) for r in times]
        cols = [_cummax([rows[i][j] for i in range(len(rows))]) for j in range(len(per_seq_grid))]
        self.times = [[cols[j][i] for j in range(len(per_seq_grid))] for i in range(len(seqs_grid))]

    def __call__(self, tokens: int, seqs: int = 1) -> float:
        per_seq = tokens / max(seqs, 1)
        at_seqs = [_interp(list(zip(self.per_seq_grid, row)), per_seq) for row in self.times]
        return _interp(list(zip(self.seqs_grid, at_seqs)), seqs)

    def as_dict(self) -> dict:
        return {"seqs": self.seqs_grid, "tokens_per_seq": self.per_seq_grid, "seconds": self.times,
                "measured": self.measured}

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        """The inverse of `as_dict`."""
        return cls(d["seqs"], d["tokens_per_seq"], d["seconds"], measured=d.get("measured", False))

    def ceiling(self, seqs: int, max_tokens_per_seq: int) -> tuple[float, int]:
        """The most any drafter could gain over plain decoding with `seqs` sequences, by this grid: a perfect
        drafter, every draft a chain of t-1 tokens the policy accepts whole, commits t tokens per sequence
        per forward of cost(seqs * t), where plain commits 1 per cost(seqs). Returns (the best
        t * cost(seqs) / cost(seqs * t) over t = 1..max_tokens_per_seq, the t that reaches it). The
        forward only: the rest of a step (drafting, sampling) is left out."""
        plain = self(seqs, seqs)
        best = max(range(1, max_tokens_per_seq + 1), key=lambda t: (t * plain / self(seqs * t, seqs), -t))
        return best * plain / self(seqs * best, seqs), best


def measure(time_forward: Callable[[int, int], float], slots: int, max_draft_tokens: int) -> CostModel:
    """Measure the grid: `time_forward(n, t)` runs one verification forward of n sequences feeding t tokens
    each (a chain) and returns its seconds. The engine supplies it (`Engine.measure_cost_model`)."""
    seqs_grid = sorted({n for n in SEQS_GRID if n < slots} | {slots})
    per_seq_grid = sorted({t for t in TOKENS_PER_SEQ_GRID if t <= max_draft_tokens} | {max_draft_tokens + 1})
    times = []
    for n in seqs_grid:
        row = []
        for t in per_seq_grid:
            if n * t > MAX_MEASURED_TOKENS and len(row) >= 2:  # big enough to extrapolate linearly from here
                break
            row.append(min(time_forward(n, t) for _ in range(REPEATS)))
        while len(row) < len(per_seq_grid):  # extrapolate the skipped (largest) points
            j = len(row)
            slope = (row[-1] - row[-2]) / (per_seq_grid[j - 1] - per_seq_grid[j - 2])
            row.append(row[-1] + slope * (per_seq_grid[j] - per_seq_grid[j - 1]))
        times.append(row)
    return CostModel(seqs_grid, per_seq_grid, times, measured=True)


def _cummax(xs: list[float]) -> list[float]:
    out, m = [], float("-inf")
    for x in xs:
        m = max(m, x)
        out.append(m)
    return out


def _interp(pts: list[tuple[float, float]], x: float) -> float:
    if len(pts) == 1 or x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = pts[-2], pts[-1]
    return y1 + (y1 - y0) * (x - x1) / (x1 - x0)
