"""What a step launches, counted on any device: the aten ops a region dispatches (`OpTrace`), and of those
the ones that compute (`launches`).

A CUDA graph replays the kernels its capture recorded, one or more per computing aten op; the same static
step runs them eagerly on a CPU (`static_step.py`). So the static step's op trace counts its kernels where no
GPU is at hand: views and metadata ops (view, permute, slice, expand, a `to` that changes nothing) launch
nothing, every other op launches at least one kernel (a matmul may add a split-K reduction, attention a
kernel or two). `bench engine` reports the count per step (`kernels_per_step`); the tests check that a
bucket's trace is the same whatever the step holds, and read nothing back to the host.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# allocations: memory, no kernel
_ALLOCATIONS = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided")


class OpTrace(TorchDispatchMode):
    """Every aten op a region runs: `ops`, (op name, output shapes, computes) each; `launches`, how many
    compute (write new memory, or a tensor in place)."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, list[tuple[int, ...]], bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.ops.append((str(func), [tuple(t.shape) for t in outs], _computes(func, args, kwargs, outs)))
        return out

    @property
    def launches(self) -> int:
        return sum(computes for _, _, computes in self.ops)


def _computes(func, args, kwargs, outs: list[torch.Tensor]) -> bool:
    """Whether an op does device work: it writes a tensor in place (its schema mutates an argument), or one
    of its outputs lives in memory none of its inputs owns (a view or a no-op `to` returns its input's)."""
    if func._schema.is_mutable:
        return True
    if func.__name__.split(".")[0] in _ALLOCATIONS:
        return False
    inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)}
    return any(t.untyped_storage().data_ptr() not in inputs for t in outs)
