"""The cost model prices a draft step as a GPU runs it (`CostModel.step`): rows padded to the longest row's
bucket, and what a drafting step adds outside the forward (the draws of every node and the walk, the host's
trees). On a synthetic GPU-like table, shaped after the H100 figures of issue 34 (smollm2-135m, 32 slots:
a 7.5 ms plain forward that grows slowly with tokens, ~5.7 ms more outside the forward a drafting step), the
budget drafts nothing where drafts do not pay, where the CPU's pricing (tokens in all, the forward alone)
drafts, and still drafts deep where they pay."""

from __future__ import annotations

import pytest

from rhymerl.cost_model import CostModel, measure
from rhymerl.histospec.budget import top_nodes, uniform_cap
from rhymerl.histospec.speculator import Speculator
from rhymerl.history import HistoryStore

MS = 1e-3
GRID = dict(seqs_grid=[1, 4, 16, 32], per_seq_grid=[1, 2, 4, 8, 9],
            times=[[6.0 * MS, 6.1 * MS, 6.2 * MS, 6.4 * MS, 6.5 * MS],
                   [6.2 * MS, 6.4 * MS, 6.6 * MS, 7.0 * MS, 7.2 * MS],
                   [6.8 * MS, 7.2 * MS, 7.8 * MS, 9.0 * MS, 9.4 * MS],
                   [7.5 * MS, 8.3 * MS, 9.5 * MS, 12.0 * MS, 13.0 * MS]])
GPU = CostModel(**GRID, padded_rows=True, draft_step_s=5.7 * MS, draft_node_s=0.002 * MS)
CPU_PRICING = CostModel(**GRID)  # the same forwards, priced by tokens in all and the forward alone


def choose(cost: CostModel, ranked, seqs=32):
    def step_cost(n, longest):
        return cost.step(seqs, seqs, n, longest)

    plain_rate = seqs / cost.step(seqs, seqs)
    return top_nodes(ranked, step_cost, plain_rate), uniform_cap(ranked, step_cost, plain_rate)


def test_a_step_is_priced_at_its_longest_rows_bucket_plus_the_draft_steps_own_cost():
    assert GPU.step(32, 32) == CPU_PRICING.step(32, 32) == pytest.approx(7.5 * MS)
    # one sequence drafting 1 node pads every row to 2 tokens; 3 nodes to the 4-token bucket
    assert GPU.step(32, 32, 1, 1) == pytest.approx(8.3 * MS + 5.7 * MS + 0.002 * MS)
    assert GPU.step(32, 32, 3, 3) == pytest.approx(9.5 * MS + 5.7 * MS + 0.006 * MS)
    assert GPU.step(32, 32, 32 * 8, 8) == pytest.approx(13.0 * MS + 5.7 * MS + 0.512 * MS)
    # the CPU's pricing: 33 tokens over 32 sequences, interpolated, nothing beside the forward
    assert CPU_PRICING.step(32, 32, 1, 1) == CPU_PRICING(33, 32) < 7.6 * MS
    back = CostModel.from_dict(GPU.as_dict())
    assert back.as_dict() == GPU.as_dict() and back.step(32, 32, 1, 1) == GPU.step(32, 32, 1, 1)
    old = {k: v for k, v in GPU.as_dict().items() if k in ("seqs", "tokens_per_seq", "seconds", "measured")}
    assert CostModel.from_dict(old).step(32, 32, 1, 1) == CPU_PRICING.step(32, 32, 1, 1)


def test_drafts_that_do_not_pay_on_a_gpu_are_not_drafted():
    """T=1.0-like drafts: one sequence's two fair nodes, the others' poor ones. Priced as the GPU runs them,
    no choice beats plain decoding; priced by tokens alone, the best node looked nearly free."""
    ranked = [[0.5, 0.3]] + [[0.1] * 8] * 31
    (keep, extra), (cap_keep, cap_extra) = choose(GPU, ranked)
    assert (sum(keep), extra, sum(cap_keep), cap_extra) == (0, 0, 0, 0)
    (keep, extra), _ = choose(CPU_PRICING, ranked)
    assert keep[0] >= 1 and extra >= 1  # what the CPU's pricing would have verified


def test_drafts_that_pay_on_a_gpu_are_still_drafted_deep():
    """T=0.3-like drafts: every sequence copying its history, eight nodes of 0.6-0.95 tokens each."""
    chain = [0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6]
    (keep, extra), (cap_keep, cap_extra) = choose(GPU, [chain] * 32)
    assert keep == [8] * 32 and extra == 256 and cap_keep == [8] * 32


def test_the_speculator_prices_its_steps_with_the_draft_steps_cost():
    """Through `Speculator.plan`: a sequence copying its history drafts where a drafting step costs what
    its forward does, and drafts nothing where the step's own cost (the walk, the host) outweighs what
    its draft can add."""
    prompt, response = list(range(1, 11)), list(range(100, 130))
    history = HistoryStore()
    history.record_rollout(prompt, [response])
    for draft_step_s, drafts in ((0.0, True), (10.0, False)):
        cost = CostModel([1, 2], [1, 2, 4, 8, 9], [[1.0, 1.0, 1.0, 1.01, 1.01]] * 2, padded_rows=True,
                         draft_step_s=draft_step_s)
        spec = Speculator(cost, history, rule="cost", max_draft_tokens=8, correct_cost=False)
        (draft,) = spec.plan([prompt[-8:]], [spec.start("g", prompt)], base_tokens=1, seqs=1)
        assert bool(draft.tokens) == drafts


def test_a_measured_grid_knows_whether_its_backend_pads_rows():
    cost = measure(lambda n, t: 1e-3 * n * t, slots=4, max_draft_tokens=8, padded_rows=True)
    assert cost.padded_rows and cost.per_seq_grid == [1, 2, 4, 8, 9] and cost.measured
    assert not measure(lambda n, t: 1e-3, slots=4, max_draft_tokens=8).padded_rows


def test_an_engine_that_verifies_on_the_device_measures_its_draft_steps_cost():
    """The CUDA backend's fixed shapes, run eagerly on the CPU ("static"): the measured model pads rows and
    prices the draws of every node and the walk; the CPU's backends do neither."""
    from rhymerl.engine.backends import CudaBackend
    from rhymerl.engine.engine import Engine
    from tiny_models import tiny_decoder

    model = tiny_decoder("llama")
    engine = Engine(model, num_slots=2, max_model_len=48, eos_token_ids=[],
                    speculator=Speculator(GPU, HistoryStore(), max_draft_tokens=4))
    backend = engine.runner.backend
    assert not backend.pads_rows and not backend.verifies_on_device
    engine.runner.backend = CudaBackend(model, engine.cache, "static")
    cost = engine.measure_cost_model(4)
    assert cost.padded_rows and cost.draft_step_s + cost.draft_node_s > 0
    # its grid is the buckets a step runs in (2 slots; 1 token + 4 drafts a row), each one measured
    assert (cost.seqs_grid, cost.per_seq_grid) == ([1, 2], [1, 2, 4, 5]) == tuple(engine.runner.backend.step_buckets)
    assert cost.step(2, 2, 2, 1) > cost(4, 2)
