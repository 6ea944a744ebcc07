"""The fixed-shape step's forward (`static_step.py`, what a CUDA graph replays): `Decoder.forward_packed`'s
formulas in fewer launches, on the model's own parameters.

A small model's graphed step waits on its kernels one after the other, not on memory (an H200 ran a 32-slot
step of smollm2-135m in 5.5 ms, its weights crossing memory in 0.065 ms), so every op a layer saves is a
kernel saved 30 times a step. With plain torch ops, which run on every device (no Triton, no compile):

- q, k, v and gate, up: one matmul each (the decoder's own layout: `qkv_proj`, `gate_up_proj`);
- RMSNorm with its weight in one op (`F.rms_norm`'s weight; one fused kernel on a GPU);
- rope in two ops, one multiply and one sum against a per-position table of 2 x 2 rotations (`rope_table`),
  the value heads' the identity, so that q, k and v stay one tensor and the K/V write one index_put;
- the residual adds inside the o_proj and down matmuls (`x.addmm_(out, W.t())`: in place, one GEMM with
  beta = 1, where an out-of-place addmm would first copy x);
- SiLU x up: two ops, as in the decoder.

A llama layer launches 12 computing ops (decode; 14 in a verification step, which folds the query heads for
attention and back), where `forward_packed` launches 17 (19). The arithmetic is the decoder's up to rounding
(tests/engine/backends/test_static_step.py): rope rounds both its products before the sum (the decoder's
addcmul fuses the second), the addmm's GEMM sums the residual in its own order, and in bf16 the norm rounds
once (x / rms(x) times the weight) where the decoder rounds x / rms(x) first (in fp32: the same bits).
Decoding and verification both run these steps, so HistoSpec's token identity holds whatever the rounding.

No weight copies: the weights are read where the parameters live, so a CUDA graph sees a weight sync that
copies into them in place (`RolloutWorker.load_weights`), as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rhymerl.engine.kv_cache import KVCache
from rhymerl.model.decoder import AttentionBackend, Decoder


def rope_table(model: Decoder, cache: KVCache) -> torch.Tensor:
    """[capacity, H + 2KV, 2, 2, D/2] in the cache's dtype: for each cache position and head, the 2 x 2 maps
    R[i, k] (over the D/2 frequencies) with rope(x)[i] = sum_k x[k] * R[i, k], x split into its halves
    x[0], x[1]. From `Decoder.qkv_rope`'s cos and signed sin ([c, c], [-s, s]; values: 1, 0): R = [[c, -s],
    [s, c]], per half the same products as `apply_rope`'s x * cos + rotate_half(x) * sin. A step gathers its
    tokens' rows (one index_select)."""
    cos, sin = model.qkv_rope(torch.arange(cache.capacity, device=cache.kv.device), cache.kv.dtype)
    c0, c1 = cos.chunk(2, -1)
    s0, s1 = sin.chunk(2, -1)
    return torch.stack((torch.stack((c0, s0), -2), torch.stack((s1, c1), -2)), -3)


def rotate(qkv: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """qkv: [N, heads, D], rope: its rows of `rope_table` -> rope(qkv), [N, heads, D] (two ops)."""
    n, heads, d = qkv.shape
    return (qkv.view(n, heads, 1, 2, d // 2) * rope).sum(-2).view(n, heads, d)


def layer_modules(model: Decoder) -> list[tuple]:
    """Per layer, the modules `forward` reads (looked up once: nn.Module.__getattr__ is slow)."""
    return [(b.input_layernorm, b.self_attn, b.post_attention_layernorm, b.mlp.gate_up_proj, b.mlp.down_proj)
            for b in model.layers]


def _w(module: torch.nn.Module, name: str = "weight") -> torch.Tensor | None:
    return module._parameters.get(name)


def forward(model: Decoder, layers: list[tuple], tokens: torch.Tensor, rope: torch.Tensor,
            attention: AttentionBackend, logit_rows: torch.Tensor | None = None) -> torch.Tensor:
    """`model.forward_packed(tokens, ..., attention, logit_rows)` in fewer launches (module docstring).
    `layers`: `layer_modules(model)`; `rope`: the tokens' rows of `rope_table`. -> [R, vocab] (or [N, vocab])."""
    cfg = model.cfg
    eps, hidden, d = cfg.rms_norm_eps, (cfg.hidden_size,), cfg.head_dim
    h, kv = cfg.num_heads, cfg.num_kv_heads
    x = F.embedding(tokens, _w(model.embed_tokens))
    n = x.shape[0]
    for norm1, attn, norm2, gate_up, down in layers:
        qkv = F.linear(F.rms_norm(x, hidden, _w(norm1), eps), _w(attn.qkv_proj), _w(attn.qkv_proj, "bias"))
        qkv = qkv.view(n, h + 2 * kv, d)
        if attn.q_norm is not None:  # Qwen3: each head of q and k normalised before rope
            qkv = torch.cat((F.rms_norm(qkv[:, :h], (d,), _w(attn.q_norm), eps),
                             F.rms_norm(qkv[:, h : h + kv], (d,), _w(attn.k_norm), eps), qkv[:, h + kv :]), 1)
        qkv = rotate(qkv, rope)
        out = attention.attend(attn.layer, qkv[:, :h], qkv[:, h:])  # [N, H, D]
        x.addmm_(out.reshape(n, h * d), _w(attn.o_proj).t())  # x += o_proj(out)
        gate, up = F.linear(F.rms_norm(x, hidden, _w(norm2), eps), _w(gate_up)).chunk(2, -1)
        x.addmm_(F.silu(gate) * up, _w(down).t())  # x += down(silu(gate) * up)
    if logit_rows is not None:
        x = x.index_select(0, logit_rows)
    return F.linear(F.rms_norm(x, hidden, _w(model.norm), eps), _w(model.lm_head), _w(model.lm_head, "bias"))
