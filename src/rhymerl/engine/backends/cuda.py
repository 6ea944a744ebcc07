"""The CUDA backend: decode and verification steps replayed as CUDA graphs, prefill eager.

An eager step of a small model is host-bound on a GPU: every layer launches a dozen small kernels from
Python (~41 ms per forward for a 135M model on an H100, as slow as transformers `generate`). A CUDA graph
launches them all at once. Each step shape (B rows, T tokens per row, L keys: `static_step.StaticShapes`)
gets its graph the first time it occurs, captured over that shape's persistent buffers
(`static_step.StaticStep`); a later step of the same shape fills the buffers and replays. Prefill chunks and
copied prompt prefixes run eagerly (`EagerBackend`, SDPA over the cache), as does every step with
`graphs=False` (how the tests run this class on a CPU).

Every forward ends with `torch.cuda.synchronize`: callers time it (the speculator's cost model, `forward_s`),
and the sampler reads the logits on the host right after anyway.
"""

from __future__ import annotations

import torch

from rhymerl.engine.backends.base import Step
from rhymerl.engine.backends.eager import EagerBackend
from rhymerl.engine.backends.static_step import StaticShapes, StaticStep
from rhymerl.engine.kv_cache import KVCache
from rhymerl.model.decoder import Decoder


class _Graph:
    """One bucket's buffers and, once captured, its graph and output (logits [B * T, vocab])."""

    def __init__(self, step: StaticStep):
        self.step = step
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None


class CudaBackend(EagerBackend):
    """Eager prefill, graphed decode and verification (`graphs=True`, the default on a CUDA device).
    `captured`: graphs captured so far; `replays`, `eager_steps`: steps of each kind."""

    # A GPU samples a whole tree's rows as fast as one, and every wait for the sampler's results is a host
    # synchronisation: draw every draft node at once, one wait per step.
    draws_every_node = True

    def __init__(self, model: Decoder, cache: KVCache, graphs: bool | None = None):
        super().__init__(model, cache)
        self.graphs = cache.kv.device.type == "cuda" if graphs is None else graphs
        self.shapes = StaticShapes(cache)
        self.buckets: dict[tuple[int, int, int], _Graph] = {}
        self.pool = None  # one memory pool for every graph: they never run at the same time
        self.captured = self.replays = self.eager_steps = 0

    def forward(self, step: Step) -> torch.Tensor:
        shape = self.shapes.of(step)
        if shape is None:
            self.eager_steps += 1
            logits = super().forward(step)
        else:
            bucket = self.buckets.get(shape)
            if bucket is None:
                bucket = self.buckets[shape] = _Graph(StaticStep(self.model, self.cache, *shape))
            index = bucket.step.load(step)
            logits = self._replay(bucket).index_select(0, index)
        if self.cache.kv.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return logits

    def _replay(self, bucket: _Graph) -> torch.Tensor:
        """Run the bucket's step on its loaded buffers: through its graph, captured on first use."""
        if not self.graphs:
            self.replays += 1
            return bucket.step.run()
        if bucket.graph is None:
            self._capture(bucket)  # its warm-up ran this very step: the output is the step's
            return bucket.logits
        bucket.graph.replay()
        self.replays += 1
        return bucket.logits

    def _capture(self, bucket: _Graph) -> None:
        """Warm the step up on a side stream (cuBLAS and the allocator set themselves up on first use, which a
        capture must not contain), then capture it. The warm-up and the capture's replay below compute this
        same loaded step, so the keys/values they write are the step's own: nothing is clobbered."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            bucket.step.run()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            bucket.logits = bucket.step.run()
        self.pool = graph.pool()
        bucket.graph = graph
        graph.replay()  # capturing only records: this computes the step
        self.captured += 1
