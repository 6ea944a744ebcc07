"""Group-relative advantages (GRPO), in TRL's vocabulary.

Rewards come as one flat vector grouped consecutively: prompt i owns rows i*G .. i*G+G-1, G = num_generations.
The advantage of a completion is its reward minus the mean reward of its group, optionally divided by a std:

    A_ij = (r_ij - mean_j r_ij) / (std + eps)

with std the group's std (scale_rewards="group", GRPO), the whole batch's std ("batch"), or no division at all
("none", Dr. GRPO). Stds are unbiased (Bessel-corrected, torch.std's default), as in TRL's GRPOTrainer.
"""

from __future__ import annotations

import torch

from rhymerl.config.sections import SCALE_REWARDS  # train.scale_rewards' choices, owned by the config


def grpo_advantages(
    rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group", eps: float = 1e-4
) -> tuple[torch.Tensor, dict]:
    """Advantages [N] for rewards [N], N = num_prompts * num_generations, grouped consecutively.

    advantage = reward - group mean, divided by (std + eps) where std is the unbiased (torch.std default, as TRL)
    std of the group ("group"), of the whole batch ("batch"), or not divided ("none"). Groups whose rewards are
    all equal (zero std, up to torch.isclose) carry no learning signal: their advantages are exactly 0 and they
    are counted in stats = {"zero_std_groups": int, "zero_std_frac": float} (whatever scale_rewards is).
    Raises ValueError for a non-1-D rewards, num_generations < 2, N not a multiple of num_generations, or an
    unknown scale_rewards.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"unknown scale_rewards {scale_rewards!r}; expected one of {SCALE_REWARDS}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if num_generations < 2:
        raise ValueError(f"num_generations must be >= 2 for a group-relative baseline, got {num_generations}")
    n = rewards.numel()
    if n == 0 or n % num_generations != 0:
        raise ValueError(f"number of rewards ({n}) is not a positive multiple of num_generations ({num_generations})")

    G = num_generations
    grouped = rewards.view(-1, G)  # [P, G], P = number of prompts
    mean = grouped.mean(dim=1, keepdim=True)  # [P, 1]
    group_std = grouped.std(dim=1, keepdim=True)  # [P, 1], unbiased
    zero = torch.isclose(group_std, torch.zeros_like(group_std))  # [P, 1] all rewards equal
    adv = grouped - mean  # [P, G]
    if scale_rewards == "group":
        std = torch.where(zero, torch.ones_like(group_std), group_std)  # [P, 1] (zero groups are zeroed below)
        adv = adv / (std + eps)
    elif scale_rewards == "batch":
        adv = adv / (rewards.std() + eps)  # scalar std over all N rewards, unbiased
    adv = torch.where(zero, torch.zeros_like(adv), adv)  # [P, G]

    zero_groups = int(zero.sum().item())
    stats = {"zero_std_groups": zero_groups, "zero_std_frac": zero_groups / grouped.shape[0]}
    return adv.reshape(-1), stats  # [N]
