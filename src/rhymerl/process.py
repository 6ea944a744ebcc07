"""Process-wide settings, made in one place per process (`setup_process`): the driver of a training run, a
`rhymerl generate` or bench process, and (next) each rollout worker process call it once, first; no
constructor changes them.

- Seeds (`torch`, `random`) of the run.
- glibc's allocator keeps freed memory (below): large temporaries stop costing page faults.
- On CUDA, deterministic algorithms for the whole process (`make_cuda_deterministic`); on a CPU only around
  the update (`deterministic_algorithms`).

PyTorch's CPU allocator hands every tensor to malloc and frees it at once. glibc serves blocks above its
mmap threshold (128 KiB, adaptive up to 32 MiB) with fresh mmap()s and unmaps them on free, so a 6 MB
temporary, e.g. the [32, 49152] probabilities of one sampling step, is faulted in page by page every
time: measured here, softmax over [32, 49152] took 4 ms instead of 0.8 ms. Raising the mmap and trim
thresholds makes glibc reuse freed heap memory instead.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import random
from contextlib import contextmanager

import torch

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_THRESHOLD = 1 << 30


def _glibc_function(name: str):
    """glibc's function `name`, or None where there is no glibc (macOS, musl, Windows)."""
    lib = ctypes.util.find_library("c")
    if lib is None:
        return None
    try:
        return getattr(ctypes.CDLL(lib), name)
    except (OSError, AttributeError):
        return None


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds to 1 GiB. Returns False where there is no glibc."""
    mallopt = _glibc_function("mallopt")
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, _THRESHOLD))


def release_freed_memory() -> bool:
    """Give the heap's free memory back to the OS (glibc malloc_trim). With the thresholds above freed
    memory otherwise stays in the process; call between phases that allocate very differently (the
    trainer's backward pass after a rollout), so their peaks do not add up. False where there is no glibc."""
    malloc_trim = _glibc_function("malloc_trim")
    return malloc_trim is not None and bool(malloc_trim(0))


def make_cuda_deterministic() -> None:
    """Same seed, same run on a GPU: a resumed run repeats the uninterrupted one and HistoSpec on or off
    learns the same thing (tests/rl/test_training_loop.py). Some CUDA kernels add with atomics in whatever
    order the threads arrive, e.g. the backward of the gather that lets GRPO siblings share their prompt's
    rows; torch has order-fixed versions of them. cuBLAS needs a fixed workspace. For the whole run (as
    verified on an H100), where a CPU needs them only in the update (`deterministic_algorithms`)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)  # an op without one warns instead of failing


@contextmanager
def deterministic_algorithms():
    """torch's deterministic algorithms for the update (on a GPU they are on for the whole run: see
    make_cuda_deterministic). On a CPU without them, the default job resumed twice from the same checkpoint
    in two processes computed different gradients five steps later (grad norm 0.49011 against 0.48996; the
    loss was the same to the last bit), so runs drifted apart; with them three such resumes agreed bit
    for bit. Which kernel differs was not found. Only around the update: on for the whole run they also
    slowed rollout (every empty tensor is filled first), whose rewards were identical in every resume
    without them."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def setup_process(seed: int | None = None, device: str = "cpu") -> None:
    """The process-wide settings of a rhymerl process, once, before it builds models or engines: seeds
    (when given), the allocator's thresholds (on a CPU: sampling temporaries are MBs), and on CUDA the
    deterministic algorithms."""
    if seed is not None:
        torch.manual_seed(seed)
        random.seed(seed)
    if torch.device(device).type == "cpu":
        keep_freed_memory()
    else:
        make_cuda_deterministic()
