"""The rollout interface in process: outputs as the engine gives them, versioned weights, history shipped as
slices to the worker's replica (never a shared reference)."""

import pytest
import torch

from rhymerl.cost_model import CostModel
from rhymerl.engine.engine import Engine
from rhymerl.history import HistoryStore
from rhymerl.config import RolloutSection
from rhymerl.rollout import LocalPool, RolloutGroup, RolloutWorker, SamplingParams, StaleWeightsError, WorkerConfig
from rhymerl.rollout.types import WorkersFailed
from helpers import worker_config
from tiny_models import random_prompts, tiny_decoder

FLAT = CostModel([1, 64], [1, 64], [[1.0, 1.0], [1.0, 1.0]])  # drafts are free: always draft
PARAMS = SamplingParams(temperature=0.3, max_tokens=16, seed=3)


@pytest.fixture(scope="module")
def policy():
    model = tiny_decoder("llama")
    with torch.no_grad():
        model.norm.weight.mul_(6.0)  # peaky, so that history drafts get accepted (see tests/histospec)
    return model


def make_pool(policy, history=None, admission="fifo"):
    config = worker_config(num_slots=4, max_draft_tokens=8, admission_order=admission)
    return LocalPool(RolloutWorker(policy, None, config, cost_model=FLAT), HistoryStore() if history is None else history)


def groups(prompts, n=2, tag="s0"):
    return [RolloutGroup(p, [f"{tag}-p{i}-g{g}" for g in range(n)]) for i, p in enumerate(prompts)]


def test_a_rollout_gives_what_plain_decoding_gives(policy):
    prompts = random_prompts(3, seed=7)
    result = make_pool(policy).rollout(groups(prompts), PARAMS)
    plain = Engine(policy, num_slots=4, max_model_len=64).generate(
        [p for p in prompts for _ in range(2)], PARAMS, request_ids=[f"s0-p{i}-g{g}" for i in range(3) for g in range(2)])
    assert [o.token_ids for o in result.outputs] == [o.token_ids for o in plain]
    assert [o.request_id for o in result.outputs] == [o.request_id for o in plain]
    (stats,) = result.workers
    assert stats.requests == 6 and stats.engine.generated_tokens == sum(len(o.token_ids) for o in plain)
    assert result.engine_totals().generated_tokens == stats.engine.generated_tokens
    assert stats.finished >= stats.started


def test_recorded_history_reaches_the_worker_as_a_slice(policy):
    history = HistoryStore()
    pool = make_pool(policy, history)
    prompts = random_prompts(2, seed=8)
    first = pool.rollout(groups(prompts, tag="e1"), PARAMS)
    assert first.workers[0].history_prompts_replaced == 0
    for i, p in enumerate(prompts):
        pool.record(p, [o.token_ids for o in first.outputs[2 * i : 2 * i + 2]], [1.0, 0.0])
    assert pool.worker.history is not history and len(pool.worker.history) == 0  # a replica, not a reference
    second = pool.rollout(groups(prompts, tag="e2"), PARAMS)
    assert second.workers[0].history_prompts_replaced == 2
    assert pool.worker.history.rollouts(prompts[0]) == history.rollouts(prompts[0])
    assert second.spec_totals().accepted_by_source["history"] > 0
    again = pool.rollout(groups(prompts, tag="e3"), PARAMS)
    assert again.workers[0].history_prompts_replaced == 0  # nothing changed: nothing shipped anew


def test_weights_are_versioned_and_a_stale_worker_refuses(policy):
    pool = make_pool(policy)
    prompts = random_prompts(2, seed=9)
    before = pool.rollout(groups(prompts), PARAMS)
    assert before.weights_version == 0
    changed = {name: p.detach() * 0.5 for name, p in policy.named_parameters()}
    pool.load_weights(changed, version=1)
    after = pool.rollout(groups(prompts), PARAMS)
    assert after.weights_version == 1
    assert [o.token_ids for o in after.outputs] != [o.token_ids for o in before.outputs]
    with pytest.raises(StaleWeightsError, match="version 1"):
        pool.worker.rollout(groups(prompts), PARAMS, {"format": "rhymerl.history/1", "prompts": []}, weights_version=2)


def test_weights_load_in_place_and_the_pool_needs_the_plain_policy(policy):
    """The contracts at the weight copy (`RolloutWorker.load_weights`): the parameters keep their memory (CUDA
    graphs read it) and their version counters move (the CPU backends' weight copies notice updates by them);
    and the pool is made from the policy before LoRA adapters are added (`make_pool` refuses it after)."""
    import copy

    from rhymerl.rl.lora import add_lora
    from rhymerl.rollout.factory import make_pool as make_rollout_pool

    pool = make_pool(policy)
    params = dict(pool.worker.model.named_parameters())
    before = {name: (p.data_ptr(), p._version) for name, p in params.items()}
    pool.load_weights({name: p.detach() * 0.5 for name, p in policy.named_parameters()}, version=1)
    for name, p in params.items():
        assert p.data_ptr() == before[name][0] and p._version > before[name][1], name
    adapted = add_lora(copy.deepcopy(policy), 2, 4, 0.0)
    config = worker_config(num_slots=4, max_draft_tokens=8)
    with pytest.raises(ValueError, match="before add_lora"):
        make_rollout_pool(config, "", adapted, None, "", HistoryStore())


def test_the_worker_and_the_pool_take_their_options_from_the_rollout_section(policy):
    """One owner per option: `WorkerConfig` carries the rollout section itself, checked by the section's own
    rules and with the machine's defaults resolved, and `make_pool` reads the pool's options from it."""
    from rhymerl.rollout.factory import make_pool as make_rollout_pool

    with pytest.raises(ValueError, match="rollout.dtype: must be resolved to 'bf16' or 'fp32'"):
        WorkerConfig(RolloutSection(max_draft_tokens=8), max_model_len=64)
    with pytest.raises(ValueError, match="rollout.max_draft_tokens: must be resolved to >= 1"):
        WorkerConfig(RolloutSection(dtype="fp32"), max_model_len=64)
    with pytest.raises(ValueError, match="rollout.num_workers: must be 1 with rollout.backend=local"):
        worker_config(num_workers=2)
    section = RolloutSection(dtype="fp32", speculative="off", num_slots=3, history_rollouts=2, max_worker_restarts=5)
    pool = make_rollout_pool(WorkerConfig(section, max_model_len=40), "", policy, None, "", HistoryStore())
    assert isinstance(pool, LocalPool) and pool.max_restarts == 5 and pool.worker.config.rollout is section
    engine = pool.worker.engine
    assert engine.speculator is None and engine.max_model_len == 40 and engine.scheduler.num_slots == 3
    assert pool.worker.history.max_rollouts == 2 and pool.worker.model.embed_tokens.weight.dtype == torch.float32


def test_longest_first_admission_changes_the_order_not_the_tokens(policy):
    """HistoPipe inside one worker: groups enter the queue longest predicted first (from the history), and
    keyed randomness gives every request the same tokens as in arrival order; outputs come back in the order
    given."""
    prompts = random_prompts(4, seed=10)
    history = HistoryStore()
    for p, n in zip(prompts, [3, 12, 6, 9]):  # recorded lengths: longest first is groups 1, 3, 2, 0
        history.record_rollout(p, [[5] * n] * 2)
    fifo, longest = make_pool(policy, history), make_pool(policy, history, admission="longest_first")
    admitted = []
    generate = longest.worker.engine.generate
    longest.worker.engine.generate = lambda ps, *a, **kw: admitted.extend(kw["request_ids"]) or generate(ps, *a, **kw)
    a = fifo.rollout(groups(prompts), PARAMS)
    b = longest.rollout(groups(prompts), PARAMS)
    assert [o.request_id for o in b.outputs] == [o.request_id for o in a.outputs]
    assert [o.token_ids for o in b.outputs] == [o.token_ids for o in a.outputs]
    assert [rid.split("-")[1] for rid in admitted[::2]] == ["p1", "p3", "p2", "p0"]
    with pytest.raises(ValueError, match="rollout.admission_order: must be one of"):
        worker_config(admission_order="shortest")


def test_spec_state_is_plain_data_that_a_new_pool_restores(policy):
    """What HistoSpec learned (calibration, cost model and its online correction, idle counters) leaves the
    pool as JSON-able data, one entry per worker, and a fresh pool that loads it holds the same state and
    uses the saved cost model (a resumed run's)."""
    import json

    measured = CostModel([1, 4], [1, 9], [[1e-3, 2e-3], [2e-3, 5e-3]], measured=True)  # corrected online
    config = worker_config(num_slots=4, max_draft_tokens=8)
    pool = LocalPool(RolloutWorker(policy, None, config, cost_model=measured), HistoryStore())
    prompts = random_prompts(2, seed=11)
    pool.rollout(groups(prompts), PARAMS)
    state = pool.spec_state()
    assert len(state) == 1 and json.loads(json.dumps(state)) == state  # plain data
    assert state[0]["ratio"] and any(any(r) for r in state[0]["calibration"]["den"])  # it learned something
    fresh = LocalPool(RolloutWorker(policy, None, config, cost_model=FLAT), HistoryStore())
    fresh.load_spec_state(json.loads(json.dumps(state)))
    assert fresh.spec_state() == state
    spec = fresh.worker.engine.speculator
    assert spec.cost.as_dict() == measured.as_dict() and spec.correct_cost
    assert fresh.worker.engine.cost_model is spec.cost
    off = LocalPool(RolloutWorker(policy, None, worker_config(num_slots=4, speculative="off"), cost_model=FLAT),
                    HistoryStore())
    assert off.spec_state() == [None]
    off.load_spec_state(state)  # nothing to restore into: ignored


def test_an_exception_inside_the_worker_rebuilds_it_and_loses_nothing(policy, monkeypatch):
    """A fault inside the worker's rollout (its engine raises on its third step, slots held, the call half
    done): the pool rebuilds the worker on the current weights and runs the groups again, and the call returns
    what an undisturbed one does. A worker that keeps failing stops the call past rollout.max_worker_restarts,
    with a message naming the key and the fault as its cause."""
    prompts = random_prompts(3, seed=12)
    halved = {name: p.detach() * 0.5 for name, p in policy.named_parameters()}
    undisturbed = make_pool(policy)
    undisturbed.load_weights(halved, version=1)
    expected = undisturbed.rollout(groups(prompts), PARAMS)
    pool = make_pool(policy)
    pool.load_weights(halved, version=1)  # the rebuilt worker must hold these, not the initial weights
    failing, steps = pool.worker, []

    def step_failing_once():
        steps.append(1)
        if len(steps) == 3:
            raise RuntimeError("injected fault")
        return Engine.step(failing.engine)

    failing.engine.step = step_failing_once
    result = pool.rollout(groups(prompts), PARAMS)
    assert len(steps) == 3 and pool.restarts == [1]  # it failed mid-call, once
    assert pool.worker is not failing and pool.worker.weights_version == 1
    assert [o.request_id for o in result.outputs] == [o.request_id for o in expected.outputs]
    assert [o.token_ids for o in result.outputs] == [o.token_ids for o in expected.outputs]
    assert [x for o in result.outputs for x in o.logprobs] == \
        pytest.approx([x for o in expected.outputs for x in o.logprobs], abs=1e-5)
    assert result.engine_totals().generated_tokens == expected.engine_totals().generated_tokens

    def always_failing(self):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(Engine, "step", always_failing)
    pool.max_restarts = 2  # one more rebuild, then none left
    with pytest.raises(WorkersFailed, match=r"injected fault.*rollout\.max_worker_restarts") as err:
        pool.rollout(groups(prompts), PARAMS)
    assert pool.restarts == [2] and str(err.value.__cause__) == "injected fault"
