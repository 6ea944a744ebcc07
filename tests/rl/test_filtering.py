"""DAPO's dynamic sampling: which groups are kept, and collecting them over a step's rollouts."""

import pytest
import torch

from rhymerl.rl.advantages import grpo_advantages
from rhymerl.rl.filtering import GroupFilter, keep_groups


def test_groups_with_equal_rewards_are_dropped():
    rewards = [1, 1, 1,  0, 1, 0,  0, 0, 0,  0.2, 0.2, 0.7]  # G = 3: groups 1 and 3 differ
    assert keep_groups(rewards, 3) == [1, 3]
    assert keep_groups(torch.tensor(rewards), 3) == [1, 3]
    assert keep_groups([0.5] * 4, 2) == [] and keep_groups([], 2) == []


def test_kept_exactly_where_advantages_are_not_zero():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 2, (40 * 4,), generator=g).float()  # many all-0 / all-1 groups of 4
    rewards[:4] = torch.tensor([0.3, 0.3 + 1e-9, 0.3, 0.3])  # equal up to float32: dropped, zero advantage
    adv, stats = grpo_advantages(rewards, 4)
    nonzero = [i for i in range(40) if adv.view(40, 4)[i].abs().sum() > 0]
    assert keep_groups(rewards, 4) == nonzero
    assert 40 - len(nonzero) == stats["zero_std_groups"] > 0


def test_bad_shapes_name_the_rule():
    with pytest.raises(ValueError, match="groups of 3"):
        keep_groups([1, 2, 3, 4], 3)
    with pytest.raises(ValueError, match="group_size >= 2"):
        keep_groups([1, 2], 1)


def test_the_filter_draws_until_the_batch_is_full():
    f = GroupFilter(target=3, group_size=2, max_batches=10)
    assert f.wants_more()
    assert f.add(["a", "b", "c"], [1, 1, 0, 1, 0, 0]) == [1]  # only b differs
    assert f.wants_more() and f.kept == ["b"]
    assert f.add(["d", "e", "f"], [0, 1, 1, 0, 1, 0]) == [0, 1]  # d, e kept; f is past the target
    assert not f.wants_more() and f.kept == ["b", "d", "e"]
    assert f.metrics() == {"train/num_gen_batches": 2, "train/kept_groups": 3, "train/filtered_groups_frac": 0.5}


def test_the_filter_stops_at_max_num_gen_batches():
    f = GroupFilter(target=2, group_size=2, max_batches=2)
    f.add(["a", "b"], [1, 1, 0, 0])
    assert f.wants_more()
    f.add(["c", "d"], [1, 1, 0, 1])
    assert not f.wants_more() and f.kept == ["d"]  # the step trains on what it has
    unlimited = GroupFilter(target=1, group_size=2, max_batches=0)
    for _ in range(50):
        unlimited.add(["x"], [1, 1])
    assert unlimited.wants_more()
    with pytest.raises(ValueError, match="3 rewards for 1 groups of 2"):
        unlimited.add(["x"], [1, 1, 1])
