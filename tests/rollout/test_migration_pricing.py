"""Migration's rule "remaining" decides on a real rollout worker as the simulator decides (issues 32 and 33):
the simulator (`histopipe/fleet.py` sync, `histopipe/stream_fleet.py` one_step_off stream) is run to its first
move and its decision recorded (the donor's and the receiver's `rebalance.Batch` and the requests taken); a
real `RolloutWorker` (a tiny random model, a token a step) is run to the same state (the same requests, step,
predicted lengths, cost model, the receiver's weights load) and asked to hand over with the same rule. Both
must price the same batches and take the same requests. (Before, the worker priced in tokens, as sums, with
no load: it took three requests where the simulator took two, and moved one into a 60 s load the simulator
refused.)"""

from __future__ import annotations

import threading
import time

import pytest

from rhymerl.cost_model import CostModel
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.histopipe import fleet, rebalance, stream_fleet
from rhymerl.histopipe.fleet import simulate_fleet
from rhymerl.histopipe.stream_fleet import simulate_stream
from rhymerl.history import HistoryStore
from rhymerl.rollout import RolloutGroup, RolloutWorker
from helpers import worker_config
from tiny_models import random_prompts, tiny_decoder

# a step of n sequences costs 0.5 + 0.5 n seconds (1 s alone, 2.5 s at 4): a CostModel, as a worker holds one
COST = CostModel([1, 4], [1, 2], [[1.0, 1.0], [2.5, 2.5]])
GROWING = lambda tokens, seqs=1: 0.5 + 0.5 * seqs  # noqa: E731  (the stream test's, test_stream_fleet.py)
PARAMS = SamplingParams(temperature=1.0, max_tokens=40, seed=5, ignore_eos=True)  # every response 40 tokens
LONG = SamplingParams(temperature=1.0, max_tokens=60, seed=5, ignore_eos=True)  # past the stream's 42nd step


class Lengths:
    """A fixed predicted length per prompt, renewed to done + 1 once passed: the simulator's and the worker's
    predictor alike (the comparison is of the pricing, not of `LengthPredictor`'s renewals)."""

    def __init__(self, by_prompt: dict):
        self.by_prompt = by_prompt

    def predict_past(self, prompt, tokens):
        p = self.by_prompt[tuple(prompt)]
        return p if p > tokens else tokens + 1.0

    def predict(self, prompt):
        return self.by_prompt[tuple(prompt)]

    def observe_finished(self, prompt, length):
        pass


def recorder(monkeypatch, module) -> list:
    """Each call of `module.moves` (the rule's decision), as (donor Batch, receiver Batch, indices taken)."""
    calls, real = [], rebalance.moves

    def recorded(works, prefills, *args, donor=None, receiver=None, **kw):
        taken = real(works, prefills, *args, donor=donor, receiver=receiver, **kw)
        calls.append((donor, receiver, taken))
        return taken
    monkeypatch.setattr(module, "moves", recorded)
    return calls


def canonical(call) -> dict:
    """A decision, whatever order each side lists the donor's requests in: each request's (tokens left,
    re-prefill on the receiver, owed on the donor), those taken, the step costs, slots and the load."""
    donor, receiver, taken = call
    assert donor is not None, "the move was not priced as batches"
    state = lambda i: (donor.lefts[i], receiver.prefills[i], donor.prefills[i])  # noqa: E731
    return {"requests": sorted(map(state, range(len(donor.lefts)))), "taken": sorted(map(state, taken)),
            "step_cost": list(donor.step_cost), "slots": donor.slots, "load": receiver.load}


def worker_decision(monkeypatch, groups, predictor, cost, steps: int, slots: int, receiver_version=None,
                    load_s: float = 0.0, params: SamplingParams = PARAMS):
    """A real worker rolls `groups` out; after `steps` engine steps it is asked (from another thread, as the
    pool asks) to hand over with rule "remaining". Its recorded decision, what it handed over, its outputs."""
    worker = RolloutWorker(tiny_decoder(), None, worker_config(80, num_slots=slots, speculative="off"),
                           cost_model=cost)
    worker._live_predictor = lambda: predictor  # the simulator's predictions (see `Lengths`)
    worker.load_s = load_s  # the simulator's load_s in place of the worker's measured last load
    calls = recorder(monkeypatch, rebalance)
    step, count, asked = worker.engine.step, [0], {}

    def stepped():
        events = step()
        count[0] += 1
        if count[0] == steps:  # served at the boundary before the next step
            told = {} if receiver_version is None else {"receiver_version": receiver_version}  # sync: none
            asked["thread"] = threading.Thread(target=lambda: asked.setdefault(
                "taken", worker.hand_over(None, 30.0, "remaining", **told)))
            asked["thread"].start()
            while worker._handover is None and asked["thread"].is_alive():
                time.sleep(0.001)
        return events
    worker.engine.step = stepped
    outputs, _ = worker.rollout(groups, params, HistoryStore().export([]), 0)
    asked["thread"].join()
    assert len(calls) == 1
    return calls[0], asked["taken"], outputs


def test_the_sync_rule_takes_on_a_worker_what_the_simulator_takes(monkeypatch):
    """Sync (`fleet.simulate_fleet`, 2 workers, 4 slots): worker 1 runs six 40-token requests predicted 30, 28,
    26, 24 (running) and 22, 20 (waiting); worker 0 one of 10 tokens, alone at 1 s a step: it runs dry at 10 s,
    when worker 1 (2.5 s a step at 4) is at its 4th step boundary. Both sides price the same batches and take
    the two running requests with the most left (26 and 24 tokens; in tokens, as sums, the worker took the
    waiting 22 too). The requests taken, continued on another worker, give the plain rollout's tokens."""
    prompts = random_prompts(7, seed=41)
    predicted = [30, 28, 26, 24, 22, 20]
    lengths = Lengths({tuple(p): float(n) for p, n in zip(prompts, predicted + [10])})
    sim_calls = recorder(monkeypatch, fleet)
    simulate_fleet([[40]] * 6 + [[10]], [[(6, (0,))], [(g, (0,)) for g in range(6)]], slots=4, cost_model=COST,
                   predicted=[[n] for n in predicted + [10]], migration="remaining", predictor=lengths,
                   keys=[tuple(p) for p in prompts])
    groups = [RolloutGroup(p, [f"r{g}"]) for g, p in enumerate(prompts[:6])]
    call, taken, outputs = worker_decision(monkeypatch, groups, lengths, COST, steps=4, slots=4)
    assert canonical(call) == canonical(sim_calls[0])
    assert canonical(call)["taken"] == [(24.0, 2.5, 0.0), (26.0, 2.5, 0.0)]  # 4 tokens re-prefilled, 2.5 / 4 s each
    assert sorted(c.request_id for c in taken) == ["r0", "r1"]
    # lossless: the rest came back here, the two taken continue on another worker to the plain rollout's tokens
    other = RolloutWorker(tiny_decoder(), None, worker_config(64, num_slots=4, speculative="off"))
    adopted, _ = other.rollout([], PARAMS, HistoryStore().export([]), 0, continuations=taken)
    plain, _ = other.rollout(groups, PARAMS, HistoryStore().export([]), 0)
    assert {o.request_id: o.token_ids for o in outputs + adopted} == {o.request_id: o.token_ids for o in plain}


@pytest.mark.parametrize("load_s, moved", [(0.5, 1), (60.0, 0)])
def test_the_stream_rule_prices_the_receivers_load_on_a_worker_as_the_simulator(monkeypatch, load_s, moved):
    """The stream (`stream_fleet.simulate_stream`, test_stream_fleet.py's case): worker 0, holding version 1
    for step 3, runs dry while worker 1 runs step 2's two 100-token requests (version 0, a step of n costing
    0.5 + 0.5 n). The donor is told the receiver's version (`hand_over(receiver_version=1)`) and prices its
    load as the simulator does: at 0.5 s one request moves, at 60 s none (with no load priced, one moved)."""
    steps = [[[1], [1]], [[1], [100, 100]], [[1]], [[1]]]
    plans = [[[(0, (0,))], [(1, (0,))]], [[(0, (0,))], [(1, (0, 1))]], [[(0, (0,))], []], [[(0, (0,))], []]]
    sim_calls = recorder(monkeypatch, stream_fleet)
    simulate_stream(steps, plans, slots=2, cost_model=GROWING, migration="remaining", predicted=steps, load_s=load_s)
    sim = canonical(sim_calls[0])
    assert sim["load"] == load_s and len(sim["taken"]) == moved
    prompt = random_prompts(1, seed=42)[0]
    done = 100 - sim["requests"][0][0]  # the step the simulator's donor was at when asked
    call, taken, _ = worker_decision(monkeypatch, [RolloutGroup(prompt, ["a", "b"])], Lengths({tuple(prompt): 100.0}),
                                     GROWING, steps=int(done), slots=2, receiver_version=1, load_s=load_s,
                                     params=LONG)
    assert canonical(call) == sim and len(taken) == moved
    same, _, _ = worker_decision(monkeypatch, [RolloutGroup(prompt, ["a", "b"])], Lengths({tuple(prompt): 100.0}),
                                 GROWING, steps=int(done), slots=2, receiver_version=0, load_s=load_s,
                                 params=LONG)
    assert canonical(same)["load"] == 0.0  # a receiver holding the donor's version loads nothing


def test_a_plain_worker_measures_the_cost_model_its_rule_prices_on_or_refuses_the_rule():
    """Speculation off (no HistoSpec cost model) and none given: a worker whose config runs a remaining rule
    measures one at start-up (its plain steps, by batch size); one whose config does not refuses the rule in one
    line (the pool would otherwise price its moves on nothing)."""
    remaining = worker_config(64, num_slots=2, speculative="off", backend="ray", num_workers=2, migration=True,
                              migration_rule="remaining")
    worker = RolloutWorker(tiny_decoder(), None, remaining)
    assert worker.cost.measured and worker.cost.seqs_grid == [1, 2] and worker.cost(1, 1) > 0
    plain = RolloutWorker(tiny_decoder(), None, worker_config(64, num_slots=2, speculative="off"))
    assert plain.cost is None
    with pytest.raises(ValueError, match="prices moves on a cost model"):
        plain.hand_over(rule="remaining")
    assert plain.hand_over(rule="half_busiest") == []  # no rollout runs: nothing to hand over
