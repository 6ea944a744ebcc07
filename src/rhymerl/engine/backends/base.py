"""What every backend takes and offers: `Step`, one engine step packed by `ModelRunner`, and `Backend`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


@dataclass
class Step:
    """One forward's tokens, packed in the order of `inputs` (a slot's tokens are consecutive)."""

    # The engine's SlotInputs (engine/model_runner.py; read here: slot, base, tokens, prefix_from). Token i
    # of an input is written to cache position base + i of its slot.
    inputs: list
    trees: list[tuple[np.ndarray | None, np.ndarray]]  # per input: ([n, n] ancestor matrix or None, [n] depth)
    tokens: torch.Tensor  # [N] token ids
    positions: torch.Tensor  # [N] rope positions (base + depth)
    logit_rows: torch.Tensor | None  # [R] rows that need logits (None: all N)


class Backend(Protocol):
    """Runs the decoder over the KV cache. `ops`: the fused CPU kernels' namespace where this backend uses
    them (the sampler's plain case runs in C++ too), else None. `verifies_on_device`: the engine draws every
    draft node and walks the drafts on the device (`engine.device_verification`: a GPU), in one call per step,
    rather than level by level on the host; such a backend offers `forward_drawn` (`CudaBackend`: the draws
    and walk inside the step, None where it cannot). `pads_rows`: every row of a step runs padded to the tokens of
    its longest row, rounded up to a bucket (CUDA graphs), so the cost model prices a draft step that way
    (`CostModel.padded_rows`). `step_buckets`: where steps run in fixed shapes, (rows, tokens per row) they are
    rounded up to, which the cost model measures one by one (`cost_model.measure`); None elsewhere."""

    ops: object | None
    verifies_on_device: bool
    pads_rows: bool
    step_buckets: tuple[list[int], list[int]] | None

    def forward(self, step: Step) -> torch.Tensor:
        """Logits [R, vocab] in the model's dtype, once the step's keys/values are in the cache."""
        ...

    def commit(self, slot: int, base: int, path: list[int]) -> None:
        """`KVCache.commit`, and whatever state the backend keeps about the cache along with it."""
        ...

    def move(self, src: int, dst: int, length: int) -> None:
        """`KVCache.move`, and whatever state the backend keeps about the cache along with it."""
        ...
