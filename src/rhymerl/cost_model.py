"""The step-time model (torch-free): how long one engine step takes for a given batch shape.

An engine measures it once at start-up (`measure`, with a callback that times real steps), HistoSpec reads
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
REPEATS = 2  # each point is the fastest of this many steps: noise only ever adds time


class CostModel:
    """Time (seconds) of a step with `seqs` sequences feeding `tokens` tokens in all, from a grid measured on
    this machine: times[i][j] for seqs_grid[i] sequences x per_seq_grid[j] tokens each. A point is the step
    as the engine runs it (`measure`): on a CPU its forward; where drafts are verified on the device (a GPU),
    its forward, the draws of every row, the acceptance walk and the host's part of the runner (packing the
    step, reading the result back), in the bucket it runs in. (Called "forward" below: what the grid holds.)
    Bilinear interpolation in (sequences, tokens per sequence), linear extrapolation past the grid, and
    the grid is made non-decreasing first (measurement noise must not make a bigger step look cheaper).
    `measured`: timed on this machine (`measure`), so HistoSpec corrects it online against the steps it
    times; a grid written by hand (tests, a fixed model) is taken as is.

    How a GPU runs a draft step (`step`), where the CPU's figures say nothing of it:
    - `padded_rows`: a step runs in a bucket of fixed shape (the CUDA backend's `StaticShapes`, which a
      measured grid is: `measure(buckets=...)`): its sequences rounded up to the next rows grid point, every
      row padded to the tokens of its longest row rounded up to the next tokens grid point. One sequence
      drafting 8 tokens then costs the step as if every one did; 5 sequences cost what 8 do.
    - `draft_step_s`, `draft_node_s`: what a step that verifies drafts adds outside the grid, once and per
      draft node. A measured grid holds a drafting step's draws and walk already (`measure`: 0 here); a grid
      measured before it did (forward alone, the draws timed apart) or written by hand sets them.
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
        t * cost(seqs) / cost(seqs * t) over t = 1..max_tokens_per_seq, the t that reaches it). The grid
        only (on a GPU the step with its draws and walk; on a CPU its forward): drafting and the rest of the
        engine's step are left out."""
        plain = self(seqs, seqs)
        best = max(range(1, max_tokens_per_seq + 1), key=lambda t: (t * plain / self(seqs * t, seqs), -t))
        return best * plain / self(seqs * best, seqs), best


def measure(time_step: Callable[[int, int], float], slots: int, max_draft_tokens: int,
            padded_rows: bool = False, buckets: tuple[list[int], list[int]] | None = None) -> CostModel:
    """Measure the grid: `time_step(n, t)` runs one verification step of n sequences feeding t tokens each
    (a token and a chain draft of t - 1) and returns its seconds. The engine supplies it
    (`ModelRunner.measure_cost`): the step as it runs it, so where drafts are verified on the device (a GPU)
    the draws of every row, the acceptance walk and the host's reading of the result are in each point, in
    the bucket they run in, and nothing is added beside the grid (`draft_step_s`, `draft_node_s` stay 0). It
    says whether its backend pads every row to the longest (`padded_rows`) and `buckets`: (rows, tokens per
    row) of a backend whose steps run in fixed shapes: the grid is then those buckets (up to the one holding
    a full draft), each measured, none extrapolated, so that a step is priced at its own bucket's measured
    time."""
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
            row.append(min(time_step(n, t) for _ in range(REPEATS)))
        while len(row) < len(per_seq_grid):  # extrapolate the skipped (largest) points
            j = len(row)
            slope = (row[-1] - row[-2]) / (per_seq_grid[j - 1] - per_seq_grid[j - 2])
            row.append(row[-1] + slope * (per_seq_grid[j] - per_seq_grid[j - 1]))
        times.append(row)
    return CostModel(seqs_grid, per_seq_grid, times, measured=True, padded_rows=padded_rows)


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
