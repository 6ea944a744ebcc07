"""DAPO's dynamic sampling (verl's `algorithm.filter_groups`; TRL has none): a group whose completions all got
the same reward has zero advantage, so it adds nothing to the gradient and only shrinks the batch's effective
size. With `train.filter_groups` such groups are dropped and more prompts are rolled out until the step holds
`train.prompts_per_step` groups, at most `train.max_num_gen_batches` rollouts per step.

`keep_groups` is the rule (pure); `GroupFilter` collects the kept groups of one step's successive rollouts.
"All equal" is decided exactly as `rhymerl.rl.advantages.grpo_advantages` zeroes a group (its unbiased std
close to 0 by torch.isclose), so every kept group has non-zero advantages and every dropped one had none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch


def keep_groups(rewards: Sequence[float] | torch.Tensor, group_size: int) -> list[int]:
    """Indexes of the groups whose rewards are not all equal, in order. rewards [P*G] are grouped
    consecutively (group i owns rows i*G .. i*G+G-1, G = group_size). Raises ValueError for G < 2 or a length
    that is not a multiple of G."""
    r = torch.as_tensor(rewards, dtype=torch.float32).flatten()  # float32: the loop's rewards tensor's dtype
    if group_size < 2 or r.numel() % group_size:
        raise ValueError(f"{r.numel()} rewards in groups of {group_size}: need group_size >= 2 and a multiple "
                         f"of it")
    if r.numel() == 0:
        return []
    std = r.view(-1, group_size).std(dim=1)  # [P], unbiased, as grpo_advantages
    return torch.nonzero(~torch.isclose(std, torch.zeros_like(std))).flatten().tolist()


@dataclass
class GroupFilter:
    """The groups one step trains on, collected over its rollouts ("generation batches" in verl).

    `add(groups, rewards)` takes one rollout's groups (anything: the loop's per-group records) and their
    rewards [P*G], and keeps those `keep_groups` keeps, up to `target` in all, first come first kept (verl
    truncates the same way). `wants_more()` says whether to roll out another batch of prompts: not yet
    `target` groups and fewer than `max_batches` rollouts (0 = no limit). Past the limit the step trains on
    what it has (verl raises instead; here a hard step trains on fewer groups, or none, rather than stopping).
    """

    target: int
    group_size: int
    max_batches: int = 0
    kept: list[Any] = field(default_factory=list)
    batches: int = 0  # rollouts added
    seen: int = 0  # groups added

    def add(self, groups: Sequence[Any], rewards: Sequence[float] | torch.Tensor) -> list[int]:
        """Keep this rollout's groups with unequal rewards (up to the target); returns their indexes in
        `groups`. Raises ValueError when rewards do not hold group_size per group."""
        if len(rewards) != len(groups) * self.group_size:
            raise ValueError(f"{len(rewards)} rewards for {len(groups)} groups of {self.group_size}")
        taken = keep_groups(rewards, self.group_size)[: max(self.target - len(self.kept), 0)]
        self.kept += [groups[i] for i in taken]
        self.batches += 1
        self.seen += len(groups)
        return taken

    def wants_more(self) -> bool:
        return len(self.kept) < self.target and (self.max_batches == 0 or self.batches < self.max_batches)

    def metrics(self) -> dict[str, float]:
        """train/num_gen_batches (verl's name): rollouts this step took; train/kept_groups, and
        train/filtered_groups_frac: the share of rolled-out groups dropped for equal rewards (or past the
        target)."""
        return {"train/num_gen_batches": self.batches, "train/kept_groups": len(self.kept),
                "train/filtered_groups_frac": 1.0 - len(self.kept) / max(self.seen, 1)}
