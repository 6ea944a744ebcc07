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

    How a GPU runs a draft step (`step`), where the CPU's figures say nothing of it:
    - `padded_rows`: a step runs in a bucket of fixed shape (the CUDA backend's `StaticShapes`, which a
      measured grid is: `measure(buckets=...)`): its sequences rounded up to the next rows grid point, every
      row padded to the tokens of its longest row rounded up to the next tokens grid point. One sequence
      drafting 8 tokens then costs the step as if every one did; 5 sequences cost what 8 do.
    - `draft_step_s`, `draft_node_s`: what a step that verifies drafts adds outside the forward, once and
      per draft node: the device's draws of every node and the acceptance walk, the host's trees. Zero
      leaves the step at its forward.
    """

    def __init__(self, seqs_grid: list[int], per_seq_grid: list[int], times: list[list[float]],
                 measured: bool = False, padded_rows: bool = False, draft_step_s: float = 0.0,
                 draft_node_s: float = 0.0):
        self.seqs_grid, self.per_seq_grid = list(seqs_grid), list(per_seq_grid)
        self.measured = measured
        self.padded_rows, self.draft_step_s, self.draft_node_s = padded_rows, draft_step_s, draft_node_s
        rows = [_cummax(r) for r in times]
        cols = [_cummax([rows[i][j] for i in range(len(rows))]) for j in range(len(per_seq_grid))]
        self.times = [[cols[j][i] for j in range(len(per_seq_grid))] for i in range(len(seqs_grid))]

    def __call__(self, tokens: int, seqs: int = 1) -> float:
        return self._forward(tokens / max(seqs, 1), seqs)

    def step(self, base_tokens: int, seqs: int, draft_tokens: int = 0, longest_draft: int = 0) -> float:
        """Predicted time of a step in which `seqs` sequences feed `base_tokens` tokens plus `draft_tokens`
        draft nodes, the longest draft `longest_draft` nodes: the forward (with `padded_rows`, the bucket's:
        rows rounded up to the rows grid point holding `seqs`, and in a drafting step tokens to the grid point
        holding the longest row, one token plus its draft) and, with any draft, the draft step's own costs.
        Past the grid's last point (no bucket holds it: the step runs eagerly), interpolated as unpadded."""
        if self.padded_rows:
            rows = next((n for n in self.seqs_grid if n >= seqs), seqs)
            per_seq = base_tokens / max(seqs, 1)
            if draft_tokens:
                longest = max(per_seq, 1 + longest_draft)
                per_seq = next((t for t in self.per_seq_grid if t >= longest), longest)
            forward = self._forward(per_seq, rows)
        else:
            forward = self(base_tokens + draft_tokens, seqs)
        return forward + (self.draft_step_s + self.draft_node_s * draft_tokens if draft_tokens else 0.0)

    def _forward(self, per_seq: float, seqs: int) -> float:
        at_seqs = [_interp(list(zip(self.per_seq_grid, row)), per_seq) for row in self.times]
        return _interp(list(zip(self.seqs_grid, at_seqs)), seqs)

    def as_dict(self) -> dict:
        return {"seqs": self.seqs_grid, "tokens_per_seq": self.per_seq_grid, "seconds": self.times,
                "measured": self.measured, "padded_rows": self.padded_rows, "draft_step_s": self.draft_step_s,
                "draft_node_s": self.draft_node_s}

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        """The inverse of `as_dict` (a model saved before the GPU terms had none: zero, unpadded)."""
        return cls(d["seqs"], d["tokens_per_seq"], d["seconds"], measured=d.get("measured", False),
                   padded_rows=d.get("padded_rows", False), draft_step_s=d.get("draft_step_s", 0.0),
                   draft_node_s=d.get("draft_node_s", 0.0))

    def ceiling(self, seqs: int, max_tokens_per_seq: int) -> tuple[float, int]:
        """The most any drafter could gain over plain decoding with `seqs` sequences, by this grid: a perfect
        drafter, every draft a chain of t-1 tokens the policy accepts whole, commits t tokens per sequence
        per forward of cost(seqs * t), where plain commits 1 per cost(seqs). Returns (the best
        t * cost(seqs) / cost(seqs * t) over t = 1..max_tokens_per_seq, the t that reaches it). The
        forward only: the rest of a step (drafting, sampling) is left out."""
        plain = self(seqs, seqs)
        best = max(range(1, max_tokens_per_seq + 1), key=lambda t: (t * plain / self(seqs * t, seqs), -t))
        return best * plain / self(seqs * best, seqs), best


def measure(time_forward: Callable[[int, int], float], slots: int, max_draft_tokens: int,
            padded_rows: bool = False, time_draws: Callable[[int, int], float] | None = None,
            buckets: tuple[list[int], list[int]] | None = None) -> CostModel:
    """Measure the grid: `time_forward(n, t)` runs one verification forward of n sequences feeding t tokens
    each (a chain) and returns its seconds. The engine supplies it (`Engine.measure_cost_model`), says
    whether its backend pads every row to the longest (`padded_rows`: the grid's tokens per sequence are
    then the backend's buckets) and, where drafts are verified on the device, `time_draws(n, t)`: the
    seconds of drawing and walking n chains of t nodes (t = 0: a plain step's draws), which give the draft
    step's own costs (`draft_step_s`, `draft_node_s`). `buckets`: (rows, tokens per row) of a backend whose
    steps run in fixed shapes: the grid is then those buckets (up to the one holding a full draft), each
    measured, none extrapolated, so that a step is priced at its own bucket's measured time."""
    if buckets is None:
        seqs_grid = sorted({n for n in SEQS_GRID if n < slots} | {slots})
        per_seq_grid = sorted({t for t in TOKENS_PER_SEQ_GRID if t <= max_draft_tokens} | {max_draft_tokens + 1})
    else:
        seqs_grid = sorted(n for n in buckets[0] if n <= slots)
        top = next((t for t in sorted(buckets[1]) if t >= max_draft_tokens + 1), max_draft_tokens + 1)
        per_seq_grid = sorted({t for t in buckets[1] if t < top} | {top})
    times = []
    for n in seqs_grid:
        row = []
        for t in per_seq_grid:
            # big enough to extrapolate linearly from here (a bucket is measured: it is what a step runs in)
            if n * t > MAX_MEASURED_TOKENS and len(row) >= 2 and buckets is None:
                break
            row.append(min(time_forward(n, t) for _ in range(REPEATS)))
        while len(row) < len(per_seq_grid):  # extrapolate the skipped (largest) points
            j = len(row)
            slope = (row[-1] - row[-2]) / (per_seq_grid[j - 1] - per_seq_grid[j - 2])
            row.append(row[-1] + slope * (per_seq_grid[j] - per_seq_grid[j - 1]))
        times.append(row)
    step_s = node_s = 0.0
    if time_draws is not None:  # all slots: the step where drafting's own cost weighs most against plain
        best = [min(time_draws(slots, t) for _ in range(REPEATS)) for t in (0, 1, max_draft_tokens)]
        node_s = max(best[2] - best[1], 0.0) / max(slots * (max_draft_tokens - 1), 1)
        step_s = max(best[1] - best[0] - slots * node_s, 0.0)
    return CostModel(seqs_grid, per_seq_grid, times, measured=True, padded_rows=padded_rows,
                     draft_step_s=step_s, draft_node_s=node_s)


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
