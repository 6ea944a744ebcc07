"""A step in fixed shapes, read from persistent buffers: what a CUDA graph replays.

A graph replays the same kernels on the same memory, so everything that changes from step to step lives in
buffers that are filled before the replay (`StaticStep.load`), and every shape is fixed per bucket:

- B rows, T tokens per row (a row's tokens are a tree: a decode token, a draft tree, a prefill chain; a row
  feeding fewer is padded), L keys (attention reads positions [0, L) of each row).
- Decode and verification steps (small trees, every running slot) are laid out by slot: row b IS cache slot
  b, for b < B (the bucket above the highest slot in the step), so attention reads the slot range `cache[:B]`
  in place, a view; slots in the range that feed nothing this step are padding rows.
- Prefill chunks (long chains, few rows) are gathered: row r holds the r-th input, whose slot is in a buffer;
  attention copies those rows' keys and values, and logits are computed for each row's last token only.

Padding computes on whatever the buffers hold and must never change what a sequence sees. By slot (trees,
T <= 1 + scratch), padding token t of a row writes its keys and values to position capacity - T + t of the
row's slot, the cache's tail [max_len - 1, capacity), where no committed token lives (a sequence stops at
max_len tokens and its last token is never fed) and no real token of the row writes (real token j writes
base + j with j below the row's padding tokens and base < max_len): one index_put a layer, no read of the old
values. Gathered (prefill chains, T up to the capacity), padding writes back what was there instead
(`torch.where(valid, new, old)` before the write). No two tokens of a step share a (slot, position); padding
queries see at least one key (no 0/0 softmax), and their logits are never returned. Real tokens see exactly
what the eager backend's `CachedAttention` gives them: the slot's committed prefix and their own ancestors.

With `StepDraws` (`load(..., draws)`) a step also draws every logits row and walks the drafts (`draw`): the
sampler's keyed draws (`sample_tensors`, keys made on the host by `sampler.draw_keys`, temperature from a
buffer) and the acceptance walk (`device_verification.walk_trees`, over the ancestor matrices the mask reads
already), so that one graph replays forward, draws and walk, and the host reads one [3, rows] tensor back.
Padding rows draw too, as roots; never read.

Nothing here is specific to CUDA: on a CPU the same step runs eagerly, and the tests compare it with the
eager backend there (tests/engine/backends/test_static_step.py). The graphs themselves are `cuda.py`'s.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from rhymerl.engine.device_verification import StepDraws, walk_trees
from rhymerl.engine.backends.static_forward import forward, layer_modules, rope_table
from rhymerl.engine.kv_cache import KVCache
from rhymerl.engine.sampler import draw_keys, sample_tensors
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.model.decoder import Decoder

MIN_KEYS = 64  # the smallest key bucket: attention over fewer positions costs the same
MIN_CHAIN = 16  # the smallest gathered (prefill) token bucket


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
    """The buckets of one engine. Trees (decode, verification) by slot: rows up to the slot count, tokens up to
    1 + the draft room (the cache's scratch). Chains longer than that (prefill) gathered: rows up to the slot
    count, tokens from MIN_CHAIN up to the cache's capacity. Keys up to the capacity."""

    def __init__(self, cache: KVCache):
        self.capacity = cache.capacity
        self.rows = buckets(cache.kv.shape[1])
        self.tree = 1 + cache.capacity - cache.max_len  # the most tokens a decoding slot feeds: 1 + its draft
        self.tokens = buckets(self.tree)
        self.chains = buckets(cache.capacity, min(MIN_CHAIN, cache.capacity))
        self.keys = buckets(cache.capacity, min(MIN_KEYS, cache.capacity))

    def every(self, longest_chain: int | None = None) -> list[tuple[bool, int, int, int]]:
        """Every (gathered, B, T, L) that `of` can return: trees of every row and token bucket, chains longer
        than a tree (the smallest chain bucket above it, and up; with `longest_chain`, only up to that chain's
        bucket: a bench knows its longest prompt), each with every key bucket that holds its T."""
        top = bucket_of(longest_chain, self.chains) or self.capacity if longest_chain else self.capacity
        trees = [(False, b, t, l) for b in self.rows for t in self.tokens for l in self.keys if l >= t]
        chains = [(True, b, t, l) for b in self.rows for t in self.chains if self.tree < t <= top
                  for l in self.keys if l >= t]
        return trees + chains

    def of(self, inputs: list) -> tuple[bool, int, int, int] | None:
        """(gathered, B, T, L) for these inputs (the engine's SlotInputs), or None: run them eagerly. Small
        trees go by slot; longer chains gathered, when each wants its last token's logits only (a prefill
        does); a copied prefix, or a padded row that would write past the cache's end (never for trees: T is
        at most 1 + scratch), eagerly."""
        if any(x.prefix_from is not None for x in inputs):
            return None
        longest = max(len(x.tokens) for x in inputs)
        gathered = longest > self.tree
        if gathered:  # chains (a prefill's): no ancestor matrices, which would be [T, T] each
            if any(x.logits_from != len(x.tokens) - 1 or x.parents is not None for x in inputs):
                return None
            b, t = bucket_of(len(inputs), self.rows), bucket_of(longest, self.chains)
        else:
            b, t = bucket_of(max(x.slot for x in inputs) + 1, self.rows), bucket_of(longest, self.tokens)
        if t is None or max(x.base for x in inputs) + t > self.capacity:
            return None
        return gathered, b, t, bucket_of(max(x.base for x in inputs) + t, self.keys)


class StaticStep:
    """One (gathered, B, T, L) bucket: its buffers, `load` to fill them from a step's inputs, and `run()`,
    the forward over them with nothing but device work (no host synchronisation, no allocation that depends
    on the data)."""

    def __init__(self, model: Decoder, cache: KVCache, gathered: bool, b: int, t: int, l: int,
                 rope: torch.Tensor | None = None):
        self.model, self.cache = model, cache
        # the rope table of every cache position (`rope_table`; a backend shares one between its buckets)
        self.rope = rope if rope is not None else rope_table(model, cache)
        self.layers = layer_modules(model)
        self.gathered, self.b, self.t, self.l = gathered, b, t, l
        self.shape = (gathered, b, t, l)
        device = cache.kv.device
        n = b * t
        # One host-to-device copy each per step. ints: tokens, rope positions, write positions and slots [N]
        # (each token's: what the K/V write indexes with); each row's base, slot and last real token's index [B].
        # Then the draws' (`draw`), per logits row (R: B * T by slot, B gathered): its draw key, parent row (a
        # root, a padding row: R, the sentinel of `drawn`) and draft token (a root: -1).
        r = self.rows = b if gathered else n
        m = 4 * n + 3 * b
        self.ints = torch.zeros(m + 3 * r, dtype=torch.int64, device=device)
        self.tokens, self.positions, self.write_pos, self.token_slots = (self.ints[k * n : (k + 1) * n]
                                                                         for k in range(4))
        self.base, self.slots, self.last = (self.ints[4 * n + k * b : 4 * n + (k + 1) * b] for k in range(3))
        self.row_keys, self.parent, self.draft = (self.ints[m + k * r : m + (k + 1) * r] for k in range(3))
        # 1 / temperature and its negation (`sample_tensors`), set when the temperature changes
        self.inv_t = torch.tensor([1.0, -1.0], dtype=torch.float32, device=device)
        self._inv_t = 1.0
        # the drawn tokens, then -1: what a root's parent (R) drew, never a draft's token (`walk_trees`)
        self.drawn = torch.full((r + 1,), -1, dtype=torch.int64, device=device)
        self.reached_all = torch.ones(r, dtype=torch.bool, device=device)  # no walk (T = 1, chains): roots
        if model.cfg.vocab_size >= 1 << 24:
            raise ValueError(f"vocab_size {model.cfg.vocab_size}: a step's draws carry token ids in fp32 (below 2^24)")
        # bools: which tokens are real, then (trees of T > 1 tokens) what each token sees of T + 2 columns:
        # [its row's committed prefix, the row's T tokens (its ancestor matrix row: itself and its ancestors),
        # the positions after them] (`mask`); chains (gathered, or one token a row) need none: token t sees
        # the positions up to base + t
        self.g = model.cfg.num_heads // cache.num_kv_heads
        trees = 0 if gathered or t == 1 else b * t * (t + 2)
        self.bools = torch.zeros(n + trees, dtype=torch.bool, device=device)
        self.valid, self.sees = self.bools[:n], self.bools[n:].view(b, t, t + 2) if trees else None
        self._host_ints = np.zeros(m + 3 * r, dtype=np.int64)
        self._host_bools = np.zeros(n + trees, dtype=bool)
        # the mask's constants: key positions (+ 1 for trees: column 0 is the prefix), each folded query row's
        # token, and the additive mask's two values
        self.keys = torch.arange(1 if trees else 0, l + (1 if trees else 0), device=device)
        self.depth = torch.arange(t, device=device).repeat(self.g)
        self.seen = torch.tensor(0.0, dtype=cache.kv.dtype, device=device)
        self.unseen = torch.tensor(float("-inf"), dtype=cache.kv.dtype, device=device)

    def load(self, inputs: list, trees: list, draws: StepDraws | None = None) -> np.ndarray:
        """Fill the buffers from a step's inputs (SlotInputs) and their trees (`Step.trees`), and with `draws`
        what `draw` needs; returns the index of each of their logit rows (tokens[logits_from:] of each input,
        in order) in `run()`'s output (and `draw`'s columns). No inputs: a step of padding alone, which changes
        no committed key or value (`cuda.py` captures every bucket on one before a timed run)."""
        b, t, n, r, m = self.b, self.t, self.b * self.t, self.rows, 4 * self.b * self.t + 3 * self.b
        ints, bools = self._host_ints, self._host_bools
        tokens, positions, write_pos, token_slots = (ints[k * n : (k + 1) * n].reshape(b, t) for k in range(4))
        base, slots, last = (ints[4 * n + k * b : 4 * n + (k + 1) * b] for k in range(3))
        keys, parent, draft = (ints[m + k * r : m + (k + 1) * r] for k in range(3))
        valid = bools[:n].reshape(b, t)
        sees = bools[n:].reshape(b, t, t + 2) if self.sees is not None else None
        anc = None if sees is None else sees[:, :, 1 : t + 1]  # the ancestor matrices, a view
        ints[:] = 0
        bools[:] = False
        parent[:] = r
        draft[:] = -1
        if sees is not None:
            sees[:, :, 0] = True  # the committed prefix (the last column, after the row's tokens, stays False)
            anc[:, np.arange(t), np.arange(t)] = True  # a padding token sees itself
        tail = self.cache.capacity - t + np.arange(t)  # by slot: where padding tokens write (module docstring)
        if not inputs:
            slots[:] = np.arange(b)
            write_pos[:] = positions[:] = np.arange(t) if self.gathered else tail
            token_slots[:] = slots[:, None]
            self.ints.copy_(torch.from_numpy(ints))
            self.bools.copy_(torch.from_numpy(bools))
            return np.zeros(0, dtype=np.int64)
        if self.gathered:  # row r: input r; padding rows on slots no input uses (no (slot, position) twice)
            used = {x.slot for x in inputs}
            slots[:] = [x.slot for x in inputs] + [s for s in range(self.cache.kv.shape[1]) if s not in used][
                : b - len(inputs)]
            rows = np.arange(len(inputs))
        else:  # row b: slot b
            slots[:] = np.arange(b)
            rows = np.array([x.slot for x in inputs])
        # Vectorised over the step's tokens (at 128 rows a per-row loop cost ~0.5 ms of host time a step):
        # token j of input i goes to flat position rows[i] * T + j.
        ks = np.array([len(x.tokens) for x in inputs])
        starts = np.cumsum(ks) - ks  # each input's first token in the packed order
        within = np.arange(ks.sum()) - np.repeat(starts, ks)
        flat = np.repeat(rows * t, ks) + within
        base[rows] = [x.base for x in inputs]
        positions[:] = base[:, None] + np.arange(t)  # padding tokens: any position in the cache will do
        packed = [tok for x in inputs for tok in x.tokens]
        tokens.reshape(-1)[flat] = packed
        depth = np.concatenate([depth for _, depth in trees])
        positions.reshape(-1)[flat] = np.repeat(base[rows], ks) + depth
        valid.reshape(-1)[flat] = True
        for r, k, (ancestors, _) in zip(rows, ks, trees):
            if ancestors is not None and anc is not None:  # a decode token (None) sees only itself: already set
                anc[r, :k, :k] = ancestors
        last[rows] = rows * t + ks - 1
        write_pos[:] = base[:, None] + np.arange(t)  # a padding row: base 0, positions [0, T)
        if not self.gathered:
            write_pos[:] = np.where(valid, write_pos, tail)
        token_slots[:] = slots[:, None]
        froms = np.array([x.logits_from for x in inputs])
        index = rows if self.gathered else flat[within >= np.repeat(froms, ks)]  # tokens[logits_from:] of each
        if draws is not None:  # row j of an input draws at output position offset + depth_j - depth_{logits_from}
            prefix, offset = np.zeros(self.rows, dtype=np.int64), np.zeros(self.rows, dtype=np.int64)
            if self.gathered:  # row r: input r's last token, its root
                prefix[rows], offset[rows] = draws.prefixes, draws.offsets
            else:
                prefix[flat] = np.repeat(draws.prefixes, ks)
                offset[flat] = np.repeat(np.asarray(draws.offsets) - depth[starts + froms], ks) + depth
                # a drawn row after its input's root: its parent's row and its draft token
                local = [p for x in inputs for p in (x.parents if x.parents is not None else range(-1, len(x.tokens) - 1))]
                child = within > np.repeat(froms, ks)
                parent[flat[child]] = (np.repeat(rows * t, ks) + np.array(local))[child]
                draft[flat[child]] = np.array(packed)[child]
            if not draws.params.greedy:
                keys[:] = draw_keys(prefix, offset)
            inv_t = 1.0 if draws.params.greedy else 1.0 / draws.params.temperature
            if inv_t != self._inv_t:  # fills on the device, queued: no copy, no wait
                self.inv_t[:1].fill_(inv_t)
                self.inv_t[1:].fill_(-inv_t)
                self._inv_t = inv_t
        self.ints.copy_(torch.from_numpy(ints))
        self.bools.copy_(torch.from_numpy(bools))
        return index

    def run(self) -> torch.Tensor:
        """The forward over the buffers -> logits: [B * T, vocab] by slot (padding rows included), [B, vocab]
        gathered (each row's last token)."""
        return forward(self.model, self.layers, self.tokens, self.rope.index_select(0, self.positions),
                       _StaticAttention(self), self.last if self.gathered else None)

    def draw(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """Every logits row (`run()`'s) drawn with its keyed draw, and the drafts walked: [3, R] fp32 (drawn
        token, exact below 2^24; its log-prob; reached by the walk), device work alone. `params`: its greedy,
        top_k and top_p (what the ops' shapes depend on); the temperature comes from the `inv_t` buffer `load`
        sets."""
        drawn, logprobs = sample_tensors(logits, params, self.row_keys, self.inv_t, self.drawn[: self.rows])
        walked = not self.gathered and self.t > 1
        reached = walk_trees(self.drawn, self.parent, self.draft, self.sees[:, :, 1 : self.t + 1]) if walked \
            else self.reached_all
        return torch.stack((drawn, logprobs, reached))  # one op, each widened to fp32

    def mask(self) -> torch.Tensor:
        """Additive mask [B, 1, G * T, L] in the cache's dtype (G query heads of each KV head folded into the
        query axis, as `_StaticAttention` folds them): token (b, t) sees position l of its row when l is before
        the row's base (its committed prefix) or l = base + j with j an ancestor of t (itself included). Chains
        (gathered rows, one token a row: j <= t) in two or three ops, trees in five: each token's `sees`,
        repeated for the G heads (a copy of the small table, not G times the host's work), gathered at column
        clamp(l + 1 - base, 0, T + 1)."""
        b, g, t, l = self.b, self.g, self.t, self.l
        if self.sees is None:  # chains: position base + j is token j's, an ancestor of every token from j on
            limit = self.base[:, None] if t == 1 else self.base[:, None] + self.depth  # [B, G*T]
            visible = self.keys <= limit[:, :, None]  # [B, G*T or 1, L]
        else:
            column = (self.keys - self.base[:, None]).clamp_(0, t + 1)  # [B, L]
            sees = self.sees[:, None].expand(b, g, t, t + 2).reshape(b, g * t, t + 2)  # query row g * T + t
            visible = sees.gather(2, column[:, None, :].expand(b, g * t, l))  # [B, G*T, L]
        return torch.where(visible, self.seen, self.unseen)[:, None].expand(b, 1, g * t, l)


class _StaticAttention:
    """`Decoder.forward_packed`'s attention backend for a `StaticStep`: write the step's keys/values (by slot
    one index_put, padding to the cache's tail; gathered, padding writes back what was there), then SDPA over
    the rows' positions [0, L) with the step's mask. The G query heads of a KV head are folded into the query
    axis ([B, KV, G * T, D]), so every kernel reads each KV head once and none needs a grouped-query mode."""

    def __init__(self, s: StaticStep):
        self.s = s
        self.additive = s.mask()  # once per step, not per layer

    def attend(self, layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """q: [N, H, D], kv: [N, 2KV, D] for the N = B * T tokens -> [N, H, D]."""
        s = self.s
        cache = s.cache.kv[layer]  # [slots, 2KV, capacity, D]
        if s.gathered:
            old = cache[s.token_slots, :, s.write_pos]  # [N, 2KV, D]
            kv = torch.where(s.valid[:, None, None], kv, old)
        cache[s.token_slots, :, s.write_pos] = kv
        n_kv = s.cache.num_kv_heads
        n, h, d = q.shape
        g = h // n_kv
        # query head h uses KV head h // G: [N, H, D] = [B, T, KV, G, D] -> [B, KV, G, T, D] -> [B, KV, G*T, D]
        folded = q.view(s.b, s.t, n_kv, g, d).permute(0, 2, 3, 1, 4).reshape(s.b, n_kv, g * s.t, d)
        # [B, 2KV, L, D]: by slot a view of the slot range, gathered a copy of the rows' keys and values
        rows = cache[:, :, : s.l].index_select(0, s.slots) if s.gathered else cache[: s.b, :, : s.l]
        out = F.scaled_dot_product_attention(folded, rows[:, :n_kv], rows[:, n_kv:], attn_mask=self.additive)
        return out.view(s.b, n_kv, g, s.t, d).permute(0, 3, 1, 2, 4).reshape(n, h, d)
