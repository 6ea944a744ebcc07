"""A PyTorch decoder for Llama-family checkpoints (Llama/SmolLM2, Qwen2, Qwen3).

One module serves both rollout and training, with the same weights and the same formulas; the kernels
differ (below), so rollout and training log-probs agree to rounding, not bit for bit (the trainer logs the
gap as `actor/logprob_diff_max`). The layers work on *packed* tokens (`[N, hidden]`, no batch dimension):
where a token's keys and values come from is decided by an attention backend passed to `forward_packed`:

- `CausalAttention` (this file): plain causal self-attention over a `[B, S]` batch, no cache, autograd
  friendly; used for training and as the reference in tests. `BranchAttention`: training's prompt trees.
- the engine's cached attention (`rhymerl.engine.backends.eager.CachedAttention`): writes new keys/values
  into a slot's preallocated cache and attends to the slot's committed prefix plus the token's own ancestors.

This file is the plain model: the engine's CPU backend (`rhymerl.engine.backends.cpu`) runs the same layers
through fused C++ kernels, with weight copies of its own; `forward_packed` is their reference and fallback.

Arithmetic follows transformers' Llama/Qwen2/Qwen3 modules (RMSNorm in fp32, rotate-half rope), so that
logits match on the same weights. q/k/v and gate/up projections are fused into one matmul each: on a CPU,
per-op overhead dominates small-batch decoding and fewer matmuls is the cheapest win.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from rhymerl.model.config import ModelConfig


class AttentionBackend(Protocol):
    def attend(self, layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """q: [N, H, D] and kv: [N, 2*KV, D] (keys then values) for the N packed tokens -> [N, H, D]."""
        ...


class Linear(nn.Linear):
    """The decoder's matmuls: a plain nn.Linear (parameter names and checkpoints as nn.Linear's). A class of its
    own so that the engine's backends can tell the decoder's projections from other nn.Linear modules (LoRA's
    adapters, say) when they make their inference copies of the weights."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            # Inference (eval mode: a rollout worker's copy, the engine's steps, a CUDA graph's): two ops, torch's
            # fused RMSNorm (one aten op on every device), then the weight. By mode, not by whether grad is on:
            # the trainer's no-grad forward (old log-probs) must round as its loss forward does. Not F.rms_norm's own weight: transformers rounds x / rms(x) to
            # the input's dtype before multiplying by the weight (as the CPU kernels do); one rounding instead
            # of two would change the last bit in bf16.
            return F.rms_norm(x, (x.shape[-1],), eps=self.eps) * self.weight
        # Training: RMSNorm through LayerNorm, whose backward is the faster one on a CPU (bf16 [2048, 576],
        # one Zen 4 thread: 8-12 ms against 14-21 ms for F.rms_norm's): the vector [x, -x] has mean 0 and
        # variance mean(x^2), so the first half of its LayerNorm is x / rms(x). Gradients agree too: the
        # mean's derivative cancels between the two halves.
        d = x.shape[-1]
        y = F.layer_norm(torch.cat((x, -x), dim=-1), (2 * d,), eps=self.eps)
        return y[..., :d] * self.weight


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """[head_dim/2] inverse frequencies, with the `linear` and `llama3` scalings."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = cfg.rope_scaling.get("rope_type")
    if kind == "linear":
        inv_freq = inv_freq / cfg.rope_scaling["factor"]
    elif kind == "llama3":
        # Llama 3.1: leave high frequencies alone, divide low ones by `factor`, blend in between.
        s = cfg.rope_scaling
        factor, lo, hi = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
        old_len = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        inv_freq = torch.where(medium, blended, scaled)
    return inv_freq


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos and signed sin, each [N, 1, D] in `dtype`, for the rotate-half convention of transformers:
    rope(x) = x * cos + rotate_half(x) * sin with rotate_half([x1, x2]) = [-x2, x1]. The sign of the
    first half moves into `sin`, so applying it needs no negation."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [N, D/2], fp32 like transformers
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat((cos, cos), -1)[:, None].to(dtype), torch.cat((-sin, sin), -1)[:, None].to(dtype)


def qkv_rope_tables(cos: torch.Tensor, signed_sin: torch.Tensor, rotated: int, kept: int):
    """`rope_tables`' [N, 1, D] widened to [N, rotated + kept, D]: the first `rotated` heads (q, k) rotate,
    the last `kept` (v) go through unchanged (cos 1, sin 0), so that one `apply_rope` over a layer's whole
    qkv gives q, k and v as views, with no copy to join k and v again."""
    n, _, d = cos.shape
    return (torch.cat((cos.expand(n, rotated, d), cos.new_ones(n, kept, d)), 1),
            torch.cat((signed_sin.expand(n, rotated, d), signed_sin.new_zeros(n, kept, d)), 1))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, D] -> x * cos + [x2, x1] * signed_sin (three kernels)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.addcmul(x * cos, torch.cat((x2, x1), dim=-1), signed_sin)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.h, self.kv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, (self.h + 2 * self.kv) * self.d, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.h * self.d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x, cos, sin, backend: AttentionBackend):
        """cos, sin: `qkv_rope_tables`, [N, H + 2KV, D] (the value heads' rotation is the identity)."""
        n, h, kv = x.shape[0], self.h, self.kv
        qkv = self.qkv_proj(x).view(n, h + 2 * kv, self.d)  # heads: h queries, kv keys, kv values
        if self.q_norm is not None:  # Qwen3 normalises each head of q and k before rope
            qkv = torch.cat((self.q_norm(qkv[:, :h]), self.k_norm(qkv[:, h : h + kv]), qkv[:, h + kv :]), dim=1)
        # every head in one go, v unchanged (x * 1 + rot(x) * 0): q and the new keys/values come out as views
        qkv = apply_rope(qkv, cos, sin)
        out = backend.attend(self.layer, qkv[:, :h], qkv[:, h:])  # [N, H, D], [N, 2KV, D] -> [N, H, D]
        return self.o_proj(out.reshape(n, h * self.d))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, backend):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """Token ids -> logits. `forward_packed` for the engine, `forward` for a dense `[B, S]` batch."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def tie_weights(self) -> None:
        """With tied embeddings the lm_head shares the embedding's Parameter (call again after the
        embedding Parameter is replaced, e.g. by load_state_dict(assign=True))."""
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def qkv_rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The rope tables a layer applies at these positions: `qkv_rope_tables`, [N, H + 2KV, D] each."""
        cos, sin = rope_tables(positions, self.inv_freq, dtype)
        return qkv_rope_tables(cos, sin, self.cfg.num_heads + self.cfg.num_kv_heads, self.cfg.num_kv_heads)

    def forward_packed(
        self,
        tokens: torch.Tensor,  # [N] token ids of every sequence in the step, packed
        positions: torch.Tensor,  # [N] rope position of each token
        backend: AttentionBackend,
        logit_rows: torch.Tensor | None = None,  # [R] which of the N tokens need logits (None: all)
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,  # `qkv_rope` of positions [0, P), made once
    ) -> torch.Tensor:  # [R, vocab] (or [N, vocab])
        x = self.embed_tokens(tokens)
        if rope is None:
            cos, sin = self.qkv_rope(positions, x.dtype)
        else:  # a fixed-shape step's: its rows of a table made once, two kernels instead of a dozen (the same
            # values: each entry is the same elementwise function of its position)
            cos, sin = rope[0].index_select(0, positions), rope[1].index_select(0, positions)
        for layer in self.layers:
            x = layer(x, cos, sin, backend)
        if logit_rows is not None:
            x = x[logit_rows]  # the lm_head is a fifth of a small model: only pay for rows we sample
        return self.lm_head(self.norm(x))

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, S]
        attention_mask: torch.Tensor | None = None,  # [B, S] 1 = real token (left or right padding)
    ) -> torch.Tensor:  # [B, S, vocab]
        b, s = input_ids.shape
        if attention_mask is None:
            positions = torch.arange(s, device=input_ids.device).expand(b, s)
        else:  # positions count real tokens only, so left padding does not shift rope
            positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        backend = CausalAttention(b, s, attention_mask)
        logits = self.forward_packed(input_ids.reshape(-1), positions.reshape(-1), backend)
        return logits.view(b, s, -1)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """SDPA for the training paths (`BranchAttention`, `CausalAttention`). Under CPU autocast SDPA would run in
    bf16, whose CPU backward is 1.6-3x slower than the fp32 one at the update's shapes (16 branches, 9 heads, 149
    positions: 32-45 ms vs 12-22 ms on Sapphire Rapids; docs/notebook/2026-11-28-d.md), so there it runs in fp32
    (as exact or more), autocast off, its output cast by the next matmul. Elsewhere: SDPA as given."""
    if q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kwargs)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


class BranchAttention:
    """Causal self-attention for packed token trees of depth one: prompts each followed by several branches
    (a prompt's sampled completions), the layout training uses so that a prompt's tokens go through the
    model once however many completions it has.

    Each branch is attended as the plain sequence `prompt + branch` (causal, right-padded to a [G, L] batch
    gathered from the packed tokens, so SDPA's causal kernel applies and nothing is wasted on masked blocks);
    a prompt token's output is taken from the first of its branches (all of them compute the same value).
    `gather`: [G, L] index of each (branch, position) into the N packed tokens; `scatter`: [N] index of each
    packed token's output in the flattened [G * L] result.
    """

    def __init__(self, gather: torch.Tensor, scatter: torch.Tensor):
        self.gather, self.scatter = gather, scatter

    def attend(self, layer, q, kv):
        g, length = self.gather.shape
        n_kv = kv.shape[1] // 2
        # index_select, not q[gather]: its backward (index_add) is a fast kernel on CPU, advanced indexing's isn't
        flat = self.gather.reshape(-1)
        qb = q.index_select(0, flat).view(g, length, *q.shape[1:]).transpose(1, 2)  # [G, H, L, D]
        kvb = kv.index_select(0, flat).view(g, length, *kv.shape[1:]).transpose(1, 2)  # [G, 2KV, L, D]
        k, v = kvb[:, :n_kv], kvb[:, n_kv:]
        out = _sdpa(qb, k, v, is_causal=True, enable_gqa=qb.shape[1] != k.shape[1])
        return out.transpose(1, 2).reshape(g * length, q.shape[1], q.shape[2]).index_select(0, self.scatter)  # [N, H, D]


class CausalAttention:
    """Dense causal self-attention over a `[B, S]` batch (no cache): training and reference."""

    def __init__(self, batch: int, seqlen: int, attention_mask: torch.Tensor | None = None):
        self.b, self.s = batch, seqlen
        self.mask = None
        if attention_mask is not None:
            causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=attention_mask.device).tril()
            keys = attention_mask.bool()[:, None, None, :]  # [B, 1, 1, S]
            # The diagonal stays visible so padded query rows do not turn into NaN (0/0 softmax).
            self.mask = (causal & keys) | torch.eye(seqlen, dtype=torch.bool, device=keys.device)

    def attend(self, layer, q, kv):
        b, s, n_kv = self.b, self.s, kv.shape[1] // 2
        k, v = kv[:, :n_kv], kv[:, n_kv:]
        q, k, v = (t.reshape(b, s, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))
        gqa = q.shape[1] != k.shape[1]
        if self.mask is None:
            out = _sdpa(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            out = _sdpa(q, k, v, attn_mask=self.mask, enable_gqa=gqa)
        return out.transpose(1, 2).reshape(b * s, q.shape[1], q.shape[3])
