"""The CPU backend's attention: `CachedAttention`'s groups, with the step's decode rows, draft trees and short
chains (group 0) attended by the fused kernels' tree attention where it takes the cache's head size and
dtype (`kernels/tree_attention.cpp`: no padding, no mask, each slot read to its own length), and the
arguments of the one-call `forward_layers` kernel, which mirrors `attend_written` in C++."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from rhymerl.engine.backends.eager import SMALL_STEP, CachedAttention, _Group, token_index
from rhymerl.engine.backends.tile_cache import TileCache
from rhymerl.engine.kv_cache import KVCache

TREE_STEP = 64  # slots feeding at most this many tokens share the tree attention's call (it has no padding)


class OneCallAttention(NamedTuple):
    """The attention arguments of `ops.forward_layers`, named as in its schema (kernels/layer.cpp) and in
    its order: its trailing arguments, after the layers' inputs (x ... eps). Passed by name, in one place
    (`cpu.forward_fused`); tests/engine/backends/test_native.py checks the names against the schema."""

    tree_base: torch.Tensor | None  # a tree group: per token, its slot's committed length
    tree_anc: torch.Tensor | None  # ... and its ancestors in the step as bits
    rows: torch.Tensor | None  # an SDPA group: its slots, where gathered (None: the range lo..hi)
    lo: int
    hi: int
    l: int  # noqa: E741 (the kernel's name): keys attended, the group's longest slot
    mask: torch.Tensor | None
    fold: int
    dense_rows: torch.Tensor | None
    dense_cols: torch.Tensor | None
    b: int
    t: int
    share_dst: list[torch.Tensor]  # prefix copies: destination slots, source slots, length
    share_src: list[torch.Tensor]
    share_len: list[int]
    tiles: torch.Tensor | None  # the tree attention's tile cache (TileCache.tiles), where it keeps one
    tile_blocks: torch.Tensor | None  # ... and its current-block counts (TileCache.blocks)


class _TreeGroup:
    """Slots of at most TREE_STEP tokens each, attended by the fused kernels' `tree_attention`: per token,
    the slot's committed length (`base`) and a bitmask of its tree ancestors and itself (`anc`, bit j =
    the slot's j-th token of the step). Tokens stay in packed order: a slot's tokens are consecutive."""

    def __init__(self, inputs: list, token_offsets: list[int], trees: list, device, num_tokens: int):
        ns = [len(x.tokens) for x in inputs]
        self.token_index = token_index(token_offsets, ns, num_tokens, device)
        anc = []
        for n, (matrix, _) in zip(ns, trees):
            if matrix is None:  # a single token: itself
                anc.append(np.ones(1, dtype=np.uint64))
            else:  # row i of the ancestor matrix as bits
                anc.append((matrix.astype(np.uint64) << np.arange(n, dtype=np.uint64)).sum(axis=1, dtype=np.uint64))
        self.base = torch.from_numpy(np.repeat([x.base for x in inputs], ns).astype(np.int64)).to(device)
        self.anc = torch.from_numpy(np.concatenate(anc).view(np.int64)).to(device)


class FusedAttention(CachedAttention):
    """The attention of `cpu.forward_fused`. `tree_attention`: the fused kernels' tree attention (given only
    where it takes the cache's head size and dtype), which attends group 0 (up to TREE_STEP tokens a slot);
    None: SDPA for every group. `tile_cache`: the tree attention's tile cache, where it keeps one."""

    def __init__(self, cache: KVCache, inputs: list, trees: list, device, num_heads: int, tree_attention=None,
                 tile_cache: TileCache | None = None):
        self.tree_attention, self.tile_cache = tree_attention, tile_cache
        self.small_step = TREE_STEP if tree_attention is not None else SMALL_STEP
        super().__init__(cache, inputs, trees, device, num_heads)

    def _make_group(self, bucket, inputs, token_offsets, trees, device, num_tokens):
        if bucket == 0 and self.tree_attention is not None:
            return _TreeGroup(inputs, token_offsets, trees, device, num_tokens)
        return super()._make_group(bucket, inputs, token_offsets, trees, device, num_tokens)

    def cache_layer(self, layer: int) -> torch.Tensor:
        """Where the pre_attn kernel writes the new keys/values: token i goes to
        `cache_layer(layer)[slot_of[i], :, write_pos[i]]`."""
        return self.cache.kv[layer]  # [slots, 2KV, capacity, D]

    def one_call_args(self) -> OneCallAttention | None:
        """The attention arguments of the `forward_layers` kernel (which mirrors `attend_written`), when the
        step is one attention group in the tokens' own order (the usual step), else None."""
        if len(self.groups) != 1 or self.groups[0].token_index is not None:
            return None
        g = self.groups[0]
        shares = dict(share_dst=[d for d, _, _ in self.shares], share_src=[s for _, s, _ in self.shares],
                      share_len=[n for _, _, n in self.shares])
        if isinstance(g, _TreeGroup):
            tiles = (None, None) if self.tile_cache is None else (self.tile_cache.tiles, self.tile_cache.blocks)
            return OneCallAttention(g.base, g.anc, None, 0, 0, 0, None, 1, None, None, 0, 0, **shares,
                                    tiles=tiles[0], tile_blocks=tiles[1])
        rows, lo, hi = (None, g.rows.start, g.rows.stop) if isinstance(g.rows, slice) else (g.rows, 0, 0)
        dense_rows, dense_cols = g.dense if g.dense is not None else (None, None)
        return OneCallAttention(None, None, rows, lo, hi, g.l, g.mask, g.fold, dense_rows, dense_cols, g.b, g.t,
                                **shares, tiles=None, tile_blocks=None)

    def _group(self, layer: int, q, cache, g: _Group | _TreeGroup):
        if not isinstance(g, _TreeGroup):
            return super()._group(layer, q, cache, g)
        slot_of = self.slot_of if g.token_index is None else self.slot_of[g.token_index]
        tc = self.tile_cache
        tiles = (None, None) if tc is None else (tc.tiles[layer], tc.blocks[layer])
        return self.tree_attention(q, cache, slot_of, g.base, g.anc, *tiles)
