"""SDPA's CPU backward at the update's shapes (16 branches, 9 heads / 3 KV heads, 149 positions, head dim 64; fp32
inputs), with and without bf16 autocast (which runs SDPA in bf16), with and without deterministic algorithms.
`python docs/notebook/data/2026-11-28-d-attention-autocast.py`: ms per backward, 4 timed of 6."""
import contextlib
import time

import torch
import torch.nn.functional as F

G, H, KV, L, D = 16, 9, 3, 149, 64
q = torch.randn(G, H, L, D, requires_grad=True)
k = torch.randn(G, KV, L, D, requires_grad=True)
v = torch.randn(G, KV, L, D, requires_grad=True)
g = torch.randn(G, H, L, D)


def backward_ms(context, label):
    times = []
    for _ in range(6):
        with context():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            t0 = time.perf_counter()
            out.backward(g)
            times.append(time.perf_counter() - t0)
    print(label, [round(t * 1e3, 1) for t in times[2:]])


backward_ms(contextlib.nullcontext, "fp32")
backward_ms(lambda: torch.autocast("cpu", dtype=torch.bfloat16), "bf16 autocast")
torch.use_deterministic_algorithms(True, warn_only=True)
backward_ms(contextlib.nullcontext, "fp32, deterministic")
backward_ms(lambda: torch.autocast("cpu", dtype=torch.bfloat16), "bf16 autocast, deterministic")
