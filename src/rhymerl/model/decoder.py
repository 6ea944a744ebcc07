"""A PyTorch decoder for Llama-family checkpoints (Llama/SmolLM2, Qwen2, Qwen3).

One module serves both rollout and training, with the same weights and the same formulas; the kernels
differ (below), so rollout and training log-probs agree to rounding, not bit for bit (the trainer logs the
gap as `actor/logprob_diff_max`). The layers work on *packed* tokens (`[N, hidden]`, no batch dimension):
where a token's keys and values come from is decided by an attention backend passed to `forward`:

- `CausalAttention` (this file): plain causal self-attention over a `[B, S]` batch, no cache, autograd
  friendly; used for training and as the reference in tests.
- the engine's cached backend (`rhymerl.engine.model_runner`): writes new keys/values into a slot's
  preallocated cache and attends to the slot's committed prefix plus the token's own ancestors.

On a CPU the engine runs `forward_fused` instead of `forward_packed`: the same layers through the fused
C++ kernels of `rhymerl.model.native` (eager `forward_packed` is their reference and fallback).

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


FUSED_PER_LAYER = 9  # tensors per layer in Decoder._fused_weights (kernels/layer.cpp: kPerLayer)
# How the fused kernels' matmul weights are stored (kernels/common.h): the parameter itself, oneDNN's
# prepacked copy, or the AMX tile copy of kernels/tile_linear.cpp.
PLAIN, ONEDNN, TILES = 0, 1, 2
TILE_COLUMNS = 16  # pack_tiles takes weights whose out_features are a multiple of this


class FusedBackend(Protocol):
    """A cached backend for `Decoder.forward_fused`, whose pre_attn kernel writes the new keys/values
    itself: token i goes to `cache_layer(layer)[slot_of[i], :, write_pos[i]]`."""

    slot_of: torch.Tensor  # [N] int64
    write_pos: torch.Tensor  # [N] int64

    def cache_layer(self, layer: int) -> torch.Tensor:  # [slots, 2*KV, capacity, D]
        ...

    def attend_written(self, layer: int, q: torch.Tensor) -> torch.Tensor:  # [N, H, D] -> [N, H, D]
        ...

    def one_call_args(self) -> tuple | None:
        """(cache [layers, slots, 2*KV, capacity, D], the attention arguments of the `forward_layers`
        kernel) when the step's attention is a single call in every layer, else None."""
        ...


def onednn_bf16() -> bool:
    """Whether oneDNN has bf16 matmul kernels for this CPU (AVX-512 or AMX on x86, BF16 on Arm)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def cpu_packing_supported(weight: torch.Tensor) -> bool:
    """oneDNN's prepacked matmul: CPU only; bf16 where the CPU has bf16 instructions, and fp32 (see
    `rhymerl bench engine --dtype fp32` in docs/benchmarks.md)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return onednn_bf16()
    return weight.dtype == torch.float32


def _param(module: nn.Module | None, name: str) -> nn.Parameter | None:
    """module.<name> (None for a missing module or parameter) without nn.Module.__getattr__'s slow path: the
    fused forward reads ~300 parameters a step."""
    return None if module is None else module._parameters.get(name)


class Linear(nn.Linear):
    """nn.Linear that, for inference on a CPU, can use a copy of its weight prepacked into oneDNN's blocked
    layout: in bf16 the same product (bit-identical in our tests) at less cost, because the
    per-call repacking of the weight disappears; in fp32 a different summation order (differences at fp32
    rounding level) and faster decoding (docs/benchmarks.md). Training (grad enabled) uses the plain weight.

    Its copies (oneDNN's, and the AMX tiles of the fused kernels) remember which version of the weight they
    were made from and are remade on first use after the weight changed, so they can never be stale.
    """

    packed: bool = False  # inference multiplies by oneDNN's prepacked copy (enable_packing)
    _copies: dict | None = None  # kind -> ((data_ptr, version) of the weight it was made from, the copy)

    def enable_packing(self) -> bool:
        self.packed = cpu_packing_supported(self.weight)
        return self.packed

    def _copy(self, kind: str, make) -> torch.Tensor:
        """make(weight), kept per kind and remade on first use after the weight changed (an optimizer step
        or a weight sync bumps its version), so a copy is never stale. The parameter is read through
        _parameters: nn.Module.__getattr__ is slow, and a fused step reads ~120 weights."""
        w = self._parameters["weight"]
        key = (w.data_ptr(), w._version)
        if self._copies is None:
            self._copies = {}
        made_from, copy = self._copies.get(kind, (None, None))
        if made_from != key:
            copy = make(w.detach())
            self._copies[kind] = (key, copy)
        return copy

    def inference_weight(self) -> tuple[torch.Tensor, bool]:
        """(weight to multiply by, whether it is the oneDNN prepacked copy)."""
        if not self.packed:
            return self.weight, False
        return self._copy("onednn", lambda w: torch.ops.mkldnn._reorder_linear_weight(w, None)), True

    def tiles(self, pack) -> torch.Tensor:
        """The weight in the fused kernels' AMX tile layout (`pack` is their `pack_tiles`). Kept apart from the
        oneDNN copy, so the engine (tiles) and an eager forward (oneDNN) in one process do not repack each
        other's copy at every call."""
        return self._copy("tiles", pack)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.packed or torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.inference_weight()[0], self.bias, "none", [], "")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # RMSNorm through LayerNorm, which is one fused native kernel on every device (F.rms_norm runs as
        # about eight small kernels on a CPU, and small-kernel overhead dominates decoding): the vector
        # [x, -x] has mean 0 and variance mean(x^2), so the first half of its LayerNorm is x / rms(x).
        # Gradients agree too: the mean's derivative cancels between the two halves.
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
        n, h, kv = x.shape[0], self.h, self.kv
        qkv = self.qkv_proj(x).view(n, h + 2 * kv, self.d)  # heads: h queries, kv keys, kv values
        if self.q_norm is not None:  # Qwen3 normalises each head of q and k before rope
            qk = torch.cat((self.q_norm(qkv[:, :h]), self.k_norm(qkv[:, h : h + kv])), dim=1)
        else:
            qk = qkv[:, : h + kv]
        qk = apply_rope(qk, cos, sin)  # queries and keys in one go: half the small ops
        q, kv_new = qk[:, :h], torch.cat((qk[:, h:], qkv[:, h + kv :]), dim=1)  # [N, H, D], [N, 2KV, D]
        out = backend.attend(self.layer, q, kv_new)  # [N, H, D]
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
        self._fused_modules: list[tuple] | None = None  # per layer, the modules forward_fused reads

    def tie_weights(self) -> None:
        """With tied embeddings the lm_head shares the embedding's Parameter (call again after the
        embedding Parameter is replaced, e.g. by load_state_dict(assign=True))."""
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def enable_packing(self) -> bool:
        """Use prepacked weights for inference where the hardware supports it (see `Linear`)."""
        return all([m.enable_packing() for m in self.modules() if isinstance(m, Linear)])

    def forward_packed(
        self,
        tokens: torch.Tensor,  # [N] token ids of every sequence in the step, packed
        positions: torch.Tensor,  # [N] rope position of each token
        backend: AttentionBackend,
        logit_rows: torch.Tensor | None = None,  # [R] which of the N tokens need logits (None: all)
    ) -> torch.Tensor:  # [R, vocab] (or [N, vocab])
        x = self.embed_tokens(tokens)
        cos, sin = rope_tables(positions, self.inv_freq, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, backend)
        if logit_rows is not None:
            x = x[logit_rows]  # the lm_head is a fifth of a small model: only pay for rows we sample
        return self.lm_head(self.norm(x))

    def tiles_fit(self) -> bool:
        """Whether every matmul weight can take the AMX tile layout (bf16, out_features a multiple of 16)."""
        return all(m.weight.dtype == torch.bfloat16 and m.out_features % TILE_COLUMNS == 0
                   for m in self.modules() if isinstance(m, Linear))

    def _fused_weights(self, pack_tiles=None) -> tuple[list, torch.Tensor, int]:
        """Every layer's tensors, flat, in the order of kernels/layer.cpp's forward_layers (per layer: input
        norm, qkv, qkv bias, q norm, k norm, o_proj, post-attention norm, gate/up, down; None where the
        architecture has none), the lm_head's weight, and the matmul weights' layout: the AMX tile copies
        when `pack_tiles` is given, else the oneDNN prepacked copies where there are some. Read afresh at
        every forward, so a weight sync or an optimizer step is always seen (stale copies are remade by
        `Linear.tiles` and `Linear.inference_weight`); only the modules are looked up once."""
        if self._fused_modules is None:
            self._fused_modules = [(b.input_layernorm, b.self_attn.qkv_proj, b.self_attn.q_norm, b.self_attn.k_norm,
                                    b.self_attn.o_proj, b.post_attention_layernorm, b.mlp.gate_up_proj,
                                    b.mlp.down_proj) for b in self.layers]
        if pack_tiles is not None:
            layout, weight = TILES, lambda lin: lin.tiles(pack_tiles)
        else:
            layout, weight = ONEDNN if self.lm_head.packed else PLAIN, lambda lin: lin.inference_weight()[0]
        out = []
        for norm1, qkv, q_norm, k_norm, o, norm2, gate_up, down in self._fused_modules:
            out += [_param(norm1, "weight"), weight(qkv), _param(qkv, "bias"), _param(q_norm, "weight"),
                    _param(k_norm, "weight"), weight(o), _param(norm2, "weight"), weight(gate_up), weight(down)]
        return out, weight(self.lm_head), layout

    @torch.inference_mode()
    def forward_fused(
        self,
        tokens: torch.Tensor,  # [N] token ids, packed
        positions: torch.Tensor,  # [N] rope positions
        backend: FusedBackend,
        ops,  # rhymerl.model.native.ops(): the fused CPU kernels
        logit_rows: torch.Tensor | None = None,  # [R] rows that need logits (None: all)
        tiles: bool = False,  # matmuls on AMX tiles (ops.tile_linear_supported() and self.tiles_fit())
    ) -> torch.Tensor:  # [R, vocab]
        """`forward_packed` for rollout on a CPU, through the fused kernels of `rhymerl.model.native`: one
        call for the whole layer stack when the step's attention is one call per layer (the usual step),
        else two calls per layer around the backend's attention; ~30 eager kernels per layer either way.
        Same formulas; the rounding differs in the summation order of RMSNorm and attention and in the exp
        of SiLU and softmax. The residual stream
        is carried as (x, r) with the previous layer's MLP output r not yet added: each pre_attn (and the
        final norm) adds it while normalising."""
        x, r, eps = self.embed_tokens(tokens), None, self.cfg.rms_norm_eps
        cos, sin = rope_tables(positions, self.inv_freq, x.dtype)
        h, kv = self.cfg.num_heads, self.cfg.num_kv_heads
        weights, lm_head, layout = self._fused_weights(ops.pack_tiles if tiles else None)
        one_call = backend.one_call_args()
        if one_call is not None:  # the usual step: the whole layer stack in one call, no Python between layers
            cache, attention = one_call
            x, r = ops.forward_layers(x, weights, layout, cos, sin, cache, backend.slot_of, backend.write_pos, h, kv,
                                      eps, *attention)
        else:
            for i in range(len(self.layers)):
                w = weights[FUSED_PER_LAYER * i : FUSED_PER_LAYER * (i + 1)]
                x, q = ops.pre_attn(x, r, w[0], w[1], w[2], layout, w[3], w[4], cos, sin, backend.cache_layer(i),
                                    backend.slot_of, backend.write_pos, h, kv, eps)
                out = backend.attend_written(i, q)  # [N, H, D]
                x, r = ops.post_attn(out.reshape(out.shape[0], -1), x, w[5], w[6], w[7], w[8], layout, eps)
        if logit_rows is not None:
            x, r = x[logit_rows], r[logit_rows]
        return ops.linear(ops.add_rms_norm(x, r, self.norm.weight, eps)[1], lm_head, self.lm_head.bias, layout)

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
        out = F.scaled_dot_product_attention(qb, k, v, is_causal=True, enable_gqa=qb.shape[1] != k.shape[1])
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
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, enable_gqa=gqa)
        return out.transpose(1, 2).reshape(b * s, q.shape[1], q.shape[3])
