"""The eager backend: `Decoder.forward_packed` with SDPA attention over the KV cache. It runs on every
device and is the reference of the others (and the fallback where the fused CPU kernels do not build, for
fp16 on a CPU, and with RHYMERL_NATIVE=0). On a CPU its matmuls multiply by oneDNN's prepacked weights
(`cpu_weights.prepacked_linears`).

Every slot in a step feeds a small token tree (a prefill chunk is a chain, a decode step one node, a
speculative step the last sampled token with a draft tree hanging from it); token `i` of a slot with `base`
committed tokens is written to cache position `base + i` and attends to the slot's committed prefix and to
its own ancestors (itself included).
"""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F

from rhymerl.engine.backends.base import Step
from rhymerl.engine.backends.cpu_weights import model_weights, prepacked_linears
from rhymerl.engine.kv_cache import KVCache
from rhymerl.model.decoder import Decoder

SMALL_STEP = 16  # slots feeding at most this many tokens (decode, draft trees) share one attention call


def token_index(token_offsets: list[int], ns: list[int], num_tokens: int, device) -> torch.Tensor | None:
    """Packed index of each of a group's tokens (slots with ns tokens each, from token_offsets), or None when
    they are all of the step's tokens, in order."""
    index = np.concatenate([off + np.arange(n) for off, n in zip(token_offsets, ns)])
    if len(index) == num_tokens and bool((index == np.arange(num_tokens)).all()):
        return None
    return torch.from_numpy(index).to(device)


class _Group:
    """Slots that share one attention call.

    Attention reads the cache rows of the slot range [lo, hi) in place (a view); idle slots inside the
    range are padding rows. Only when the group's slots are sparse in their range (the end of a rollout)
    are their rows gathered, which copies their keys/values in every layer. Queries are laid out densely
    as [b, heads, t, D] (row = slot in the range, t = the group's longest step), so that folding the query
    heads of a KV head into the query axis is a view.
    """

    def __init__(self, inputs: list, token_offsets: list[int], trees: list, dtype, device,
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
        self.token_index = token_index(token_offsets, ns, num_tokens, device)
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
    """The attention backend of `Decoder.forward_packed` for the engine: write new keys/values, attend over
    the slot caches with SDPA.

    Slots are grouped by `_bucket`: every decode row and draft tree together (group 0), prefill chunks by
    size (17-32, 33-64, 65+). Attention over a slot range reads every slot's keys/values in it, so splitting
    the small steps by size (as an earlier version did) read the cache once per size class; one call padded
    to the largest tree reads it once (`rhymerl bench spec` in docs/benchmarks.md). Subclasses may widen
    group 0 (`small_step`) and attend it otherwise (`_make_group`, `_group`)."""

    small_step = SMALL_STEP

    def __init__(self, cache: KVCache, inputs: list, trees: list, device, num_heads: int):
        self.cache = cache
        self.group_size = num_heads // cache.num_kv_heads
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
            buckets.setdefault(self._bucket(len(x.tokens)), []).append(i)
        self.groups = [self._make_group(bucket, [inputs[i] for i in g], [offsets[i] for i in g],
                                        [trees[i] for i in g], device, off)
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

    def _bucket(self, n: int) -> int:
        """Attention group of a slot feeding n tokens (see the class docstring)."""
        return 0 if n <= self.small_step else min((n - 1).bit_length(), 7)

    def _make_group(self, bucket: int, inputs: list, token_offsets: list[int], trees: list, device, num_tokens: int):
        return _Group(inputs, token_offsets, trees, self.cache.kv.dtype, device, self.group_size, num_tokens)

    def attend(self, layer, q, kv):
        self.cache.kv[layer][self.slot_of, :, self.write_pos] = kv
        return self.attend_written(layer, q)

    def attend_written(self, layer, q):
        """Attention for q: [N, H, D] once this step's keys/values are in the cache -> [N, H, D]."""
        cache = self.cache.kv[layer]
        for dst, src, n in self.shares:
            cache[dst, :, :n] = cache[src, :, :n]
        if len(self.groups) == 1 and self.groups[0].token_index is None:
            return self._group(layer, q, cache, self.groups[0])  # the usual step: no scatter of the outputs
        out = torch.empty_like(q)
        for g in self.groups:
            out[g.token_index] = self._group(layer, q if g.token_index is None else q[g.token_index], cache, g)
        return out

    def _group(self, layer: int, q, cache, g: _Group):
        """q: [n, H, D] the group's tokens in packed order -> [n, H, D]."""
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


class EagerBackend:
    """`Decoder.forward_packed` over `CachedAttention`; on a CPU the matmuls multiply by oneDNN's prepacked
    weights where it has them (fp32, and bf16 on CPUs with bf16 instructions)."""

    ops = None  # no fused kernels: the sampler runs in torch too
    pads_rows = False  # each row computes its own tokens only
    step_buckets = None  # no fixed shapes
    verifies_on_device = False  # on a CPU each sampled row costs a pass over the vocabulary

    def __init__(self, model: Decoder, cache: KVCache):
        self.model, self.cache = model, cache
        self.device = next(model.parameters()).device
        self.prepacked = model_weights(model).packable()

    def forward(self, step: Step) -> torch.Tensor:
        attention = CachedAttention(self.cache, step.inputs, step.trees, self.device, self.model.cfg.num_heads)
        with prepacked_linears(self.model) if self.prepacked else nullcontext():
            return self.model.forward_packed(step.tokens, step.positions, attention, step.logit_rows)

    def commit(self, slot: int, base: int, path: list[int]) -> None:
        self.cache.commit(slot, base, path)

    def move(self, src: int, dst: int, length: int) -> None:
        self.cache.move(src, dst, length)
