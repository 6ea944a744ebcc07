"""The CPU backend: the decoder through the fused C++ kernels of `native.py` (fp32 and bf16).

Each decoder layer runs as two fused calls around the attention (`kernels/layer.cpp`: residual add,
RMSNorm, qkv, rope and the K/V write; then o_proj, RMSNorm, gate/up, SiLU and down) instead of ~30 small
eager kernels, and a step whose attention is one call per layer (the usual step) runs the whole layer
stack in one call (`forward_layers`). The matmuls multiply by AMX tile copies of the weights in bf16 on CPUs
with AMX tiles, else by oneDNN's prepacked copies (`cpu_weights.py`). Decode rows and draft trees are
attended by the tree kernel where it takes the head size and dtype, with its tile cache on AMX
(`cpu_attention.py`, `tile_cache.py`), else by the SDPA groups of the eager backend, in C++.
"""

from __future__ import annotations

import torch

from rhymerl.engine.backends.base import Step
from rhymerl.engine.backends.cpu_attention import FusedAttention
from rhymerl.engine.backends.cpu_weights import FUSED_PER_LAYER, ONEDNN, PLAIN, TILES, model_weights
from rhymerl.engine.backends.tile_cache import TileCache
from rhymerl.engine.kv_cache import KVCache
from rhymerl.model.decoder import Decoder, rope_tables


@torch.inference_mode()
def forward_fused(
    model: Decoder,
    tokens: torch.Tensor,  # [N] token ids, packed
    positions: torch.Tensor,  # [N] rope positions
    attention: FusedAttention,
    ops,  # native.ops(): the fused CPU kernels
    logit_rows: torch.Tensor | None = None,  # [R] rows that need logits (None: all)
    layout: int = PLAIN,  # how the matmul weights are stored: PLAIN, ONEDNN or TILES (cpu_weights.py)
) -> torch.Tensor:  # [R, vocab]
    """`model.forward_packed` through the fused kernels: one call for the whole layer stack when the step's
    attention is one call per layer (the usual step), else two calls per layer around the attention;
    ~30 eager kernels per layer either way. Same formulas; the rounding differs in the summation order of
    RMSNorm and attention and in the exp of SiLU and softmax. The residual stream is carried as (x, r) with
    the previous layer's MLP output r not yet added: each pre_attn (and the final norm) adds it while
    normalising."""
    cfg = model.cfg
    x, r, eps = model.embed_tokens(tokens), None, cfg.rms_norm_eps
    cos, sin = rope_tables(positions, model.inv_freq, x.dtype)
    h, kv = cfg.num_heads, cfg.num_kv_heads
    weights, lm_head = model_weights(model).fused(layout, ops.pack_tiles if layout == TILES else None)
    one_call = attention.one_call_args()
    if one_call is not None:  # the usual step: the whole layer stack in one call, no Python between layers
        x, r = ops.forward_layers(x, weights, layout, cos, sin, attention.cache.kv, attention.slot_of,
                                  attention.write_pos, h, kv, eps, **one_call._asdict())
    else:
        for i in range(cfg.num_layers):
            w = weights[FUSED_PER_LAYER * i : FUSED_PER_LAYER * (i + 1)]
            x, q = ops.pre_attn(x, r, w[0], w[1], w[2], layout, w[3], w[4], cos, sin, attention.cache_layer(i),
                                attention.slot_of, attention.write_pos, h, kv, eps)
            out = attention.attend_written(i, q)  # [N, H, D]
            x, r = ops.post_attn(out.reshape(out.shape[0], -1), x, w[5], w[6], w[7], w[8], layout, eps)
    if logit_rows is not None:
        x, r = x[logit_rows], r[logit_rows]
    return ops.linear(ops.add_rms_norm(x, r, model.norm.weight, eps)[1], lm_head, model.lm_head.bias, layout)


class CpuBackend:
    """`forward_fused` over `FusedAttention`. `ops`: the built kernels (`native.ops()`); the cache's dtype
    must be fp32 or bf16 (the kernels' dtypes)."""

    pads_rows = False  # each row computes its own tokens only
    step_buckets = None  # no fixed shapes
    verifies_on_device = False  # each sampled row costs a pass over the vocabulary: sample the rows walks reach

    def __init__(self, model: Decoder, cache: KVCache, ops):
        self.model, self.cache, self.ops = model, cache, ops
        self.device = next(model.parameters()).device
        cfg, dtype = model.cfg, cache.kv.dtype
        takes_trees = ops.tree_attention_supports(cfg.head_dim, dtype)
        self.tree_attention = ops.tree_attention if takes_trees else None
        # On AMX tiles the tree attention keeps the slots' keys and values rearranged (0: it keeps none).
        block_elems = ops.tree_attention_block_elems(cfg.head_dim, dtype) if takes_trees else 0
        self.tile_cache = TileCache(cache, block_elems) if block_elems > 0 else None
        # bf16 matmuls on AMX tiles where the CPU has them (kernels/tile_linear.cpp), else oneDNN's.
        weights = model_weights(model)
        self.tiles = ops.tile_linear_supported() and weights.tiles_fit()
        self.layout = TILES if self.tiles else ONEDNN if weights.packable() else PLAIN

    def forward(self, step: Step) -> torch.Tensor:
        if self.tile_cache is not None:  # this step writes each slot from its base on, and a copied prefix from 0
            self.tile_cache.forget([x.slot for x in step.inputs],
                                   [0 if x.prefix_from is not None else x.base for x in step.inputs])
        attention = FusedAttention(self.cache, step.inputs, step.trees, self.device, self.model.cfg.num_heads,
                                   self.tree_attention, self.tile_cache)
        return forward_fused(self.model, step.tokens, step.positions, attention, self.ops, step.logit_rows,
                             self.layout)

    def commit(self, slot: int, base: int, path: list[int]) -> None:
        self.cache.commit(slot, base, path)  # the tile cache holds only blocks below base: nothing to forget

    def move(self, src: int, dst: int, length: int) -> None:
        self.cache.move(src, dst, length)
        if self.tile_cache is not None:
            self.tile_cache.move(src, dst, length)
