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

import numpy as np
import torch

from rhymerl.engine.sampling_params import SamplingParams, draw_key

BLOCK = 256  # columns per first-level block
_TOKEN_SALT = 1 << 40  # noise streams: block b uses column b, token i uses column i + _TOKEN_SALT
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # the 64-bit constants as signed int64 (torch has no uint64 ops)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic and copies the sign bit; no device shifts
    uint64): two ops, the second in place."""
    return (x >> k).bitwise_and_((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (wrapping like uint64): 11 ops, in place after the first."""
    x = x ^ _shr(x, 30)
    x *= _MIX1
    x ^= _shr(x, 27)
    x *= _MIX2
    x ^= _shr(x, 31)
    return x


_U64 = tuple(np.uint64(v % (1 << 64)) for v in (_GOLDEN, _MIX1, _MIX2, 30, 27, 31))  # numpy's uint64 constants


def draw_keys(prefixes: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """`sampling_params.draw_key` on arrays, on the host: prefixes [R] (`draw_prefix`, signed int64),
    positions [R] -> [R] keys as int64, bit for bit (tests/histospec/test_verify.py). A step's keys are made
    here and copied with its other inputs (~7 us of numpy for up to 256 rows, where the device would launch
    13 kernels a step: docs/design.md, section 6.1)."""
    golden, mix1, mix2, s30, s27, s31 = _U64
    z = np.bitwise_xor(np.asarray(prefixes, dtype=np.int64), np.asarray(positions, dtype=np.int64)).view(np.uint64)
    z += golden  # uint64 arrays wrap, as the hash wants
    z ^= z >> s30
    z *= mix1
    z ^= z >> s27
    z *= mix2
    z ^= z >> s31
    return z.view(np.int64)


def keyed_uniforms(keys: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """keys [R] int64 (draw keys), columns [R, C] or [C] int64 -> [R, C] fp64 uniforms in (0, 1): splitmix64
    of (key + (column + 1) * golden), with int64 arithmetic wrapping like uint64 (tests/test_engine.py
    checks it bit for bit against plain-Python uint64 arithmetic)."""
    x = keys[:, None] + (columns + 1) * _GOLDEN
    return _uniforms(x, torch.tensor(_HALF_ULP, dtype=torch.float64, device=x.device))


_HALF_ULP = 0.5 / (1 << 53)


def _uniforms(x: torch.Tensor, half_ulp: torch.Tensor) -> torch.Tensor:
    """`keyed_uniforms` from key + (column + 1) * golden, computed by the caller; `half_ulp`: 2^-54 as a 0-dim
    fp64 tensor. (v + 0.5) * 2^-53 for the top 53 bits v of the hash z, in two ops: z with its low 11 bits
    cleared, read as uint64 (a view; unlike its shifts, widening uint64 is a copy kernel's and a CUDA kernel's
    cast), is v * 2^11, widened exactly; half_ulp + 2^-64 * that in fp64 rounds once, as (v + 0.5) * 2^-53
    does (scaling by a power of two commutes with rounding): the same bits, where a logical shift, the widening and the affine map took five."""
    return torch.add(half_ulp, _mix(x).bitwise_and_(-(1 << 11)).view(torch.uint64), alpha=1.0 / (1 << 64))


def _scores(log_w: torch.Tensor, x: torch.Tensor, half_ulp: torch.Tensor) -> torch.Tensor:
    """log_w + Gumbel noise of the hash inputs x, as log_w - log(-log(u)) (b - a is b + (-a) in floating
    point: the same bits, one kernel fewer than adding the negated noise)."""
    return log_w - _uniforms(x, half_ulp).log_().neg_().log_()


_BLOCK_GOLDEN = (BLOCK * _GOLDEN + (1 << 63)) % (1 << 64) - (1 << 63)  # BLOCK * golden, wrapped to int64


@functools.lru_cache(maxsize=32)
def _column_terms(blocks: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, tuple | None]:
    """The draw-independent parts of the noise, made once per vocabulary and device: the hash terms [blocks +
    BLOCK] (block j's (j + 1) * golden, then offset i's token-stream term (i + _TOKEN_SALT + 1) * golden:
    column b * BLOCK + i of the token stream hashes key + b * BLOCK * golden + that term, as int64 arithmetic
    wraps), 2^-54 (`_uniforms`), and where the last block is short ([blocks, BLOCK] each) every block's
    columns clamped to the vocabulary and which of them lie past its end."""
    with torch.inference_mode(False), torch.no_grad():
        offsets = torch.arange(BLOCK, device=device)
        terms = torch.cat(((torch.arange(blocks, device=device) + 1) * _GOLDEN, (offsets + _TOKEN_SALT + 1) * _GOLDEN))
        half_ulp = torch.tensor(_HALF_ULP, dtype=torch.float64, device=device)
        if vocab == blocks * BLOCK:
            return terms, half_ulp, None
        cols = torch.arange(blocks * BLOCK, device=device).view(blocks, BLOCK)
        return terms, half_ulp, (cols.clamp(max=vocab - 1), cols >= vocab)


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


def sample_columns(probs: torch.Tensor, keys: torch.Tensor, block_mass: torch.Tensor | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """probs [R, V] (unnormalised, >= 0, a positive entry per row), keys [R] int64 -> [R, 1] sampled
    columns, by the two-level keyed Gumbel-max of the module docstring. A zero column is never chosen.
    `block_mass` [R, nb]: `_block_mass(probs)`, when the caller has it already; `out` [R] int64: where to
    write the columns (a step's buffer). Both levels' hash inputs come from one add (key + terms); the
    chosen block's columns are one gather where the vocabulary is whole blocks."""
    r, v = probs.shape
    if block_mass is None:
        block_mass = _block_mass(probs)
    nb = block_mass.shape[1]
    terms, half_ulp, short_end = _column_terms(nb, v, probs.device)
    x = keys[:, None] + terms  # [R, nb + BLOCK]: the blocks' hash inputs, then the token stream's less its block
    b = _scores(block_mass.double().log(), x[:, :nb], half_ulp).argmax(-1)  # [R]
    if short_end is None:  # the chosen block's columns
        inner = probs.view(r, nb, BLOCK).gather(1, b[:, None, None].expand(r, 1, BLOCK))[:, 0].double()
    else:  # past the vocabulary's end (a short last block) probability 0
        cols, past = short_end
        inner = probs.gather(1, cols.index_select(0, b)).double().masked_fill_(past.index_select(0, b), 0.0)
    token_x = torch.add(x[:, nb:], b[:, None], alpha=_BLOCK_GOLDEN)  # key + (column + _TOKEN_SALT + 1) * golden
    c = _scores(inner.log_(), token_x, half_ulp).argmax(-1)  # log 0 = -inf: never chosen
    return torch.add(c, b, alpha=BLOCK, out=out)[:, None]


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
                   inv_t: torch.Tensor | None = None, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample` on the device, without reading anything back: logits [R, V] (fp32 or bf16), keys [R] int64 (on
    the logits' device) -> (tokens [R] int64, log-probs [R] fp32). `inv_t`: (1 / temperature, -1 / temperature)
    as an fp32 tensor [2] on the logits' device, read instead of `params.temperature` (a CUDA graph's buffer:
    one graph serves every temperature; `static_step.StaticStep.draw`). Either way the same arithmetic, so the
    same bits. `out` [R] int64: where to write the tokens."""
    if params.greedy:
        logits = logits.float()
        tokens = torch.argmax(logits, -1, out=out)
        return tokens, torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
    if inv_t is None:  # a fill, not a copy from the host (which would wait for the queued forward)
        inv_t = torch.full((2,), 1.0 / params.temperature, dtype=torch.float32, device=logits.device)
        inv_t[1:].neg_()
    scale, neg_scale = inv_t[:1], inv_t[1:]
    # Softmax by hand, because the sampler needs only unnormalised probabilities, their block sums and the
    # log-probs of the sampled tokens: four passes over [R, V] (max; shift and scale; exp; block sums,
    # whose sum is the normaliser) where log_softmax + exp + sums take seven. bf16 logits are widened inside
    # the ops that read them (exactly: the same bits as a copy in fp32 first, one pass fewer).
    neg_top = torch.mul(logits.amax(-1, keepdim=True), neg_scale)  # [R, 1]: -max(z) for z = logits / T, fp32
    # logits / T - max(z) in one pass (0 at the maximum). The floor keeps exp() out of denormals (10x slower
    # at low temperature, where log-probs reach -300); it adds at most 49152 * e^-80 < 1e-30 of relative mass.
    probs = torch.addcmul(neg_top, logits, scale).clamp_(min=-80.0).exp_()  # [R, V], max 1
    mass = _block_mass(probs)  # [R, nb]
    log_norm = mass.sum(-1, keepdim=True).log_()  # [R, 1]: log_softmax(z) = z - max(z) - log_norm
    kept = filtered_probs(probs, params)
    tokens = sample_columns(kept, keys, mass if kept is probs else None, out)  # [R, 1]
    shifted = torch.addcmul(neg_top, logits.gather(-1, tokens), scale)  # the same arithmetic as above
    return tokens[:, 0], (shifted - log_norm)[:, 0]
