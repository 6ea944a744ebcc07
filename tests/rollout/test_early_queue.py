"""The siblings' early warning on a rollout worker (`rollout/early_queue.py`, rule `remaining+early`): the
worker holds its call's requests back from the engine, admits one member of each group first, then a waiting
sibling whose group has run past its prediction ahead of the others; a hand-over prices the held requests
too. On a stand-in engine (its unfinished requests and its queue), so that every step is set by the test."""

from types import SimpleNamespace

from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.engine.sequence import Status
from rhymerl.histopipe.predict import LengthPredictor
from rhymerl.histopipe.rebalance import pool_moves
from rhymerl.rollout.early_queue import EarlyQueue

A, B = [1, 2, 3], [4, 5, 6]  # A's history says 100 tokens, B's 10
PARAMS = SamplingParams(max_tokens=400, seed=1)
GROWING = lambda tokens, seqs=1: 0.5 + 0.5 * seqs  # noqa: E731  (a step of n sequences: 0.5 + 0.5 n seconds)


class Engine:
    """What EarlyQueue reads of an engine: its unfinished requests, and a request queued."""

    def __init__(self):
        self.requests = []

    def unfinished(self):
        return [q for q in self.requests if q.status == Status.WAITING] + \
               [q for q in self.requests if q.status == Status.RUNNING]

    def add_request(self, prompt_ids, params, request_id):
        if not prompt_ids:
            raise ValueError(f"request {request_id!r}: empty prompt")
        self.requests.append(SimpleNamespace(request_id=request_id, prompt_ids=prompt_ids, output_ids=[],
                                             status=Status.WAITING))

    def run(self, request_id, tokens):
        q = next(q for q in self.requests if q.request_id == request_id)
        q.status, q.output_ids = Status.RUNNING, [7] * tokens
        return q

    def finish(self, request_id):
        q = next(q for q in self.requests if q.request_id == request_id)
        self.requests.remove(q)
        return SimpleNamespace(request_id=request_id, prompt_ids=q.prompt_ids, token_ids=q.output_ids)


def predictor():
    p = LengthPredictor(cap=400)
    p.record(A, [100, 96, 104, 100])
    p.record(B, [10, 9, 11, 10])
    return p


def queue(slots=2):
    live = predictor()
    ids = ["a0", "a1", "b0", "b1"]
    return EarlyQueue([A, A, B, B], ids, PARAMS, slots, lambda: live), live



def started(q: EarlyQueue) -> "Engine":
    """A stand-in engine holding what the queue lets in first (`EarlyQueue.start`)."""
    engine = Engine()
    for prompt, rid in zip(*q.start(0)):
        engine.add_request(prompt, PARAMS, rid)
    return engine

def test_one_member_of_each_group_enters_first():
    q, _ = queue()
    prompts, ids = q.start(0)
    assert ids == ["a0", "b0"] and prompts == [A, B]
    assert [h.request_id for h in q.held] == ["a1", "b1"]
    q, _ = queue()
    assert q.start(1) == ([A], ["a0"])  # the engine adopts a continuation first: one slot is left
    q, _ = queue()
    assert q.start(2) == ([A], ["a0"])  # at least one, beside continuations that may be rejected


def test_a_sibling_that_outgrew_its_prediction_renews_the_waiting_ones_and_they_enter_first():
    q, _ = queue()
    engine = started(q)
    engine.run("a0", 20)  # on time for 100
    engine.run("b0", 50)  # far past B's 10: B has shifted
    q.finished(engine.finish("b0"), engine)  # a slot frees: a1 was next in line, b1 is renewed and goes first
    assert [r.request_id for r in engine.requests] == ["a0", "b1"] and q.renewals == 1
    assert [h.request_id for h in q.held] == ["a1"]


def test_without_a_renewal_the_probe_order_stands():
    q, _ = queue()
    engine = started(q)
    engine.run("a0", 20)
    engine.run("b0", 9)  # within B's prediction
    q.finished(engine.finish("b0"), engine)
    assert [r.request_id for r in engine.requests] == ["a0", "a1"] and q.renewals == 0
    assert q.outputs == {}  # a0, b0 came back through the engine's own results; a1 has not finished


def test_a_rejected_request_comes_back_as_an_error_alone():
    live = predictor()
    q = EarlyQueue([A, [], B], ["a0", "x", "b0"], PARAMS, 1, lambda: live)
    engine = started(q)
    engine.run("a0", 5)
    q.finished(engine.finish("a0"), engine)
    assert q.outputs["x"].finish_reason == "error" and "empty prompt" in q.outputs["x"].error
    q.feed(engine)
    assert [r.request_id for r in engine.requests] == ["b0"]


def test_a_hand_over_prices_the_held_ones_at_their_renewed_length_and_queues_what_it_takes():
    q, live = queue()
    engine = started(q)
    engine.run("a0", 90)
    engine.run("b0", 60)  # b1, held, is renewed from b0's 60 tokens
    running = [r for r in engine.unfinished() if r.status == Status.RUNNING]
    plain = pool_moves(running, q.held, live, GROWING, 2)  # as rule "remaining": b1 priced at B's 10
    picked = q.moves(engine, GROWING)
    assert "b1" in [r.request_id for r in picked] and "b1" not in [r.request_id for r in plain]
    assert "b1" in [r.request_id for r in engine.requests]  # queued, so that the engine can extract it
    assert "b1" not in [h.request_id for h in q.held]
