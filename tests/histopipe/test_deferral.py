"""The tail's deferral rule (histopipe/deferral.py) on hand-made lengths, and the simulator's runs of steps that
defer (simulate_run(defer_tail=True)): what is deferred, where it finishes, what re-runs under max_staleness."""

import pytest

from rhymerl.histopipe.deferral import continues, defer_on_worker, tail_size, threshold
from rhymerl.histopipe.simulate import simulate_run


def flat(tokens, seqs=1):
    return 1.0  # every engine step costs 1 s: times are step counts


def test_tail_rule_shared_figures():
    assert tail_size(8) == 1 and tail_size(16) == 2 and tail_size(2) == 1
    assert threshold(100) == pytest.approx(120.0)
    assert continues(3, 4, 1) and not continues(2, 4, 1) and continues(2, 4, 2)


def test_the_long_member_is_deferred_once_its_group_is_in_its_tail():
    # one group of 4 (tail 1), threshold 12: the 40-token one passes 12 tokens at step 13, when its three
    # siblings (5, 6, 7) are done: deferred holding 13 tokens
    assert defer_on_worker([5, 6, 7, 40], [0] * 4, [12] * 4, [1] * 4, slots=4) == [None, None, None, 13]
    # past its threshold early, but its group's tail begins only at step 30, when the other three finish
    assert defer_on_worker([30, 30, 30, 40], [0] * 4, [12] * 4, [1] * 4, slots=4) == [None, None, None, 30]
    # never past its threshold: runs to its end
    assert defer_on_worker([5, 6, 7, 12], [0] * 4, [12] * 4, [1] * 4, slots=4) == [None] * 4
    # two in the tail (tail 2 of a group of 16 is not needed: tail 1 here) -> the group still has 2 unfinished
    assert defer_on_worker([5, 5, 40, 40], [0] * 4, [12] * 4, [1] * 4, slots=4) == [None] * 4
    # not deferrable (a continuation): runs to its end
    assert defer_on_worker([5, 6, 7, 40], [0] * 4, [12] * 4, [1] * 4, slots=4,
                           deferrable=[True, True, True, False]) == [None] * 4


def test_a_deferral_frees_its_slot_for_the_next_request():
    # 2 slots: group 0 = (3, 50), group 1 = (4, 4) queued; at step 3 the 3 finishes and group 1's first enters;
    # the 50 passes 10 tokens at step 11 with its group in its tail: deferred there, its slot refilled
    assert defer_on_worker([3, 50, 4, 4], [0, 0, 1, 1], [10] * 4, [1] * 4, slots=2) == [None, 11, None, None]


def test_a_deferred_request_continues_first_in_the_next_step_or_reruns():
    lengths = [[[5, 6, 7, 40], [5, 5, 5, 5]], [[5, 6, 7, 8], [5, 5, 5, 5]]]
    predicted = [[[10] * 4, [5] * 4], [[10] * 4, [5] * 4]]
    whole = simulate_run(lengths, 2, "static", mode="one_step_off", slots=4, cost_model=flat, predicted=predicted)
    assert whole.deferred == 0 and whole.rollouts[0] == (0.0, 40.0)
    for max_staleness, rerun in ((2, 0), (1, 1)):
        run = simulate_run(lengths, 2, "static", mode="one_step_off", slots=4, cost_model=flat, predicted=predicted,
                           defer_tail=True, max_staleness=max_staleness)
        assert run.deferred == 1 and run.rerun == rerun
        assert run.rollouts[0] == (0.0, 13.0)  # step 1 ends when the 40-token request is deferred at 13 tokens
        start = 13.0  # worker 0 starts step 2 as its share of step 1 ends (step 2 runs on version 0)
        # step 2 on worker 0: the carried request first; kept: 27 tokens left after its re-prefill (13 tokens at
        # a 4-slot step's cost per token, 3.25 s); re-run: all 40 from scratch
        left = 27 + 13 / 4 if rerun == 0 else 40
        assert run.timeline.finish[0][3] == pytest.approx(start + left)
        assert run.rerun_tokens == (13 if rerun else 0)
    # the last step never defers: nothing follows it
    last = simulate_run(lengths[:1], 2, "static", mode="one_step_off", slots=4, cost_model=flat,
                        predicted=predicted[:1], defer_tail=True, max_staleness=2)
    assert last.deferred == 0


def test_max_staleness_below_the_modes_own_is_refused():
    with pytest.raises(ValueError, match="max_staleness 0 is below one_step_off"):
        simulate_run([[[5, 5]]], 1, "static", mode="one_step_off", slots=2, cost_model=flat, predicted=[[5]],
                     max_staleness=0)
