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
from rhymerl.model.decoder import Decoder


@dataclass
class SlotInput:
    slot: int
    base: int  # committed tokens already in the slot's cache
    tokens: list[int]  # new tokens of this step
    parents: list[int] | None = None  # per token: index of its parent, -1 = the committed prefix; None = chain
    logits_from: int = 0  # logits are returned for tokens[logits_from:]


def _ancestors(parents: list[int] | None, n: int) -> tuple[np.ndarray, np.ndarray]:
    """([n, n] bool: j is i or an ancestor of i, [n] depth) for a tree given in topological order."""
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


class _Group:
    """Slots that share one attention call: all single-token slots, or all multi-token slots (so a long
    prefill does not pad every decode row to its length)."""

    def __init__(self, inputs: list[SlotInput], token_offsets: list[int], dtype, device):
        self.n = len(inputs)
        ns = [len(x.tokens) for x in inputs]
        self.t = max(ns)
        self.l = max(x.base + len(x.tokens) for x in inputs)
        slots = [x.slot for x in inputs]
        lo = slots[0]
        self.rows = slice(lo, lo + self.n) if slots == list(range(lo, lo + self.n)) else torch.tensor(slots, device=device)
        # Packed token index of (row r, query t); padded queries are dropped on the way back.
        idx = np.concatenate([off + np.arange(n) for off, n in zip(token_offsets, ns)])
        self.token_index = torch.from_numpy(idx).to(device)
        self.dense_index = None
        if self.t == 1:
            bases = torch.tensor([x.base for x in inputs], device=device)
            mask = (torch.arange(self.l, device=device)[None, :] <= bases[:, None])[:, None, None, :]
        else:
            mask = np.zeros((self.n, self.t, self.l), dtype=bool)
            mask[:, :, 0] = True  # padded query rows see one key, so their softmax is not 0/0
            for r, x in enumerate(inputs):
                n = len(x.tokens)
                anc, _ = _ancestors(x.parents, n)
                mask[r, :n, : x.base] = True
                mask[r, :n, x.base : x.base + n] = anc
            mask = torch.from_numpy(mask).to(device)[:, None]
            dense = np.concatenate([r * self.t + np.arange(n) for r, n in enumerate(ns)])
            self.dense_index = torch.from_numpy(dense).to(device)
        # Additive form, built once per step: SDPA would otherwise convert a bool mask in every layer.
        self.mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, float("-inf"))


class CachedAttention:
    """The attention backend for the engine: write new keys/values, attend over the slot caches."""

    def __init__(self, cache: KVCache, inputs: list[SlotInput], device):
        dtype = cache.kv.dtype
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
        single = [i for i, x in enumerate(inputs) if len(x.tokens) == 1]
        multi = [i for i, x in enumerate(inputs) if len(x.tokens) > 1]
        self.groups = [_Group([inputs[i] for i in g], [offsets[i] for i in g], dtype, device) for g in (single, multi) if g]
        self.one_group = len(self.groups) == 1 and self.groups[0].t == 1

    def attend(self, layer, q, kv):
        cache = self.cache.kv[layer]  # [slots, 2KV, capacity, D]
        cache[self.slot_of, :, self.write_pos] = kv
        h, d = q.shape[1], q.shape[2]
        if self.one_group:  # pure decode: tokens are already in row order, no scatter needed
            g = self.groups[0]
            out = self._sdpa(q.view(g.n, 1, h, d).transpose(1, 2), cache, g)
            return out.transpose(1, 2).reshape(g.n, h, d)
        out = torch.empty_like(q)
        for g in self.groups:
            qg = q[g.token_index]
            if g.dense_index is not None:
                dense = q.new_zeros(g.n * g.t, h, d)
                dense[g.dense_index] = qg
                qg = dense
            o = self._sdpa(qg.view(g.n, g.t, h, d).transpose(1, 2), cache, g)
            o = o.transpose(1, 2).reshape(g.n * g.t, h, d)
            out[g.token_index] = o if g.dense_index is None else o[g.dense_index]
        return out

    def _sdpa(self, q, cache, g: _Group):
        n_kv = self.cache.num_kv_heads
        rows = cache[g.rows, :, : g.l]  # [B, 2KV, L, D]
        k, v = rows[:, :n_kv], rows[:, n_kv:]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, enable_gqa=q.shape[1] != n_kv)


class ModelRunner:
    def __init__(self, model: Decoder, cache: KVCache):
        self.model = model
        self.cache = cache
        self.packed = model.enable_packing()  # prepacked bf16 weights on CPU: ~2x faster matmuls
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def run(self, inputs: list[SlotInput]) -> torch.Tensor:
        """One forward over every slot's new tokens -> fp32 logits [sum of returned rows, vocab]."""
        for x in inputs:
            if x.base + len(x.tokens) > self.cache.capacity:
                raise ValueError(f"slot {x.slot}: {x.base}+{len(x.tokens)} tokens exceed cache capacity {self.cache.capacity}")
        tokens, positions, rows, off = [], [], [], 0
        for x in inputs:
            n = len(x.tokens)
            _, depth = _ancestors(x.parents, n) if x.parents is not None else (None, np.arange(n))
            tokens += x.tokens
            positions.append(x.base + depth)
            rows += range(off + x.logits_from, off + n)
            off += n
        dev = self.device
        tokens_t = torch.tensor(tokens, device=dev)
        positions_t = torch.from_numpy(np.concatenate(positions)).to(dev)
        logit_rows = None if len(rows) == off else torch.tensor(rows, device=dev)
        backend = CachedAttention(self.cache, inputs, dev)
        return self.model.forward_packed(tokens_t, positions_t, backend, logit_rows).float()
