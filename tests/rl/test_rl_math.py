"""Hand-computed checks of the RL maths: GRPO advantages, the clipped policy loss per loss_type, KL, entropy."""

from __future__ import annotations

import math

import pytest
import torch

from rhymerl.rl.advantages import grpo_advantages
from rhymerl.rl.losses import entropy_from_logits, kl_k3, masked_mean, policy_loss

D = torch.float64


def t(x):
    return torch.tensor(x, dtype=D)


def close(a, b, tol=1e-9):
    assert torch.allclose(torch.as_tensor(a, dtype=D), torch.as_tensor(b, dtype=D), atol=tol, rtol=0), (a, b)


# ---------------------------------------------------------------- advantages


def test_advantages_group_scaling_by_hand():
    # groups [1, 0] and [1, 1]; group 0: mean 0.5, unbiased std sqrt((0.25 + 0.25) / 1) = sqrt(0.5)
    adv, stats = grpo_advantages(t([1.0, 0.0, 1.0, 1.0]), num_generations=2)
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    close(adv, [a, -a, 0.0, 0.0])
    assert stats == {"zero_std_groups": 1, "zero_std_frac": 0.5}
    adv, _ = grpo_advantages(t([1.0, 0.0, 1.0, 1.0]), num_generations=2, eps=0.0)
    close(adv, [math.sqrt(0.5), -math.sqrt(0.5), 0.0, 0.0])


def test_advantages_batch_and_none_by_hand():
    r = t([1.0, 0.0, 1.0, 1.0])
    # batch: mean 0.75, squared deviations 0.0625 + 0.5625 + 0.0625 + 0.0625 = 0.75, / (4 - 1) = 0.25 -> std 0.5
    adv, stats = grpo_advantages(r, 2, scale_rewards="batch")
    close(adv, [0.5 / 0.5001, -0.5 / 0.5001, 0.0, 0.0])
    assert stats["zero_std_groups"] == 1
    adv, _ = grpo_advantages(r, 2, scale_rewards="none")
    close(adv, [0.5, -0.5, 0.0, 0.0])


def test_advantages_group_of_three_and_zero_std_count():
    # group [0, 1, 2]: mean 1, unbiased std 1 -> [-1, 0, 1]; groups [3, 3, 3] and [0.1, 0.1, 0.1] are flat
    r = t([0.0, 1.0, 2.0, 3.0, 3.0, 3.0, 0.1, 0.1, 0.1])
    adv, stats = grpo_advantages(r, 3, eps=0.0)
    close(adv, [-1.0, 0.0, 1.0, 0, 0, 0, 0, 0, 0])
    assert stats["zero_std_groups"] == 2
    assert stats["zero_std_frac"] == pytest.approx(2 / 3)
    assert adv[3:].eq(0).all()  # exactly zero, not merely small


def test_advantages_invalid_arguments():
    with pytest.raises(ValueError, match="multiple of num_generations"):
        grpo_advantages(t([1.0, 0.0, 1.0]), 2)
    with pytest.raises(ValueError, match="scale_rewards"):
        grpo_advantages(t([1.0, 0.0]), 2, scale_rewards="std")
    with pytest.raises(ValueError, match="num_generations"):
        grpo_advantages(t([1.0, 0.0]), 1)
    with pytest.raises(ValueError, match="1-D"):
        grpo_advantages(t([[1.0, 0.0]]), 2)


# ---------------------------------------------------------------- policy loss


def _example():
    # B=2, T=3, old_logp = 0 so ratio = exp(logp) = r; the last token of row 1 is padding (ratio 5 is ignored)
    r = t([[1.0, 1.1, 0.9], [1.0, 1.1, 5.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    return r.log(), torch.zeros_like(r), t([1.0, -1.0]), mask


def test_loss_types_by_hand():
    logp, old, adv, mask = _example()
    # per-token -r*A (no clipping at epsilon 0.2): row 0 [-1, -1.1, -0.9] (sum -3), row 1 [1, 1.1] (sum 2.1)
    loss, stats = policy_loss(logp, old, adv, mask, loss_type="grpo")
    close(loss, (-3.0 / 3 + 2.1 / 2) / 2)  # 0.025
    loss, _ = policy_loss(logp, old, adv, mask, loss_type="dapo")
    close(loss, (-3.0 + 2.1) / 5)  # -0.18
    loss, _ = policy_loss(logp, old, adv, mask, loss_type="bnpo")
    close(loss, -0.18)
    loss, _ = policy_loss(logp, old, adv, mask, loss_type="dr_grpo", max_completion_length=4)
    close(loss, (-3.0 + 2.1) / (2 * 4))  # -0.1125
    assert stats["clipfrac"] == 0.0
    assert stats["ratio_mean"] == pytest.approx((1 + 1.1 + 0.9 + 1 + 1.1) / 5)


def test_clip_higher_asymmetry_positive_advantage():
    logp, old = t([[1.25, 1.3, 0.7]]).log(), torch.zeros(1, 3, dtype=D)
    adv, mask = t([1.0]), torch.ones(1, 3, dtype=D)
    # eps_high 0.28: 1.25 kept, 1.3 clipped to 1.28; 0.7 < 0.8 but with A > 0 min picks 0.7 (not a clip)
    loss, stats = policy_loss(logp, old, adv, mask, epsilon=0.2, epsilon_high=0.28)
    close(loss, -(1.25 + 1.28 + 0.7) / 3)
    assert stats["clipfrac"] == pytest.approx(1 / 3) and stats["clipfrac_high"] == pytest.approx(1 / 3)
    assert stats["clipfrac_low"] == 0.0
    # symmetric epsilon 0.2: both 1.25 and 1.3 clip to 1.2
    loss, stats = policy_loss(logp, old, adv, mask, epsilon=0.2)
    close(loss, -(1.2 + 1.2 + 0.7) / 3)
    assert stats["clipfrac"] == pytest.approx(2 / 3)


def test_clip_negative_advantage():
    logp, old = t([[0.7, 1.3]]).log(), torch.zeros(1, 2, dtype=D)
    # A=-1: 0.7 -> -min(-0.7, -0.8) = 0.8 (clipped); 1.3 -> -min(-1.3, -1.2) = 1.3 (not clipped)
    loss, stats = policy_loss(logp, old, t([-1.0]), torch.ones(1, 2, dtype=D), epsilon=0.2, epsilon_high=0.28)
    close(loss, (0.8 + 1.3) / 2)
    assert stats["clipfrac"] == 0.5 and stats["clipfrac_low"] == 0.5


def test_gradient_sign_and_clipped_tokens_get_none():
    old = torch.zeros(2, 2, dtype=D)
    logp = t([[1.0, 1.5], [1.0, 0.5]]).log().requires_grad_()
    loss, _ = policy_loss(logp, old, t([1.0, -1.0]), torch.ones(2, 2, dtype=D), loss_type="dapo")
    loss.backward()
    g = logp.grad
    assert g[0, 0] < 0  # A > 0: descending the loss raises logp
    assert g[1, 0] > 0  # A < 0: lowers it
    close(g[0, 0], -1.0 / 4)  # d(-r*A/4)/dlogp = -r*A/4 at r=1
    assert g[0, 1] == 0 and g[1, 1] == 0  # ratio 1.5 with A>0 and 0.5 with A<0 are clipped: no gradient


def test_kl_term_with_beta():
    logp = t([[0.5, 0.5]]).log()
    ref = t([[0.25, 0.5]]).log()
    # k3 at token 0: d = log 0.25 - log 0.5 = -log 2 -> 0.5 + log 2 - 1; token 1: 0
    k = 0.5 + math.log(2) - 1
    close(kl_k3(logp, ref), [[k, 0.0]])
    # A = 0, ratio 1: the loss is only beta * KL, aggregated like the policy term
    loss, stats = policy_loss(logp, logp.clone(), t([0.0]), torch.ones(1, 2, dtype=D), ref_logp=ref, beta=0.1)
    close(loss, 0.1 * k / 2)
    assert stats["kl"] == pytest.approx(k / 2)


def test_kl_k3_zero_iff_equal():
    x = torch.randn(3, 4, dtype=D)
    close(kl_k3(x, x), torch.zeros(3, 4))
    assert (kl_k3(x, x + torch.rand(3, 4, dtype=D) + 0.1) > 0).all()
    assert (kl_k3(x, x - torch.rand(3, 4, dtype=D) - 0.1) > 0).all()


def test_policy_loss_invalid_arguments():
    logp, old, adv, mask = _example()
    with pytest.raises(ValueError, match="'ppo'"):
        policy_loss(logp, old, adv, mask, loss_type="ppo")
    with pytest.raises(ValueError, match="max_completion_length"):
        policy_loss(logp, old, adv, mask, loss_type="dr_grpo")
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, old, adv, mask, beta=0.1)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logp, old, t([1.0]), mask)
    with pytest.raises(ValueError, match="shape"):
        policy_loss(logp, old[:, :2], adv, mask)


# ---------------------------------------------------------------- helpers


def test_masked_mean():
    x, m = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), t([[1, 1, 0], [0, 0, 0]])
    close(masked_mean(x, m), 1.5)
    close(masked_mean(x, m, dim=-1), [1.5, 0.0])  # an empty row gives 0, not NaN


def test_entropy_from_logits():
    close(entropy_from_logits(torch.zeros(2, 3, 7)), torch.full((2, 3), math.log(7)), tol=1e-6)
    close(entropy_from_logits(torch.tensor([[[0.0, 0.0, 0.0, 0.0]]]) + 5), [[math.log(4)]], tol=1e-6)
    logits = torch.tensor([[[0.0, float("-inf")], [0.0, 0.0]]], requires_grad=True)
    h = entropy_from_logits(logits)  # [1, 2]
    close(h.detach(), [[0.0, math.log(2)]], tol=1e-6)
    h.sum().backward()
    assert torch.isfinite(logits.grad).all()
