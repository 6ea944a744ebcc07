"""The CUDA backend. For now the eager forward (`EagerBackend`: SDPA attention over the cache) followed by a
`torch.cuda.synchronize`: callers time the forward (the speculator's cost model, `forward_s`), not its
launch. This class is where the GPU's own fast path will go (CUDA graphs of the decode step, say); until
then it has no code that the eager backend's tests do not cover."""

from __future__ import annotations

import torch

from rhymerl.engine.backends.base import Step
from rhymerl.engine.backends.eager import EagerBackend


class CudaBackend(EagerBackend):
    def forward(self, step: Step) -> torch.Tensor:
        logits = super().forward(step)
        torch.cuda.synchronize(self.device)
        return logits
