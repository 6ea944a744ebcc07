"""The policy update against a reference: one big-batch loss computed the plain way (full logits from
`Decoder.forward`, `policy_loss` over the whole batch) must give the same gradient as the trainer's
micro-batched, row-selected, zero-advantage-skipping update."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from rhymerl.config import TrainSection
from rhymerl.engine.engine import Engine
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.rl.losses import entropy_from_logits, policy_loss
from rhymerl.rl.logprobs import ROWS_PER_CHUNK, Sample, TargetLogprobs, token_logprobs
from rhymerl.rl.trainer import PolicyTrainer, lr_multiplier
from helpers import FLAT, training_samples, worker_config
from tiny_models import random_prompts, tiny_decoder


def _reference_grads(model, samples, loss_type, temperature=0.7, beta=0.0, ref=None):
    """The textbook computation: right-padded [B, S] batch, all logits, gather, one policy_loss call."""
    model = copy.deepcopy(model)
    B = len(samples)
    S = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    T = max(len(s.completion_ids) for s in samples)
    ids = torch.zeros(B, S, dtype=torch.long)
    attn = torch.zeros(B, S, dtype=torch.long)
    logp_idx = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T)
    old = torch.zeros(B, T)
    for b, s in enumerate(samples):
        full = s.prompt_ids + s.completion_ids
        ids[b, : len(full)] = torch.tensor(full)
        attn[b, : len(full)] = 1
        k = len(s.completion_ids)
        logp_idx[b, :k] = torch.arange(len(s.prompt_ids) - 1, len(s.prompt_ids) - 1 + k)
        mask[b, :k] = 1
        old[b, :k] = torch.tensor(s.logprobs)

    def logps(m):
        logits = m(ids, attn).float() / temperature  # [B, S, V]
        lp_all = torch.log_softmax(logits, -1)
        picked = lp_all.gather(1, logp_idx[:, :, None].expand(B, T, lp_all.shape[-1]))  # [B, T, V]
        targets = torch.zeros(B, T, dtype=torch.long)
        for b, s in enumerate(samples):
            targets[b, : len(s.completion_ids)] = torch.tensor(s.completion_ids)
        return picked.gather(2, targets[:, :, None]).squeeze(2) * mask  # [B, T]

    ref_logp = logps(ref).detach() if ref is not None else None
    adv = torch.tensor([s.advantage for s in samples])
    loss, _ = policy_loss(logps(model), old, adv, mask, 0.2, 0.28, loss_type, 8, ref_logp, beta)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("loss_type,group,micro", [("grpo", 1, 2), ("dapo", 1, 2), ("dr_grpo", 1, 2),
                                                   ("dapo", 3, 4), ("grpo", 3, 3), ("dapo", 6, 4)])
def test_microbatched_update_equals_big_batch_reference(loss_type, group, micro):
    """Micro-batching, sibling rows sharing their prompt and skipped zero-advantage samples change nothing."""
    model = tiny_decoder().train()
    samples = training_samples(group=group)
    expected = _reference_grads(model, samples, loss_type)
    cfg = TrainSection(micro_batch_size=micro, loss_type=loss_type, dtype="fp32", max_grad_norm=0.0, learning_rate=1e-3,
                       recompute_logprobs=False)  # the reference uses the samples' (rollout) old log-probs
    trainer = PolicyTrainer(model, cfg, temperature=0.7, max_completion_length=8)
    seen = {}  # the accumulated gradient, captured right before the optimizer consumes it
    trainer.optimizer.register_step_pre_hook(
        lambda *_: seen.update({n: p.grad.clone() for n, p in model.named_parameters()}))
    metrics = trainer.update(samples)
    assert metrics["actor/skipped_seqs"] == 2 and metrics["actor/trained_seqs"] == 4
    for name, g in expected.items():
        torch.testing.assert_close(seen[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_kl_term_matches_reference_and_trains_every_sequence():
    model = tiny_decoder().train()
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    with torch.no_grad():  # make the policy differ from the reference so the KL term is non-zero
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    samples = training_samples(1)
    expected = _reference_grads(model, samples, "dapo", beta=0.1, ref=ref)
    cfg = TrainSection(micro_batch_size=4, loss_type="dapo", dtype="fp32", max_grad_norm=0.0, beta=0.1,
                       recompute_logprobs=False)
    trainer = PolicyTrainer(model, cfg, temperature=0.7, max_completion_length=8, ref_model=ref)
    seen = {}  # the accumulated gradient, captured right before the optimizer consumes it
    trainer.optimizer.register_step_pre_hook(
        lambda *_: seen.update({n: p.grad.clone() for n, p in model.named_parameters()}))
    m = trainer.update(samples)
    assert m["actor/skipped_seqs"] == 0 and m["actor/kl"] > 0
    for name, g in expected.items():
        torch.testing.assert_close(seen[name], g, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_target_logprobs_match_the_autograd_reference(dtype, temperature):
    """The chunked log-prob op gives the plain formula's values and gradients bit for bit (over several
    chunks and a ragged last one), and the entropy of the reference function."""
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(2 * ROWS_PER_CHUNK + 5, 300, generator=g) * 3).to(dtype)
    target = torch.randint(0, 300, (base.shape[0],), generator=g)
    weight = torch.randn(base.shape[0], generator=g)
    ref_in, ours_in = base.clone().requires_grad_(), base.clone().requires_grad_()
    x = ref_in.float() / temperature
    ref = x.gather(1, target[:, None]).squeeze(1) - torch.logsumexp(x, dim=-1)
    (ref * weight).sum().backward()
    ours, ent = TargetLogprobs.apply(ours_in, target, temperature, True)
    (ours * weight).sum().backward()
    assert torch.equal(ours, ref) and torch.equal(ours_in.grad, ref_in.grad)
    torch.testing.assert_close(ent, entropy_from_logits(x.detach()), atol=1e-4, rtol=1e-4)  # another formula


def test_rollout_logprobs_equal_trainer_logprobs_in_fp32():
    model = tiny_decoder()
    engine = Engine(model, num_slots=4, max_model_len=64)
    prompts = random_prompts(4, seed=3)
    outs = engine.generate(prompts, SamplingParams(temperature=0.8, max_tokens=10, seed=5))
    samples = [Sample(p, o.token_ids, o.logprobs, 1.0) for p, o in zip(prompts, outs)]
    logp, mask, ent = token_logprobs(model, samples, 0.8, None, with_entropy=True)
    for b, s in enumerate(samples):
        torch.testing.assert_close(logp[b, : len(s.logprobs)], torch.tensor(s.logprobs), atol=1e-4, rtol=0)
    assert mask.sum() == sum(len(s.completion_ids) for s in samples)
    assert (ent[mask.bool()] > 0).all()


def test_update_changes_weights_and_reports_metrics():
    model = tiny_decoder().train()
    before = copy.deepcopy(model.state_dict())
    cfg = TrainSection(micro_batch_size=3, dtype="fp32", learning_rate=1e-2, num_iterations=2, recompute_logprobs=False)
    trainer = PolicyTrainer(model, cfg, temperature=1.0, max_completion_length=8)
    m = trainer.update(training_samples(2))
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert m["actor/grad_norm"] > 0 and 0 <= m["actor/pg_clipfrac"] <= 1 and m["actor/lr"] == pytest.approx(1e-2)
    assert m["actor/logprob_diff_max"] > 0  # the synthetic old log-probs are not the model's


def test_all_zero_advantages_skip_the_update():
    model = tiny_decoder().train()
    before = copy.deepcopy(model.state_dict())
    trainer = PolicyTrainer(model, TrainSection(dtype="fp32"), temperature=1.0, max_completion_length=8)
    samples = [Sample(s.prompt_ids, s.completion_ids, s.logprobs, 0.0) for s in training_samples()]
    m = trainer.update(samples)
    assert m["actor/trained_seqs"] == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_samples_carry_their_temperature_and_the_trainer_refuses_another():
    """A sample records the temperature it was drawn at; greedy (0) samples' log-probs are at temperature 1."""
    model = tiny_decoder()
    trainer = PolicyTrainer(model, TrainSection(dtype="fp32"), temperature=1.0, max_completion_length=8)
    greedy = [dataclasses.replace(s, temperature=0.0) for s in training_samples()]
    trainer.update(greedy)  # greedy: log-probs at temperature 1, as this trainer takes them
    hot = [dataclasses.replace(s, temperature=0.7) for s in training_samples()]
    with pytest.raises(ValueError, match="temperature"):
        trainer.update(hot)


def test_lr_schedule():
    assert lr_multiplier(0, 2, 10, "constant") == pytest.approx(1 / 3)
    assert lr_multiplier(2, 2, 10, "constant") == 1.0
    assert lr_multiplier(2, 2, 10, "linear") == 1.0 and lr_multiplier(10, 2, 10, "linear") == 0.0
    assert lr_multiplier(6, 2, 10, "cosine") == pytest.approx(0.5)
    with pytest.raises(ValueError, match="lr_scheduler"):
        lr_multiplier(5, 0, 10, "exp")


def _lr_case(kind, iterations, warmup):
    """The LR of every optimizer step of a run of 4 rollout steps, and `actor/lr` after each rollout step."""
    model = tiny_decoder().train()
    cfg = TrainSection(dtype="fp32", learning_rate=1e-2, total_steps=4, num_iterations=iterations,
                       warmup_steps=warmup, lr_scheduler=kind, micro_batch_size=6)
    trainer = PolicyTrainer(model, cfg, temperature=1.0, max_completion_length=8)
    used = []  # the LR each optimizer step ran with
    trainer.optimizer.register_step_pre_hook(lambda opt, *_: used.append(opt.param_groups[0]["lr"]))
    after = [trainer.update(training_samples(step, n=3))["actor/lr"] for step in range(4)]
    return used, after


_COS = [0.5 * (1 + math.cos(math.pi * k / 8)) for k in range(9)]  # cosine over 8 optimizer steps


@pytest.mark.parametrize("kind,iterations,warmup,used,after", [
    # one optimizer step per rollout step: the schedule spans the 4 steps
    ("linear", 1, 0, [1.0, 0.75, 0.5, 0.25], [0.75, 0.5, 0.25, 0.0]),
    ("cosine", 1, 0, [_COS[0], _COS[2], _COS[4], _COS[6]], [_COS[2], _COS[4], _COS[6], _COS[8]]),
    # num_iterations=2: 8 optimizer steps, the LR moves at each of them (the old code reached 0 after step 2)
    ("linear", 2, 0, [1 - k / 8 for k in range(8)], [0.75, 0.5, 0.25, 0.0]),
    ("cosine", 2, 0, _COS[:8], [_COS[2], _COS[4], _COS[6], _COS[8]]),
    # warm-up counts optimizer steps (TRL's): 2 of them = the first rollout step, then decay over the other 6
    ("linear", 2, 2, [1 / 3, 2 / 3] + [1 - k / 6 for k in range(6)], [1.0, 4 / 6, 2 / 6, 0.0]),
])
def test_lr_schedule_advances_per_optimizer_step_over_total_steps_x_num_iterations(kind, iterations, warmup,
                                                                                    used, after):
    got_used, got_after = _lr_case(kind, iterations, warmup)
    assert got_used == pytest.approx([1e-2 * f for f in used], abs=1e-12)
    assert got_after == pytest.approx([1e-2 * f for f in after], abs=1e-12)


def _plain_logps(model, samples, temperature):
    """Log-probs, mask and entropy [B, T] the textbook way: right-padded batch, all logits, gather."""
    B, T = len(samples), max(len(s.completion_ids) for s in samples)
    S = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    ids, attn = torch.zeros(B, S, dtype=torch.long), torch.zeros(B, S, dtype=torch.long)
    logp, mask, ent = torch.zeros(B, T), torch.zeros(B, T), torch.zeros(B, T)
    with torch.no_grad():
        for b, s in enumerate(samples):
            full = s.prompt_ids + s.completion_ids
            ids[b, : len(full)], attn[b, : len(full)] = torch.tensor(full), 1
        logits = model(ids, attn).float() / temperature  # [B, S, V]
        for b, s in enumerate(samples):
            P, k = len(s.prompt_ids), len(s.completion_ids)
            rows = logits[b, P - 1 : P - 1 + k]  # [k, V]: position P-1+t predicts completion token t
            logp[b, :k] = torch.log_softmax(rows, -1).gather(1, torch.tensor(s.completion_ids)[:, None]).squeeze(1)
            ent[b, :k] = entropy_from_logits(rows[None])[0]
            mask[b, :k] = 1
    return logp, mask, ent


def test_metrics_average_over_every_iteration_and_every_completion_token():
    """num_iterations=2 with the trainer's own old log-probs: iteration 0 is on-policy (ratio 1, nothing
    clipped), iteration 1 clips. The metrics are means over both iterations and every completion token,
    recomputed here by a plain loop from the weights each optimizer step ran with."""
    eps, eps_high = 0.2, 0.28
    model = tiny_decoder().train()
    samples = training_samples(7, n=6, group=3)
    cfg = TrainSection(dtype="fp32", micro_batch_size=4, num_iterations=2, learning_rate=0.05, max_grad_norm=0.0,
                       epsilon=eps, epsilon_high=eps_high, loss_type="dapo")
    trainer = PolicyTrainer(model, cfg, temperature=1.0, max_completion_length=8)
    states = []  # the weights each optimizer step's gradient was taken at
    trainer.optimizer.register_step_pre_hook(lambda *_: states.append(copy.deepcopy(model.state_dict())))
    m = trainer.update(samples)
    assert len(states) == 2

    trained = [b for b, s in enumerate(samples) if s.advantage != 0.0]
    assert 0 < len(trained) < len(samples)  # some skipped: their tokens count for clipfrac, never clipped
    ref_model = tiny_decoder()
    per_it = []
    for state in states:
        ref_model.load_state_dict(state)
        per_it.append(_plain_logps(ref_model, samples, 1.0))
    old_logp, mask, _ = per_it[0]
    adv = torch.tensor([s.advantage for s in samples])[:, None].expand_as(mask)
    tmask = torch.zeros_like(mask)
    tmask[trained] = mask[trained]  # trained sequences' completion tokens
    clipped, low, high, ratio_sum, kl_sum, ent_sum = [], 0.0, 0.0, 0.0, 0.0, 0.0
    for logp, _, ent in per_it:  # a plain loop over iterations, then tokens
        r = torch.exp(logp - old_logp)
        lo = (r < 1 - eps) & (adv < 0) & mask.bool()
        hi = (r > 1 + eps_high) & (adv > 0) & mask.bool()
        # no ratio within 1e-3 of a threshold, so that rounding cannot flip a token between the two forwards
        assert ((r - (1 - eps)).abs()[mask.bool()] > 1e-3).all() and ((r - (1 + eps_high)).abs()[mask.bool()] > 1e-3).all()
        clipped.append(int((lo | hi).sum()))
        low, high = low + float(lo.sum()), high + float(hi.sum())
        ratio_sum += float((r * tmask).sum())
        kl_sum += float(((old_logp - logp) * tmask).sum())
        ent_sum += float((ent * tmask).sum())
    assert clipped[0] == 0 and clipped[1] > 0  # so iteration 0 alone (the old figure) would say 0
    all_pairs = 2 * mask.sum().item()  # every iteration x every completion token
    trained_pairs = 2 * tmask.sum().item()
    assert m["actor/pg_clipfrac"] == pytest.approx(sum(clipped) / all_pairs, abs=1e-7) and m["actor/pg_clipfrac"] > 0
    assert m["actor/pg_clipfrac_lower"] == pytest.approx(low / all_pairs, abs=1e-7)
    assert m["actor/pg_clipfrac_higher"] == pytest.approx(high / all_pairs, abs=1e-7)
    assert m["actor/ratio_mean"] == pytest.approx(ratio_sum / trained_pairs, rel=1e-5)
    assert m["actor/ppo_kl"] == pytest.approx(kl_sum / trained_pairs, abs=1e-5)
    assert m["actor/entropy"] == pytest.approx(ent_sum / trained_pairs, rel=1e-5)
    # the rollout-vs-trainer gap is the behaviour policy's (iteration 0), over the trained tokens once
    rollout = torch.zeros_like(mask)
    for b, s in enumerate(samples):
        rollout[b, : len(s.logprobs)] = torch.tensor(s.logprobs)
    diff = (old_logp - rollout).abs() * tmask
    assert m["actor/logprob_diff_mean"] == pytest.approx(float(diff.sum() / tmask.sum()), rel=1e-5)
    assert m["actor/logprob_diff_max"] == pytest.approx(float(diff.max()), rel=1e-5)


def test_bf16_autocast_update_runs():
    model = tiny_decoder().train()
    trainer = PolicyTrainer(model, TrainSection(dtype="bf16", micro_batch_size=4), temperature=1.0,
                            max_completion_length=8)
    m = trainer.update(training_samples(4))
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights stay fp32
    assert m["actor/grad_norm"] > 0


def test_sibling_rows_give_each_completion_its_own_logprobs():
    """A prompt with several completions in one row equals each completion run alone (fp32)."""
    model = tiny_decoder()
    samples = training_samples(5, n=4, group=4)
    together, mask, _ = token_logprobs(model, samples, 1.0, None)
    for b, s in enumerate(samples):
        alone, _, _ = token_logprobs(model, [s], 1.0, None)
        k = len(s.completion_ids)
        torch.testing.assert_close(together[b, :k], alone[0, :k], atol=1e-5, rtol=1e-5)
        assert mask[b].sum() == k


def test_trainer_old_logprobs_make_the_update_independent_of_rollout_rounding():
    """Default: old log-probs are the trainer's own, so rollout log-probs that differ in their last bits
    (a speculative rollout's verification forward rounds differently) change nothing in the update."""
    results = []
    for noise in (0.0, 1e-6):
        model = tiny_decoder().train()
        samples = [Sample(s.prompt_ids, s.completion_ids, [x + noise for x in s.logprobs], s.advantage)
                   for s in training_samples(3, group=3)]
        trainer = PolicyTrainer(model, TrainSection(dtype="fp32", micro_batch_size=4, num_iterations=2,
                                                    learning_rate=1e-2), temperature=1.0, max_completion_length=8)
        m = trainer.update(samples)
        assert m["actor/ratio_mean"] != 1.0  # iteration 1 is off-policy, and the metrics average over it too
        results.append((copy.deepcopy(model.state_dict()), {k: v for k, v in m.items() if "logprob_diff" not in k}))
    assert results[0][1] == results[1][1]  # every metric but the rollout-vs-trainer gap
    results = [r[0] for r in results]
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])


def test_config_choices_are_written_once_and_the_implementations_accept_each():
    """Each list of choices has one owner (the torch-free module implementing the option, or the config for
    the options torch modules implement), and what implements an option accepts every choice."""
    from rhymerl import config
    from rhymerl.histopipe import plan
    from rhymerl.histospec import budget, speculator
    from rhymerl.model import pretrained
    from rhymerl.rl import advantages, losses
    from rhymerl.rollout import RolloutGroup, RolloutWorker, ray_pool

    assert config.DRAFT_RULES is budget.DRAFT_RULES and config.SPECULATIVE_MODES is speculator.SPECULATIVE_MODES
    assert config.ADMISSION_ORDERS is plan.ADMISSION_ORDERS
    assert config.sections.ROLLOUT_SCHEDULES is plan.SCHEDULES is ray_pool.SCHEDULES
    assert config.LOSS_TYPES is losses.LOSS_TYPES and config.SCALE_REWARDS is advantages.SCALE_REWARDS
    for rule in config.DRAFT_RULES:
        budget.length_rule(rule, 8)  # raises for a rule HistoSpec does not know
    policy, groups = tiny_decoder(), [RolloutGroup(p, [f"p{i}"]) for i, p in enumerate(random_prompts(3, seed=2))]
    for mode in config.SPECULATIVE_MODES:  # the worker builds its engine for each mode
        engine = RolloutWorker(policy, None, worker_config(speculative=mode, max_draft_tokens=4),
                               cost_model=FLAT).engine
        assert (engine.cost_model is FLAT) == (mode == "histospec"), mode
    for order in config.ADMISSION_ORDERS:  # and orders a call's groups by each admission order
        w = RolloutWorker(policy, None, worker_config(speculative="off", admission_order=order))
        assert sorted(map(id, w.admission_order(groups, step=1))) == sorted(map(id, groups)), order
    for scale in config.SCALE_REWARDS:
        advantages.grpo_advantages(torch.tensor([1.0, 0.0]), 2, scale)
    x, mask = torch.zeros(1, 2), torch.ones(1, 2)
    for loss_type in config.LOSS_TYPES:
        losses.policy_loss(x, x, torch.ones(1), mask, loss_type=loss_type, max_completion_length=2)
    for name in config.DTYPES:
        pretrained.parse_dtype(name, "cpu")  # raises for a dtype the loader does not know
    for kind in config.LR_SCHEDULERS:
        lr_multiplier(3, 1, 10, kind)  # raises for a schedule the trainer does not know


@pytest.mark.parametrize("max_grad_norm", [0.0, 1e-3])
def test_grad_norm_is_the_float64_norm_and_clips_as_clip_grad_norm(max_grad_norm):
    """The reported norm is the exact (float64) norm of the whole gradient; clipping scales the gradient as
    torch's `clip_grad_norm_` does (by max / (norm + 1e-6) when below 1, else not at all)."""
    trainer = PolicyTrainer(tiny_decoder(), TrainSection(dtype="fp32", max_grad_norm=max_grad_norm), 1.0, 8)
    g = torch.Generator().manual_seed(0)
    for p in trainer.model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    grads = [p.grad.clone() for p in trainer.model.parameters()]
    exact = math.sqrt(sum(float(x.double().square().sum()) for x in grads))
    expected = copy.deepcopy(grads)
    if max_grad_norm:
        expected = [x * (max_grad_norm / (exact + 1e-6)) for x in grads]
    assert trainer._clip() == pytest.approx(exact, rel=1e-12)
    for p, want in zip(trainer.model.parameters(), expected):
        assert torch.allclose(p.grad, want, rtol=1e-6, atol=0)
    assert max_grad_norm == 0 or torch.cat([p.grad.flatten() for p in trainer.model.parameters()]).norm() < 1.01e-3
