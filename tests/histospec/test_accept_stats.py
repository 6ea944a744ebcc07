"""Accept statistics count only the tokens the output kept: draft tokens accepted past an EOS or a stop
string are dropped from the response, and must not count as accepted."""

import pytest
import torch

from rhymerl.engine.engine import Engine
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.history import HistoryStore
from helpers import speculator
from tiny_models import random_prompts, tiny_decoder

PROMPTS = random_prompts(4, seed=11)
PARAMS = SamplingParams(temperature=1.0, max_tokens=24, seed=3)


class CharTokenizer:
    """Token i is the character chr(0x100 + i): enough for stop strings (the engine decodes output tails)."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(0x100 + int(i)) for i in ids)


@pytest.fixture(scope="module")
def setup():
    """A peaky model, its responses (without any EOS) as the history: the run to come draws the same tokens
    (same seed and request ids), so a draft copies them through whatever token later ends a response; and
    the token at position 10 of each response, where it does not occur before position 3 in any, as the
    tokens that end responses midway (EOS or stop strings)."""
    model = tiny_decoder("llama")
    with torch.no_grad():
        model.norm.weight.mul_(6.0)
    outs = Engine(model, num_slots=4, max_model_len=64, eos_token_ids=[]).generate(PROMPTS, PARAMS)
    history = HistoryStore()
    for prompt, o in zip(PROMPTS, outs):
        history.record_rollout(prompt, [o.token_ids])
    enders = sorted({o.token_ids[10] for o in outs
                     if all(o.token_ids[10] not in other.token_ids[:3] for other in outs)})
    assert enders
    return model, history, enders


def run(model, history, eos, tokenizer, params, drafter_sees_eos=True):
    """Plain and HistoSpec outputs, the engine's SpecStats, and how many accepted draft tokens the output
    dropped (seen from the verified paths handed to the speculator)."""
    def make(spec):
        return Engine(model, tokenizer, num_slots=4, max_model_len=64, eos_token_ids=eos, 
                      speculator=speculator(spec, history))

    plain = make("off").generate(PROMPTS, params)
    eng = make("histospec")
    if not drafter_sees_eos:  # a drafter that drafts through the EOS (as one unaware of a generation EOS would)
        eng.speculator.drafter.eos_token_ids = frozenset()
    dropped = [0]
    commit = eng.speculator.commit

    def spy(seqs, drafts, verified, appended, *a, **kw):
        for v, new in zip(verified, appended):
            dropped[0] += max(len(v.path) - len(new), 0)
        return commit(seqs, drafts, verified, appended, *a, **kw)

    eng.speculator.commit = spy
    spec = eng.generate(PROMPTS, params)
    return plain, spec, eng.speculator.stats, dropped[0]


def check_kept(plain, spec, stats):
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert stats.accepted == sum(o.spec.accepted for o in spec) > 0
    for o in spec:
        # Each forward of a request appends its kept accepted draft tokens and the bonus token, except that
        # the last one may end inside the draft (then no bonus): so the response holds exactly the kept
        # accepted tokens plus one per forward, less at most one. Counting dropped tokens breaks this.
        assert o.forwards - 1 <= len(o.token_ids) - o.spec.accepted <= o.forwards, o.request_id


def test_tokens_accepted_past_eos_do_not_count(setup):
    model, history, enders = setup
    plain, spec, stats, dropped = run(model, history, enders, None, PARAMS, drafter_sees_eos=False)
    assert any(o.finish_reason == "stop" for o in plain)
    assert dropped > 0  # the case happened: accepted draft tokens after the EOS were cut from the output
    check_kept(plain, spec, stats)


def test_tokens_accepted_past_a_stop_string_do_not_count(setup):
    model, history, enders = setup
    params = SamplingParams(**{**PARAMS.__dict__, "stop": tuple(CharTokenizer().decode([t]) for t in enders)})
    plain, spec, stats, dropped = run(model, history, [], CharTokenizer(), params)
    assert any(o.finish_reason == "stop" for o in plain)
    assert dropped > 0
    check_kept(plain, spec, stats)
