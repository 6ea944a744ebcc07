"""The CPU backends' inference copies of a decoder's matmul weights.

- oneDNN's prepacked copy (`torch.ops.mkldnn._reorder_linear_weight`): in bf16 the same product
  (bit-identical in our tests) at less cost, because the per-call repacking of the weight disappears; in
  fp32 a different summation order (differences at fp32 rounding level) and faster decoding
  (docs/benchmarks.md). The fused kernels multiply by it, and the eager backend on a CPU too
  (`prepacked_linears`).
- the AMX tile copy of `kernels/tile_linear.cpp` (`ops.pack_tiles`), for the fused kernels' bf16 matmuls
  on CPUs with AMX tiles.

The copies live outside the model (the decoder stays a plain nn.Module), one `ModelWeights` per decoder,
shared by every backend built on it. Each copy remembers the (data_ptr, version) of the weight it was made
from and is remade on first use after the weight changed (an optimizer step or a weight sync bumps the
version), so a copy is never stale. This relies on torch's private `Tensor._version`, the counter every
in-place op bumps (`copy_` and the optimizers' updates included): a weight changed without an in-place op
on the parameter (writing through a numpy view of it, say) or swapped for an equal-version tensor at the
same address would go unnoticed. `RolloutWorker.load_weights` updates in place for this reason.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from rhymerl.model.decoder import Decoder, Linear
from rhymerl.model.device import onednn_bf16

# How the fused kernels' matmul weights are stored (kernels/common.h): the parameter itself, oneDNN's
# prepacked copy, or the AMX tile copy of kernels/tile_linear.cpp.
PLAIN, ONEDNN, TILES = 0, 1, 2
TILE_COLUMNS = 16  # pack_tiles takes weights whose out_features are a multiple of this
FUSED_PER_LAYER = 9  # tensors per layer in ModelWeights.fused (kernels/layer.cpp: kPerLayer)


def cpu_packing_supported(weight: torch.Tensor) -> bool:
    """oneDNN's prepacked matmul: CPU only; bf16 where the CPU has bf16 instructions, and fp32 (see
    `rhymerl bench engine --dtype fp32` in docs/benchmarks.md)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return onednn_bf16()
    return weight.dtype == torch.float32


def _param(module: torch.nn.Module | None, name: str) -> torch.nn.Parameter | None:
    """module.<name> (None for a missing module or parameter) without nn.Module.__getattr__'s slow path: the
    fused forward reads ~300 parameters a step."""
    return None if module is None else module._parameters.get(name)


class ModelWeights:
    """One decoder's matmul weight copies (get it through `model_weights`)."""

    def __init__(self, model: Decoder):
        self.linears = [m for m in model.modules() if isinstance(m, Linear)]
        # per layer, the modules `fused` reads (looked up once: nn.Module.__getattr__ is slow)
        self.layers = [(b.input_layernorm, b.self_attn.qkv_proj, b.self_attn.q_norm, b.self_attn.k_norm,
                        b.self_attn.o_proj, b.post_attention_layernorm, b.mlp.gate_up_proj, b.mlp.down_proj)
                       for b in model.layers]
        self.lm_head = model.lm_head
        # (linear, kind) -> ((data_ptr, version) of the weight it was made from, the copy)
        self._copies: dict[tuple[Linear, str], tuple[tuple[int, int], torch.Tensor]] = {}

    def packable(self) -> bool:
        """Whether every matmul can take oneDNN's prepacked copy (see `cpu_packing_supported`)."""
        return all(cpu_packing_supported(lin.weight) for lin in self.linears)

    def tiles_fit(self) -> bool:
        """Whether every matmul weight can take the AMX tile layout (bf16, out_features a multiple of 16)."""
        return all(lin.weight.dtype == torch.bfloat16 and lin.out_features % TILE_COLUMNS == 0 for lin in self.linears)

    def copy(self, lin: Linear, kind: str, make) -> torch.Tensor:
        """make(weight), kept per kind and remade on first use after the weight changed. The parameter is
        read through _parameters: nn.Module.__getattr__ is slow, and a fused step reads ~120 weights."""
        w = lin._parameters["weight"]
        key = (w.data_ptr(), w._version)
        made_from, copy = self._copies.get((lin, kind), (None, None))
        if made_from != key:
            copy = make(w.detach())
            self._copies[(lin, kind)] = (key, copy)
        return copy

    def onednn(self, lin: Linear) -> torch.Tensor:
        """The weight prepacked into oneDNN's blocked layout."""
        return self.copy(lin, "onednn", lambda w: torch.ops.mkldnn._reorder_linear_weight(w, None))

    def tiles(self, lin: Linear, pack) -> torch.Tensor:
        """The weight in the fused kernels' AMX tile layout (`pack` is their `pack_tiles`). Kept apart from the
        oneDNN copy, so the fused kernels (tiles) and an eager forward (oneDNN) in one process do not repack
        each other's copy at every call."""
        return self.copy(lin, "tiles", pack)

    def fused(self, layout: int, pack_tiles=None) -> tuple[list, torch.Tensor]:
        """Every layer's tensors, flat, in the order of kernels/layer.cpp's forward_layers (per layer: input
        norm, qkv, qkv bias, q norm, k norm, o_proj, post-attention norm, gate/up, down; None where the
        architecture has none), and the lm_head's weight, the matmul weights in `layout` (TILES needs
        `pack_tiles`). Read afresh at every forward, so a weight sync or an optimizer step is always seen."""
        if layout == TILES:
            weight = lambda lin: self.tiles(lin, pack_tiles)  # noqa: E731
        elif layout == ONEDNN:
            weight = self.onednn
        else:
            weight = lambda lin: lin._parameters["weight"]  # noqa: E731
        out = []
        for norm1, qkv, q_norm, k_norm, o, norm2, gate_up, down in self.layers:
            out += [_param(norm1, "weight"), weight(qkv), _param(qkv, "bias"), _param(q_norm, "weight"),
                    _param(k_norm, "weight"), weight(o), _param(norm2, "weight"), weight(gate_up), weight(down)]
        return out, weight(self.lm_head)


_BY_MODEL: weakref.WeakKeyDictionary[Decoder, ModelWeights] = weakref.WeakKeyDictionary()


def model_weights(model: Decoder) -> ModelWeights:
    """The decoder's ModelWeights, made on first use; it lives as long as the decoder."""
    weights = _BY_MODEL.get(model)
    if weights is None:
        weights = _BY_MODEL[model] = ModelWeights(model)
    return weights


@contextmanager
def prepacked_linears(model: Decoder):
    """Within the block, the decoder's matmuls multiply by oneDNN's prepacked copies (the eager backend's
    forward on a CPU; only where `model_weights(model).packable()`). Each Linear's `forward` is shadowed by
    an instance attribute for the block's duration only, so the model is plain outside it, and a forward
    with grad enabled (training) multiplies by the parameter as always."""
    weights = model_weights(model)

    def packed_forward(lin: Linear):
        def forward(x: torch.Tensor) -> torch.Tensor:
            if torch.is_grad_enabled():
                return F.linear(x, lin.weight, lin.bias)
            return torch.ops.mkldnn._linear_pointwise(x, weights.onednn(lin), lin.bias, "none", [], "")
        return forward

    for lin in weights.linears:
        lin.forward = packed_forward(lin)
    try:
        yield
    finally:
        for lin in weights.linears:
            del lin.forward
