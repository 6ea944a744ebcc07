"""A preallocated per-slot KV cache.

Layout `[layers, slots, 2 * kv_heads, max_len + scratch, head_dim]` (keys in the first kv_heads rows,
values in the rest, so one write per layer stores both): a slot's committed tokens occupy positions
`[0, committed)`; a step's new tokens (a prefill chunk, a decode token, or a draft tree) are written right
after them. Draft-tree nodes land at scratch positions in tree order; `commit` then moves the accepted
path's keys/values down to the committed positions and everything past them is simply overwritten later.

Backends that keep state about the cache's contents (the CPU backend's tile cache, `backends/tile_cache.py`)
keep it consistent through `ModelRunner.commit` and `ModelRunner.move`, which the engine calls instead.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, scratch: int = 0):
        self.max_len = max_len  # committed tokens a slot can hold (prompt + completion)
        self.capacity = max_len + scratch  # plus room for the draft tokens of one step
        self.num_kv_heads = num_kv_heads
        # zeros, not empty: attention reads masked positions too, and a NaN left in uninitialised memory
        # survives a -inf mask (NaN + -inf = NaN). Stale keys/values of earlier sequences are finite.
        self.kv = torch.zeros((num_layers, num_slots, 2 * num_kv_heads, self.capacity, head_dim), dtype=dtype,
                              device=device)

    @classmethod
    def for_model(cls, model, num_slots: int, max_len: int, scratch: int = 0) -> "KVCache":
        """The cache of `num_slots` slots of `max_len` tokens (plus `scratch` draft positions) for `model`'s
        layers and heads, in its parameters' dtype and on their device: what an engine of that shape runs on
        (`ModelRunner(model, KVCache.for_model(...))`, also what a bench hands several engines to share)."""
        cfg, param = model.cfg, next(model.parameters())
        return cls(cfg.num_layers, num_slots, max_len, cfg.num_kv_heads, cfg.head_dim, param.dtype, param.device,
                   scratch)

    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def commit(self, slot: int, base: int, path: list[int]) -> None:
        """Keep draft nodes `path` (indices into the step's tokens, increasing) as committed tokens
        `base, base+1, ...` of `slot`, in every layer at once."""
        if path == list(range(len(path))):
            return  # already in place (a chain accepted from its start)
        src = torch.tensor(path, device=self.kv.device) + base
        dst = torch.arange(base, base + len(path), device=self.kv.device)
        # The right-hand side gathers into a new tensor first, so overlapping src/dst is safe.
        self.kv[:, slot, :, dst] = self.kv[:, slot, :, src]

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` committed positions of slot `src` to slot `dst` (all layers)."""
        self.kv[:, dst, :, :length] = self.kv[:, src, :, :length]
