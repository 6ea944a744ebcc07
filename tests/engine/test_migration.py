"""Migration between engines: a request taken out of one engine at a step boundary
(`Engine.extract`) and adopted by another on the same weights (`Engine.adopt`) ends exactly as it would have
on the first: the same tokens and, to float tolerance, the same logprobs (fp32; sampled and greedy;
HistoSpec on and off; EOS on). The adopting engine counts the migration and its re-prefill."""

import functools
from dataclasses import replace

import pytest
import torch

from rhymerl.engine.engine import Engine
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.engine.sequence import Continuation
from rhymerl.history import HistoryStore
from helpers import speculator
from tiny_models import VOCAB, random_prompts, tiny_decoder

PROMPTS = random_prompts(4, seed=71)
BATCH = [p for p in PROMPTS for _ in range(2)]  # 2 siblings per prompt
IDS = [f"p{i}-g{g}" for i in range(4) for g in range(2)]
MOVED = ["p0-g1", "p1-g0", "p3-g0", "p3-g1"]  # running after a few steps (4 slots), and waiting ones


@functools.lru_cache(maxsize=None)
def peaky():
    """The tiny llama sharpened (as tests/histospec/test_lossless.py), so that history drafts get accepted."""
    model = tiny_decoder("llama")
    with torch.no_grad():
        model.norm.weight.mul_(6.0)
    return model


def engine(spec: str, eos, history=None) -> Engine:
    return Engine(peaky(), num_slots=4, max_model_len=96, eos_token_ids=eos, 
                  speculator=speculator(spec, history))


@functools.lru_cache(maxsize=None)
def setup(temperature: float):
    """Params, an EOS token that ends some responses midway (the second most frequent token the model
    emits), a history of 3 earlier epochs, and the unmigrated plain outputs."""
    params = SamplingParams(temperature=temperature, max_tokens=24, seed=5)
    probe = engine("off", []).generate(BATCH, params, request_ids=IDS)
    ranked = torch.bincount(torch.tensor([t for o in probe for t in o.token_ids]), minlength=VOCAB).argsort(
        descending=True).tolist()
    eos = [ranked[1]]
    history = HistoryStore()
    for e in range(3):
        outs = engine("off", eos).generate(PROMPTS, replace(params, seed=100 + e))
        for prompt, o in zip(PROMPTS, outs):
            history.record_rollout(prompt, [o.token_ids], [1.0])
    plain = engine("off", eos).generate(BATCH, params, request_ids=IDS)
    return params, eos, history, plain


def run_migrated(spec: str, temperature: float, k: int, moved=MOVED, mutate=None):
    """The batch on engine A; after `k` steps the unfinished requests of `moved` go to engine B (same
    weights), each engine runs to the end. Returns (outputs in IDS order, continuations moved, A, B)."""
    params, eos, history, _ = setup(temperature)
    a, b = engine(spec, eos, history), engine(spec, eos, history)
    for prompt, rid in zip(BATCH, IDS):
        a.add_request(prompt, params, rid)
    done = {}

    def run(eng: Engine, steps: int | None = None) -> None:
        while eng.has_unfinished() and (steps is None or steps > 0):
            done.update({ev.request_id: ev.output for ev in eng.step() if ev.output is not None})
            steps = None if steps is None else steps - 1

    run(a, k)
    unfinished = {q.request_id for q in a.unfinished()}
    conts = [a.extract(rid) for rid in moved if rid in unfinished]
    for c in conts:
        b.adopt(mutate(c) if mutate else c)
    run(a)
    run(b)
    return [done[rid] for rid in IDS], conts, a, b


@pytest.mark.parametrize("spec", ["off", "histospec"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("k", [3, 7])
def test_a_migrated_request_ends_as_the_unmigrated_one(spec, temperature, k):
    *_, plain = setup(temperature)
    outs, conts, a, b = run_migrated(spec, temperature, k)
    assert any(c.output_ids for c in conts), "no request was moved mid-response"
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert [o.finish_reason for o in outs] == [o.finish_reason for o in plain]
    for got, want in zip(outs, plain):
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-4, rtol=1e-4)
    assert any(o.finish_reason == "stop" for o in plain)  # EOS ended some responses
    assert a.stats.handed_over == b.stats.migrations == len(conts)
    running = [c for c in conts if c.output_ids]
    # each re-prefilled its generated tokens and at least its prompt's last token
    assert b.stats.migration_prefill_tokens >= sum(len(c.output_ids) + 1 for c in running)
    assert b.stats.migration_prefill_s > 0 and a.stats.migrations == 0
    if spec == "histospec":
        assert a.speculator.stats.accepted > 0  # drafts were verified and followed
    # every token was drawn once: by A before the hand-over, or by B after it
    assert a.stats.generated_tokens + b.stats.generated_tokens == sum(len(o.token_ids) for o in plain)


def test_the_comparison_catches_a_wrong_continuation():
    """A continuation whose generated tokens are not the ones it drew (here reversed) decodes on from
    another context: the check above would fail."""
    *_, plain = setup(1.0)
    outs, conts, _, _ = run_migrated("off", 1.0, 7, mutate=lambda c: replace(c, output_ids=c.output_ids[::-1]))
    assert any(len(c.output_ids) > 1 for c in conts)
    assert [o.token_ids for o in outs] != [o.token_ids for o in plain]


def test_extract_frees_the_slot_and_names_what_it_cannot_take():
    params, eos, _, _ = setup(1.0)
    eng = engine("off", eos)
    for prompt, rid in zip(BATCH, IDS):
        eng.add_request(prompt, params, rid)
    eng.step()
    assert len(eng.scheduler.running) == 4 and len(eng.scheduler.waiting) == 4
    c = eng.extract("p0-g0")
    assert isinstance(c, Continuation) and len(c.output_ids) == len(c.logprobs) == 1 and c.params == params
    assert len(eng.scheduler.running) == 3 and eng.scheduler.free_slots
    eng.step()
    assert len(eng.scheduler.running) == 4  # a waiting request took the freed slot
    waiting = eng.extract("p3-g1")
    assert waiting.output_ids == [] and "p3-g1" not in {q.request_id for q in eng.unfinished()}
    with pytest.raises(KeyError, match="not unfinished"):
        eng.extract("p0-g0")
    with pytest.raises(ValueError, match="1 tokens but 0 logprobs"):
        engine("off", eos).adopt(replace(c, logprobs=[]))


def test_generate_hands_over_between_steps_and_adopts_continuations():
    """`generate`'s hooks, as a rollout worker uses them: a request handed over between steps has no result
    on the engine it left; the engine that adopts it returns it after its own prompts."""
    params, eos, _, plain = setup(1.0)
    a, b = engine("off", eos), engine("off", eos)
    taken = []

    def hand_over():
        if a.stats.forward_passes == 5 and not taken:
            taken.extend(a.extract(q.request_id) for q in a.unfinished()[-3:])

    kept = a.generate(BATCH, params, request_ids=IDS, between_steps=hand_over)
    assert len(taken) == 3 and len(kept) == len(IDS) - 3
    adopted = b.generate([], params, continuations=taken)
    got = {o.request_id: o.token_ids for o in kept + adopted}
    assert got == {o.request_id: o.token_ids for o in plain}
    assert b.stats.migrations == 3
