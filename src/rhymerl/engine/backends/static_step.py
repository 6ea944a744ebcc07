"""A decode or verification step in fixed shapes, read from persistent buffers: what a CUDA graph replays.

A graph replays the same kernels on the same memory, so everything that changes from step to step lives in
buffers that are filled before the replay (`StaticStep.load`), and every shape is fixed per bucket:

- B rows: row b IS cache slot b, for b < B (the bucket above the highest slot in the step). Attention then
  reads the slot range `cache[:B]` in place (a view; no gather of keys and values), and slots in the range
  that feed nothing this step are padding rows.
- T tokens per row: the step's largest token tree (1 for plain decoding; 1 + the draft for HistoSpec).
  A row feeding fewer tokens is padded.
- L keys: attention reads positions [0, L) of each row (the bucket above the furthest position written).

Padding computes on whatever the buffers hold and must never change what a sequence sees. Its keys and
values are written back as they were (`torch.where(valid, new, old)` before the write, so the write touches
nothing it should not, whichever slot or position a padding token lands on), its queries see at least one key
(no 0/0 softmax), and its logits are never returned. Real tokens see exactly what the eager backend's
`CachedAttention` gives them: the slot's committed prefix and their own ancestors.

Nothing here is specific to CUDA: on a CPU the same step runs eagerly, and the tests compare it with the
eager backend there (tests/engine/backends/test_static_step.py). The graphs themselves are `cuda.py`'s.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from rhymerl.engine.backends.base import Step
from rhymerl.engine.kv_cache import KVCache
from rhymerl.model.decoder import Decoder

MIN_KEYS = 64  # the smallest key bucket: attention over fewer positions costs the same


def buckets(limit: int, smallest: int = 1) -> list[int]:
    """Powers of two from `smallest` up to `limit`, and `limit` itself: the sizes a shape is rounded up to."""
    sizes, n = [], smallest
    while n < limit:
        sizes.append(n)
        n *= 2
    return sizes + [limit]


def bucket_of(n: int, sizes: list[int]) -> int | None:
    """The smallest size >= n, or None when n is above them all."""
    return next((s for s in sizes if s >= n), None)


class StaticShapes:
    """The buckets of one engine: rows up to its slot count, tokens per row up to 1 + the draft room
    (the cache's scratch), keys up to the cache's capacity."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.rows = buckets(cache.kv.shape[1])
        self.tokens = buckets(1 + cache.capacity - cache.max_len)
        self.keys = buckets(cache.capacity, min(MIN_KEYS, cache.capacity))

    def of(self, step: Step) -> tuple[int, int, int] | None:
        """(B, T, L) for `step`, or None when it is not a decode or verification step: a prefill chunk
        (more tokens than the largest tree), a copied prefix, or a padded row that would write past the
        cache's end (never, with T at most 1 + scratch; checked all the same)."""
        inputs = step.inputs
        if any(x.prefix_from is not None for x in inputs):
            return None
        t = bucket_of(max(len(x.tokens) for x in inputs), self.tokens)
        if t is None:
            return None
        furthest = max(x.base for x in inputs) + t
        if furthest > self.cache.capacity:
            return None
        return bucket_of(max(x.slot for x in inputs) + 1, self.rows), t, bucket_of(furthest, self.keys)


class StaticStep:
    """One (B, T, L) bucket: its buffers, `load(step)` to fill them, and `run()`, the forward over them with
    nothing but device work (no host synchronisation, no allocation that depends on the data)."""

    def __init__(self, model: Decoder, cache: KVCache, b: int, t: int, l: int):
        self.model, self.cache = model, cache
        self.b, self.t, self.l = b, t, l
        device = cache.kv.device
        n = b * t
        # Filled by load(); one host-to-device copy each. ints: tokens, rope positions, write positions, bases.
        self.ints = torch.zeros(3 * n + b, dtype=torch.int64, device=device)
        self.tokens, self.positions, self.write_pos = self.ints[:n], self.ints[n : 2 * n], self.ints[2 * n : 3 * n]
        self.base = self.ints[3 * n :]
        # bools: which tokens are real, then each row's [T, T] ancestor matrix (a token and its ancestors)
        self.bools = torch.zeros(n + n * t, dtype=torch.bool, device=device)
        self.valid, self.anc = self.bools[:n], self.bools[n:].view(b, t, t)
        self.rows = torch.arange(b, device=device).repeat_interleave(t)  # [N] each token's row (= slot)
        self._host_ints = np.zeros(3 * n + b, dtype=np.int64)
        self._host_bools = np.zeros(n + n * t, dtype=bool)

    def load(self, step: Step) -> torch.Tensor:
        """Fill the buffers from `step` (its slots below B, its trees at most T tokens); returns the index of
        each of the step's logit rows in `run()`'s [B * T] output."""
        b, t = self.b, self.t
        n = b * t
        ints, bools = self._host_ints, self._host_bools
        tokens, positions = ints[:n].reshape(b, t), ints[n : 2 * n].reshape(b, t)
        base = ints[3 * n :]
        valid, anc = bools[:n].reshape(b, t), bools[n:].reshape(b, t, t)
        ints[:] = 0
        bools[:] = False
        anc[:, np.arange(t), np.arange(t)] = True  # a padding token sees itself
        packed = []  # per packed token of the step: its index in the [B * T] layout
        for x, (ancestors, depth) in zip(step.inputs, step.trees):
            r, k = x.slot, len(x.tokens)
            tokens[r, :k] = x.tokens
            base[r] = x.base
            valid[r, :k] = True
            if ancestors is not None:
                anc[r, :k, :k] = ancestors
            positions[r] = x.base + np.arange(t)  # padding tokens: any position in the cache will do
            positions[r, :k] = x.base + depth
            packed.append(r * t + np.arange(k))
        # token i of row r is written to position base + i (a padding row: base 0, positions [0, T))
        ints[2 * n : 3 * n] = (base[:, None] + np.arange(t)).reshape(-1)
        self.ints.copy_(torch.from_numpy(ints))
        self.bools.copy_(torch.from_numpy(bools))
        index = np.concatenate(packed)
        if step.logit_rows is not None:
            index = index[step.logit_rows.cpu().numpy()]
        return torch.from_numpy(index).to(self.cache.kv.device)

    def run(self) -> torch.Tensor:
        """The forward over the buffers -> logits [B * T, vocab] (padding rows included)."""
        attention = _StaticAttention(self)
        return self.model.forward_packed(self.tokens, self.positions, attention)

    def mask(self) -> torch.Tensor:
        """Additive mask [B, 1, G * T, L] in the cache's dtype: token (b, t) sees position l of its row when
        l is before the row's base (its committed prefix) or l = base + j with j an ancestor of t (itself
        included). Repeated for the G query heads of each KV head (`_StaticAttention` folds them into the
        query axis)."""
        b, t, l = self.b, self.t, self.l
        g = self.model.cfg.num_heads // self.cache.num_kv_heads
        rel = torch.arange(l, device=self.base.device)[None, :] - self.base[:, None]  # [B, L] position - base
        in_tree = (rel >= 0) & (rel < t)
        tree = self.anc.gather(2, rel.clamp(0, t - 1)[:, None, :].expand(b, t, l))  # [B, T, L] anc[b, t, l - base]
        visible = (rel < 0)[:, None, :] | (in_tree[:, None, :] & tree)
        additive = torch.zeros((b, t, l), dtype=self.cache.kv.dtype, device=rel.device)
        additive.masked_fill_(~visible, float("-inf"))
        return additive[:, None].expand(b, g, t, l).reshape(b, 1, g * t, l)


class _StaticAttention:
    """`Decoder.forward_packed`'s attention backend for a `StaticStep`: write the step's keys/values (padding
    writes back what was there), then SDPA over rows [0, B) and positions [0, L) with the step's mask. The G
    query heads of a KV head are folded into the query axis ([B, KV, G * T, D]), so every kernel reads each
    KV head once and none needs a grouped-query mode."""

    def __init__(self, s: StaticStep):
        self.s = s
        self.additive = s.mask()  # once per step, not per layer

    def attend(self, layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """q: [N, H, D], kv: [N, 2KV, D] for the N = B * T tokens -> [N, H, D]."""
        s = self.s
        cache = s.cache.kv[layer]  # [slots, 2KV, capacity, D]
        old = cache[s.rows, :, s.write_pos]  # [N, 2KV, D]
        cache[s.rows, :, s.write_pos] = torch.where(s.valid[:, None, None], kv, old)
        n_kv = s.cache.num_kv_heads
        n, h, d = q.shape
        g = h // n_kv
        # query head h uses KV head h // G: [N, H, D] = [B, T, KV, G, D] -> [B, KV, G, T, D] -> [B, KV, G*T, D]
        folded = q.view(s.b, s.t, n_kv, g, d).permute(0, 2, 3, 1, 4).reshape(s.b, n_kv, g * s.t, d)
        rows = cache[: s.b, :, : s.l]  # [B, 2KV, L, D], a view
        out = F.scaled_dot_product_attention(folded, rows[:, :n_kv], rows[:, n_kv:], attn_mask=self.additive)
        return out.view(s.b, n_kv, g, s.t, d).permute(0, 3, 1, 2, 4).reshape(n, h, d)
