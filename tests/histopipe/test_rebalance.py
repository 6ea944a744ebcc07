"""Migration by predicted remaining work (`histopipe.rebalance`, rule "remaining"): the price of a request's
remaining decode, the donor order, the moves that pay, and the rule in the fleet simulation, where it picks
the donor by work where half_busiest picks it by count."""

import pytest

from rhymerl.histopipe.batching import ContextCost
from rhymerl.histopipe.fleet import POOL_MIGRATIONS, simulate_fleet
from rhymerl.histopipe.metrics import makespan
from rhymerl.histopipe.predict import LengthPredictor
from rhymerl.histopipe.early_warning import evidence, probe_order, renewed_first, renewed_length
from rhymerl.histopipe import rebalance
from rhymerl.histopipe.rebalance import Batch, attention_work, batches, donors, moves, pool_moves, remaining_work


def test_remaining_work_prices_tokens_and_the_keys_still_to_attend():
    # 10 tokens left at 0.5 s each, and keys 11 + 12 + ... + 20 = 155 at 0.1 s
    assert remaining_work(10, 20, 0.5, 0.1) == pytest.approx(5.0 + 15.5)
    assert remaining_work(0, 4, 1.0) == pytest.approx(4.0)
    # a request past its predicted length has at least one token left (it has not ended)
    assert remaining_work(30, 20, 0.5, 0.1) == pytest.approx(0.5 + 0.1 * 31)


def test_donors_latest_predicted_end_first_and_only_those_ending_after_the_receiver():
    assert donors([5.0, None, 9.0, 7.0], receiver=0) == [2, 3]
    assert donors([None, None, 9.0, 7.0, 9.0], receiver=0, now=8.0) == [2, 4]  # ties: lower index
    assert donors([3.0, 2.0], receiver=0) == []
    assert donors([None, None], receiver=0) == []


def test_moves_take_the_largest_while_the_later_of_the_two_shortens():
    # 3 + 3 balance 12 into 6 / 6; a third would make the receiver the later one
    assert moves([3.0, 3.0, 3.0, 3.0], [0.0] * 4) == [0, 1]
    # the long request goes (14 -> max(4, 10.5)); then no short one helps any more
    assert moves([1.0, 10.0, 1.0, 1.0, 1.0], [0.5] * 5) == [1]
    # a lone request gains nothing by moving (its re-prefill makes it worse)
    assert moves([5.0], [0.5]) == [] and moves([5.0], [0.0]) == []
    # a re-prefill dearer than the gain keeps a request where it is
    assert moves([4.0, 4.0], [5.0, 5.0]) == []
    # a busy receiver takes less
    assert moves([3.0, 3.0, 3.0, 3.0], [0.0] * 4, receiver_left=4.0) == [0]
    with pytest.raises(ValueError, match="re-prefill"):
        moves([1.0], [])


def test_a_batch_pays_its_steps_at_the_size_it_runs_and_each_request_its_own_attention():
    steps = [0.0, 1.0, 1.5, 2.0]  # a step of n sequences: 0.5 + 0.5 n seconds, on 3 slots
    batch = Batch(lefts=[10, 4, 6, 2], attention=[1.0, 2.0, 3.0, 4.0], prefills=[0.5] * 4, step_cost=steps,
                  slots=3, load=7.0, own=3.0)
    assert batch.time([]) == 3.0
    assert batch.time([0]) == pytest.approx(3.0 + 7.0 + 0.5 + 1.0 + 10 * 1.0)  # alone: a whole step per token
    # 4, 6, 10 together: 4 steps of three, 2 of two, 4 of one
    assert batch.time([0, 1, 2]) == pytest.approx(3 + 7 + 1.5 + 6 + 4 * 2.0 + 2 * 1.5 + 4 * 1.0)
    # past its slots, the fourth waits for one (`batching.worker_time`): 10, 4, 6 run 4 steps, then 10, 6, 2
    # run 2 more, then the 10 alone 4
    assert batch.time([0, 1, 2, 3]) == pytest.approx(3 + 7 + 2 + 10 + 4 * 2.0 + 2 * 2.0 + 4 * 1.0)
    assert attention_work(10, 20, 0.1) == pytest.approx(15.5)  # keys 11 .. 20


def test_moves_priced_as_batches_save_nothing_on_a_flat_step_and_pay_the_receivers_load():
    flat = [0.0, 1.0, 1.0, 1.0, 1.0]  # a step costs 1 s whatever its batch
    works = [remaining_work(0, 100, flat[2] / 2)] * 2
    kept, taken = batches([0, 0], [100, 100], [0.0, 0.0], [0.0, 0.0], flat, 4)
    # the donor's share step_cost[2] / 2 priced them 50 s each, as if the donor saved 50 s by giving one
    assert works == [50.0, 50.0] and moves(works, [0.0, 0.0]) == [0]
    # run as batches: the donor still takes 100 steps with the other, so giving one pays nothing
    assert kept.time([0, 1]) == kept.time([0]) == 100.0 and moves(works, [0.0, 0.0], donor=kept, receiver=taken) == []
    growing = [0.0, 1.0, 1.5, 2.0, 2.5]  # 0.5 + 0.5 n: the donor's 150 s become 100 + 100 s
    works = [remaining_work(0, 100, growing[2] / 2)] * 2
    kept, taken = batches([0, 0], [100, 100], [0.0, 0.0], [0.0, 0.0], growing, 4)
    assert moves(works, [0.0, 0.0], donor=kept, receiver=taken) == [0]
    assert moves(works, [0.0, 0.0], donor=kept, receiver=Batch(**{**taken.__dict__, "load": 49.0})) == [0]
    assert moves(works, [0.0, 0.0], donor=kept, receiver=Batch(**{**taken.__dict__, "load": 50.0})) == []
    with pytest.raises(ValueError, match="both sides"):
        moves(works, [0.0, 0.0], donor=kept)


class _Request:
    def __init__(self, held: int):
        self.prompt_ids, self.output_ids = [1], [0] * held


class _Known:
    def predict_past(self, prompt, done):
        return 100.0


def test_the_pool_prices_on_the_cost_model_with_the_receivers_load():
    """`pool_moves` (the rollout worker's rule) on two waiting requests predicted 100 tokens: on a flat step
    nothing moves, on 0.5 + 0.5 n one does (each side then runs 100 s against 150), unless the receiver's load
    (60 s) makes it 160."""
    waiting = [_Request(0), _Request(0)]
    flat, growing = (lambda tokens, seqs=1: 1.0), (lambda tokens, seqs=1: 0.5 + 0.5 * seqs)
    assert pool_moves([], waiting, _Known(), flat, 4) == []
    assert pool_moves([], waiting, _Known(), growing, 4) == [waiting[0]]
    assert pool_moves([], waiting, _Known(), growing, 4, load=49.0) == [waiting[0]]
    assert pool_moves([], waiting, _Known(), growing, 4, load=60.0) == []
    with pytest.raises(ValueError, match="renewed lengths"):
        pool_moves([], waiting, _Known(), growing, 4, renewed=[1.0])


def test_a_waiting_continuation_owes_its_re_prefill_on_either_side(monkeypatch):
    """A waiting request holding 40 tokens (adopted, not admitted yet) re-prefills them wherever it runs, so
    moving it saves the donor that re-prefill as well (`Batch.prefills` of the donor, as the simulator's queued
    moved-in request owes it); a running one re-prefills only on the receiver."""
    running, waiting = [_Request(40)], [_Request(40)]
    growing = lambda tokens, seqs=1: 0.5 + 0.5 * seqs  # noqa: E731
    calls = []
    real = rebalance.moves

    def recorded(works, prefills, donor=None, receiver=None):
        calls.append((donor, receiver))
        return real(works, prefills, donor=donor, receiver=receiver)
    monkeypatch.setattr(rebalance, "moves", recorded)
    pool_moves(running, waiting, _Known(), growing, 4)
    donor, receiver = calls[0]
    assert receiver.prefills == [40 * 2.5 / 4] * 2  # each token at a full batch's share of a step
    assert donor.prefills == [0.0, 40 * 2.5 / 4]  # the running one paid its own already


def test_the_sync_rule_leaves_a_flat_batch_alone():
    """Two 100-token requests on worker 0, one of 1 on worker 1, a step costing 1 s whatever its batch: worker
    1 runs dry at 1 s; taking one request would save worker 0 nothing (priced at the donor's share, it moved
    one, and the re-prefill made the step end at 100.25 s)."""
    unit = lambda tokens, seqs=1: 1.0  # noqa: E731
    lengths = [[100, 100], [1]]
    timeline, moved = simulate_fleet(lengths, [[(0, (0, 1))], [(1, (0,))]], slots=4, cost_model=unit,
                                     predicted=[[100.0, 100.0], [1.0]], migration="remaining")
    assert moved == 0 and makespan(timeline) == pytest.approx(100.0)


def test_the_pool_runs_the_rule():
    assert "remaining" in POOL_MIGRATIONS


def affine(tokens, seqs=1):
    return 1.0 + 0.25 * tokens


PRICED = ContextCost(affine, per_key=0.01, prefill_per_pair=0.001)  # attention dominates, as at long contexts
# worker 0: two long requests; worker 1: eight short ones (more requests, far less work); worker 2: one short
# group, then out of work
LENGTHS = [[400, 400], [30] * 8, [5, 5]]
ASSIGNMENT = [[(0, (0, 1))], [(1, tuple(range(8)))], [(2, (0, 1))]]


def test_the_dry_worker_takes_from_the_latest_predicted_end_not_the_most_requests():
    args = dict(slots=4, cost_model=PRICED, predicted=[[float(n) for n in ls] for ls in LENGTHS])
    still, _ = simulate_fleet(LENGTHS, ASSIGNMENT, **args)
    by_count, _ = simulate_fleet(LENGTHS, ASSIGNMENT, migration="half_busiest", **args)
    by_work, moved = simulate_fleet(LENGTHS, ASSIGNMENT, migration="remaining", **args)
    assert moved == 1  # one long request: the two then run apart
    assert any(by_work.busy[2][-1][1] == pytest.approx(t) for t in by_work.finish[0])  # ... it ends on worker 2
    assert makespan(by_work) < 0.8 * makespan(still)
    assert makespan(by_work) < makespan(by_count)  # half_busiest took short ones from worker 1 first


def test_the_rule_moves_nothing_when_no_move_pays():
    lengths = [[400], [5]]  # a lone request: moving it only adds its re-prefill
    _, moved = simulate_fleet(lengths, [[(0, (0,))], [(1, (0,))]], slots=4, cost_model=PRICED,
                              predicted=[[400.0], [5.0]], migration="remaining")
    assert moved == 0


def test_predict_past_conditions_on_the_tokens_held_and_falls_back_to_the_prior_once_shifted():
    predictor = LengthPredictor(cap=4096)
    for k in range(20):
        predictor.record(f"p{k}", [100 * (k + 1) + j for j in range(8)])
    assert predictor.predict_past("p0", 0) == pytest.approx(predictor.predict("p0"))
    held = [predictor.predict_past("p4", t) for t in (100, 400, 800)]
    assert all(h > t for h, t in zip(held, (100, 400, 800))) and held == sorted(held)
    # p0 (about 100 tokens) at 1,000: its own history rules that out, so the prior's spread prices it
    assert predictor.predict_past("p0", 1000) > 1100
    assert 4000 < predictor.predict_past("p0", 4000) <= 4096  # cut at the cap


def test_probe_order_puts_one_member_of_each_group_first():
    assert probe_order([10, 11, 12, 20, 21, 30], [1, 1, 1, 2, 2, 3]) == [10, 20, 30, 11, 12, 21]
    assert probe_order([], []) == []
    with pytest.raises(ValueError, match="groups"):
        probe_order([1, 2], [0])


def test_evidence_is_the_most_tokens_a_sibling_reached_running_or_finished():
    assert evidence(0, []) == 0.0
    assert evidence(30, [12, 45, 7]) == 45.0
    assert evidence(60, [12, 45]) == 60.0


def test_a_waiting_request_is_renewed_only_once_a_sibling_passed_its_prediction():
    past = lambda seen: seen * 2 + 1  # noqa: E731  (a stand-in for predict_past)
    assert renewed_length(40, 50, past) == 0.0  # not passed: its own prediction stands
    assert renewed_length(50, 50, past) == 0.0  # reached, not passed
    assert renewed_length(51, 50, past) == 103.0


def test_renewed_first_admits_the_renewed_longest_first_and_keeps_the_rest_in_order():
    renewed = {"a": 0.0, "b": 80.0, "c": 0.0, "d": 120.0, "e": 80.0}
    assert renewed_first("abcde", renewed.get) == ["d", "b", "e", "a", "c"]
    assert renewed_first("ac", renewed.get) == ["a", "c"]
    assert renewed_first([], renewed.get) == []


def test_the_pool_runs_the_early_warning():
    assert "remaining+early" in POOL_MIGRATIONS


def test_early_admits_a_waiting_sibling_once_its_group_ran_past_its_prediction():
    # one worker, 2 slots: group 0 is predicted and runs 100; group 1 is predicted 10 and runs 50
    lengths, assignment = [[100, 100], [50, 50]], [[(0, (0, 1)), (1, (0, 1))]]
    args = dict(slots=2, cost_model=PRICED, predicted=[[100.0, 100.0], [10.0, 10.0]])
    plain, _ = simulate_fleet(lengths, assignment, migration="remaining", **args)
    early, moved = simulate_fleet(lengths, assignment, migration="remaining+early", **args)
    assert moved == 0  # one worker: nothing to move, only the admission order changes
    assert plain.finish[1][0] > plain.finish[0][1]  # longest-predicted-first: group 1 waits for group 0
    assert early.finish[1][0] < early.finish[0][0]  # probe order: group 1's first member runs at once
    # its sibling, renewed from that member's 50 tokens, is admitted before group 0's waiting member
    assert early.finish[1][1] < early.finish[0][1]
    with pytest.raises(ValueError, match="unknown migration"):
        simulate_fleet(lengths, assignment, migration="remaining+soon", **args)
