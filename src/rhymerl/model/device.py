"""What the device can do, as far as the model's dtype choice needs to know (`pretrained.has_fast_bf16`)."""

from __future__ import annotations

import torch


def onednn_bf16() -> bool:
    """Whether oneDNN has bf16 matmul kernels for this CPU (AVX-512 or AMX on x86, BF16 on Arm)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
