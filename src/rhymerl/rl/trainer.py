"""The policy update: micro-batched forward/backward of the GRPO loss, AdamW, clipping and the LR schedule.

One optimizer step per rollout batch (times `num_iterations`, TRL's PPO epochs over the same batch).
Gradients are accumulated over micro-batches so that the step equals one big-batch step: each micro-batch's
loss is rescaled from its own normaliser to the whole batch's (tokens for dapo/bnpo, sequences for grpo and
dr_grpo), so the sum over micro-batches is exactly the batch loss of `rl.losses.policy_loss`.

Old log-probs (the behaviour policy's, in the PPO ratio) are by default the trainer's own: the first
iteration's forward runs the policy before any update of this batch, so its detached log-probs are exactly a
recomputation, at no extra cost (with num_iterations=1 the ratio is exactly 1, as in TRL). This is what keeps
training independent of speculation: the engine's log-probs come from forwards whose shape depends on the
drafts (a verification forward rounds differently from a 1-token decode), and AdamW turns even last-bit
gradient differences into learning-rate-sized steps on near-zero-gradient weights, so rollout-side old
log-probs would make spec-on and spec-off runs drift apart. `recompute_logprobs=false` uses the rollout's
instead. Either way the largest and mean absolute difference between the two is reported.

In rollout.mode=one_step_off the samples come from the weights one update older than the trainer's: the
recomputed old log-probs are then the proximal policy's, and `tis_imp_ratio_cap` > 0 (the loop passes
train.tis_imp_ratio_cap in that mode only) weights each token's policy-gradient term by
min(exp(old - rollout log-prob), cap), verl's truncated importance sampling (`rl.losses.tis_weights`), against
the stale behaviour policy. In sync mode the two differ only by rollout numerics (dtype, speculation's
verification shapes), and weighting by that gap would tie training to speculation, so the loop passes 0 (off).
With recompute_logprobs=false the old log-probs are the rollout's and every weight is exactly 1.

Inside one rank of a multi-rank update (`sharding`, `rl/sharding.py`) the same code runs on that rank's share
of the micro-batches, the gradients and metric sums reduced across ranks, so that the update equals the
single-process one.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch
from torch.optim.lr_scheduler import LambdaLR

from rhymerl.config import TrainSection
from rhymerl.model.decoder import Decoder
from rhymerl.model.pretrained import resolve_dtype
from rhymerl.rl.logprobs import Sample, logprob_temperature, padded, token_logprobs
from rhymerl.rl.losses import policy_loss, tis_weights

if TYPE_CHECKING:  # only ranks of a multi-rank update (rl/ranks.py) pass one; torch.distributed's imports are long
    from rhymerl.rl.sharding import Sharding


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, kind: str) -> float:
    """Learning-rate factor after `step` optimizer steps: linear warm-up, then constant / linear / cosine decay
    to 0 at `total_steps` (the transformers schedules of the same names)."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if kind == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if kind == "linear":
        return 1.0 - progress
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"train.lr_scheduler: unknown schedule {kind!r}")


class PolicyTrainer:
    """Owns the optimizer and schedule of `model` (fp32 master weights; bf16 autocast if configured)."""

    def __init__(self, model: Decoder, cfg: TrainSection, temperature: float, max_completion_length: int,
                 ref_model: Decoder | None = None, dtype: str | None = None, tis_imp_ratio_cap: float = 0.0,
                 sharding: Sharding | None = None):
        """`dtype`: what the update computes in, resolved ("bf16" = bf16 autocast, "fp32"); by default
        `cfg.dtype` as `resolve_dtype` decides it for the model's device. `tis_imp_ratio_cap` > 0: truncated
        importance sampling against the rollout's log-probs (see the module doc); <= 0: off. `sharding`: this
        process is one rank of several, `model` and `ref_model` already wrapped by it (None: the only one)."""
        if cfg.beta > 0 and ref_model is None:
            raise ValueError("train.beta > 0 needs a reference model")
        self.model, self.cfg, self.ref_model = model, cfg, ref_model
        self.tis_cap = tis_imp_ratio_cap
        self.sharding = sharding
        # The engine reports log-probs of logits / temperature (greedy: temperature 1); so does the trainer.
        self.temperature = logprob_temperature(temperature)
        self.max_completion_length = max_completion_length
        device = next(model.parameters()).device
        self.autocast = torch.bfloat16 if (dtype or resolve_dtype(cfg.dtype, device)) == "bf16" else None
        params = [p for p in model.parameters() if p.requires_grad]
        # fused: one kernel for the whole update instead of ~6 elementwise passes per parameter list
        self.optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                           weight_decay=cfg.weight_decay, fused=True)
        # TRL's convention: the schedule advances once per optimizer step and spans every optimizer step of
        # the run, train.total_steps rollout steps x num_iterations optimizer steps each (train.total_steps
        # itself stays the number of rollout steps). warmup_steps count optimizer steps too, as TRL's (the
        # transformers scheduler's num_warmup_steps are optimizer steps), so with num_iterations=2 a warm-up of
        # 4 lasts 2 rollout steps.
        self.schedule_steps = cfg.total_steps * cfg.num_iterations
        self.scheduler = LambdaLR(self.optimizer, lambda s: lr_multiplier(s, cfg.warmup_steps, self.schedule_steps,
                                                                          cfg.lr_scheduler))

    def _micro_batches(self, samples: list[Sample]) -> list[list[Sample]]:
        """Micro-batches of at most micro_batch_size sequences, siblings kept together (they share one
        prompt row in `token_logprobs`); pieces of similar length together, for less padding."""
        m = self.cfg.micro_batch_size
        groups: dict[tuple, list[Sample]] = {}
        for s in samples:
            groups.setdefault(tuple(s.prompt_ids), []).append(s)
        pieces = [g[i : i + m] for g in groups.values() for i in range(0, len(g), m)]
        pieces.sort(key=lambda p: len(p[0].prompt_ids) + sum(len(s.completion_ids) for s in p))  # stable
        batches: list[list[Sample]] = []
        for piece in pieces:
            if batches and len(batches[-1]) + len(piece) <= m:
                batches[-1].extend(piece)
            else:
                batches.append(list(piece))
        return batches

    def update(self, samples: list[Sample]) -> dict[str, float]:
        """`num_iterations` optimizer steps on a rollout batch (TRL's PPO epochs over it); returns verl-style
        `actor/...` metrics, one row for the whole update (every iteration, see the comment per metric)."""
        cfg = self.cfg
        sampled_at = {s.temperature for s in samples if s.temperature is not None}
        if sampled_at and {logprob_temperature(t) for t in sampled_at} != {self.temperature}:
            raise ValueError(f"samples drawn at temperature {sorted(sampled_at)}, but this trainer takes log-probs "
                             f"at {self.temperature}: the importance ratio needs both at the same temperature")
        total_tokens = sum(len(s.completion_ids) for s in samples)
        total_seqs = len(samples)
        # A zero advantage gives a zero policy-gradient term whatever the ratio: without a KL term such
        # sequences contribute nothing to the gradient, so they are not run at all (the normalisers above
        # still count them, so the gradient is exactly that of the full batch).
        trained = [s for s in samples if s.advantage != 0.0 or cfg.beta > 0]
        # Sums over (iteration, micro-batch, completion token) of the trained sequences; "tok" counts those
        # (token, iteration) pairs, "tok0" the tokens of iteration 0 only (the behaviour-policy forward).
        acc = {"loss": 0.0, "clip": 0.0, "clip_low": 0.0, "clip_high": 0.0, "ratio": 0.0, "kl": 0.0,
               "ent": 0.0, "tok": 0, "tok0": 0, "diff_max": 0.0, "diff_sum": 0.0, "ppo_kl": 0.0, "tis": 0.0,
               "tis_truncated": 0.0}
        grad_norm = 0.0
        # id(sample) -> old log-probs [T_s]; filled by the first iteration when the trainer's own are used
        old = {} if cfg.recompute_logprobs else {id(s): torch.tensor(s.logprobs) for s in samples}
        self.model.train()
        batches = self._micro_batches(trained)
        # (micro-batch, live): this rank's share, padded with zero-weighted ones (see rl/sharding.py)
        plan = self.sharding.share(batches) if self.sharding else [(mb, True) for mb in batches]
        for it in range(cfg.num_iterations):
            for i, (mb, live) in enumerate(plan):
                with self._grad_sync(last=i == len(plan) - 1):
                    self._micro_step(mb, old, it, total_tokens, total_seqs, acc, live)
            if trained:
                grad_norm = self._clip()
            self.optimizer.step()  # without gradients (nothing trained) AdamW leaves every parameter alone
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()  # once per optimizer step, trained or not, so the schedule follows the step
        if self.sharding:
            acc = self.sharding.reduce(acc)
        # All means below are pooled over tokens (sums / counts), one row per rollout step; TRL averages its
        # micro-batches' means instead, the same figure when micro-batches hold equal numbers of tokens.
        n = max(acc["tok"], 1)  # (token, iteration) pairs of the trained sequences
        n0 = max(acc["tok0"], 1)  # tokens of the trained sequences, counted once
        # Every iteration x every completion token of the batch: skipped (zero-advantage) sequences are never
        # clipped (a clip needs A < 0 or A > 0), so their tokens count in the denominator, as in TRL's mean
        # over all completion tokens, without being run.
        n_all = max(total_tokens * cfg.num_iterations, 1)
        metrics = {
            # mean over iterations of the whole batch's loss (each iteration's is exactly the big-batch loss)
            "actor/pg_loss": acc["loss"] / cfg.num_iterations,
            # fraction of (iteration, completion token) pairs whose clipped term was taken (TRL's
            # clip_ratio/region_mean, low_mean, high_mean): over every iteration and every completion token
            "actor/pg_clipfrac": acc["clip"] / n_all, "actor/pg_clipfrac_lower": acc["clip_low"] / n_all,
            "actor/pg_clipfrac_higher": acc["clip_high"] / n_all,
            # mean ratio new / behaviour policy over every iteration and every trained completion token
            "actor/ratio_mean": acc["ratio"] / n if acc["tok"] else 1.0,
            # mean of (old logp - new logp) over every iteration and every trained completion token (verl's)
            "actor/ppo_kl": acc["ppo_kl"] / n,
            # mean entropy of the policy over every iteration and every trained completion token (TRL computes
            # it in every iteration's forward too); skipped sequences are not run, so not in it
            "actor/entropy": acc["ent"] / n,
            # the last optimizer step's (what transformers logs at the step that logs)
            "actor/grad_norm": grad_norm,
            # the LR after this update's last scheduler step, i.e. the next optimizer step's (as transformers)
            "actor/lr": self.scheduler.get_last_lr()[0],
            "actor/trained_seqs": len(trained), "actor/skipped_seqs": total_seqs - len(trained),
            # rollout vs trainer log-probs: the behaviour policy's, i.e. iteration 0's forward (the policy before
            # this batch's update), over every trained completion token once, like TRL's
            # sampling/sampling_logp_difference; later iterations would add the update's own drift to this
            # engine-vs-trainer gap (that drift is ppo_kl / ratio_mean)
            "actor/logprob_diff_max": acc["diff_max"],
            "actor/logprob_diff_mean": acc["diff_sum"] / n0,
        }
        if cfg.beta > 0:  # k3 KL to the reference: every iteration x every completion token (all are trained)
            metrics["actor/kl"] = acc["kl"] / n
        if self.tis_cap > 0:  # the weights are the same in every iteration: over every trained token once
            metrics["actor/tis_weight_mean"] = acc["tis"] / n0 if acc["tok0"] else 1.0
            metrics["actor/tis_clipfrac"] = acc["tis_truncated"] / n0  # tokens whose weight was cut to the cap
        return metrics

    def _grad_sync(self, last: bool):
        return self.sharding.grad_sync(self.model, last) if self.sharding else nullcontext()

    def _micro_step(self, mb: list[Sample], old: dict, iteration: int, total_tokens: int, total_seqs: int,
                    acc: dict, live: bool = True) -> None:
        cfg = self.cfg
        first = iteration == 0
        logp, mask, ent = token_logprobs(self.model, mb, self.temperature, self.autocast, with_entropy=True)
        T, device = logp.shape[1], logp.device
        if first and cfg.recompute_logprobs:  # the policy before this batch's update (behaviour or proximal)
            for b, s in enumerate(mb):
                old[id(s)] = logp[b, : len(s.completion_ids)].detach()
        old_logp = padded([old[id(s)] for s in mb], T, device)  # [B, T]
        adv = torch.tensor([s.advantage for s in mb], device=device)  # [B]
        ref_logp = None
        if cfg.beta > 0:
            with torch.no_grad():
                ref_logp, _, _ = token_logprobs(self.ref_model, mb, self.temperature, self.autocast)
        rollout_logp = padded([s.logprobs for s in mb], T, device)  # [B, T] the behaviour policy's
        tis = truncated = None
        if self.tis_cap > 0:  # [B, T] each: the stale behaviour policy -> the proximal one (old_logp)
            tis, truncated = tis_weights(old_logp, rollout_logp, self.tis_cap)
        # train.epsilon_high 0 means "the same as epsilon" (TRL's default, None there)
        loss, stats = policy_loss(logp, old_logp, adv, mask, cfg.epsilon, cfg.epsilon_high or cfg.epsilon,
                                  cfg.loss_type, self.max_completion_length, ref_logp, cfg.beta, tis_weight=tis)
        # From this micro-batch's normaliser to the whole batch's (see the module docstring).
        tokens = int(mask.sum().item())
        scale = tokens / total_tokens if cfg.loss_type in ("dapo", "bnpo") else len(mb) / total_seqs
        if not live:  # a rank's padding: joins the collectives, adds nothing (rl/sharding.py)
            (loss * 0.0).backward()
            return
        (loss * (scale * self.sharding.loss_factor) if self.sharding else loss * scale).backward()
        acc["loss"] += loss.item() * scale
        # Every iteration: token-weighted sums (stats are this micro-batch's means over its tokens).
        acc["tok"] += tokens
        acc["clip"] += stats["clipfrac"] * tokens
        acc["clip_low"] += stats["clipfrac_low"] * tokens
        acc["clip_high"] += stats["clipfrac_high"] * tokens
        acc["ratio"] += stats["ratio_mean"] * tokens
        acc["kl"] += stats.get("kl", 0.0) * tokens
        acc["ent"] += (ent * mask).sum().item()
        acc["ppo_kl"] += ((old_logp - logp.detach()) * mask).sum().item()
        if first:  # the rollout-vs-trainer gap, at the behaviour policy only (see `update`)
            acc["tok0"] += tokens
            diff = ((logp.detach() - rollout_logp).abs() * mask)
            acc["diff_max"] = max(acc["diff_max"], diff.max().item())
            acc["diff_sum"] += diff.sum().item()
            if tis is not None:
                acc["tis"] += (tis * mask).sum().item()
                acc["tis_truncated"] += (truncated * mask).sum().item()

    def _clip(self) -> float:
        """The full gradient's norm, and the gradient clipped to train.max_grad_norm (as `clip_grad_norm_`:
        scaled by max / (norm + 1e-6) when that is below 1). Each gradient's squares are summed in float64
        (with several ranks, over their shards too), so the norm does not depend on how the gradient is cut:
        torch's fp32 norm of one 28M-element tensor (smollm2's embedding) was 1.5e-3 off the exact one on
        random data, and FSDP's halves moved smollm2's grad norm by 1.8e-5 from one process's."""
        params = [p for p in self.model.parameters() if p.requires_grad and p.grad is not None]
        if not params:
            return 0.0
        squares = torch.stack([_local(p.grad).double().square().sum() for p in params]).sum()
        norm = math.sqrt(self.sharding.sum_squares(squares) if self.sharding else float(squares))
        coef = self.cfg.max_grad_norm / (norm + 1e-6)
        if self.cfg.max_grad_norm > 0 and coef < 1:
            with torch.no_grad():
                for p in params:
                    p.grad.mul_(coef)
        return norm

    def state_dict(self) -> dict:
        """Optimizer and schedule in one process's layout (with several ranks: the full state, on rank 0)."""
        optimizer = (self.sharding.optimizer_state(self.model, self.optimizer) if self.sharding
                     else self.optimizer.state_dict())
        return {"optimizer": optimizer, "scheduler": self.scheduler.state_dict()}

    def close(self) -> None:
        """Nothing to release (`RankGroup.close`, its multi-rank counterpart, stops its ranks)."""

    def load_state_dict(self, state: dict) -> None:
        """`state_dict`'s, saved at any world size."""
        if self.sharding:
            self.sharding.load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


def _local(grad: torch.Tensor) -> torch.Tensor:
    """This process's part of a gradient: an FSDP shard's local tensor (a DTensor's), else the gradient."""
    return grad.to_local() if hasattr(grad, "to_local") else grad
