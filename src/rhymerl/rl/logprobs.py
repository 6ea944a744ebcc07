"""Per-token log-probs of completions under the policy: what the update's loss and its ratio are made of.

`token_logprobs` runs a micro-batch of `Sample`s through the model, siblings packed on their one shared
prompt (`BranchAttention`), only the positions that predict a completion token going through the lm_head;
`TargetLogprobs` turns those [rows, vocab] logits into log softmax(logits / temperature)[target] in
cache-sized row chunks, without an fp32 copy kept for the backward. Apart from `rl.trainer` (optimizer,
micro-batching, loss bookkeeping), which imports from here; `Sample` lives here because these read it.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from rhymerl.model.decoder import BranchAttention, Decoder


@dataclass
class Sample:
    """One completion ready for the update."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # the rollout's log-prob of each completion token (behaviour policy)
    advantage: float
    temperature: float | None = None  # what it was sampled at (None: the trainer's); its log-probs are at this


def logprob_temperature(sampled_at: float) -> float:
    """The temperature log-probs are taken at for a sample drawn at `sampled_at`: itself, and 1 for greedy
    (0), as the engine reports them."""
    return sampled_at if sampled_at > 0 else 1.0


def _rows(batch: list[Sample]) -> list[list[int]]:
    """Consecutive samples with the same prompt form one tree: the prompt and its sibling completions."""
    rows: list[list[int]] = []
    for i, s in enumerate(batch):
        if rows and batch[rows[-1][0]].prompt_ids == s.prompt_ids:
            rows[-1].append(i)
        else:
            rows.append([i])
    return rows


ROWS_PER_CHUNK = 64  # [64, vocab] fp32 rows: 12.6 MB at SmolLM2's 49152, so a chunk stays in cache


class TargetLogprobs(torch.autograd.Function):
    """log softmax(logits / temperature)[target] per row, and optionally the softmax's entropy (no grad).

    The same values and gradients as `x = logits.float() / temperature; x.gather(target) - logsumexp(x)`
    (bit for bit: the same kernels per row), but it walks the [R, V] logits in row chunks that stay in
    cache, and keeps only the logits and the [R] normaliser for the backward, not an fp32 copy (at GRPO
    sizes R is ~1000 rows per micro-batch, so that copy is ~200 MB).
    """

    @staticmethod
    def forward(ctx, logits, target, temperature: float, with_entropy: bool):  # [R, V], [R] -> [R], [R]
        rows = logits.shape[0]
        logp = torch.empty(rows, device=logits.device)
        log_norm = torch.empty_like(logp)  # logsumexp(x) per row
        entropy = torch.zeros_like(logp)
        for i in range(0, rows, ROWS_PER_CHUNK):
            c = slice(i, i + ROWS_PER_CHUNK)
            x = _scaled(logits[c], temperature)  # [C, V]
            log_norm[c] = torch.logsumexp(x, dim=-1)
            logp[c] = x.gather(1, target[c, None]).squeeze(1) - log_norm[c]
            if with_entropy:  # H = log Z - sum_i p_i x_i
                p = (x - log_norm[c, None]).exp_()
                entropy[c] = log_norm[c] - torch.linalg.vecdot(p, x)
        ctx.save_for_backward(logits, target, log_norm)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):  # [R] -> [R, V]
        logits, target, log_norm = ctx.saved_tensors
        temperature = ctx.temperature
        grad = torch.empty_like(logits)
        for i in range(0, logits.shape[0], ROWS_PER_CHUNK):
            c = slice(i, i + ROWS_PER_CHUNK)
            x = _scaled(logits[c], temperature)  # [C, V]
            g = grad_logp[c, None]  # [C, 1]
            # d logp / dx = onehot(target) - softmax(x)
            d = (x - log_norm[c, None]).exp_().mul_(-g).scatter_add_(1, target[c, None], g)
            grad[c] = d.div_(temperature) if temperature != 1.0 else d
        return grad, None, None, None


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 logits / temperature (no division at 1), as the engine's sampler scales them."""
    x = logits.float()
    return x if temperature == 1.0 else x / temperature


def token_logprobs(model: Decoder, batch: list[Sample], temperature: float, autocast: torch.dtype | None,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, T] (fp32) of each sample's completion tokens under `model` at `temperature`, the mask
    [B, T] of real completion tokens, and (optionally, without grad) the entropy [B, T] of each position.

    Siblings run their prompt once: consecutive samples sharing a prompt are packed as
    `prompt, c1[:-1], c2[:-1], ...`, each completion attending to the prompt and its own earlier tokens
    (`BranchAttention`), positions counted as if it ran alone. GRPO's num_generations completions per prompt
    would otherwise push the prompt through every linear layer num_generations times. Only the positions
    that predict a completion token go through the lm_head, whose [rows, vocab] output is the update's
    largest tensor; the prompt's last position predicts every sibling's first token.
    """
    device = next(model.parameters()).device
    ids, positions, scatter, gather = [], [], [], []
    logit_rows, b_idx, t_idx, targets = [], [], [], []
    L = max(len(s.prompt_ids) + len(s.completion_ids) - 1 for s in batch)  # longest prompt + branch
    for members in _rows(batch):
        prompt = batch[members[0]].prompt_ids
        P, base = len(prompt), len(ids)  # the prompt's tokens are packed at base .. base + P - 1
        ids += prompt
        positions += range(P)
        scatter += [len(gather) * L + p for p in range(P)]  # from the first branch of this tree
        for i in members:
            comp = batch[i].completion_ids
            n, start = len(comp) - 1, len(ids)  # the last token predicts nothing we need
            ids += comp[:-1]
            positions += range(P, P + n)
            scatter += [len(gather) * L + P + t for t in range(n)]
            # this branch's attention row: prompt, then its own tokens, right-padded (causal: never seen)
            gather.append(list(range(base, base + P)) + list(range(start, start + n)) + [base] * (L - P - n))
            # token t is predicted by the prompt's last position (t = 0) or by the branch's token t - 1
            logit_rows += [base + P - 1] + list(range(start, start + n))
            b_idx += [i] * len(comp)
            t_idx += range(len(comp))
            targets += comp
    B, T = len(batch), max(len(s.completion_ids) for s in batch)
    backend = BranchAttention(torch.tensor(gather, device=device), torch.tensor(scatter, device=device))
    ctx = torch.autocast(device.type, dtype=autocast) if autocast is not None else nullcontext()
    with ctx:
        logits = model.forward_packed(torch.tensor(ids, device=device), torch.tensor(positions, device=device),
                                      backend, logit_rows=torch.tensor(logit_rows, device=device))  # [R, V]
    target = torch.tensor(targets, device=device)
    lp, ent = TargetLogprobs.apply(logits, target, temperature, with_entropy)  # [R], [R]
    bt = (torch.tensor(b_idx, device=device), torch.tensor(t_idx, device=device))
    logp = torch.zeros(B, T, device=device, dtype=lp.dtype).index_put(bt, lp)  # [B, T]
    mask = torch.zeros(B, T, device=device).index_put(bt, torch.ones_like(lp))  # [B, T]
    entropy = torch.zeros(B, T, device=device).index_put(bt, ent) if with_entropy else None  # [B, T]
    return logp, mask, entropy


def padded(values: list, T: int, device) -> torch.Tensor:
    """Right-pad ragged per-token values (lists or 1-D tensors) to [B, T] (zeros)."""
    out = torch.zeros(len(values), T, device=device)
    for b, v in enumerate(values):
        out[b, : len(v)] = torch.as_tensor(v, dtype=out.dtype)
    return out
