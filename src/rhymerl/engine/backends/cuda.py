"""The CUDA backend: every step replayed from CUDA graphs.

An eager step of a small model is host-bound on a GPU: every layer launches a dozen small kernels from
Python (~41 ms per forward for a 135M model on an H100, as slow as transformers `generate`). A CUDA graph
launches them all at once. A step is cut into parts of one kind each (`_parts`): prefill chains and small
trees (decode, verification), and the sequences that copy a shared prompt prefix after the others, once the
copy is made. Each part's shape (`static_step.StaticShapes`) gets its graph the first time it occurs,
captured over that shape's persistent buffers (`static_step.StaticStep`); a later part of the same shape fills
the buffers and replays. What fits no bucket runs eagerly (`EagerBackend`, SDPA over the cache).

Modes: "graphs" (the default on a GPU); "static", the same parts and buffers run eagerly, no capture (how the
tests run this class on a CPU); "eager", every step through `EagerBackend` (`RHYMERL_CUDA_GRAPHS=0`: the
baseline).

`forward_drawn` runs the step's draws and acceptance walk inside each part's step too (`StaticStep.draw`): one
graph a (bucket, greedy/top-k/top-p) replays forward, draws and walk, and the host reads one small tensor
back (`device_verification.read_drawn`), its one wait of the step. `forward` returns logits (the cost model's
forwards, a step of several SamplingParams), whose draws the engine makes after it
(`device_verification.verify_on_device`). Whoever times a forward synchronises (`ModelRunner.synchronize`).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import replace
from typing import Callable, Iterable

import numpy as np
import torch

from rhymerl.engine.backends.base import Step
from rhymerl.engine.backends.eager import EagerBackend
from rhymerl.engine.backends.static_forward import rope_table
from rhymerl.engine.backends.static_step import StaticShapes, StaticStep
from rhymerl.engine.device_verification import StepDraws
from rhymerl.engine.kv_cache import KVCache
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.model.decoder import Decoder


class _Graph:
    """One bucket's buffers and, once captured, its graphs: by key, None for the forward alone (its output the
    logits), `draw_kind(params)` for the forward with the draws and walk (its output `StaticStep.draw`'s)."""

    def __init__(self, step: StaticStep):
        self.step = step
        self.graphs: dict = {}  # key -> (torch.cuda.CUDAGraph, its output tensor)
        self.failed: set = set()  # keys whose capture raised: run eagerly
        self.ran: set = set()  # keys run at least once (captured, failed, or in "static" mode run eagerly)


def draw_kind(params: SamplingParams) -> tuple[bool, int, float]:
    """What a drawing graph's ops depend on: greedy or not, top-k, top-p (the temperature is a buffer)."""
    return params.greedy, params.top_k, params.top_p


MODES = ("graphs", "static", "eager")


class CudaBackend(EagerBackend):
    """Steps replayed from CUDA graphs where a bucket fits, eager elsewhere; `mode` in MODES (module
    docstring). `captured`: graphs captured so far, in `capture_s` seconds; `first_runs`: (bucket, key) pairs
    run for the first time (in "graphs" mode each a capture, or its failure; in "static" mode, where nothing is
    captured, what a GPU would have captured: the CPU's check that a bench's timed runs capture nothing);
    `replays`, `eager_parts`: parts run each way."""

    # A GPU samples a whole tree's rows as fast as one, and every wait for the sampler's results is a host
    # synchronisation: draw every draft node and walk the drafts there, one wait per step.
    verifies_on_device = True

    def __init__(self, model: Decoder, cache: KVCache, mode: str = "graphs"):
        if mode not in MODES:
            raise ValueError(f"CudaBackend mode {mode!r}: choose one of {MODES}")
        super().__init__(model, cache)
        self.mode = mode
        self.shapes = StaticShapes(cache)
        self.rope = rope_table(model, cache)  # every bucket's steps gather their rope rows from it
        self.buckets: dict[tuple[bool, int, int, int], _Graph] = {}
        self.pool = None  # one memory pool for every graph: they never run at the same time
        self.captured = self.replays = self.eager_parts = self.first_runs = 0
        self.capture_s = 0.0

    def forward(self, step: Step) -> torch.Tensor:
        if self.mode == "eager":
            self.eager_parts += 1
            return super().forward(step)
        parts = _parts(step.inputs, self.shapes.tree)
        if len(parts) == 1 and step.inputs[0].prefix_from is None:
            logits = self._part(step, list(range(len(step.inputs))))
        else:
            pieces, order = [], []
            for part in parts:
                if step.inputs[part[0]].prefix_from is not None:
                    self._copy_prefixes([step.inputs[i] for i in part])
                pieces.append(self._part(step, part))
                order += part
            # back to the step's order: the inputs' logit rows, input by input
            counts = [len(x.tokens) - x.logits_from for x in step.inputs]
            starts = np.cumsum([0] + [counts[i] for i in order])
            at = dict(zip(order, starts))
            index = np.concatenate([at[i] + np.arange(counts[i]) for i in range(len(step.inputs))])
            logits = torch.cat(pieces).index_select(0, torch.from_numpy(index).to(self.device))
        return logits

    @property
    def pads_rows(self) -> bool:
        """Fixed shapes pad every row to the step's longest (`static_step`); the eager mode does not."""
        return self.mode != "eager"

    @property
    def step_buckets(self) -> tuple[list[int], list[int]] | None:
        """(rows, tokens per row) a decode or verification step is rounded up to (`StaticShapes`)."""
        return None if self.mode == "eager" else (self.shapes.rows, self.shapes.tokens)

    def forward_drawn(self, inputs: list, trees: list, draws: StepDraws) -> tuple[torch.Tensor, np.ndarray] | None:
        """`forward`, with every logits row drawn and the drafts walked inside each part's step (module
        docstring): ([3, X] on the device, the columns of the inputs' logit rows in order), or None where a
        part fits no bucket (then nothing has run: the caller takes `forward`'s logits instead)."""
        if self.mode == "eager":
            return None
        parts = _parts(inputs, self.shapes.tree)
        stripped = [x if x.prefix_from is None else replace(x, prefix_from=None) for x in inputs]
        shapes = [self.shapes.of([stripped[i] for i in part]) for part in parts]
        if None in shapes:
            return None
        outs, at, width = [], {}, 0
        for part, shape in zip(parts, shapes):
            if inputs[part[0]].prefix_from is not None:
                self._copy_prefixes([inputs[i] for i in part])
            inputs_p = [stripped[i] for i in part]
            bucket = self._bucket(shape)
            index = bucket.step.load(inputs_p, [trees[i] for i in part],
                                     StepDraws([draws.prefixes[i] for i in part], [draws.offsets[i] for i in part],
                                               draws.params))
            out = self._graphed(bucket, draw_kind(draws.params),
                                lambda step=bucket.step: step.draw(step.run(), draws.params))
            if len(parts) == 1:  # the common step (decode, verification): its tensor as the graph left it
                return out, index
            outs.append(out.clone())  # a later part may replay the same bucket
            counts = [len(x.tokens) - x.logits_from for x in inputs_p]
            for i, a, k in zip(part, np.cumsum([0] + counts), counts):
                at[i] = width + index[a : a + k]
            width += out.shape[1]
        return torch.cat(outs, 1), np.concatenate([at[i] for i in range(len(inputs))])

    @torch.inference_mode()
    def capture_every_shape(self, longest_chain: int | None = None,
                            params: Iterable[SamplingParams] = (SamplingParams(),)) -> tuple[int, float]:
        """Capture a graph for every bucket (`StaticShapes.every`, prefill chains up to `longest_chain`
        tokens) and every draw kind of `params` (`draw_kind`: greedy, top-k, top-p; one temperature serves
        every other, a buffer) now, on a step of padding alone (which changes no committed key or value), so
        that no later step pays for a capture: what a bench does before its timed runs, with the
        SamplingParams its runs use. The graphs are the engine's: the forward with the draws
        (`forward_drawn`), which every step of one SamplingParams runs. "static" mode runs each (bucket, kind)
        once instead (what the CPU can check: `first_runs`). Returns (graphs newly captured or buckets run,
        seconds).
        In inference mode, as `ModelRunner.run`: a caller outside it would otherwise capture every bucket's
        autograd graph, its activations kept alive by the bucket's logits (on an H200, 130 GiB after three
        engines' captures)."""
        if self.mode == "eager":
            return 0, 0.0
        kinds = {draw_kind(p): p for p in params}  # one SamplingParams per kind
        t0, done = time.perf_counter(), 0
        for shape in self.shapes.every(longest_chain):
            bucket = self._bucket(shape)
            for kind, p in kinds.items():
                if kind in bucket.ran:
                    continue
                bucket.step.load([], [])
                run = lambda step=bucket.step, p=p: step.draw(step.run(), p)  # noqa: E731
                if self.mode == "static":  # a run, not a part of a step: no replay counted
                    self._first_run(bucket, kind)
                    run()
                else:
                    self._graphed(bucket, kind, run)  # captures it
                done += 1
        if self.mode == "graphs":
            torch.cuda.synchronize(self.device)
        return done, time.perf_counter() - t0

    def _part(self, step: Step, part: list[int]) -> torch.Tensor:
        """Logits of the inputs `part` (indices into the step's; their prefixes, if copied, in place by now)."""
        whole = len(part) == len(step.inputs) and all(x.prefix_from is None for x in step.inputs)
        inputs = [step.inputs[i] if step.inputs[i].prefix_from is None else replace(step.inputs[i], prefix_from=None)
                  for i in part]
        trees = [step.trees[i] for i in part]
        shape = self.shapes.of(inputs)
        if shape is None:
            self.eager_parts += 1
            return super().forward(step if whole else _sub_step(inputs, trees, self.device))
        bucket = self._bucket(shape)
        index = bucket.step.load(inputs, trees)
        return self._graphed(bucket, None, bucket.step.run).index_select(0, torch.from_numpy(index).to(self.device))

    def _bucket(self, shape: tuple[bool, int, int, int]) -> _Graph:
        bucket = self.buckets.get(shape)
        if bucket is None:
            bucket = self.buckets[shape] = _Graph(StaticStep(self.model, self.cache, *shape, self.rope))
        return bucket

    def _copy_prefixes(self, inputs: list) -> None:
        """Each input's first `base` positions from its `prefix_from` slot, in every layer at once."""
        by_length: dict[int, list] = {}
        for x in inputs:
            by_length.setdefault(x.base, []).append(x)
        for n, xs in by_length.items():
            dst = torch.tensor([x.slot for x in xs], device=self.device)
            src = torch.tensor([x.prefix_from for x in xs], device=self.device)
            self.cache.kv[:, dst, :, :n] = self.cache.kv[:, src, :, :n]

    def _graphed(self, bucket: _Graph, key, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`run()` (the bucket's work on its loaded buffers) through the bucket's graph for `key`, captured on
        first use; in "static" mode, or where its capture failed, eagerly."""
        self._first_run(bucket, key)
        if self.mode == "static":
            self.replays += 1
            return run()
        entry = bucket.graphs.get(key)
        if entry is None:
            if key in bucket.failed:  # its capture failed once: eager from then on
                return run()
            t0 = time.perf_counter()
            try:
                entry = bucket.graphs[key] = self._capture(run)  # computes this very step
            except RuntimeError as e:  # an op that syncs with the host, say: slower, never wrong
                bucket.failed.add(key)
                warnings.warn(f"CUDA graph capture of step shape {bucket.step.shape} ({key}) failed, running it "
                              f"eagerly: {e}")
                torch.cuda.synchronize(self.device)
                return run()
            finally:
                self.capture_s += time.perf_counter() - t0
            return entry[1]
        entry[0].replay()
        self.replays += 1
        return entry[1]

    def _first_run(self, bucket: _Graph, key) -> None:
        if key not in bucket.ran:
            bucket.ran.add(key)
            self.first_runs += 1

    def _capture(self, run: Callable[[], torch.Tensor]) -> tuple:
        """Warm `run` up on a side stream (cuBLAS and the allocator set themselves up on first use, which a
        capture must not contain), capture it, replay it: (graph, its output). The warm-up and the replay
        compute this same loaded step, so the keys/values they write are the step's own: nothing is
        clobbered. The graph reads the model's parameters at the addresses they have now: a weight update
        must copy into them in place (`RolloutWorker.load_weights` does), never replace them."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls (a trainer's, a hand-over's) do not break this capture
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = run()
        self.pool = graph.pool()
        graph.replay()  # capturing only records the kernels: this runs them
        self.captured += 1
        return graph, out


def _parts(inputs: list, tree: int) -> list[list[int]]:
    """The step's inputs (indices) in parts of one kind, in the order they must run: prefill chains (longer
    than `tree` tokens), small trees, then the inputs that copy a prefix (sources hold it by then: a running
    sequence, or one prefilled in this step, never another copier), chains then trees."""
    parts: list[list[int]] = [[], [], [], []]
    for i, x in enumerate(inputs):
        parts[2 * (x.prefix_from is not None) + (len(x.tokens) <= tree)].append(i)
    return [p for p in parts if p]


def _sub_step(inputs: list, trees: list, device) -> Step:
    """A Step of these inputs alone, for the eager forward."""
    tokens = [t for x in inputs for t in x.tokens]
    positions = np.concatenate([x.base + depth for x, (_, depth) in zip(inputs, trees)])
    rows, off = [], 0
    for x in inputs:
        rows += range(off + x.logits_from, off + len(x.tokens))
        off += len(x.tokens)
    logit_rows = None if len(rows) == off else torch.tensor(rows, device=device)
    return Step(inputs, trees, torch.tensor(tokens, device=device), torch.from_numpy(positions).to(device), logit_rows)
