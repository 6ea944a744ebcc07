"""HistoPipe's pricing under HistoSpec (`histopipe.pricing`): a request's work in predicted forwards, its
prompt's tokens per forward learned from the calls so far, a step at a full batch's price; the plan then
balances forwards where token pricing did not; and the worker model on per-request forwards counts the
engine's forwards exactly (the premise of pricing in forwards)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from rhymerl.cost_model import CostModel
from rhymerl.engine.engine import Engine
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.histopipe.batching import worker_time
from rhymerl.histopipe.plan import plan_pieces
from rhymerl.histopipe.pricing import (PRIOR_FORWARDS, FlatStepCost, ReplayedRates, TokensPerForward,
                                       speculative_step_cost)
from rhymerl.histopipe.replay import Replay
from rhymerl.histospec.speculator import Speculator
from rhymerl.history import HistoryStore

from tiny_models import random_prompts, tiny_decoder

COST = CostModel([1, 4], [1, 8], [[0.010, 0.030], [0.020, 0.080]])


def out(prompt, tokens, forwards):
    return SimpleNamespace(prompt_ids=prompt, token_ids=[5] * tokens, forwards=forwards)


def test_rates_per_prompt_with_their_fallbacks():
    rates = TokensPerForward(decay=0.5, prior_forwards=0)  # each prompt's own rate (the shrinkage: below)
    assert rates.rate([1, 2]) == 1.0  # nothing seen: token pricing
    rates.observe([out([1, 2], 40, 10), out([1, 2], 20, 5), out([3], 10, 10), out([4], 0, 0), out([6], 3, 0)])
    assert rates.rate([1, 2]) == pytest.approx(4.0)
    assert rates.rate([3]) == 1.0
    assert rates.rate([4]) == rates.rate([9]) == pytest.approx(70 / 25)  # unseen (an error's too): the mean
    assert rates.forwards([1, 2], [80.0, 8.0]) == pytest.approx([20.0, 2.0])
    rates.observe([out([1, 2], 10, 10)])  # a newer call weighs twice the older: (30 + 10) / (7.5 + 10)
    assert rates.rate([1, 2]) == pytest.approx(40 / 17.5)
    rates.observe([out([3], 2, 4)])  # below a token per forward (prefill's share): at least 1
    assert rates.rate([3]) == 1.0
    with pytest.raises(ValueError, match="decay"):
        TokensPerForward(decay=1.0)
    with pytest.raises(ValueError, match="prior_forwards"):
        TokensPerForward(prior_forwards=-1)


def test_a_rate_is_shrunk_toward_the_mean_by_the_forwards_that_back_it():
    """Credibility weighting (pricing's module doc): (tokens + K x mean) / (forwards + K). A prompt seen over
    a few forwards is priced near the pool's mean whatever its own rate; one backed by many keeps most of its
    own; more calls back a rate with more (decayed) forwards."""
    k = PRIOR_FORWARDS
    rates = TokensPerForward(decay=0.5)
    rates.observe([out([1], 40, 10), out([2], 1000, 1000), out([3], 3000, 1000)])
    mean = 4040 / 2010
    assert rates.rate([1]) == pytest.approx((40 + k * mean) / (10 + k))  # 4.0 seen: about 2.1
    assert rates.rate([1]) < 0.6 * 4.0
    assert rates.rate([3]) == pytest.approx((3000 + k * mean) / (1000 + k))  # 3.0 seen: about 2.9
    assert rates.rate([3]) > 0.9 * 3.0
    assert rates.rate([9]) == pytest.approx(mean)  # never seen: the mean
    before = rates.rate([1])
    rates.observe([out([1], 400, 100)])  # a second call at the same 4.0: more evidence, closer to it
    assert before < rates.rate([1]) < 4.0


def test_a_speculative_step_costs_a_full_batch_whatever_its_sequences():
    flat = speculative_step_cost(COST, 4, True)
    assert isinstance(flat, FlatStepCost)
    assert flat(1, 1) == flat(4, 4) == flat(36, 4) == pytest.approx(COST(4, 4))
    assert speculative_step_cost(COST, 4, False) is COST  # no speculation: the cost model as it is


def test_forward_pricing_balances_the_forwards_token_pricing_did_not():
    """Three one-request groups on two one-slot workers: A 120 tokens drafting at 4 tokens per forward, B 70
    and C 60 at 1. Token pricing puts A alone (120 tokens) and B with C (130 tokens, 130 forwards); forward
    pricing B alone and A with C: 70 and 90 forwards."""
    rates = TokensPerForward(prior_forwards=0)  # the rates as observed
    prompts = [[1], [2], [3]]
    rates.observe([out([1], 120, 30), out([2], 70, 70), out([3], 60, 60)])
    tokens = [[120.0], [70.0], [60.0]]
    forwards = [rates.forwards(p, t) for p, t in zip(prompts, tokens)]
    true_forwards = [[30], [70], [60]]

    def worst(plan):  # the plan's workers' forwards (one slot: a worker's forwards add up)
        flat = [0.0, 1.0]
        return max(worker_time([true_forwards[g][i] for g, idx in share for i in idx], 1, flat) for share in plan)

    by_tokens = plan_pieces([1, 1, 1], 2, "histopipe", tokens, COST, slots=1, tier2=False)
    by_forwards = plan_pieces([1, 1, 1], 2, "histopipe", forwards, speculative_step_cost(COST, 1, True), slots=1,
                              tier2=False)
    assert worst(by_tokens) == 130
    assert worst(by_forwards) == 90


def test_the_worker_model_on_per_request_forwards_counts_the_engines_forwards():
    """A HistoSpec engine on 3 slots, 9 requests in waves: `worker_time` on each request's forwards (flat step
    cost) is the engine's forward count; on its tokens it is not (speculation commits several a forward)."""
    model = tiny_decoder()
    prompts = random_prompts(3, seed=5)
    history = HistoryStore()
    for p in prompts:  # a history to draft from: the engine's own greedy answers
        history.record_rollout(p, [Engine(model, num_slots=1, max_model_len=64, eos_token_ids=[]).generate(
            [p], SamplingParams(temperature=0.0, max_tokens=24))[0].token_ids])
    engine = Engine(model, num_slots=3, max_model_len=64, eos_token_ids=[],
                    speculator=Speculator(COST, history, max_draft_tokens=8))
    lengths = [24, 6, 12] * 3
    outs = engine.generate([p for p in prompts for _ in range(3)],
                           [SamplingParams(temperature=0.0, max_tokens=n) for n in lengths])
    steps = engine.stats.forward_passes
    flat = [0.0, 1.0, 1.0, 1.0]
    assert worker_time([o.forwards for o in outs], 3, flat) == steps
    assert sum(len(o.token_ids) for o in outs) > sum(o.forwards for o in outs)  # drafts were accepted


CHEAP = CostModel([1, 4], [1, 16], [[0.010, 0.011], [0.010, 0.011]])  # drafting nearly free: every node pays


def test_the_replay_drafts_a_copied_answer_whole_and_unseen_tokens_not_at_all():
    """Leave-one-out: an answer its siblings hold word for word takes its prefill and one forward (a 2-token
    match drafts the rest, up to max_draft); an answer of unseen tokens takes a forward a token and verifies
    no draft. Before `warm` the calibration's prior (half the share a depth) keeps the deep nodes out."""
    copied, fresh = list(range(10, 30)), list(range(100, 120))

    def replayed(max_draft, warm=True):
        replay = Replay(CHEAP, slots=4, max_draft=max_draft)
        if warm:
            replay.warm([1, 2, 3], [copied, list(copied), fresh])
        return replay.prompt([1, 2, 3], [copied, list(copied), fresh])

    got = replayed(32)
    assert (got[1].tokens, got[1].forwards) == (20, 2)
    assert (got[2].tokens, got[2].forwards, got[2].drafted, got[2].units) == (20, 20, 0, 20.0)
    assert replayed(4)[1].forwards == 1 + 4  # 19 tokens after the prefill, 4 + 1 a forward: 4 forwards
    assert replayed(0)[1].forwards == 20
    assert replayed(32, warm=False)[1].forwards > 2


def test_the_replay_drafts_histospecs_tree_by_counts_not_the_latest_occurrence():
    """HistoSpec's drafter grows a tree by how often each continuation follows the match. Three answers go on
    after a common phrase X with A, A, B (B the latest recorded); a fourth, X then A, replayed against the
    three: its draft after X's first two tokens holds X's rest then A (2 of 3) and B, so one forward commits
    X's rest and all of A. The suffix matcher this replaced drafted one chain from the latest occurrence (B):
    7 forwards, where HistoSpec's drafter takes 6."""
    f = [[100, 101, 102], [110, 111, 112], [120, 121, 122], [130, 131, 132]]  # each answer's own start
    x, a, b = list(range(20, 26)), list(range(40, 46)), list(range(60, 66))
    answers = [f[0] + x + a, f[1] + x + a, f[2] + x + b, f[3] + x + a]
    replay = Replay(CHEAP, slots=4, max_draft=16)
    replay.warm([1, 2, 3], answers)
    got = replay.prompt([1, 2, 3], answers)[3]
    assert got.forwards == 6  # prefill; f's 2 tokens, x0, x1 one a forward; then x2..x5 + a in one
    assert got.drafted == 16  # the whole tree verified: x's 4, a's 6, b's 6


def test_replayed_rates_follow_the_tokens_and_the_cost_model_not_the_timing():
    """A prompt whose answers repeat each other replays at several tokens a forward, one of unseen tokens at
    1, a prompt without history at the call's mean. Counted from the history alone, so no call's forwards
    (the timing-driven counts) can move them. A cost model where drafting is dear drafts nothing: rate 1."""
    history = HistoryStore()
    answer = list(range(10, 50))
    history.record_rollout([1, 2], [answer] * 4)
    history.record_rollout([3], [list(range(100 + 40 * i, 140 + 40 * i)) for i in range(4)])
    rates = ReplayedRates(max_draft_tokens=8, unit="forwards").rates(history, [[1, 2], [3], [9]], CHEAP, slots=4)
    assert rates[0] == pytest.approx(160 / (4 * 6))  # 40 tokens: the prefill's, then 8 + 1 a forward (4 x 9, 3)
    assert rates[1] == 1.0
    assert rates[2] == pytest.approx(320 / (24 + 160))
    dear = CostModel([1, 4], [1, 16], [[0.010, 1.0], [0.010, 1.0]])
    assert ReplayedRates(max_draft_tokens=8).rates(history, [[1, 2], [3]], dear, slots=4) == [1.0, 1.0]
    with pytest.raises(ValueError, match="unit"):
        ReplayedRates(8, unit="seconds")


def test_replayed_steps_price_a_wide_forward_at_what_the_cost_model_says_it_costs():
    """unit="steps": a forward verifying a wide draft counts as its full-batch step over a plain one's. Where a
    step verifying 8 drafts a row costs twice a plain one (and still pays: 9 tokens for 2), the copied
    answers' tokens per step are near half their tokens per forward; where drafting is nearly free, the two
    agree to a few percent."""
    history = HistoryStore()
    history.record_rollout([1, 2], [list(range(10, 50))] * 4)
    twice = CostModel([1, 4], [1, 9], [[0.010, 0.020], [0.010, 0.020]])
    per_fwd = ReplayedRates(8, unit="forwards").rates(history, [[1, 2]], twice, slots=4)[0]
    per_step = ReplayedRates(8, unit="steps").rates(history, [[1, 2]], twice, slots=4)[0]
    assert per_fwd == pytest.approx(160 / 24)
    # a response: its prefill (1), 4 forwards verifying 8 (2 each), the last verifying the 3 left (1 + 3/8)
    assert per_step == pytest.approx(160 / (4 * (1 + 4 * 2 + 1.375)))
    cheap = [ReplayedRates(8, unit=u).rates(history, [[1, 2]], CHEAP, slots=4)[0] for u in ("forwards", "steps")]
    assert cheap[1] == pytest.approx(cheap[0], rel=0.05)


def test_the_pricing_and_its_replay_do_not_import_torch():
    """The replay drafts with HistoSpec's torch-free parts only, so the planner stays torch-free."""
    code = ("import sys\nfrom rhymerl.histopipe import pricing, replay\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)
