"""rollout.reward_aware_drafting: the config key reaches the drafter, reorders drafts where rewards differ,
and leaves the tokens as they are."""

from dataclasses import replace

import pytest
import torch

from rhymerl.config import load_config
from rhymerl.engine.engine import Engine
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.history import HistoryStore
from rhymerl.rollout.worker import RolloutWorker, WorkerConfig
import helpers
from helpers import FLAT
from tiny_models import random_prompts, tiny_decoder

PROMPT = list(range(1, 11))
SHARED = [40, 41, 42, 43]
# After SHARED, three earlier responses went on with 50 (reward 0) and two with 60 (reward 1).
RESPONSES = [SHARED + [50, 51, 52]] * 3 + [SHARED + [60, 61, 62]] * 2
REWARDS = [0.0] * 3 + [1.0] * 2


def speculator(model, reward_aware: bool):
    history = HistoryStore()
    history.record_rollout(PROMPT, RESPONSES, REWARDS)
    eng = Engine(model, num_slots=2, max_model_len=64, eos_token_ids=[], 
                 speculator=helpers.speculator("histospec", history, reward_aware=reward_aware))
    return eng.speculator


@pytest.fixture(scope="module")
def model():
    return tiny_decoder("llama")


def first_child_after_shared(spec) -> tuple[int, float]:
    s = spec.start("g", PROMPT)
    draft = spec.drafter.draft(PROMPT[-4:] + SHARED, history=s.history, max_branches=2)
    root = [k for k, p in enumerate(draft.parents) if p == -1]
    return draft.tokens[root[0]], draft.probs[root[0]]


def test_drafts_differ_in_priority_when_rewards_differ(model):
    assert first_child_after_shared(speculator(model, False)) == (50, pytest.approx(3 / 5))  # by count: 3 vs 2
    # count + reward: 50 scores 3 + 0, 60 scores 2 + 2: the rewarded branch comes first
    assert first_child_after_shared(speculator(model, True)) == (60, pytest.approx(4 / 7))


def test_equal_rewards_change_nothing(model):
    spec = speculator(model, True)
    spec.history.clear()
    spec.history.record_rollout(PROMPT, RESPONSES, [1.0] * 5)  # every reward 1
    token, prob = first_child_after_shared(spec)
    assert token == 50 and prob == pytest.approx((3 + 3) / (3 + 3 + 2 + 2))  # shares as by count


def test_the_config_key_reaches_the_drafter(model):
    assert load_config().rollout.reward_aware_drafting is False  # off by default
    cfg = load_config(overrides=["rollout.reward_aware_drafting=true"])
    resolved = replace(cfg.rollout, dtype="fp32", max_draft_tokens=8)  # as the run resolves them for its machine
    worker = RolloutWorker(model, None, WorkerConfig(resolved, max_model_len=64), cost_model=FLAT)
    assert worker.engine.speculator.drafter.reward_weighted is True
    assert RolloutWorker(model, None, helpers.worker_config(num_slots=2, max_draft_tokens=8),
                         cost_model=FLAT).engine.speculator.drafter.reward_weighted is False


def test_reward_aware_drafts_keep_the_tokens():
    model = tiny_decoder("llama")
    with torch.no_grad():
        model.norm.weight.mul_(6.0)  # peaky: the history predicts, drafts get accepted
    prompts = random_prompts(4, seed=3)
    history = HistoryStore()
    for g in range(4):
        p = SamplingParams(temperature=1.0, max_tokens=20, seed=100 + g)
        outs = Engine(model, num_slots=4, max_model_len=64, eos_token_ids=[]).generate(prompts, p)
        for prompt, o in zip(prompts, outs):
            history.record_rollout(prompt, [o.token_ids], [float(g % 2)])
    params = SamplingParams(temperature=1.0, max_tokens=20, seed=5)
    plain = Engine(model, num_slots=4, max_model_len=64, eos_token_ids=[]).generate(prompts, params)
    eng = Engine(model, num_slots=4, max_model_len=64, eos_token_ids=[], 
                 speculator=helpers.speculator("histospec", history, reward_aware=True))
    spec = eng.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert eng.speculator.stats.accepted > 0
