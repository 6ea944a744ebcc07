"""Fused CPU kernels for the rollout forward, compiled on first use and cached.

The C++ files of `kernels/` (next to this file), one library, `torch.ops.rhymerl_native`:
- `layer.cpp` turns a decoder layer's ~30 small eager kernels and Python calls into two calls around the
  attention (`pre_attn`, `post_attn`), and the whole layer stack into one call (`forward_layers`) when a
  step's attention is one call per layer;
- `tile_linear.cpp`: on CPUs with AMX-BF16 tiles (Linux, x86), the bf16 matmuls, with the weights packed
  once into the tile layout (`pack_tiles`); elsewhere the matmuls are oneDNN's;
- `tree_attention.cpp`: the attention of decode rows, draft trees and short chains (AVX-512 code in fp32
  and bf16; elsewhere portable vector code, fp32 only); in bf16 on CPUs with AMX its products run on tiles, over a cache of the slots' keys and values rearranged
  for them (`tile_cache.py`);
- `sampler.cpp`: the sampler's plain case (temperature, no top-k or top-p), a one-pass version of
  `engine/sampler.py` (`sample_rows`).

The engine uses them on a CPU when they build (the CPU backend, `cpu.py`, and `sampler.sample`); the eager
backend (`eager.py`, the model's own `forward_packed`) and the torch code in `sampler.py` stay the reference
and the fallback.

Building needs a C++ compiler and takes about 15 s, once; the library is cached under
`$RHYMERL_CACHE/native/<hash of source, torch version, CPU and compiler flags>`. Where it cannot be built
(no compiler, an unusual platform) `ops()` returns None after one warning that says why, and the engine
runs the eager backend and the torch sampler. `RHYMERL_NATIVE=0` turns the kernels off.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import time
import warnings
from pathlib import Path

import ninja
import torch
from torch.utils import cpp_extension

from rhymerl.model.fetch import CACHE_DIR

KERNELS = Path(__file__).with_name("kernels")
# at::parallel_for is a header template that only spreads work over threads when the including file is
# compiled with OpenMP. On Linux the library then resolves libgomp.so.1 to the copy torch has already loaded,
# so there is one thread pool; elsewhere (Apple's clang has no -fopenmp) the kernels run on one thread.
OPENMP = ["-fopenmp"] if sys.platform.startswith("linux") else []
# Built for this CPU. On x86, the loops the compiler vectorises (the sampler's exp over the vocabulary, SiLU)
# use 512-bit registers where the CPU has them; GCC otherwise stops at 256 bits.
X86 = platform.machine() in ("x86_64", "AMD64")
CFLAGS = ["-O3", "-march=native", *(["-mprefer-vector-width=512"] if X86 else []), *OPENMP]
_loaded: dict[str, object] = {}


def enabled() -> bool:
    return os.environ.get("RHYMERL_NATIVE", "1") != "0"


def _cpu_flags() -> bytes:
    """The CPU's instruction-set flags: the library is built for this CPU (-march=native), so a cache
    shared with a different machine must not hand it over."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return platform.processor().encode()


def build_dir() -> Path:
    sources = b"".join(path.read_bytes() for path in sorted(KERNELS.iterdir()) if path.suffix in (".cpp", ".h"))
    key = hashlib.sha256(sources + torch.__version__.encode() + _cpu_flags()
                         + " ".join(CFLAGS).encode()).hexdigest()[:16]
    return CACHE_DIR / "native" / key


def ops():
    """The `torch.ops.rhymerl_native` namespace, or None where the kernels are off or cannot be built."""
    if not enabled():
        return None
    if "ops" not in _loaded:
        _loaded["ops"] = _build()
    return _loaded["ops"]


STALE_LOCK_S = 900.0  # a build takes ~15 s (minutes on a loaded machine); a lock this old outlived its build


def clear_stale_lock(out: Path, now: float | None = None) -> bool:
    """Remove the build lock torch's `cpp_extension.load` left in `out` if it is older than STALE_LOCK_S: a
    build killed mid-way leaves it, and every later process would otherwise wait on it forever. True if removed."""
    lock = out / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < STALE_LOCK_S:
        return False
    warnings.warn(f"rhymerl: removing the fused kernels' build lock {lock}, left {age:.0f} s ago by a build that "
                  f"did not finish", stacklevel=3)
    lock.unlink(missing_ok=True)
    return True


def _build():
    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    clear_stale_lock(out)
    if shutil.which("ninja") is None:  # torch calls `ninja` from PATH; the pip package's may not be on it
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    if not any(out.glob("*.so")):
        print(f"rhymerl: compiling fused CPU kernels into {out} (once, about 15 s)", file=sys.stderr)
    try:
        cpp_extension.load(name="rhymerl_native", sources=sorted(str(p) for p in KERNELS.glob("*.cpp")),
                           build_directory=str(out), extra_cflags=CFLAGS, extra_ldflags=OPENMP,
                           is_python_module=False, verbose=False)
    except Exception as e:  # no compiler (or no OpenMP in it), no ninja, a platform the source does not build on
        lines = str(e).strip().splitlines() or [""]
        reason = next((line for line in lines if "error:" in line.lower()), lines[-1])  # the compiler's line
        warnings.warn(f"rhymerl: fused CPU kernels unavailable (they need a C++ compiler with OpenMP), using the "
                      f"eager forward ({type(e).__name__}: {reason.strip()}; build directory {out})", stacklevel=3)
        return None
    return torch.ops.rhymerl_native
