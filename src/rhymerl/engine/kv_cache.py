"""A preallocated per-slot KV cache.

Layout `[layers, slots, 2 * kv_heads, max_len + scratch, head_dim]` (keys in the first kv_heads rows,
values in the rest, so one write per layer stores both): a slot's committed tokens occupy positions
`[0, committed)`; a step's new tokens (a prefill chunk, a decode token, or a draft tree) are written right
after them. Draft-tree nodes land at scratch positions in tree order; `commit` then moves the accepted
path's keys/values down to the committed positions and everything past them is simply overwritten later.

Where the tree attention runs on AMX tiles (bf16), it also keeps `tiles`: each slot's committed keys and
values in blocks of 32 positions, rearranged as its tile products read them, so that a block is rearranged
once, not at every step. `tile_blocks[layer, slot, kv head]` counts the leading blocks that are current;
the kernel fills blocks as a slot's committed length passes them, and every write below a slot's current
blocks (a new sequence, a copied prefix, a move) must first `forget_tiles` from that position.
"""

from __future__ import annotations

import torch

TILE_BLOCK = 32  # positions per block of the tile cache (kernels/tree_attention.cpp)


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
        self.tiles: torch.Tensor | None = None
        self.tile_blocks: torch.Tensor | None = None

    def enable_tiles(self, block_elems: int) -> None:
        """Keep the tree attention's tile cache: `block_elems` values per (layer, slot, kv head, block of
        TILE_BLOCK positions), as `ops.tree_attention_block_elems` gives them (0: none is kept)."""
        if block_elems <= 0:
            return
        layers, slots, two_kv = self.kv.shape[:3]
        blocks = -(-self.capacity // TILE_BLOCK)
        self.tiles = torch.zeros((layers, slots, two_kv // 2, blocks, block_elems), dtype=self.kv.dtype,
                                 device=self.kv.device)
        self.tile_blocks = torch.zeros((layers, slots, two_kv // 2), dtype=torch.int64, device=self.kv.device)

    def forget_tiles(self, slots: list[int], positions: list[int]) -> None:
        """Slot slots[i]'s positions from positions[i] on are about to be rewritten: its tile blocks that
        hold any of them are no longer current (the slots are distinct)."""
        if self.tiles is None or not slots:
            return
        index = torch.tensor(slots)
        keep = torch.tensor(positions) // TILE_BLOCK  # [len(slots)] blocks wholly before the position
        self.tile_blocks[:, index] = torch.minimum(self.tile_blocks[:, index], keep[None, :, None])

    def nbytes(self) -> int:
        """Memory held: the KV cache, and the tile cache where there is one (as large again)."""
        return sum(t.numel() * t.element_size() for t in (self.kv, self.tiles) if t is not None)

    def commit(self, slot: int, base: int, path: list[int]) -> None:
        """Keep draft nodes `path` (indices into the step's tokens, increasing) as committed tokens
        `base, base+1, ...` of `slot`, in every layer at once."""
        if path == list(range(len(path))):
            return  # already in place (a chain accepted from its start)
        # No forget_tiles: the tile cache holds only blocks below the step's base, and this writes from it on.
        src = torch.tensor(path, device=self.kv.device) + base
        dst = torch.arange(base, base + len(path), device=self.kv.device)
        # The right-hand side gathers into a new tensor first, so overlapping src/dst is safe.
        self.kv[:, slot, :, dst] = self.kv[:, slot, :, src]

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` committed positions of slot `src` to slot `dst` (all layers)."""
        self.kv[:, dst, :, :length] = self.kv[:, src, :, :length]
        if self.tiles is not None:  # the tile blocks move along (cheaper than rearranging them again)
            self.tiles[:, dst] = self.tiles[:, src]
            self.tile_blocks[:, dst] = torch.clamp(self.tile_blocks[:, src], max=length // TILE_BLOCK)
