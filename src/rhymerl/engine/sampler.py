"""Logits -> tokens, with keyed randomness.

Sampling is by inverse CDF with one uniform per token: `u = keyed_uniform(seed, request, position)` and
the token is the first index whose cumulative probability exceeds `u` (times the total). The draw is a
deterministic function of the distribution and the key, so the same request gives the same tokens in any
batch; a tiny change in the logits only changes the token when `u` sits within that change of a CDF boundary
(a floating-point tie).

The returned log-prob is `log_softmax(logits / temperature)` of the sampled token (temperature 1 for greedy)
before top-k/top-p: the convention of verl and TRL, whose trainers recompute it the same way.
"""

from __future__ import annotations

import torch

from rhymerl.engine.sampling_params import SamplingParams

_BLOCK = 256  # inverse CDF in two levels: block sums, then one block (see inverse_cdf)


def filtered_probs(logp: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[R, V] log-probs after temperature -> (probs over the kept tokens [R, V'], vocabulary ids of those
    columns, or None when V' is the whole vocabulary in order). Applies top-k, then top-p."""
    if params.top_k == 0 and params.top_p >= 1.0:
        # The floor keeps exp() out of denormals (10x slower at low temperature, where log-probs reach
        # -300); it adds at most 49152 * e^-80 < 1e-30 of probability mass.
        return logp.clamp(min=-80.0).exp(), None
    k = logp.shape[-1] if params.top_k == 0 else min(params.top_k, logp.shape[-1])
    top, ids = torch.topk(logp, k, dim=-1)  # sorted, descending
    probs = torch.softmax(top, dim=-1)
    if params.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it is kept).
        before = probs.cumsum(-1) - probs
        probs = probs.masked_fill(before >= params.top_p, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs, ids


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs [R, V] (unnormalised is fine), uniforms [R] fp64 in [0, 1) -> column [R, 1]: the first column
    whose cumulative mass exceeds u * total. Cumulative sums are in fp64 (a 49k-term fp32 cumsum drifts by
    ~1e-4) and in two levels (blocks of 256, then inside the chosen block), which avoids a slow
    full-vocabulary fp64 cumsum.
    A zero-probability column is never chosen: its cumulative mass equals its left neighbour's."""
    r, v = probs.shape
    pad = (-v) % _BLOCK
    blocks = (torch.nn.functional.pad(probs, (0, pad)) if pad else probs).view(r, -1, _BLOCK)  # [R, nb, 256]
    block_mass = blocks.sum(-1).double()  # [R, nb]; a 256-term fp32 sum is good to ~1e-7 (fp64 costs 5x)
    cum = block_mass.cumsum(-1)
    target = uniforms[:, None] * cum[:, -1:]  # [R, 1]
    b = torch.searchsorted(cum, target, right=True).clamp_(max=cum.shape[-1] - 1)  # the block
    rest = target - (cum.gather(-1, b) - block_mass.gather(-1, b))  # mass to cover inside the block
    inner = blocks.gather(1, b[:, :, None].expand(r, 1, _BLOCK))[:, 0].double().cumsum(-1)  # [R, 256]
    c = torch.searchsorted(inner, rest, right=True)
    # fp64 rounding can put `rest` at or past the block's total: take its last positive column then.
    c = torch.minimum(c, inner.argmax(-1, keepdim=True))
    return b * _BLOCK + c


def sample(logits: torch.Tensor, params: SamplingParams, uniforms: list[float]) -> tuple[list[int], list[float]]:
    """logits: [R, V] fp32, all rows with the same params; uniforms: [R] keyed draws in [0, 1).
    Returns (token ids, policy log-probs)."""
    if params.greedy:
        tokens = logits.argmax(-1, keepdim=True)
        return tokens[:, 0].tolist(), torch.log_softmax(logits, -1).gather(-1, tokens)[:, 0].tolist()
    logp = torch.log_softmax(logits / params.temperature, -1)
    probs, ids = filtered_probs(logp, params)
    u = torch.tensor(uniforms, dtype=torch.float64, device=logits.device)
    col = inverse_cdf(probs, u)
    tokens = col if ids is None else ids.gather(-1, col)
    return tokens[:, 0].tolist(), logp.gather(-1, tokens)[:, 0].tolist()
