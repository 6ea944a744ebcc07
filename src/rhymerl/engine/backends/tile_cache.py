"""The tree attention's tile cache (bf16 on CPUs with AMX tiles): a copy of each slot's committed keys and
values in blocks of TILE_BLOCK positions, rearranged as the kernel's tile products read them, so that a
block is rearranged once, not at every step (`kernels/tree_attention.cpp`).

`blocks[layer, slot, kv head]` counts the leading blocks that are current; the kernel fills blocks as a
slot's committed length passes them, and every write below a slot's current blocks (a new sequence, a
copied prefix, a move) must first `forget` from that position. A commit needs nothing: the cache holds only
blocks below the step's base, and a commit writes from it on.
"""

from __future__ import annotations

import torch

from rhymerl.engine.kv_cache import KVCache

TILE_BLOCK = 32  # positions per block (kernels/tree_attention.cpp)


class TileCache:
    def __init__(self, cache: KVCache, block_elems: int):
        """`block_elems` values per (layer, slot, kv head, block), as `ops.tree_attention_block_elems` gives
        them (> 0)."""
        layers, slots, two_kv = cache.kv.shape[:3]
        blocks = -(-cache.capacity // TILE_BLOCK)
        self.tiles = torch.zeros((layers, slots, two_kv // 2, blocks, block_elems), dtype=cache.kv.dtype,
                                 device=cache.kv.device)
        self.blocks = torch.zeros((layers, slots, two_kv // 2), dtype=torch.int64, device=cache.kv.device)

    def nbytes(self) -> int:
        return self.tiles.numel() * self.tiles.element_size()

    def forget(self, slots: list[int], positions: list[int]) -> None:
        """Slot slots[i]'s positions from positions[i] on are about to be rewritten: its blocks that hold any
        of them are no longer current (the slots are distinct)."""
        if not slots:
            return
        index = torch.tensor(slots)
        keep = torch.tensor(positions) // TILE_BLOCK  # [len(slots)] blocks wholly before the position
        self.blocks[:, index] = torch.minimum(self.blocks[:, index], keep[None, :, None])

    def move(self, src: int, dst: int, length: int) -> None:
        """Along with `KVCache.move`: the blocks move too (cheaper than rearranging them again)."""
        self.tiles[:, dst] = self.tiles[:, src]
        self.blocks[:, dst] = torch.clamp(self.blocks[:, src], max=length // TILE_BLOCK)
