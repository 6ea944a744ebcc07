"""Sampling settings and keyed randomness (torch-free).

Keyed randomness (docs/design.md, section 6.1): the random numbers that pick a token depend only on (seed, request id,
position), through the 64-bit `draw_key`, never on the batch, the slot, the step or whether drafting was
on. A request's output is therefore the same alone or in any batch, on any worker, with or without
speculation (up to floating-point ties in the logits; see `sampler`).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    max_tokens: int = 256  # TRL's max_completion_length
    stop: tuple[str, ...] = field(default_factory=tuple)  # stop strings (excluded from the text)
    seed: int = 0
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field and value that is out of range."""
        if not (self.temperature >= 0):  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty, got {list(self.stop)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def request_key(request_id: int | str) -> int:
    """A stable 64-bit key for a request id (Python's hash() of a str changes between processes)."""
    if isinstance(request_id, int):
        return request_id & _MASK64
    return int.from_bytes(hashlib.blake2b(str(request_id).encode(), digest_size=8).digest(), "little")


def _signed(z: int) -> int:
    """A 64-bit value as a signed int64 (what torch holds)."""
    return z - (1 << 64) if z >> 63 else z


@functools.lru_cache(maxsize=1 << 16)  # a running request's, every step: two splitmix64 in Python, ~1.5 us
def draw_prefix(seed: int, request_key: int) -> int:
    """The part of every draw key of one request that does not depend on the position, as a signed int64:
    `draw_key` mixes the position into it, and so does the sampler's tensor version (`sampler.draw_keys`)."""
    return _signed(_splitmix64(_splitmix64(seed & _MASK64) ^ request_key))


def draw_key(seed: int, request_key: int, position: int) -> int:
    """The key of one token draw: a 64-bit function of (seed, request, position of the generated token), as
    a signed int64 (what torch holds). The sampler derives all its noise for that draw from it."""
    return _signed(_splitmix64((draw_prefix(seed, request_key) ^ position) & _MASK64))
