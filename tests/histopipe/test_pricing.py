"""HistoPipe's pricing under HistoSpec (`histopipe.pricing`): a request's work in predicted forwards, its
prompt's tokens per forward learned from the calls so far, a step at a full batch's price; the plan then
balances forwards where token pricing did not; and the worker model on per-request forwards counts the
engine's forwards exactly (the premise of pricing in forwards)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rhymerl.cost_model import CostModel
from rhymerl.engine.engine import Engine
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.histopipe.batching import worker_time
from rhymerl.histopipe.plan import plan_pieces
from rhymerl.histopipe.pricing import (PRIOR_FORWARDS, FlatStepCost, ReplayedRates, TokensPerForward,
                                       speculative_step_cost)
from rhymerl.histopipe.replay import draftable_runs, replay_walk
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


def test_draftable_runs_read_the_other_responses_and_the_own_tokens():
    """A response copied from a sibling drafts whole from it; one of unseen tokens matches nothing (-1: no
    draft); a response repeating itself drafts from its own committed tokens, never past them."""
    prompt = [1, 2, 3]
    copied = list(range(10, 30))
    fresh = list(range(100, 120))
    runs = draftable_runs(prompt, [copied, list(copied), fresh], max_draft=8)
    assert runs[1] == [-1] + [min(8, 20 - i) for i in range(1, 20)]
    assert runs[2] == [-1] * 20
    own = draftable_runs(prompt, [[7, 8, 9, 7, 8, 9, 7, 8, 9, 7]], max_draft=8)[0]
    assert own[:5] == [-1, -1, -1, -1, -1] and own[5] == 3  # after 7, 8, 9, 7, 8: 9, 7, 8 committed to copy


def test_the_replay_walk_verifies_at_most_the_draft_length():
    assert replay_walk([-1, 3, -1, 0, -1, -1, -1], 0) == (7, 0)  # a token a forward
    assert replay_walk([-1, 3, -1, 0, -1, -1, -1], 2) == (5, 2)  # token 0; 1-3 (2 drafted); 4; 5; 6
    assert replay_walk([-1, 3, -1, 0, -1, -1, -1], 8) == (4, 8)  # token 0; 1-4 (8 drafted); 5; 6
    assert replay_walk([-1, 1, -1, 0, -1], 2) == (4, 4)  # token 0; 1-2; 3 (2 drafted, none taken); 4
    assert replay_walk([], 8) == (0, 0)


def test_replayed_rates_follow_the_tokens_and_the_cost_model_not_the_timing():
    """A prompt whose answers repeat each other replays at several tokens a forward, one of unseen tokens at
    1, a prompt without history at the call's mean. Counted from the history alone, so no call's forwards
    (the timing-driven counts) can move them. A cost model where drafting is dear drafts nothing: rate 1."""
    history = HistoryStore()
    answer = list(range(10, 50))
    history.record_rollout([1, 2], [answer] * 4)
    history.record_rollout([3], [list(range(100 + 40 * i, 140 + 40 * i)) for i in range(4)])
    cheap = CostModel([1, 4], [1, 16], [[0.010, 0.011], [0.010, 0.011]])
    rates = ReplayedRates(max_draft_tokens=8).rates(history, [[1, 2], [3], [9]], cheap, slots=4)
    assert rates[0] == pytest.approx(160 / (4 * 6))  # 40 tokens: the prefill's, then 8 + 1 a forward (4 x 9, 3)
    assert rates[1] == 1.0
    assert rates[2] == pytest.approx(320 / (24 + 160))
    dear = CostModel([1, 4], [1, 16], [[0.010, 1.0], [0.010, 1.0]])
    assert ReplayedRates(max_draft_tokens=8).rates(history, [[1, 2], [3]], dear, slots=4) == [1.0, 1.0]
