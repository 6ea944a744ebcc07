"""HistoSpec in the engine: lossless verification, identity with plain decoding, the budget."""

import time

import pytest
import torch

from rhymerl.engine.engine import Engine
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.cost_model import CostModel
from rhymerl.histospec.budget import (PROBE_EVERY, PROBE_MAX, PROBE_NODES, PROBE_SPEND, AIMDLength, DoublingLength,
                                      is_probe_step, top_nodes, uniform_cap)
from rhymerl.histospec.calibration import edge_events
from rhymerl.histospec.drafter import Draft
from rhymerl.histospec.speculator import MATCH_WINDOW, SIBLING_PROMPT_TOKENS, Speculator
from rhymerl.histospec.verify import verify
from rhymerl.history import HistoryStore
from helpers import FLAT, history_of, peaky, speculator, worker_config
from suffix_index_check import check_suffix_index
from tiny_models import VOCAB, random_prompts, tiny_decoder

STEEP = CostModel([1, 64], [1, 64], [[1.0, 64.0], [64.0, 4096.0]])  # every token costs a forward: never


@pytest.fixture(scope="module")
def model():
    return peaky(tiny_decoder("llama"))


def engine(model, spec, history=None, cost=FLAT, slots=4, **kw):
    return Engine(model, num_slots=slots, max_model_len=96, eos_token_ids=[], 
                  speculator=speculator(spec, history, cost), **kw)


def run_verify(draft, node_tokens):
    """`verify` with a fixed draw per node (node_tokens[k]: the draw after node k-1)."""
    (v,) = verify([draft], lambda live, nodes, depths: ([node_tokens[n + 1] for n in nodes], [0.0] * len(nodes)))
    return v.path, v.tokens


PROMPT, RESPONSE = list(range(1, 11)), list(range(100, 130))  # a one-response history (see `copier`)


def copier(per_token: float, max_draft_tokens: int, unit: float = 1.0):
    """A Speculator whose history holds one response to PROMPT, with a forward taking `unit` seconds plus
    `per_token` units for each further token per sequence, and the state of a sequence at the end of
    PROMPT: it drafts RESPONSE's first tokens."""
    history = HistoryStore()
    history.record_rollout(PROMPT, [RESPONSE])
    linear = CostModel([1, 2], [1, 64], [[unit, (1 + 63 * per_token) * unit]] * 2)
    spec = Speculator(linear, history, rule="cost", max_draft_tokens=max_draft_tokens, correct_cost=False)
    return spec, spec.start("g", PROMPT)


def test_verify_follows_the_policy_draws():
    # tree: 0:a(root child) -> 1:b -> 3:d ; 0 -> 2:c
    draft = Draft(tokens=[10, 11, 12, 13], parents=[-1, 0, 0, 1], source="history", match_len=2,
                  probs=[0.9, 0.5, 0.4, 0.3])
    # node_tokens[k] is the draw after node k-1 (k=0: after the root)
    assert run_verify(draft, [10, 11, 13, 99, 7]) == ([0, 1, 3], [10, 11, 13, 7])
    assert run_verify(draft, [10, 12, 5, 5, 5]) == ([0, 2], [10, 12, 5])
    assert run_verify(draft, [42, 0, 0, 0, 0]) == ([], [42])


def test_length_rules():
    aimd, dbl = AIMDLength(), DoublingLength()
    assert [aimd.next(2, 2, 2), aimd.next(4, 4, 1), aimd.next(32, 32, 32), aimd.next(6, 0, 0)] == [4, 2, 32, 6]
    assert [dbl.next(2, 2, 2), dbl.next(8, 8, 3), dbl.next(16, 16, 16), dbl.next(2, 2, 0)] == [4, 4, 16, 2]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "llama-d64"])  # d64: decode rows in the fused decode attention
@pytest.mark.parametrize("temperature", [0.0, 0.3, 1.0])
def test_speculative_rollout_is_token_identical_to_plain(arch, temperature):
    model = peaky(tiny_decoder(arch))
    prompts = random_prompts(6, seed=21)
    params = SamplingParams(temperature=temperature, max_tokens=24, seed=5)
    history = history_of(model, prompts, params)
    ids = [f"p{i}-g{g}" for i in range(6) for g in range(2)]  # 2 generations per prompt: siblings
    batch = [p for p in prompts for _ in range(2)]
    plain = engine(model, "off").generate(batch, params, request_ids=ids)
    spec_engine = engine(model, "histospec", history)
    spec = spec_engine.generate(batch, params, request_ids=ids)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    for a, b in zip(spec, plain):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=1e-4)
    st = spec_engine.speculator.stats
    assert st.drafted > 0  # drafts were really verified (a rejection takes the bonus-token path) ...
    if temperature <= 0.3:
        assert st.accepted > 0  # ... and, where the policy is predictable, accepted


def test_per_request_stats_add_up_to_the_engines(model):
    """RequestOutput.spec is HistoSpec's work on that request: summed over the requests it is the engine's,
    and a request commits its response in its forwards plus its accepted draft tokens."""
    prompts = random_prompts(4, seed=31)
    params = SamplingParams(temperature=0.0, max_tokens=20, seed=3)
    history = history_of(model, prompts, params)
    batch = [p for p in prompts for _ in range(2)]
    plain = engine(model, "off").generate(batch, params)
    assert all(o.spec is None and o.forwards == len(o.token_ids) for o in plain)  # one token per forward
    eng = engine(model, "histospec", history)
    outs = eng.generate(batch, params)
    total = eng.speculator.stats
    assert sum(o.spec.drafted for o in outs) == total.drafted > 0
    assert sum(o.spec.accepted for o in outs) == total.accepted > 0
    assert sum(o.spec.verify_steps for o in outs) == total.verify_steps
    for src in total.accepted_by_source:
        assert sum(o.spec.accepted_by_source[src] for o in outs) == total.accepted_by_source[src]
    assert 0 < sum(o.spec.draft_s for o in outs) <= total.draft_s + 1e-9
    assert sum(o.forwards for o in outs) == eng.stats.seq_steps
    # accepted tokens past a finish (EOS, max_tokens) are not appended: hence <=
    assert all(len(o.token_ids) <= o.forwards + o.spec.accepted for o in outs)
    assert any(o.tokens_per_forward > 1 for o in outs)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculative_rollout_is_token_identical_in_bf16_on_tiles(temperature):
    """Where the matmuls run on AMX tiles and attention in the tree kernel, every row's arithmetic is
    independent of the rest of the step, so bf16 verification reproduces bf16 decoding bit for bit:
    the same tokens and the same log-probs (elsewhere bf16 is covered by the distribution test only)."""
    model = peaky(tiny_decoder("llama-d64", torch.bfloat16))
    probe = engine(model, "off")
    backend = probe.runner.backend
    if not (getattr(backend, "tiles", False) and backend.tree_attention is not None):
        pytest.skip("needs AMX tiles and the AVX-512 tree attention")
    prompts = random_prompts(6, seed=23)
    params = SamplingParams(temperature=temperature, max_tokens=24, seed=7)
    history = history_of(model, prompts, params)
    ids = [f"p{i}-g{g}" for i in range(6) for g in range(2)]
    batch = [p for p in prompts for _ in range(2)]
    plain = engine(model, "off").generate(batch, params, request_ids=ids)
    spec_engine = engine(model, "histospec", history)
    spec = spec_engine.generate(batch, params, request_ids=ids)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert [o.logprobs for o in spec] == [o.logprobs for o in plain]
    assert spec_engine.speculator.stats.accepted > 0


def test_tile_cache_changes_no_bit_of_a_rollout():
    """The tree kernel's tile cache (bf16 on AMX) is kept across steps and must follow every rewrite of a
    slot: requests refilling slots, copied prompt prefixes, moves when slots are compacted, commits of draft
    paths. A rollout with it equals one whose cache is forgotten before every step."""
    model = peaky(tiny_decoder("llama-d64", torch.bfloat16))
    probe = engine(model, "off")
    if getattr(probe.runner.backend, "tile_cache", None) is None:
        pytest.skip("needs AMX tiles (the tree kernel keeps no tile cache elsewhere)")
    prompts = random_prompts(5, seed=29, lo=40, hi=70)  # past a 32-position block before decoding
    params = SamplingParams(temperature=0.3, max_tokens=40, seed=3)
    history = history_of(model, prompts, params)
    batch = [p for p in prompts for _ in range(3)]  # siblings share their prompt's prefix
    ids = [f"p{i}-g{k}" for i in range(5) for k in range(3)]
    outs = {}
    for forget in (False, True):
        eng = engine(model, "histospec", history, slots=4)
        if forget:
            run = eng.runner.run
            def run_forgetting(inputs, *a, eng=eng, run=run, **kw):
                eng.runner.backend.tile_cache.blocks.zero_()
                return run(inputs, *a, **kw)
            eng.runner.run = run_forgetting
        outs[forget] = eng.generate(batch, params, request_ids=ids)
        assert eng.speculator.stats.accepted > 0
    assert [o.token_ids for o in outs[False]] == [o.token_ids for o in outs[True]]
    assert [o.logprobs for o in outs[False]] == [o.logprobs for o in outs[True]]


def test_greedy_full_acceptance_needs_fewer_forwards(model):
    prompts = random_prompts(4, seed=22)
    params = SamplingParams(temperature=0, max_tokens=30)
    history = history_of(model, prompts, params, n_gen=1)  # greedy: history = the exact answer
    plain_engine, spec_engine = engine(model, "off"), engine(model, "histospec", history)
    plain = plain_engine.generate(prompts, params)
    spec = spec_engine.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert spec_engine.speculator.stats.accept_rate > 0.9
    assert spec_engine.stats.forward_passes * 3 < plain_engine.stats.forward_passes
    assert spec_engine.stats.tokens_per_forward > 3


def test_first_tokens_follow_the_policy_distribution(model):
    """Chi-square: the first two tokens sampled through HistoSpec (with an adversarial history that
    always drafts the same tokens) are distributed as the model says."""
    prompt = random_prompts(1, seed=23)[0]
    history = HistoryStore()
    history.record_rollout(prompt, [[7, 8, 9, 10]] * 4)
    n = 3000
    # 3 tokens: the second one is verified against a draft (a draft for the last token would gain nothing,
    # so none is made)
    params = SamplingParams(temperature=1.0, max_tokens=3, seed=9)
    eng = engine(model, "histospec", history, slots=64)
    outs = eng.generate([prompt] * n, params, request_ids=list(range(n)))
    assert eng.speculator.stats.drafted > 0
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt]))[0, -1].double(), -1)
    counts = torch.bincount(torch.tensor([o.token_ids[0] for o in outs]), minlength=VOCAB).double()
    expected = p1 * n
    big = expected >= 5  # pool the rare tokens into one cell
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    assert chi2 < dof + 4 * (2 * dof) ** 0.5  # ~4 sigma
    # Second token after the drafted first token 7: conditional distribution check.
    second = [o.token_ids[1] for o in outs if o.token_ids[0] == 7]
    if len(second) > 200:
        with torch.no_grad():
            p2 = torch.softmax(model(torch.tensor([prompt + [7]]))[0, -1].double(), -1)
        top = int(p2.argmax())
        frac = sum(t == top for t in second) / len(second)
        assert abs(frac - float(p2[top])) < 4 * (float(p2[top]) * (1 - float(p2[top])) / len(second)) ** 0.5 + 1e-9


def test_budget_turns_speculation_off_when_it_does_not_pay(model):
    prompts = random_prompts(4, seed=24)
    params = SamplingParams(temperature=0, max_tokens=20)
    history = history_of(model, prompts, params, n_gen=1)
    eng = engine(model, "histospec", history, cost=STEEP)
    eng.generate(prompts, params)
    assert eng.speculator.stats.drafted == 0
    eng = engine(model, "histospec", history, cost=FLAT)
    eng.generate(prompts, params)
    assert eng.speculator.stats.drafted > 0


def test_measured_cost_model_and_bad_mode(model):
    eng = Engine(model, num_slots=4, max_model_len=96, speculator=speculator(cost=None))
    cost = eng.speculator.cost
    assert 0 < cost(1, 1) <= cost(9, 1) and cost(4, 4) <= cost(12, 4)  # non-decreasing in tokens
    grid = CostModel([1, 4], [1, 2], [[1.0, 0.5], [2.0, 3.0]])  # noise made a bigger step look cheaper
    assert grid.times == [[1.0, 1.0], [2.0, 3.0]]
    # 3 tokens over 2 sequences: 1.5 per sequence -> 1.0 on the 1-sequence row, 2.5 on the 4-sequence row
    assert grid(3, 2) == pytest.approx(1.5)
    # A measured model is corrected online wherever it goes (a second engine reusing it, as `bench spec`
    # does); one written by hand is taken as is.
    assert eng.speculator.correct_cost and cost.measured
    reused = Engine(model, num_slots=4, max_model_len=96, speculator=speculator(cost=cost))
    assert reused.speculator.cost is cost and reused.speculator.correct_cost
    assert not engine(model, "histospec").speculator.correct_cost
    with pytest.raises(ValueError, match="rollout.speculative: must be one of"):  # the worker builds it by mode
        worker_config(speculative="medusa")


def test_cost_ceiling_is_the_perfect_drafters_speedup():
    assert FLAT.ceiling(4, 8) == (8.0, 8)  # drafts are free: the longest chain wins, 8 tokens per forward
    assert STEEP.ceiling(1, 8) == (1.0, 1)  # every token costs a forward: nothing beats plain
    # 4 sequences: the forward costs 1 up to 4 rows, 2 at 16 rows, 4 at 32 rows. Chains of 4 tokens reach
    # 2x (4 tokens for twice the time) and longer ones no more: the shortest best t is reported.
    knee = CostModel([1, 4], [1, 4, 8], [[1.0, 1.0, 1.0], [1.0, 2.0, 4.0]])
    assert knee.ceiling(4, 8) == (pytest.approx(2.0), 4)
    assert knee.ceiling(4, 3) == (pytest.approx(3 / (1 + 2 / 3)), 3)


def test_probe_steps_thin_out():
    idle = range(300)
    assert [i for i in idle if is_probe_step(i)] == (list(range(PROBE_EVERY)) + [8, 16, 32]
                                                     + list(range(PROBE_MAX, 300, PROBE_MAX)))


def test_drafting_is_mostly_skipped_once_it_stopped_paying(model):
    """After PROBE_EVERY steps with a zero budget the drafter only runs on probe steps, and there every
    sequence drafts: steps that draft nothing at all do not also count towards a sequence's own pause
    (the two schedules compounded, and no probe drafted any more)."""
    prompts = random_prompts(2, seed=25)
    params = SamplingParams(temperature=0, max_tokens=80)
    eng = engine(model, "histospec", history_of(model, prompts, params, n_gen=1), cost=STEEP, slots=2)
    calls = []
    draft = eng.speculator.drafter.draft
    eng.speculator.drafter.draft = lambda *a, **k: calls.append(1) or draft(*a, **k)
    eng.generate(prompts, params)
    steps = eng.stats.forward_passes - 1  # the first step only prefills
    assert eng.speculator.stats.drafted == 0
    assert 0 < len(calls) == 2 * sum(map(is_probe_step, range(steps))) <= 2 * (PROBE_EVERY + 4)


def test_a_sequence_whose_drafts_are_never_kept_drafts_only_on_its_probes():
    """Beside a sequence that copies its history, one that matches nothing: after PROBE_EVERY proposals
    that kept none of its draft, the second is drafted only every PROBE_EVERY-th proposal, while the first
    drafts at every one."""
    prompt_a, prompt_b, response = list(range(1, 11)), list(range(40, 50)), list(range(100, 130))
    history = HistoryStore()
    history.record_rollout(prompt_a, [response])
    cheap = CostModel([1, 2], [1, 64], [[1.0, 1.63], [1.0, 1.63]])  # +1% per draft token
    spec = Speculator(cheap, history, rule="cost", max_draft_tokens=8, correct_cost=False)
    a, b = spec.start("a", prompt_a), spec.start("b", prompt_b)
    calls = []
    draft = spec.drafter.draft
    spec.drafter.draft = lambda ctx, **k: calls.append(ctx[0]) or draft(ctx, **k)
    for _ in range(30):
        kept = spec.plan([prompt_a[-8:], prompt_b[-8:]], [a, b], base_tokens=2, seqs=2)
        assert kept[0].tokens and not kept[1].tokens
    assert calls.count(prompt_a[-8]) == 30
    assert calls.count(prompt_b[-8]) == sum(1 for k in range(30) if k < PROBE_EVERY or k % PROBE_EVERY == 0)
    assert a.idle == 0 and b.idle == 30


def test_drafts_that_save_less_time_than_drafting_took_count_as_idle():
    """A copying sequence whose draft pays on the cost model's terms: where a forward takes a second, the
    saving dwarfs the drafting time and drafting goes on; where it takes a nanosecond (the same shape, so
    the same drafts are kept), the saving is below the drafting time, so the step counts as idle and
    after PROBE_EVERY + 1 such steps the step-level pause skips drafting."""
    for unit, paused in ((1.0, False), (1e-9, True)):
        spec, state = copier(0.01, 8, unit)  # +1% per draft token
        for _ in range(PROBE_EVERY + 1):  # idle 0..8 are probe steps (is_probe_step), 9 is not
            assert not spec.drafting_paused(1)
            (draft,) = spec.plan([PROMPT[-8:]], [state], base_tokens=1, seqs=1)
            assert draft.tokens == RESPONSE[: len(draft.tokens)] != []
        assert spec.drafting_paused(1) == paused


def test_probes_explore_so_early_rejections_cannot_stop_drafting_for_good():
    """Rejected drafts at the start leave the edge calibration below what a draft token costs here, so the
    budget keeps nothing and nothing more is verified to correct it. A probe step while paused verifies its
    PROBE_NODES best nodes anyway (they add less than PROBE_SPEND to the step): the policy (copying its
    history) accepts them, the calibration recovers and drafting resumes. (Seen in `bench spec`: two
    rejected single-token drafts, then a T=0.3 rollout that drafted nothing more.)"""
    spec, state = copier(0.05, 8)
    for _ in range(12):
        spec.record(state, Draft([100], [-1], "history", spec.drafter.max_window, [1.0]), [])
    assert spec.edge_calibration(1)[0] < 0.05 and PROBE_NODES * 0.05 <= PROBE_SPEND
    drafted = []
    for _ in range(40):
        if spec.drafting_paused(1):
            continue
        (draft,) = spec.plan([PROMPT[-8:]], [state], base_tokens=1, seqs=1)
        drafted.append(len(draft.tokens))
        if draft.tokens:  # a chain the policy follows to its end
            assert draft.is_chain() and draft.tokens == RESPONSE[: len(draft.tokens)]
            spec.record(state, draft, list(range(len(draft.tokens))))
    assert drafted[:PROBE_EVERY] == [0] * PROBE_EVERY  # the calibration keeps nothing ...
    assert drafted[PROBE_EVERY] == PROBE_NODES  # ... the first probe while paused explores ...
    assert drafted[-1] == 8  # ... and the whole draft pays again


def test_indexes_catch_up_with_every_committed_token(model):
    """Committed tokens are buffered until a sequence drafts: after a flush, each sequence's own index
    holds prompt + output and the siblings' index every sibling's prompt tail + output, exactly."""
    prompt = random_prompts(1, seed=26)[0]
    params = SamplingParams(temperature=1.0, max_tokens=30, seed=3)
    eng = engine(model, "histospec", None, cost=STEEP)
    specs = []
    start = eng.speculator.start
    eng.speculator.start = lambda *a: specs.append(start(*a)) or specs[-1]
    outs = eng.generate([prompt] * 3, params)
    assert len(specs) == 3 and any(s.unindexed for s in specs)  # drafting was off: nothing indexed yet
    for spec, out in zip(specs, outs):
        spec.flush()
        assert spec.own.sequence(0) == prompt + out.token_ids
        assert spec.group.index.sequence(spec.sibling_id) == prompt[-SIBLING_PROMPT_TOKENS:] + out.token_ids
        check_suffix_index(spec.own)
        check_suffix_index(spec.group.index)


def test_edge_events_count_each_reached_node_once():
    # root -> 0 -> 1 -> 2 (shares 1 below node 0), and root -> 3 (a 0.25 alternative to node 0)
    draft = Draft(tokens=[10, 11, 12, 20], parents=[-1, 0, 1, -1], source="history", match_len=2,
                  probs=[0.75, 0.75, 0.75, 0.25])
    # accepted 0 and 1, rejected below 1: the root (depth 0), 0 and 1 each predicted a continuation with
    # share 1; the walk continued out of the first two
    assert edge_events(draft, [0, 1]) == [(pytest.approx(1.0), 1), (pytest.approx(1.0), 1), (pytest.approx(1.0), 0)]
    # accepted 3, a leaf: only the root predicted anything
    assert edge_events(draft, [3]) == [(pytest.approx(1.0), 1), (0.0, 0)]
    assert edge_events(draft, []) == [(pytest.approx(1.0), 0)]


def test_budget_discounts_deep_nodes_per_edge():
    """A 30-token history continuation (every share 1) with a per-edge acceptance of 0.5 is worth
    0.5 + 0.25 + ... < 1 token, not 15: with a forward that grows 10% per extra token, the budget
    verifies 2 draft tokens (the rate (1 + gain) / cost peaks there), not the whole chain."""
    spec, state = copier(0.1, 32)
    assert spec.edge_calibration() == [0.5] * 32  # the prior, before any verification
    (draft,) = spec.plan([PROMPT[-8:]], [state], base_tokens=1, seqs=1)
    assert draft.tokens == RESPONSE[:2]


def test_budget_takes_the_steps_best_nodes_while_requests_wait_and_caps_every_draft_in_the_drain():
    """A copying sequence (nodes worth 0.9 tokens) beside a poorly matched one (0.1), a forward that
    grows 10% per draft token: while requests wait the step's best nodes are all the copying sequence's
    and the other drafts nothing (throughput); in the drain every draft gets the same cap, so the
    sequence that will finish last is not starved."""
    ranked = [[0.9] * 10, [0.1] * 10]
    cost = lambda extra, longest: 1.0 + 0.1 * extra  # noqa: E731
    keep, extra = top_nodes(ranked, cost, plain_rate=2.0)
    assert keep[1] == 0 and keep[0] >= 8 and extra == sum(keep)
    assert uniform_cap(ranked, cost, plain_rate=2.0) == ([10, 10], 20)
    # nothing pays when a draft token costs as much as a forward
    steep = lambda extra, longest: 1.0 + 1.0 * extra  # noqa: E731
    assert top_nodes(ranked, steep, plain_rate=2.0) == ([0, 0], 0) == uniform_cap(ranked, steep, plain_rate=2.0)


def test_engine_tells_the_budget_when_the_rollout_drains(model):
    """`draining` is False while a request waits for a slot and True once none does."""
    history = HistoryStore()
    prompts = random_prompts(6, seed=40)
    eng = engine(model, "histospec", history, slots=2)
    seen = []
    propose = eng.speculator.plan
    eng.speculator.plan = lambda *a, draining=False, **kw: (seen.append((len(eng.scheduler.waiting), draining))
                              or propose(*a, draining=draining, **kw))
    eng.generate(prompts, SamplingParams(temperature=1.0, max_tokens=6, seed=1))
    assert seen and all(d == (w == 0) for w, d in seen)
    assert {d for _, d in seen} == {False, True}


def test_drafts_reach_the_end_of_the_context_and_never_past_it(model):
    """A response's last tokens before the end of the context (or max_tokens) draft too, as deep as the
    tokens it may still append less the bonus token: before, its last max_draft_tokens were decoded one per
    step. Greedy with the very responses as history and free drafts: 8 accepted + the bonus per step."""
    prompts = random_prompts(2, seed=41)
    params = SamplingParams(temperature=0, max_tokens=24)
    history = history_of(model, prompts, params, n_gen=1)
    max_len = max(map(len, prompts)) + 24  # the longer prompt ends its context with its 24th token
    eng = Engine(model, num_slots=2, max_model_len=max_len, eos_token_ids=[], 
                 speculator=speculator("histospec", history))
    rooms, depths = [], []
    propose = eng.speculator.plan

    def spy(*a, max_depths=None, **kw):
        drafts = propose(*a, max_depths=max_depths, **kw)
        rooms.extend(max_depths)
        depths.extend(max(d.depths(), default=0) for d in drafts)
        return drafts

    eng.speculator.plan = spy
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in engine(model, "off").generate(prompts, params)]
    # the prompt's forward gives token 1, then 9 + 9 + 5 (a draft 4 deep: 5 tokens were left)
    assert [o.forwards for o in outs] == [4, 4]
    assert all(d <= r for d, r in zip(depths, rooms)) and 4 in depths


def test_a_long_match_tells_apart_responses_that_share_their_last_7_tokens(model):
    """Two history responses end in the same 7 tokens, then go on differently; what came before those 7
    tokens says which one a new response is repeating. With the 15-token window the draft follows that one
    only; a 7-token window drafts both continuations, half the share each. The engine hands the drafter
    that many recent tokens."""
    shared, before_a, before_b = [70, 71, 72, 73, 74, 75, 76], [40, 41, 42, 43], [50, 51, 52, 53]
    response_a, response_b = before_a + shared + [90, 91, 92], before_b + shared + [95, 96, 97]
    history = HistoryStore()
    history.record_rollout(PROMPT, [response_a, response_b])
    context = PROMPT[-4:] + response_a[:11]  # a new response that has repeated response_a so far
    for window, first in ((MATCH_WINDOW, {90}), (7, {90, 95})):
        spec = Speculator(FLAT, history, rule="cost", max_draft_tokens=3, correct_cost=False)
        spec.drafter.max_window = window
        (draft,) = spec.plan([context], [spec.start("g", PROMPT)], base_tokens=1, seqs=1)
        assert {t for t, p in zip(draft.tokens, draft.parents) if p < 0} == first
        assert draft.match_len == window  # the history index holds the prompt in front of each response
    eng = engine(model, "histospec", history)
    contexts = []
    propose = eng.speculator.plan
    eng.speculator.plan = lambda ctx, *a, **kw: contexts.extend(ctx) or propose(ctx, *a, **kw)
    prompts = random_prompts(2, seed=42)
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    # each context: a sequence's last MATCH_WINDOW tokens at the time (all of them while it was shorter)
    tails = [full[max(0, k - MATCH_WINDOW):k] for full in (p + o.token_ids for p, o in zip(prompts, outs))
             for k in range(1, len(full) + 1)]
    assert all(c in tails for c in contexts) and any(len(c) == MATCH_WINDOW for c in contexts)


def test_calibration_is_kept_per_match_class():
    """Drafts from whole-window matches that are followed and 2-token matches that are not: each class
    learns its own factor, and the pooled one lies between."""
    prompt = list(range(1, 11))
    spec = Speculator(CostModel([1, 2], [1, 64], [[1.0, 7.3], [1.0, 7.3]]), HistoryStore(), rule="cost",
                      max_draft_tokens=8, correct_cost=False)
    state = spec.start("g", prompt)
    window = spec.drafter.max_window
    for i in range(200):
        chain = Draft(tokens=[5, 6, 7], parents=[-1, 0, 1], source="history", match_len=window if i % 2 else 2,
                      probs=[1.0] * 3)
        spec.record(state, chain, [0, 1, 2] if i % 2 else [])
    full, short, pooled = spec.edge_calibration(1)[0], spec.edge_calibration(0)[0], spec.edge_calibration()[0]
    assert full > 0.95 and short < 0.05
    assert short < pooled < full


def test_calibration_learns_that_deep_edges_continue_more_often():
    """Walks that fail at the first edge 3 times in 4 but, once on a history span, follow it to the end:
    the calibration must say so per depth (c_0 ~ 0.25, deeper ~ 1), so every node is worth ~0.25 tokens
    against a cost of 0.1 and the budget verifies the whole chain. A single per-edge constant fitted to
    the same walks (0.73, so 0.73**k) would have cut it to 4 tokens."""
    spec, state = copier(0.1, 32)
    chain = Draft(tokens=RESPONSE[:8], parents=[-1, 0, 1, 2, 3, 4, 5, 6], source="history", match_len=2,
                  probs=[1.0] * 8)
    for i in range(400):
        spec.record(state, chain, list(range(8)) if i % 4 == 0 else [])
    calib = spec.edge_calibration()
    assert calib[0] == pytest.approx(0.25, abs=0.05)
    assert all(c > 0.95 for c in calib[1:8])
    assert calib[8:] == pytest.approx([calib[7]] * 24, abs=0.05)  # never observed: borrowed from above
    (draft,) = spec.plan([PROMPT[-8:]], [state], base_tokens=1, seqs=1)
    assert len(draft.tokens) > 16


def test_waiting_for_a_core_while_drafting_does_not_count_as_drafting_time():
    """Two workers on shared cores: one descheduled while it drafts (here the drafter sleeps: wall time, no
    CPU time) has not spent that wait drafting. Priced by the wall clock, the 50 ms wait exceeds what a
    copying draft saves where a forward takes 1 ms, and drafting paused after PROBE_EVERY + 1 steps; priced
    by the thread's CPU time, it goes on."""
    spec, state = copier(0.01, 8, unit=1e-3)
    draft = spec.drafter.draft
    spec.drafter.draft = lambda *a, **k: time.sleep(0.05) or draft(*a, **k)
    for _ in range(PROBE_EVERY + 1):
        assert not spec.drafting_paused(1)
        (kept,) = spec.plan([PROMPT[-8:]], [state], base_tokens=1, seqs=1)
        assert kept.tokens == RESPONSE[: len(kept.tokens)] != []
    assert not spec.drafting_paused(1)


class CpuClock:
    """`time` for the speculator: each reading of the thread's CPU clock is `drafting_s` later than the one
    before (so a plan's drafting takes that CPU time, whatever the load on this machine); the wall clock
    stands still."""

    def __init__(self, drafting_s: float):
        self.cpu, self.drafting_s = 0.0, drafting_s

    def thread_time(self) -> float:
        self.cpu += self.drafting_s
        return self.cpu

    def perf_counter(self) -> float:
        return 0.0


@pytest.mark.parametrize("measured_over_predicted, pauses", [(4.0, False), (1.0, True)])
def test_the_pause_weighs_drafting_against_the_steps_measured_seconds(monkeypatch, measured_over_predicted,
                                                                      pauses):
    """A pool's first worker measures the cost model alone, and the steps then ran at up to 2.9x its seconds
    (the online correction's measured/predicted ratio, two Ray workers on two cores). A copying draft saves
    about 5 ms of the model's seconds per step here, and drafting takes 10 ms of CPU time: at 4x the model's
    seconds it saves 20 ms and pays, at 1x it does not. Priced in the model's own seconds, the pause stopped
    drafting after PROBE_EVERY steps in both cases."""
    from rhymerl.histospec import speculator as speculator_module

    monkeypatch.setattr(speculator_module, "time", CpuClock(0.010))
    history = HistoryStore()
    history.record_rollout(PROMPT, [RESPONSE])
    unit = 1e-3  # a plain step of one sequence: 1 ms by the model, 0.01 ms more per further token
    linear = CostModel([1, 2], [1, 64], [[unit, 1.63 * unit]] * 2, measured=True)
    spec = Speculator(linear, history, rule="cost", max_draft_tokens=8)
    big, c = 1e9, 0.9  # the calibration: continuation factor c at every depth
    r = measured_over_predicted
    spec.load_state_dict({"calibration": {"num": [[c * big] * 9] * 2, "den": [[big] * 9] * 2},
                          "ratio": [[1, False, r], [1, True, r]]})
    state = spec.start("g", PROMPT)
    paused = []
    for _ in range(3 * PROBE_EVERY):
        paused.append(spec.drafting_paused(1))
        if not paused[-1]:
            (kept,) = spec.plan([PROMPT[-8:]], [state], base_tokens=1, seqs=1)
            assert kept.tokens == RESPONSE[: len(kept.tokens)] != []
    assert any(paused) == pauses
