"""The GRPO-family policy loss (PPO-style clipped surrogate), KL penalty and entropy metric, in TRL's vocabulary.

Per completion token t of sequence b, with ratio r = exp(logp - old_logp) (new policy / behaviour policy):

    loss_bt = -min(r * A_b, clip(r, 1 - epsilon, 1 + epsilon_high) * A_b)   (+ beta * k3 KL to the reference)

epsilon_high defaults to epsilon; a larger epsilon_high is DAPO's clip-higher. The per-token losses are
aggregated over completion tokens (mask) according to loss_type:

    "grpo"    : mean over each sequence's tokens, then mean over sequences (original GRPO; favours short answers)
    "dapo"    : sum over all tokens / number of completion tokens in the whole batch (token-level; TRL's "dapo",
                which normalises by the active tokens of the global accumulated batch: the trainer rescales each
                micro-batch to the whole batch's token count)
    "bnpo"    : the same as "dapo" here. TRL's "bnpo" normalises by the tokens of each local (micro-)batch
                instead, so its loss moves with the micro-batch split; rhymerl's always uses the whole batch's
                count, i.e. its "bnpo" is TRL's "dapo" (checked against TRL's GRPOConfig docs)
    "dr_grpo" : sum over all tokens / (B * max_completion_length) (Dr. GRPO: a constant, length-unbiased normaliser)

When the samples come from an older policy than the one the ratio's old_logp belongs to (rollout.mode=
one_step_off), each token's policy-gradient term is also multiplied by a truncated importance-sampling weight
(`tis_weights`, verl's TIS) before the aggregation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rhymerl.config.sections import LOSS_TYPES  # train.loss_type's choices, owned by the config


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over the positions where mask is 1 (all of them, or along dim); 0 where the mask is empty."""
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate [B, T] of KL(policy || ref) from the sampled tokens' log-probs [B, T].

    k3 = exp(ref - logp) - (ref - logp) - 1: unbiased for samples from the policy, always >= 0, 0 iff equal.
    """
    d = ref_logp - logp  # [B, T]
    return torch.exp(d) - d - 1.0  # [B, T]


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy [B, T] of the softmax over the last axis of logits [B, T, V], computed in float32 via log_softmax.

    -inf logits (masked vocabulary) contribute 0, without NaNs in the value or its gradient.
    """
    logp = F.log_softmax(logits.float(), dim=-1)  # [B, T, V]
    logp = logp.clamp(min=torch.finfo(logp.dtype).min)  # -inf -> finite, so that p * logp = 0 there
    return -(logp.exp() * logp).sum(dim=-1)  # [B, T]


def tis_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance-sampling weights (verl's TIS, `tis_imp_ratio_cap`) for samples drawn by an older
    behaviour policy than the proximal one the PPO ratio starts from:

        w_bt = min(exp(old_logp_bt - rollout_logp_bt), cap)      (detached: a weight, not a path for gradients)

    old_logp: [B, T] the proximal policy's log-probs of the sampled tokens (the trainer's recomputation);
    rollout_logp: [B, T] the behaviour policy's (what the rollout recorded). Returns (w [B, T], truncated
    [B, T] bool: where the ratio exceeded cap). Raises ValueError for cap <= 0 (off is the caller's choice)
    or mismatched shapes."""
    if cap <= 0:
        raise ValueError(f"the TIS cap must be > 0, got {cap} (<= 0 means off: do not call tis_weights)")
    if old_logp.shape != rollout_logp.shape:
        raise ValueError(f"old_logp and rollout_logp must share one [B, T] shape, got {tuple(old_logp.shape)} "
                         f"and {tuple(rollout_logp.shape)}")
    ratio = torch.exp(old_logp.detach() - rollout_logp.detach())  # [B, T] proximal / behaviour
    return ratio.clamp(max=cap), ratio > cap  # [B, T], [B, T]


def _aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, max_completion_length: int | None):
    """Reduce per-token losses [B, T] over completion tokens (mask [B, T]) to a scalar, per loss_type."""
    if loss_type == "grpo":
        return masked_mean(per_token, mask, dim=-1).mean()  # [B] -> scalar
    if loss_type in ("dapo", "bnpo"):
        return masked_mean(per_token, mask)  # scalar
    # dr_grpo
    return (per_token * mask).sum() / (per_token.shape[0] * max_completion_length)


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    loss_type: str = "grpo",
    max_completion_length: int | None = None,
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
    tis_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """Clipped-surrogate policy loss (scalar) and its stats, for the sampled tokens of a batch of completions.

    logp, old_logp: [B, T] log-probs of the sampled tokens under the policy being trained / the behaviour policy
    (old_logp is detached); advantages: [B] one per completion; mask: [B, T], 1 on completion tokens.
    With beta > 0, beta * kl_k3(logp, ref_logp) is added per token before aggregation, so the KL term is
    aggregated with the same loss_type as the policy term (as TRL does). tis_weight: [B, T] (`tis_weights`)
    multiplies the policy-gradient term per token (not the KL term, as verl); None = no weighting.

    stats (python floats, over completion tokens):
      "clipfrac": fraction of tokens whose clipped term was chosen with a different value, i.e. the ratio left
                  the trust region in the direction that matters (TRL's clip_ratio/region_mean):
                  (r < 1 - epsilon and A < 0) or (r > 1 + epsilon_high and A > 0); these tokens get no gradient.
      "clipfrac_low", "clipfrac_high": the two halves of that; "ratio_mean": mean ratio;
      "kl": mean k3 KL to the reference (only when beta > 0).
    Raises ValueError for an unknown loss_type, dr_grpo without max_completion_length, beta > 0 without
    ref_logp, negative beta or non-positive epsilons, or mismatched shapes.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {LOSS_TYPES}")
    if loss_type == "dr_grpo" and (max_completion_length is None or max_completion_length <= 0):
        raise ValueError(f"loss_type 'dr_grpo' needs a positive max_completion_length, got {max_completion_length}")
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    if epsilon <= 0 or epsilon_high <= 0:
        raise ValueError(f"epsilon and epsilon_high must be > 0, got {epsilon} and {epsilon_high}")
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if beta > 0 and ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp")
    if logp.dim() != 2 or old_logp.shape != logp.shape or mask.shape != logp.shape:
        raise ValueError(f"logp, old_logp, mask must share one [B, T] shape, got "
                         f"{tuple(logp.shape)}, {tuple(old_logp.shape)}, {tuple(mask.shape)}")
    if advantages.shape != logp.shape[:1]:
        raise ValueError(f"advantages must be [B] = [{logp.shape[0]}], got {tuple(advantages.shape)}")
    if tis_weight is not None and tis_weight.shape != logp.shape:
        raise ValueError(f"tis_weight must be [B, T] = {tuple(logp.shape)}, got {tuple(tis_weight.shape)}")

    mask = mask.to(logp.dtype)  # [B, T]
    A = advantages.to(logp.dtype).unsqueeze(1)  # [B, 1]
    ratio = torch.exp(logp - old_logp.detach())  # [B, T]
    clipped = torch.clamp(ratio, 1.0 - epsilon, 1.0 + epsilon_high)  # [B, T]
    per_token = -torch.min(ratio * A, clipped * A)  # [B, T] pessimistic surrogate
    if tis_weight is not None:
        per_token = per_token * tis_weight.detach().to(logp.dtype)  # [B, T] behaviour -> proximal correction
    if beta > 0:
        kl = kl_k3(logp, ref_logp)  # [B, T]
        per_token = per_token + beta * kl
    loss = _aggregate(per_token, mask, loss_type, max_completion_length)

    with torch.no_grad():
        low = ((ratio < 1.0 - epsilon) & (A < 0)).to(logp.dtype)  # [B, T]
        high = ((ratio > 1.0 + epsilon_high) & (A > 0)).to(logp.dtype)  # [B, T]
        stats = {
            "clipfrac": masked_mean(low + high, mask).item(),
            "clipfrac_low": masked_mean(low, mask).item(),
            "clipfrac_high": masked_mean(high, mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
        }
        if beta > 0:
            stats["kl"] = masked_mean(kl, mask).item()
    return loss, stats
