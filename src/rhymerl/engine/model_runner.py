"""Turns one engine step (new tokens per slot) into one forward pass over the cached decoder.

Every slot in a step feeds a small token tree: a prefill chunk is a chain, a decode step is one node, a
speculative step is the last sampled token with a draft tree hanging from it. Token `i` of a slot with
`base` committed tokens is written to cache position `base + i` and has rope position `base + depth(i)`;
it attends to the slot's committed prefix and to its own ancestors (itself included). This module packs the
step (tokens, positions, logit rows, each tree's ancestors); how the forward runs on the device is the
backend's (`rhymerl.engine.backends`, chosen by `select_backend`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from rhymerl import cost_model
from rhymerl.cost_model import CostModel
from rhymerl.engine.backends import Backend, Step, select_backend
from rhymerl.engine.device_verification import StepDraws, read_drawn, verify_on_device
from rhymerl.engine.kv_cache import KVCache
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.histospec.drafter import Draft
from rhymerl.model.decoder import Decoder


@dataclass
class SlotInput:
    slot: int
    base: int  # committed tokens already in the slot's cache
    tokens: list[int]  # new tokens of this step
    parents: list[int] | None = None  # per token: index of its parent, -1 = the committed prefix; None = chain
    logits_from: int = 0  # logits are returned for tokens[logits_from:]
    prefix_from: int | None = None  # a slot whose first `base` positions hold this slot's prefix: copied first


_ONE_TOKEN = (None, np.zeros(1, dtype=np.int64))  # a decode step's tree, shared by every such input: read-only
_ONE_TOKEN[1].flags.writeable = False


def _ancestors(parents: list[int] | None, n: int) -> tuple[np.ndarray | None, np.ndarray]:
    """([n, n] bool: j is i or an ancestor of i, [n] depth) for a tree given in topological order.
    A single token (a decode step) needs no matrix: None, and its depth array is one shared read-only array."""
    if n == 1:
        if parents is not None and parents != [-1]:
            raise ValueError(f"draft tree not in topological order: token 0 has parent {parents[0]}")
        return _ONE_TOKEN
    if parents is None:
        return np.tril(np.ones((n, n), dtype=bool)), np.arange(n)
    anc = np.zeros((n, n), dtype=bool)
    depth = np.zeros(n, dtype=np.int64)
    for i, p in enumerate(parents):
        if p >= i:
            raise ValueError(f"draft tree not in topological order: token {i} has parent {p}")
        if p >= 0:
            anc[i] = anc[p]
            depth[i] = depth[p] + 1
        anc[i, i] = True
    return anc, depth


class ModelRunner:
    """Runs the engine's forwards through the backend `select_backend` picks for the model's device (on a CPU
    in fp32 or bf16: the fused kernels where they build; `fused=False`, fp16 or RHYMERL_NATIVE=0: the eager
    forward). `ops`: the fused kernels' namespace where the backend uses them (for the sampler), else None.

    The engine commits draft paths and moves slots through `commit` and `move`, not the cache's own
    methods: a backend may keep state about the cache's contents (the CPU backend's tile cache).
    `backend`: one the caller built over `cache` instead (a bench runs the CUDA backend's static mode on a CPU)."""

    def __init__(self, model: Decoder, cache: KVCache, fused: bool = True, backend: Backend | None = None):
        self.model = model
        self.cache = cache
        self.device = next(model.parameters()).device
        self.backend = backend if backend is not None else select_backend(model, cache, fused)
        self.ops = self.backend.ops

    def check_fits(self, model: Decoder, num_slots: int, max_model_len: int, scratch: int) -> None:
        """ValueError unless another engine of `model`, `num_slots` slots, `max_model_len` and `scratch` draft
        positions can run on this runner (its cache, and on a GPU its captured graphs)."""
        c = self.cache
        if self.model is not model or c.kv.shape[1] != num_slots or c.max_len != max_model_len \
                or c.capacity < max_model_len + scratch:
            raise ValueError(f"runner= needs this engine's model, {num_slots} slots, max_model_len "
                             f"{max_model_len} and room for {scratch} draft tokens; its cache has "
                             f"{c.kv.shape[1]} slots of {c.max_len} (+{c.capacity - c.max_len})")

    @torch.inference_mode()
    def run(self, inputs: list[SlotInput], float_logits: bool = True) -> torch.Tensor:
        """One forward over every slot's new tokens -> logits [sum of returned rows, vocab]: fp32, or with
        `float_logits=False` the model's dtype."""
        capacity = self.cache.capacity
        counts = [len(x.tokens) for x in inputs]
        bases = [x.base for x in inputs]
        for x, n, base in zip(inputs, counts, bases):
            if base + n > capacity:
                raise ValueError(f"slot {x.slot}: {base}+{n} tokens exceed cache capacity {capacity}")
        trees = [_ancestors(x.parents, n) for x, n in zip(inputs, counts)]  # ([n, n] ancestors, [n] depth)
        # Packed with a few numpy calls, not one array operation per input (host time on a GPU: the device waits)
        tokens = [t for x in inputs for t in x.tokens]
        positions = np.repeat(np.array(bases, dtype=np.int64), counts) + np.concatenate([d for _, d in trees])
        logit_rows = None
        if any(x.logits_from for x in inputs):  # some input wants fewer than all its rows
            rows, off = [], 0
            for x, n in zip(inputs, counts):
                rows += range(off + x.logits_from, off + n)
                off += n
            logit_rows = torch.tensor(rows, device=self.device)
        dev = self.device
        step = Step(inputs, trees, torch.tensor(tokens, device=dev), torch.from_numpy(positions).to(dev), logit_rows)
        logits = self.backend.forward(step)
        return logits.float() if float_logits else logits

    @torch.inference_mode()
    def run_drawn(self, inputs: list[SlotInput], draws: StepDraws | None) -> tuple[torch.Tensor, np.ndarray] | None:
        """`run` with the step's draws and acceptance walk inside it, where the backend can (the CUDA backend's
        fixed-shape steps: `CudaBackend.forward_drawn`): ([3, X] on the device, the columns of the inputs'
        logit rows), for `device_verification.read_drawn`. None, having run nothing, where it cannot."""
        if draws is None or not self.backend.verifies_on_device:
            return None
        for x in inputs:
            if x.base + len(x.tokens) > self.cache.capacity:
                raise ValueError(f"slot {x.slot}: {x.base}+{len(x.tokens)} tokens exceed cache capacity {self.cache.capacity}")
        return self.backend.forward_drawn(inputs, [_ancestors(x.parents, len(x.tokens)) for x in inputs], draws)

    def synchronize(self) -> None:
        """Wait until the device has run what was queued (a GPU's forward returns before it has run)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def commit(self, slot: int, base: int, path: list[int]) -> None:
        """Keep draft nodes `path` (indices into the step's tokens, increasing) as committed tokens
        `base, base+1, ...` of `slot` (`KVCache.commit`, with the backend's state kept consistent)."""
        self.backend.commit(slot, base, path)

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` committed positions of slot `src` to slot `dst` (`KVCache.move`, with the
        backend's state kept consistent)."""
        self.backend.move(src, dst, length)

    def measure_cost(self, max_draft_tokens: int, context: int,
                     params: SamplingParams = SamplingParams()) -> CostModel:
        """Time real verification steps on the cache's slots (`rhymerl.cost_model.measure`): n sequences, each
        with a `context`-token prefix, feeding t tokens as a chain (a token and a draft of t - 1). Each step
        as the engine runs it (`priced_step`), host work included. Only while no request holds a slot: it
        writes every slot's first `context` + `max_draft_tokens` + 1 positions. `params`: the draws' kind
        (greedy, top-k, top-p) where the backend draws in the step; temperature sampling by default."""
        slots = self.cache.kv.shape[1]
        self.priced_step([SlotInput(s, 0, [0] * context, logits_from=context - 1) for s in range(slots)], params)
        # fixed shapes (`step_buckets`): each point run once untimed first, which on a GPU is its graph's capture
        warm: set = set() if self.backend.step_buckets is not None else None

        def time_step(n: int, t: int) -> float:
            inputs = [SlotInput(s, context, [0] * t, list(range(-1, t - 1))) for s in range(n)]
            if warm is not None and (n, t) not in warm:
                warm.add((n, t))
                self.priced_step(inputs, params)
            t0 = time.perf_counter()
            self.priced_step(inputs, params)
            return time.perf_counter() - t0

        # On a GPU: every bucket a step runs in (`Backend.step_buckets`), rows padded to them (`Backend.pads_rows`)
        return cost_model.measure(time_step, slots, max_draft_tokens, self.backend.pads_rows,
                                  self.backend.step_buckets)

    def priced_step(self, inputs: list[SlotInput], params: SamplingParams) -> None:
        """One step of `inputs` run as the engine runs it, to its end, for the cost model to time. Where the
        backend verifies on the device: the forward with every row's draws and the acceptance walk (inside
        the step, `run_drawn`; where it cannot, the forward then `verify_on_device`: the engine's way for
        such a step), and the host's wait for and reading of the result, each input's tokens after its first
        taken as a chain draft. Elsewhere the forward alone (a CPU's draws are the host's, priced online by
        HistoSpec's measured/predicted ratio)."""
        if not self.backend.verifies_on_device:
            self.run(inputs, float_logits=False)
            self.synchronize()
            return
        drafts = [Draft(x.tokens[1:], list(range(-1, len(x.tokens) - 2))) if x.logits_from == 0 else Draft()
                  for x in inputs]
        draws = StepDraws([x.slot for x in inputs], [0] * len(inputs), params)
        drawn = self.run_drawn(inputs, draws)
        if drawn is not None:
            read_drawn(drafts, *drawn)
            return
        logits = self.run(inputs, float_logits=False)
        starts = np.cumsum([0] + [len(x.tokens) - x.logits_from for x in inputs])[:-1].tolist()
        verify_on_device(drafts, logits, starts, draws.prefixes, draws.offsets, params)
