"""Graph captures kept out of a bench's timed runs: every step shape of the benched engines' CUDA backends
captured before the first timed run, with the draws of every kind the bench's runs use
(`CudaBackend.capture_every_shape`), the seconds that took, and how many graphs the timed runs still captured
(none expected). In "static" mode (the CPU's stand-in) nothing is captured and each shape runs once instead:
`shapes_first_run_later` counts the (bucket, draw kind) pairs a timed run met first there too. Nothing happens
where no backend is the CUDA backend."""

from __future__ import annotations

import time
from collections.abc import Iterable

from rhymerl.engine.backends import CudaBackend
from rhymerl.engine.sampling_params import SamplingParams


class GraphCaptures:
    """Capture now, over `backends` (the others are skipped), prefill chains up to `longest_chain` tokens, the
    draws of every kind of `params` (the SamplingParams the timed runs will use)."""

    def __init__(self, backends: list, longest_chain: int | None = None,
                 params: Iterable[SamplingParams] = (SamplingParams(),)):
        self.backends = [b for b in backends if isinstance(b, CudaBackend)]
        params = list(params)
        t0 = time.perf_counter()
        for backend in self.backends:
            backend.capture_every_shape(longest_chain, params)
        self.seconds = time.perf_counter() - t0
        self.before = sum(b.captured for b in self.backends)
        self.first_runs = sum(b.first_runs for b in self.backends)
        self.capture_s = sum(b.capture_s for b in self.backends)

    def fields(self) -> dict:
        """The bench JSON's figures: `capture_s` (the captures made here, seconds), `graphs_captured` (before
        the timed runs, the cost models' measurements included) in `graphs_capture_s` seconds, and, by the
        runs since, `graphs_captured_later` and `shapes_first_run_later`."""
        if not self.backends:
            return {}
        return {"capture_s": round(self.seconds, 2), "graphs_captured": self.before,
                "graphs_capture_s": round(self.capture_s, 2),
                "graphs_captured_later": sum(b.captured for b in self.backends) - self.before,
                "shapes_first_run_later": sum(b.first_runs for b in self.backends) - self.first_runs}
