"""The rhyming workload (`histopipe.workload`): its statistics are the published ones it is calibrated to
(median, p99 / median, the cut, rank shifts between epochs, drift), and it is a function of its seed."""

import math
from statistics import mean

import pytest

from rhymerl.histopipe.predict import moved_far_share, quantile
from rhymerl.histopipe.workload import Rhyming

PROMPTS = 3000  # per step: enough for the 99th percentile and a 3% share to be measured within a few points


def flat(groups):
    return [n for _, ls in groups for n in ls]


def test_lengths_have_the_calibrated_median_p99_and_cut():
    params = Rhyming()
    lengths = flat(params.workload(PROMPTS, seed=0).step(0))  # step 0: no drift yet
    assert len(lengths) == PROMPTS * 8
    assert quantile(lengths, 0.5) == pytest.approx(1500, rel=0.08)
    assert quantile(lengths, 0.99) / quantile(lengths, 0.5) == pytest.approx(10, rel=0.2)
    assert max(lengths) <= 16384 and min(lengths) >= 1
    at_cap = sum(n == 16384 for n in lengths) / len(lengths)
    assert 0.002 < at_cap < 0.03  # a few responses are cut: a lognormal past 16,384 with p99 at ~15,000
    # the spread splits into the prompts' levels and the spread inside a group
    assert params.between_sigma() ** 2 + params.group_spread ** 2 == pytest.approx(params.total_sigma() ** 2)


def test_three_percent_of_prompts_move_far_between_adjacent_epochs():
    params = Rhyming(epoch_steps=1)  # one step per epoch: step t is epoch t, every prompt in it
    workload = params.workload(PROMPTS, seed=1)
    shares = []
    for epoch in (1, 2, 3):
        before = dict(workload.step(epoch - 1))
        after = dict(workload.step(epoch))
        keys = sorted(before)
        shares.append(moved_far_share([mean(before[k]) for k in keys], [mean(after[k]) for k in keys]))
    # 3% shift their level more than 30% of the ranking; group noise moves a few more, rarely that far
    assert 0.02 < mean(shares) < 0.05, shares
    levels = [(workload.level(p, 0), workload.level(p, 1)) for p in range(PROMPTS)]
    assert sum(a != b for a, b in levels) / PROMPTS == pytest.approx(0.03, abs=0.01)


def test_the_mean_length_drifts_up_thirty_percent_over_a_hundred_steps():
    params = Rhyming(epoch_steps=1, shift_share=0.0)  # steps 0 and 100: the same prompts at the same levels
    workload = params.workload(1000, seed=2)  # the same prompts: only the drift and the group noise differ
    first = {k: ls for k, ls in workload.step(0)}
    later = {k: ls for k, ls in workload.step(100)}
    assert set(first) == set(later)
    # the cut keeps the growth just under 30%; the group noise is drawn anew each epoch
    assert mean(flat(later.items())) / mean(flat(first.items())) == pytest.approx(1.3, abs=0.04)


def test_a_step_is_a_function_of_the_seed_alone():
    params = Rhyming()
    a = params.workload(200, seed=5)
    b = params.workload(200, seed=5)
    b.step(9)  # other steps first: the draws are keyed, not sequential
    assert a.step(13) == b.step(13)
    assert a.step(13) != params.workload(200, seed=6).step(13)
    assert [k for k, _ in a.step(0)] != [k for k, _ in a.step(4)]  # each epoch its own order
    assert sorted(k for t in range(4) for k, _ in a.step(t)) == sorted(f"r{p}" for p in range(800))


def test_waves_size_the_step_and_bad_parameters_name_themselves():
    assert Rhyming().prompts_per_step(64, 32) == 4 * 64 * 32 // 8
    assert Rhyming(waves=5, num_generations=16).prompts_per_step(3, 7) == math.ceil(5 * 3 * 7 / 16)
    assert Rhyming().first_step() == 16
    with pytest.raises(ValueError, match="median"):
        Rhyming(median=0)
    with pytest.raises(ValueError, match="group_spread"):
        Rhyming(group_spread=2.0)
    with pytest.raises(ValueError, match="shift_share"):
        Rhyming(shift_share=1.5)
