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


def test_an_engine_that_verifies_on_the_device_times_whole_steps_in_its_buckets(monkeypatch):
    """The CUDA backend's fixed shapes, run eagerly on the CPU ("static"): the measured model pads rows, and each
    point of its grid is a step with the draws and the walk inside it (`run_drawn`, every bucket a step runs
    in), read back as the engine reads it; nothing is priced beside the grid. The CPU's backends time the
    forward alone."""
    from rhymerl.engine import model_runner
    from rhymerl.engine.backends import CudaBackend
    from rhymerl.engine.engine import Engine
    from tiny_models import tiny_decoder

    model = tiny_decoder("llama")
    engine = Engine(model, num_slots=2, max_model_len=48, eos_token_ids=[],
                    speculator=Speculator(GPU, HistoryStore(), max_draft_tokens=4))
    backend = engine.runner.backend
    assert not backend.pads_rows and not backend.verifies_on_device
    engine.runner.backend = CudaBackend(model, engine.cache, "static")
    drawn, read = [], []
    run_drawn, read_drawn = model_runner.ModelRunner.run_drawn, model_runner.read_drawn
    monkeypatch.setattr(model_runner.ModelRunner, "run_drawn",
                        lambda self, inputs, draws: drawn.append((len(inputs), max(len(x.tokens) for x in inputs)))
                        or run_drawn(self, inputs, draws))
    monkeypatch.setattr(model_runner, "read_drawn", lambda *a: read.append(1) or read_drawn(*a))
    cost = engine.measure_cost_model(4)
    assert cost.padded_rows and cost.draft_step_s == cost.draft_node_s == 0.0
    # its grid is the buckets a step runs in (2 slots; 1 token + 4 drafts a row), each one a drawn step
    assert (cost.seqs_grid, cost.per_seq_grid) == ([1, 2], [1, 2, 4, 5]) == tuple(engine.runner.backend.step_buckets)
    assert {(n, t) for n, t in drawn if t <= 5} == {(n, t) for n in (1, 2) for t in (1, 2, 4, 5)}
    assert len(read) == len(drawn)  # every step's result read back to the host, as the engine does
    assert cost.step(2, 2, 2, 1) > 0


class StatedClock:
    """`time` for `model_runner`: only the stated costs below move it, whatever this CPU's load."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class StatedSteps:
    """The CUDA backend's "static" steps with stated times on `clock`: a forward costs FORWARD_S in every bucket
    (a GPU waiting on launches); a step with the draws and the walk in it (`forward_drawn`) costs FORWARD_S plus
    `drafting_s` in a drafting bucket (more than a token a row: the walk, the draws of every node); reading a
    drafting step's result back (`read_drawn`: its paths, on the host) costs `read_s`."""

    FORWARD_S = 1.0

    def __init__(self, monkeypatch, model, cache, drafting_s: float, read_s: float = 0.0):
        from rhymerl.engine import model_runner
        from rhymerl.engine.backends import CudaBackend

        self.clock = clock = StatedClock()
        backend = CudaBackend(model, cache, "static")
        forward, forward_drawn = backend.forward, backend.forward_drawn

        def drawn(inputs, trees, draws):
            clock.now += self.FORWARD_S + (drafting_s if max(len(x.tokens) for x in inputs) > 1 else 0.0)
            return forward_drawn(inputs, trees, draws)

        def read(drafts, out, index):
            clock.now += read_s if len(index) > len(drafts) else 0.0  # drafted rows to read
            return read_drawn(drafts, out, index)

        read_drawn = model_runner.read_drawn
        monkeypatch.setattr(backend, "forward", lambda step: setattr(clock, "now", clock.now + self.FORWARD_S)
                            or forward(step))
        monkeypatch.setattr(backend, "forward_drawn", drawn)
        monkeypatch.setattr(model_runner, "read_drawn", read)
        monkeypatch.setattr(model_runner, "time", clock)
        self.runner = model_runner.ModelRunner(model, cache, backend=backend)


@pytest.mark.parametrize("drafting_s, read_s, drafts", [(0.0, 0.0, True), (10.0, 0.0, False), (0.0, 10.0, False)])
def test_the_budget_drafts_nothing_where_the_steps_draws_walk_or_host_do_not_pay(monkeypatch, drafting_s, read_s,
                                                                                   drafts):
    """Measured through `ModelRunner.measure_cost` on a backend whose steps have stated costs: where a drafting
    bucket's step (its draws and walk inside the graph) costs ten forwards, a sequence copying its history
    drafts nothing; so too where the host's reading of its result does; where neither costs, it drafts.
    (Pricing the forward alone beside draws timed apart, as before, priced both dear steps at a forward and
    drafted.)"""
    from rhymerl.engine.kv_cache import KVCache
    from tiny_models import tiny_decoder

    model = tiny_decoder("llama")
    steps = StatedSteps(monkeypatch, model, KVCache.for_model(model, 2, 48, 4), drafting_s, read_s)
    cost = steps.runner.measure_cost(4, context=16)
    assert cost.step(1, 1) == pytest.approx(steps.FORWARD_S)
    assert cost.step(1, 1, 3, 3) == pytest.approx(steps.FORWARD_S + drafting_s + read_s)
    prompt, response = list(range(1, 11)), list(range(100, 130))
    history = HistoryStore()
    history.record_rollout(prompt, [response])
    spec = Speculator(cost, history, rule="cost", max_draft_tokens=4, correct_cost=False)
    (draft,) = spec.plan([prompt[-8:]], [spec.start("g", prompt)], base_tokens=1, seqs=1)
    assert bool(draft.tokens) == drafts


def test_a_step_that_cannot_draw_in_itself_is_priced_with_the_draws_after_its_forward(monkeypatch):
    """The CUDA backend's eager mode (`RHYMERL_CUDA_GRAPHS=0`) verifies on the device but draws nothing inside
    its steps (`forward_drawn` is None): each point is then timed as the engine runs such a step, the forward
    and `verify_on_device` after it, in one call per step."""
    from rhymerl.engine import model_runner
    from rhymerl.engine.backends import CudaBackend
    from rhymerl.engine.kv_cache import KVCache
    from tiny_models import tiny_decoder

    model = tiny_decoder("llama")
    cache = KVCache.for_model(model, 2, 48, 4)
    runner = model_runner.ModelRunner(model, cache, backend=CudaBackend(model, cache, "eager"))
    verified = []
    verify = model_runner.verify_on_device
    monkeypatch.setattr(model_runner, "verify_on_device",
                        lambda drafts, *a: verified.append([len(d.tokens) for d in drafts]) or verify(drafts, *a))
    cost = runner.measure_cost(4, context=16)
    assert not cost.padded_rows and cost.seqs_grid == [1, 2]
    # the context's prefill, then each point (1, 2, 4, 5 tokens a row), REPEATS times
    assert verified[0] == [0, 0] and {tuple(v) for v in verified[1:]} == {(t - 1,) * n for n in (1, 2)
                                                                          for t in (1, 2, 4, 5)}
