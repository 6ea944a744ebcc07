"""The engine's backends: how a step's forward runs on a device, over the KV cache.

- `eager` (`eager.py`): `Decoder.forward_packed` with SDPA attention over the cache; every device. The
  reference of the others, and the fallback.
- `cpu` (`cpu.py`): the fused C++ kernels (`native.py`, `kernels/`), fp32 and bf16 on a CPU.
- `cuda` (`cuda.py`): steps replayed from CUDA graphs (tests/engine/test_cuda.py passed on an H100); the
  eager forward with `RHYMERL_CUDA_GRAPHS=0`.

`select_backend` is the one spot that chooses. A backend offers `forward(step)`, `commit` and `move`
(`base.Backend`); the engine reaches it through `ModelRunner` (engine/model_runner.py).
"""

from __future__ import annotations

import os

import torch

from rhymerl.engine.backends import native
from rhymerl.engine.backends.base import Backend, Step
from rhymerl.engine.backends.cpu import CpuBackend
from rhymerl.engine.backends.cuda import CudaBackend
from rhymerl.engine.backends.eager import EagerBackend
from rhymerl.engine.kv_cache import KVCache
from rhymerl.model.decoder import Decoder

__all__ = ["Backend", "CpuBackend", "CudaBackend", "EagerBackend", "Step", "select_backend"]

KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # the fused CPU kernels' dtypes


def select_backend(model: Decoder, cache: KVCache, fused: bool = True) -> Backend:
    """The backend for `model` over `cache` on the model's device:

    - CUDA: `CudaBackend` replaying CUDA graphs; in its eager mode with RHYMERL_CUDA_GRAPHS=0 or `fused=False`;
    - CPU: `CpuBackend` where the fused kernels build (`native.ops()`; None after one warning where they
      cannot, and with RHYMERL_NATIVE=0) and take the cache's dtype (fp32, bf16), unless `fused=False`;
    - otherwise (fp16 on a CPU, no kernels, other devices): `EagerBackend`.
    """
    device = next(model.parameters()).device
    if device.type == "cuda":
        # On by default since tests/engine/test_cuda.py passed on an H100 (docs/engine.md, "On a GPU");
        # RHYMERL_CUDA_GRAPHS=0 is the eager baseline.
        graphs = fused and os.environ.get("RHYMERL_CUDA_GRAPHS", "1") != "0"
        return CudaBackend(model, cache, "graphs" if graphs else "eager")
    if fused and device.type == "cpu" and cache.kv.dtype in KERNEL_DTYPES:
        ops = native.ops()
        if ops is not None:
            return CpuBackend(model, cache, ops)
    return EagerBackend(model, cache)
