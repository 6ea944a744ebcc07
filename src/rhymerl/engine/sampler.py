"""Logits -> tokens, with keyed randomness.

Sampling is Gumbel-max in two levels, with noise that is a pure function of the draw's key (seed,
request, position; `sampling_params.draw_key`) and of the block or token it perturbs:

1. the vocabulary is cut into blocks of 256 columns; block b is picked by argmax(log mass_b + G_b);
2. inside block b, token i by argmax(log p_i + G'_i).

Each level is an exact draw (Gumbel-max picks i with probability w_i / sum w), so the token has
probability (mass_b / total) * (p_i / mass_b) = p_i / total. Two levels keep the noise cheap (256 + 192
keyed values per row, not one per vocabulary entry) and, unlike an inverse CDF, make the draw robust to
last-bit differences in the logits, e.g. between a 1-token and a draft-tree forward in fp32: the token
can only change when the two best perturbed scores of a level are within that difference of each other
(about 1e-6 per level), whereas an inverse CDF moves every boundary by the rounding error accumulated
over all the columns before it and flipped about one fp32 response in ten at temperature 1.

The returned log-prob is `log_softmax(logits / temperature)` of the sampled token (temperature 1 for greedy)
before top-k/top-p: the convention of verl and TRL, whose trainers recompute it the same way.
"""

from __future__ import annotations

import functools
from collections import defaultdict

import torch

from rhymerl.engine.sampling_params import SamplingParams, draw_key

BLOCK = 256  # columns per first-level block
_TOKEN_SALT = 1 << 40  # noise streams: block b uses column b, token i uses column i + _TOKEN_SALT
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # the 64-bit constants as signed int64 (torch has no uint64 ops)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic and copies the sign bit)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (wrapping like uint64)."""
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def draw_keys(prefixes: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`sampling_params.draw_key` on tensors: prefixes [R] (`draw_prefix` as signed int64), positions [R]
    -> [R] keys, bit for bit (tests/engine/test_engine.py), so a device can key its own draws."""
    return _mix((prefixes ^ positions) + _GOLDEN)


def keyed_uniforms(keys: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """keys [R] int64 (draw keys), columns [R, C] or [C] int64 -> [R, C] fp64 uniforms in (0, 1): splitmix64
    of (key + (column + 1) * golden), with int64 arithmetic wrapping like uint64 (tests/test_engine.py
    checks it bit for bit against plain-Python uint64 arithmetic)."""
    return _uniforms(keys[:, None] + (columns + 1) * _GOLDEN)


def _uniforms(x: torch.Tensor) -> torch.Tensor:
    """`keyed_uniforms` from key + (column + 1) * golden, computed by the caller."""
    return (_shr(_mix(x), 11).double() + 0.5) * (1.0 / (1 << 53))


def _negated_gumbel(x: torch.Tensor) -> torch.Tensor:
    """log(-log(u)) = -Gumbel for the uniforms `_uniforms(x)`: a score adds the noise by subtracting this
    (b - a is b + (-a) in floating point: the same bits, one kernel fewer)."""
    return torch.log(-torch.log(_uniforms(x)))


_BLOCK_GOLDEN = (BLOCK * _GOLDEN + (1 << 63)) % (1 << 64) - (1 << 63)  # BLOCK * golden, wrapped to int64


@functools.lru_cache(maxsize=32)
def _column_terms(blocks: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The draw-independent parts of the noise's hash inputs, made once per vocabulary and device: block j's
    (j + 1) * golden [blocks], the offsets 0..BLOCK-1 inside a block, and offset i's token-stream term
    (i + _TOKEN_SALT + 1) * golden [BLOCK]. Column b * BLOCK + i of the token stream then hashes
    key + b * BLOCK * golden + that term: (column + _TOKEN_SALT + 1) * golden, as int64 arithmetic wraps."""
    with torch.inference_mode(False), torch.no_grad():
        offsets = torch.arange(BLOCK, device=device)
        return ((torch.arange(blocks, device=device) + 1) * _GOLDEN, offsets,
                (offsets + _TOKEN_SALT + 1) * _GOLDEN)


def filtered_probs(probs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[R, V] unnormalised probabilities after temperature -> the same with the tokens top-k and top-p
    removed set to zero (top-k first, then top-p; top-p is relative to the mass top-k kept)."""
    if params.top_k == 0 and params.top_p >= 1.0:
        return probs
    k = probs.shape[-1] if params.top_k == 0 else min(params.top_k, probs.shape[-1])
    top, ids = torch.topk(probs, k, dim=-1)  # sorted, descending
    if params.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p of the kept mass (the crossing token is kept).
        before = top.cumsum(-1) - top
        top = top.masked_fill(before >= params.top_p * top.sum(-1, keepdim=True), 0.0)
    return torch.zeros_like(probs).scatter_(-1, ids, top)


def _block_mass(probs: torch.Tensor) -> torch.Tensor:
    """[R, V] -> [R, ceil(V / BLOCK)]: the sum of each block of BLOCK columns (the last may be shorter)."""
    r, v = probs.shape
    full = v - v % BLOCK
    mass = probs[:, :full].view(r, -1, BLOCK).sum(-1)
    return torch.cat((mass, probs[:, full:].sum(-1, keepdim=True)), dim=1) if full < v else mass


def sample_columns(probs: torch.Tensor, keys: torch.Tensor, block_mass: torch.Tensor | None = None) -> torch.Tensor:
    """probs [R, V] (unnormalised, >= 0, a positive entry per row), keys [R] int64 -> [R, 1] sampled
    columns, by the two-level keyed Gumbel-max of the module docstring. A zero column is never chosen.
    `block_mass` [R, nb]: `_block_mass(probs)`, when the caller has it already."""
    v = probs.shape[1]
    if block_mass is None:
        block_mass = _block_mass(probs)
    block_terms, offsets, token_terms = _column_terms(block_mass.shape[1], probs.device)
    b = (block_mass.double().log() - _negated_gumbel(keys[:, None] + block_terms)).argmax(-1)  # [R]
    cols = b[:, None] * BLOCK + offsets  # [R, 256] vocabulary ids
    # the chosen block's columns; past the vocabulary's end (a short last block) probability 0
    inner = probs.gather(1, cols.clamp(max=v - 1)).double().masked_fill_(cols >= v, 0.0)  # [R, 256]
    token_x = (keys + b * _BLOCK_GOLDEN)[:, None] + token_terms  # key + (column + _TOKEN_SALT + 1) * golden
    c = (inner.log() - _negated_gumbel(token_x)).argmax(-1)  # log 0 = -inf: never chosen
    return (b * BLOCK + c)[:, None]


def sample(logits: torch.Tensor, params: SamplingParams, keys: list[int], kernels=None,
           rows: list[int] | None = None) -> tuple[list[int], list[float]]:
    """logits: [N, V] (fp32, or bf16: widened exactly); rows: the R rows to sample, all with the same params
    (None: every row); keys: [R] draw keys (`draw_key`). Returns (token ids, policy log-probs).
    `kernels`: `rhymerl.engine.backends.native.ops()`, whose `sample_rows` does the plain case (temperature, no
    top-k/top-p) on a CPU in one pass over each row, in place, with the same keyed noise and a few-ulp exp
    (tests/test_engine.py compares the two: the same tokens)."""
    if kernels is not None and not params.greedy and params.top_k == 0 and params.top_p >= 1.0 \
            and logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16):
        index = torch.arange(len(logits)) if rows is None else torch.tensor(rows, dtype=torch.int64)
        tokens, logprobs = kernels.sample_rows(logits, index, torch.tensor(keys, dtype=torch.int64),
                                               1.0 / params.temperature)
        return tokens.tolist(), logprobs.tolist()
    if rows is not None and rows != list(range(len(logits))):
        # index_select: the cheaper of the row copies torch offers (advanced indexing goes through index_put)
        logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
    tokens, logprobs = sample_tensors(logits, params, torch.tensor(keys, dtype=torch.int64, device=logits.device))
    return tokens.tolist(), logprobs.tolist()


def sample_rows(logits: torch.Tensor, seqs: list, rows: list[int], offsets: list[int],
                kernels=None) -> tuple[list[int], list[float]]:
    """One token at each logits row `rows[k]`, for sequence `seqs[k]` (an engine `Sequence`: its params, key
    and output); the draw for output token j of a request depends on (seed, request, j) only (here j = its
    output length + `offsets[k]`), exactly what plain decoding uses there. Rows with the same SamplingParams
    share one `sample` call."""
    groups: dict[SamplingParams, list[int]] = defaultdict(list)
    for k, seq in enumerate(seqs):
        groups[seq.params].append(k)
    tokens, logprobs = [0] * len(seqs), [0.0] * len(seqs)
    for params, ks in groups.items():
        keys = [draw_key(params.seed, seqs[k].key, len(seqs[k].output_ids) + offsets[k]) for k in ks]
        toks, lps = sample(logits, params, keys, kernels, [rows[k] for k in ks])
        for k, t, lp in zip(ks, toks, lps):
            tokens[k], logprobs[k] = t, lp
    return tokens, logprobs


def sample_tensors(logits: torch.Tensor, params: SamplingParams, keys: torch.Tensor,
                   inv_t: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample` on the device, without reading anything back: logits [R, V], keys [R] int64 (on the logits'
    device) -> (tokens [R] int64, log-probs [R] fp32). `inv_t`: 1 / temperature as an fp32 tensor [1, 1] on
    the logits' device, read instead of `params.temperature` (a CUDA graph's buffer: one graph serves every
    temperature; `static_step.StaticStep.draw`). Either way the same arithmetic, so the same bits."""
    logits = logits.float()
    if params.greedy:
        tokens = logits.argmax(-1, keepdim=True)
        return tokens[:, 0], torch.log_softmax(logits, -1).gather(-1, tokens)[:, 0]
    if inv_t is None:  # a fill, not a copy from the host (which would wait for the queued forward)
        inv_t = torch.full((1, 1), 1.0 / params.temperature, dtype=torch.float32, device=logits.device)
    # Softmax by hand, because the sampler needs only unnormalised probabilities, their block sums and the
    # log-probs of the sampled tokens: four passes over [R, V] (max; shift and scale; exp; block sums,
    # whose sum is the normaliser) where log_softmax + exp + sums take seven.
    neg_top = logits.amax(-1, keepdim=True).mul_(inv_t).neg_()  # [R, 1]: -max(z) for z = logits / T
    # logits / T - max(z) in one pass (0 at the maximum). The floor keeps exp() out of denormals (10x slower
    # at low temperature, where log-probs reach -300); it adds at most 49152 * e^-80 < 1e-30 of relative mass.
    probs = torch.addcmul(neg_top, logits, inv_t).clamp_(min=-80.0).exp_()  # [R, V], max 1
    mass = _block_mass(probs)  # [R, nb]
    log_norm = mass.sum(-1, keepdim=True).log()  # [R, 1]: log_softmax(z) = z - max(z) - log_norm
    kept = filtered_probs(probs, params)
    tokens = sample_columns(kept, keys, mass if kept is probs else None)  # [R, 1]
    shifted = torch.addcmul(neg_top, logits.gather(-1, tokens), inv_t)  # the same arithmetic as above
    return tokens[:, 0], (shifted - log_norm)[:, 0]
