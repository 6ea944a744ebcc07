"""Turns one engine step (new tokens per slot) into one forward pass over the cached decoder.

Every slot in a step feeds a small token tree: a prefill chunk is a chain, a decode step is one node, a
speculative step is the last sampled token with a draft tree hanging from it. Token `i` of a slot with
`base` committed tokens is written to cache position `base + i` and has rope position `base + depth(i)`;
it attends to the slot's committed prefix and to its own ancestors (itself included).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from rhymerl.engine.kv_cache import KVCache
from rhymerl.model import native
from rhymerl.model.decoder import Decoder


@dataclass
class SlotInput:
    slot: int
    base: int  # committed tokens already in the slot's cache
    tokens: list[int]  # new tokens of this step
    parents: list[int] | None = None  # per token: index of its parent, -1 = the committed prefix; None = chain
    logits_from: int = 0  # logits are returned for tokens[logits_from:]
    prefix_from: int | None = None  # a slot whose first `base` positions hold this slot's prefix: copied first


def _ancestors(parents: list[int] | None, n: int) -> tuple[np.ndarray | None, np.ndarray]:
    """([n, n] bool: j is i or an ancestor of i, [n] depth) for a tree given in topological order.
    A single token (a decode step) needs no matrix: None."""
    if n == 1:
        if parents not in (None, [-1]):
            raise ValueError(f"draft tree not in topological order: token 0 has parent {parents[0]}")
        return None, np.zeros(1, dtype=np.int64)
    if parents is None:
        return np.tril(np.ones((n, n), dtype=bool)), np.arange(n)
    anc = np.zeros((n, n), dtype=bool)
    depth = np.zeros(n, dtype=np.int64)
    for i, p in enumerate(parents):
        if p >= i:
            raise ValueError(f"draft tree not in topological order: token {i} has parent {p}")
        if p >= 0:
            anc[i] = anc[p]
            depth[i] = depth[p] + 1
        anc[i, i] = True
    return anc, depth


SMALL_STEP = 16  # slots feeding at most this many tokens (decode, draft trees) share one attention call
TREE_STEP = 64  # ... or this many, with the fused tree attention (which has no padding to pay for)


def _bucket(n: int, tree_kernel: bool) -> int:
    """Attention group of a slot feeding n tokens: every decode row and draft tree together (0), prefill
    chunks by size (17-32, 33-64, 65+). Attention over a slot range reads every slot's keys/values in it,
    so splitting the small steps by size (as an earlier version did) read the cache once per size class;
    one call padded to the largest tree reads it once (`rhymerl bench spec` in docs/benchmarks.md). The
    fused tree attention reads each slot to its own length, so group 0 takes up to TREE_STEP tokens."""
    return 0 if n <= (TREE_STEP if tree_kernel else SMALL_STEP) else min((n - 1).bit_length(), 7)


def _token_index(token_offsets: list[int], ns: list[int], num_tokens: int, device) -> torch.Tensor | None:
    """Packed index of each of a group's tokens (slots with ns tokens each, from token_offsets), or None when
    they are all of the step's tokens, in order."""
    index = np.concatenate([off + np.arange(n) for off, n in zip(token_offsets, ns)])
    if len(index) == num_tokens and bool((index == np.arange(num_tokens)).all()):
        return None
    return torch.from_numpy(index).to(device)


class _TreeGroup:
    """Slots of at most TREE_STEP tokens each, attended by the fused kernels' `tree_attention`: per token,
    the slot's committed length (`base`) and a bitmask of its tree ancestors and itself (`anc`, bit j =
    the slot's j-th token of the step). Tokens stay in packed order: a slot's tokens are consecutive."""

    def __init__(self, inputs: list[SlotInput], token_offsets: list[int], trees: list, device, num_tokens: int):
        ns = [len(x.tokens) for x in inputs]
        self.token_index = _token_index(token_offsets, ns, num_tokens, device)
        anc = []
        for n, (matrix, _) in zip(ns, trees):
            if matrix is None:  # a single token: itself
                anc.append(np.ones(1, dtype=np.uint64))
            else:  # row i of the ancestor matrix as bits
                anc.append((matrix.astype(np.uint64) << np.arange(n, dtype=np.uint64)).sum(axis=1, dtype=np.uint64))
        self.base = torch.from_numpy(np.repeat([x.base for x in inputs], ns).astype(np.int64)).to(device)
        self.anc = torch.from_numpy(np.concatenate(anc).view(np.int64)).to(device)


class _Group:
    """Slots that share one attention call.

    Attention reads the cache rows of the slot range [lo, hi) in place (a view); idle slots inside the
    range are padding rows. Only when the group's slots are sparse in their range (the end of a rollout)
    are their rows gathered, which copies their keys/values in every layer. Queries are laid out densely
    as [b, heads, t, D] (row = slot in the range, t = the group's longest step), so that folding the query
    heads of a KV head into the query axis is a view.
    """

    def __init__(self, inputs: list[SlotInput], token_offsets: list[int], trees: list, dtype, device,
                 group_size: int, num_tokens: int):
        order = sorted(range(len(inputs)), key=lambda i: inputs[i].slot)
        inputs, trees = [inputs[i] for i in order], [trees[i] for i in order]
        token_offsets = [token_offsets[i] for i in order]
        ns = [len(x.tokens) for x in inputs]
        slots = [x.slot for x in inputs]
        self.t = max(ns)
        self.l = max(x.base + len(x.tokens) for x in inputs)
        lo, hi = slots[0], slots[-1] + 1
        if hi - lo <= 2 * len(slots):
            self.rows, row_of, self.b = slice(lo, hi), [s - lo for s in slots], hi - lo
        else:
            self.rows, row_of, self.b = torch.tensor(slots, device=device), list(range(len(slots))), len(slots)
        # Packed index of each of the group's tokens, and its (row, position) in the dense query layout
        # (None: one token per row, every row: a plain view).
        self.token_index = _token_index(token_offsets, ns, num_tokens, device)
        self.dense = None
        if not (self.t == 1 and self.b == len(slots)):
            rows = np.repeat(row_of, ns)
            cols = np.concatenate([np.arange(n) for n in ns])
            self.dense = (torch.from_numpy(rows).to(device), torch.from_numpy(cols).to(device))
        # mask[row, query, key]; padding rows and padded queries see key 0 only, so no softmax is 0/0.
        if self.t == 1:
            bases = np.zeros(self.b, dtype=np.int64)
            bases[row_of] = [x.base for x in inputs]
            mask = torch.arange(self.l)[None, None, :] <= torch.from_numpy(bases)[:, None, None]
        else:
            m = np.zeros((self.b, self.t, self.l), dtype=bool)
            m[:, :, 0] = True
            for r, x, (anc, _) in zip(row_of, inputs, trees):
                n = len(x.tokens)
                m[r, :n, : x.base] = True
                m[r, :n, x.base : x.base + n] = True if anc is None else anc  # None: a single token
            mask = torch.from_numpy(m)
        # Few queries per slot (a draft tree being verified): fold the G query heads that share a KV head
        # into the query axis, [B, H, T, D] -> [B, KV, G*T, D], so the CPU flash kernel reads each KV
        # head's keys once instead of G times (2x faster at 3-9 tokens; worse for 1 token or > 32).
        self.fold = group_size if 1 < self.t and group_size * self.t <= 32 else 1
        if self.fold > 1:
            mask = mask.repeat(1, self.fold, 1)  # [B, G*T, L]: the G heads of a group see the same keys
        # Additive form, built once per step: SDPA would otherwise convert a bool mask in every layer.
        self.mask = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))[:, None].to(device)


class CachedAttention:
    """The attention backend for the engine: write new keys/values, attend over the slot caches.

    `tree_attention`: the fused kernels' tree attention (`rhymerl.model.native`, given only where it takes
    the cache's head size and dtype), which attends the step's decode rows, draft trees and short chains
    (group 0) without padding or mask; None: SDPA for every group."""

    def __init__(self, cache: KVCache, inputs: list[SlotInput], trees: list, device, num_heads: int,
                 tree_attention=None):
        dtype = cache.kv.dtype
        self.tree_attention = tree_attention
        group_size = num_heads // cache.num_kv_heads
        self.cache = cache
        slot_of, write_pos = [], []
        offsets, off = [], 0
        for x in inputs:
            n = len(x.tokens)
            slot_of += [x.slot] * n
            write_pos += range(x.base, x.base + n)
            offsets.append(off)
            off += n
        self.slot_of = torch.tensor(slot_of, device=device)
        self.write_pos = torch.tensor(write_pos, device=device)
        buckets: dict[int, list[int]] = {}
        for i, x in enumerate(inputs):
            buckets.setdefault(_bucket(len(x.tokens), tree_attention is not None), []).append(i)
        self.groups = [
            _TreeGroup([inputs[i] for i in g], [offsets[i] for i in g], [trees[i] for i in g], device, off)
            if bucket == 0 and tree_attention is not None else
            _Group([inputs[i] for i in g], [offsets[i] for i in g], [trees[i] for i in g], dtype, device, group_size, off)
            for bucket, g in sorted(buckets.items())]
        # Shared prefixes, by length: (destination slots, source slots, length). Copied in each layer after
        # that layer's new keys/values are written, so a source may be prefilling the prefix in this very step.
        shares: dict[int, tuple[list[int], list[int]]] = {}
        for x in inputs:
            if x.prefix_from is not None:
                dst, src = shares.setdefault(x.base, ([], []))
                dst.append(x.slot)
                src.append(x.prefix_from)
        self.shares = [(torch.tensor(d, device=device), torch.tensor(s, device=device), n)
                       for n, (d, s) in shares.items()]

    def cache_layer(self, layer: int) -> torch.Tensor:
        return self.cache.kv[layer]  # [slots, 2KV, capacity, D]

    def one_call_args(self) -> tuple | None:
        """The cache and the attention arguments of the fused `forward_layers` kernel (which mirrors
        `_group` and `_sdpa`), when the step is one attention group in the tokens' own order."""
        if len(self.groups) != 1 or self.groups[0].token_index is not None:
            return None
        g = self.groups[0]
        shares = ([d for d, _, _ in self.shares], [s for _, s, _ in self.shares], [n for _, _, n in self.shares])
        if isinstance(g, _TreeGroup):
            return self.cache.kv, (g.base, g.anc, None, 0, 0, 0, None, 1, None, None, 0, 0, *shares, self.cache.tiles,
                                   self.cache.tile_blocks)
        rows, lo, hi = (None, g.rows.start, g.rows.stop) if isinstance(g.rows, slice) else (g.rows, 0, 0)
        dense_rows, dense_cols = g.dense if g.dense is not None else (None, None)
        return self.cache.kv, (None, None, rows, lo, hi, g.l, g.mask, g.fold, dense_rows, dense_cols, g.b, g.t, *shares)

    def attend(self, layer, q, kv):
        self.cache.kv[layer][self.slot_of, :, self.write_pos] = kv
        return self.attend_written(layer, q)

    def attend_written(self, layer, q):
        """Attention for q: [N, H, D] once this step's keys/values are in the cache -> [N, H, D]."""
        cache = self.cache.kv[layer]
        for dst, src, n in self.shares:
            cache[dst, :, :n] = cache[src, :, :n]
        tiles = (None, None) if self.cache.tiles is None else (self.cache.tiles[layer], self.cache.tile_blocks[layer])
        if len(self.groups) == 1 and self.groups[0].token_index is None:
            return self._group(q, cache, self.groups[0], tiles)  # the usual step: no scatter of the outputs
        out = torch.empty_like(q)
        for g in self.groups:
            out[g.token_index] = self._group(q if g.token_index is None else q[g.token_index], cache, g, tiles)
        return out

    def _group(self, q, cache, g: _Group | _TreeGroup, tiles=(None, None)):
        """q: [n, H, D] the group's tokens in packed order -> [n, H, D]. tiles: the layer's tile cache and
        its current-block counts, for the tree attention."""
        if isinstance(g, _TreeGroup):
            slot_of = self.slot_of if g.token_index is None else self.slot_of[g.token_index]
            return self.tree_attention(q, cache, slot_of, g.base, g.anc, *tiles)
        h, d = q.shape[1], q.shape[2]
        if g.dense is None:  # one token per row, every row: [n, H, D] is already [b, t=1, H, D]
            return self._sdpa(q.view(g.b, 1, h, d).transpose(1, 2), cache, g).transpose(1, 2).reshape(g.b, h, d)
        rows, cols = g.dense
        dense = q.new_zeros(g.b, h, g.t, d)
        dense[rows, :, cols] = q
        return self._sdpa(dense, cache, g)[rows, :, cols]

    def _sdpa(self, q, cache, g: _Group):
        """q: [B, H, T, D] -> [B, H, T, D], attending to the group's slot rows of the cache."""
        n_kv = self.cache.num_kv_heads
        rows = cache[g.rows, :, : g.l]  # [B, 2KV, L, D]
        k, v = rows[:, :n_kv], rows[:, n_kv:]
        if g.fold > 1:
            b, h, t, d = q.shape
            out = F.scaled_dot_product_attention(q.reshape(b, n_kv, g.fold * t, d), k, v, attn_mask=g.mask)
            return out.reshape(b, h, t, d)  # a CUDA kernel may return another layout than [b, kv, fold*t, d]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, enable_gqa=q.shape[1] != n_kv)


class ModelRunner:
    """Runs the engine's forwards. On a CPU in fp32 or bf16 it uses the fused kernels of
    `rhymerl.model.native` when they build (`fused=False`, fp16 or RHYMERL_NATIVE=0: the eager
    `forward_packed`)."""

    def __init__(self, model: Decoder, cache: KVCache, fused: bool = True):
        self.model = model
        self.cache = cache
        model.enable_packing()  # oneDNN prepacked weights on CPU (the eager path and fp32)
        self.device = next(model.parameters()).device
        # The kernels are built for fp32 and bf16; fp16 on a CPU runs the eager forward.
        kernel_dtype = cache.kv.dtype in (torch.float32, torch.bfloat16)
        self.ops = native.ops() if fused and self.device.type == "cpu" and kernel_dtype else None
        takes_trees = self.ops is not None and self.ops.tree_attention_supports(model.cfg.head_dim, cache.kv.dtype)
        self.tree_attention = self.ops.tree_attention if takes_trees else None
        if takes_trees:  # on AMX tiles the tree attention keeps the slots' keys and values rearranged
            cache.enable_tiles(self.ops.tree_attention_block_elems(model.cfg.head_dim, cache.kv.dtype))
        # bf16 matmuls on AMX tiles where the CPU has them (kernels/tile_linear.cpp), else oneDNN's.
        self.tiles = self.ops is not None and self.ops.tile_linear_supported() and model.tiles_fit()

    @torch.inference_mode()
    def run(self, inputs: list[SlotInput], float_logits: bool = True) -> torch.Tensor:
        """One forward over every slot's new tokens -> logits [sum of returned rows, vocab]: fp32, or with
        `float_logits=False` the model's dtype."""
        for x in inputs:
            if x.base + len(x.tokens) > self.cache.capacity:
                raise ValueError(f"slot {x.slot}: {x.base}+{len(x.tokens)} tokens exceed cache capacity {self.cache.capacity}")
        tokens, positions, rows, off = [], [], [], 0
        trees = [_ancestors(x.parents, len(x.tokens)) for x in inputs]  # ([n, n] ancestors, [n] depth)
        for x, (_, depth) in zip(inputs, trees):
            n = len(x.tokens)
            tokens += x.tokens
            positions.append(x.base + depth)
            rows += range(off + x.logits_from, off + n)
            off += n
        # This step writes each slot from its base on, and a copied prefix from 0.
        self.cache.forget_tiles([x.slot for x in inputs], [0 if x.prefix_from is not None else x.base for x in inputs])
        dev = self.device
        tokens_t = torch.tensor(tokens, device=dev)
        positions_t = torch.from_numpy(np.concatenate(positions)).to(dev)
        logit_rows = None if len(rows) == off else torch.tensor(rows, device=dev)
        backend = CachedAttention(self.cache, inputs, trees, dev, self.model.cfg.num_heads, self.tree_attention)
        if self.ops is not None:
            logits = self.model.forward_fused(tokens_t, positions_t, backend, self.ops, logit_rows, self.tiles)
        else:
            logits = self.model.forward_packed(tokens_t, positions_t, backend, logit_rows)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)  # callers time the forward (cost model, forward_s), not its launch
        return logits.float() if float_logits else logits
