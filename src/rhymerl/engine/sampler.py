"""Logits -> tokens, with keyed randomness.

Sampling is by inverse CDF with one uniform per token: `u = keyed_uniform(seed, request, position)` and
the token is the first index whose cumulative probability exceeds `u`. The draw is a deterministic function
of the distribution and the key, so the same request gives the same tokens in any batch; a tiny change in
the logits only changes the token when `u` sits within that change of a CDF boundary (a floating-point tie).

The returned log-prob is `log_softmax(logits / temperature)` of the sampled token (temperature 1 for greedy)
before top-k/top-p: the convention of verl and TRL, whose trainers recompute it the same way.
"""

from __future__ import annotations

import torch

from rhymerl.engine.sampling_params import SamplingParams


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[R, V] fp32 logits -> (probs over kept tokens [R, V'], vocabulary ids of those columns or None if
    V' is the whole vocabulary in order). Applies temperature, top-k, then top-p."""
    scaled = logits / params.temperature
    if params.top_k == 0 and params.top_p >= 1.0:
        return torch.softmax(scaled, dim=-1), None
    k = scaled.shape[-1] if params.top_k == 0 else min(params.top_k, scaled.shape[-1])
    top, ids = torch.topk(scaled, k, dim=-1)  # sorted, descending
    probs = torch.softmax(top, dim=-1)
    if params.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it is kept).
        before = probs.cumsum(-1) - probs
        probs = probs.masked_fill(before >= params.top_p, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs, ids


def sample(logits: torch.Tensor, params: SamplingParams, uniforms: list[float]) -> tuple[list[int], list[float]]:
    """logits: [R, V] fp32, all rows with the same params; uniforms: [R] keyed draws in [0, 1).
    Returns (token ids, policy log-probs)."""
    if params.greedy:
        tokens = logits.argmax(-1)
        logp = torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
        return tokens.tolist(), logp.tolist()
    probs, ids = filtered_probs(logits, params)
    cdf = probs.double().cumsum(-1)  # fp64: a 49k-term fp32 cumsum drifts by ~1e-4
    u = torch.tensor(uniforms, dtype=torch.float64, device=logits.device)[:, None] * cdf[:, -1:]
    # First column whose cdf exceeds u: never a zero-probability column, since its cdf equals its left
    # neighbour's. u < total, so the clamp only guards against fp64 rounding at the very end.
    col = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[-1] - 1)
    tokens = col if ids is None else ids.gather(-1, col)
    logp = torch.log_softmax(logits / params.temperature, -1).gather(-1, tokens)[:, 0]
    return tokens[:, 0].tolist(), logp.tolist()
