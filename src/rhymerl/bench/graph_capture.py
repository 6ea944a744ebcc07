"""Graph captures kept out of a bench's timed runs: every step shape of the benched engines' CUDA backends
captured before the first timed run (`CudaBackend.capture_every_shape`), the seconds that took, and how
many graphs the timed runs still captured (none expected). Nothing happens where no backend replays graphs."""

from __future__ import annotations

import time

from rhymerl.engine.backends import CudaBackend


class GraphCaptures:
    """Capture now, over `backends` (the others are skipped), prefill chains up to `longest_chain` tokens."""

    def __init__(self, backends: list, longest_chain: int | None = None):
        self.backends = [b for b in backends if isinstance(b, CudaBackend)]
        t0 = time.perf_counter()
        for backend in self.backends:
            backend.capture_every_shape(longest_chain)
        self.seconds = time.perf_counter() - t0
        self.before = sum(b.captured for b in self.backends)

    def fields(self) -> dict:
        """The bench JSON's figures: `capture_s` and `graphs_captured_later` (by the runs since)."""
        if not self.backends:
            return {}
        return {"capture_s": round(self.seconds, 2),
                "graphs_captured_later": sum(b.captured for b in self.backends) - self.before}
