"""The Ray rollout pool on a real local Ray cluster (one per test session): the same outputs as the in-process pool,
versioned weights, history shipped as slices, a killed worker replaced without changing the step's outputs."""

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import ray

import rhymerl
from rhymerl.cost_model import CostModel
from rhymerl.errors import UserError
from rhymerl.history import HistoryStore
from rhymerl.model.weights import load_decoder
from rhymerl.rollout import LocalPool, RolloutGroup, RolloutWorker, SamplingParams, StaleWeightsError
from rhymerl.histopipe.plan import static_split
from rhymerl.rollout.ray_pool import RayPool, worker_resources
from rhymerl.rollout.types import WorkersFailed
from helpers import worker_config
from tiny_models import peaky_checkpoint, random_prompts

FLAT = CostModel([1, 64], [1, 64], [[1.0, 1.0], [1.0, 1.0]])  # drafts are free: always draft
PARAMS = SamplingParams(temperature=0.3, max_tokens=16, seed=3)
LONG = SamplingParams(temperature=0.3, max_tokens=40, seed=3)  # long enough to be killed in the middle
CONFIG = worker_config(num_slots=4, max_draft_tokens=8)


@pytest.fixture(scope="module")
def peaky_dir(tmp_path_factory):
    return peaky_checkpoint(tmp_path_factory.mktemp("peaky"))


@pytest.fixture(scope="module")
def policy(peaky_dir):
    return load_decoder(peaky_dir)


@pytest.fixture(scope="module")
def pool(cluster, policy, peaky_dir):
    """Two workers, shared by the tests of the module (each leaves it usable by the next)."""
    pool = RayPool(policy, None, peaky_dir, CONFIG, HistoryStore(), num_workers=2, cost_model=FLAT)
    yield pool
    pool.close()


def local_pool(policy, history=None):
    return LocalPool(RolloutWorker(policy, None, CONFIG, cost_model=FLAT),
                     HistoryStore() if history is None else history)


def groups(prompts, n=2, tag="s0"):
    return [RolloutGroup(p, [f"{tag}-p{i}-g{g}" for g in range(n)]) for i, p in enumerate(prompts)]


def tokens(result):
    return [(o.request_id, o.token_ids) for o in result.outputs]


def test_static_split_and_resources():
    assert static_split(5, 2) == [[0, 1, 2], [3, 4]]  # the pool's static schedule: histopipe.plan's
    assert static_split(1, 3) == [[0], [], []]
    assert worker_resources(2, "cpu", 2.0) == (1.0, 0, 1)
    assert worker_resources(1, "cpu", 2.0) == (2.0, 0, 2)
    assert worker_resources(4, "cuda", 2.0) == (0.5, 1, 1)


def test_the_workers_draft_from_the_first_workers_measured_cost_model(cluster, policy, peaky_dir):
    """Without a cost model given, the first worker measures one and the others start with it (ray_pool's
    module doc: workers measuring their own under each other's load drafted differently), and the plan
    prices with the same model. It runs before the tests that take the module's `pool`: that pool would hold
    the cluster's 2 CPUs, and this one's workers would wait for them."""
    pool = RayPool(policy, None, peaky_dir, CONFIG, HistoryStore(), num_workers=2)
    try:
        first, second = (s["cost"] for s in pool.spec_state())
        assert first["measured"] and first == second
        assert pool._plan_cost().as_dict() == first
    finally:
        pool.close()


def test_two_workers_give_what_the_local_pool_gives(pool, policy):
    assert ray.get([a.threads.remote() for a in pool.actors.values()]) == [1, 1]  # 2 cores, 2 workers
    prompts = random_prompts(5, seed=7)
    result = pool.rollout(groups(prompts), PARAMS)
    local = local_pool(policy).rollout(groups(prompts), PARAMS)
    assert tokens(result) == tokens(local)
    logprobs = [x for o in local.outputs for x in o.logprobs]
    assert [x for o in result.outputs for x in o.logprobs] == pytest.approx(logprobs, abs=1e-5)
    assert [(w.worker, w.requests) for w in result.workers] == [(0, 6), (1, 4)]  # 3 groups and 2
    assert result.engine_totals().generated_tokens == local.engine_totals().generated_tokens
    assert result.weights_version == pool.weights_version


def test_recorded_history_reaches_the_workers_as_slices(pool):
    prompts = random_prompts(4, seed=8)
    first = pool.rollout(groups(prompts, tag="e1"), PARAMS)
    assert sum(w.history_prompts_replaced for w in first.workers) == 0
    for i, p in enumerate(prompts):
        pool.record(p, [o.token_ids for o in first.outputs[2 * i : 2 * i + 2]], [1.0, 0.0])
    second = pool.rollout(groups(prompts, tag="e2"), PARAMS)
    assert [w.history_prompts_replaced for w in second.workers] == [2, 2]  # each worker its own prompts' slice
    assert second.spec_totals().accepted_by_source["history"] > 0
    again = pool.rollout(groups(prompts, tag="e3"), PARAMS)
    assert sum(w.history_prompts_replaced for w in again.workers) == 0  # nothing changed: nothing replaced


def test_weights_are_versioned_and_a_stale_worker_refuses(pool, policy):
    prompts = random_prompts(3, seed=9)
    before = pool.rollout(groups(prompts), PARAMS)
    version = pool.weights_version + 1
    changed = {name: p.detach() * 0.5 for name, p in policy.named_parameters()}
    pool.load_weights(changed, version=version)
    after = pool.rollout(groups(prompts), PARAMS)
    assert after.weights_version == version and tokens(after) != tokens(before)
    local = local_pool(policy)
    local.load_weights(changed, version=version)
    assert tokens(after) == tokens(local.rollout(groups(prompts), PARAMS))
    empty = HistoryStore().export([])
    with pytest.raises(StaleWeightsError, match=f"version {version}"):
        ray.get(pool.actors[1].rollout.remote(groups(prompts), PARAMS, empty, version + 1))


def cpu_seconds(pid: int) -> float:
    """The CPU time process `pid` has used (user + system, from /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        utime, stime = f.read().rsplit(")", 1)[1].split()[11:13]
    return (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")


def test_a_worker_killed_mid_step_is_replaced_and_its_requests_run_again(pool):
    prompts = random_prompts(8, seed=10)
    undisturbed = pool.rollout(groups(prompts, tag="f"), LONG)
    restarts, victim = list(pool.restarts), pool.pids[1]
    busy_from = cpu_seconds(victim) + 0.05
    result = {}
    call = threading.Thread(target=lambda: result.update(r=pool.rollout(groups(prompts, tag="f"), LONG)))
    call.start()
    while cpu_seconds(victim) < busy_from and call.is_alive():  # wait until the worker is rolling out
        time.sleep(0.002)
    os.kill(victim, signal.SIGKILL)
    call.join(timeout=120)
    assert pool.restarts == [restarts[0], restarts[1] + 1], "the kill did not land inside the call"
    assert pool.pids[1] != victim
    assert tokens(result["r"]) == tokens(undisturbed)  # every response once, the same tokens


def test_only_the_ray_backend_imports_ray():
    """Ray is imported by the Ray backend's modules only, the pool and its call driver (the driver's side), its
    stream and its actor, so that the rest of rhymerl does not import it (`from rhymerl.rollout import ...`
    stays free of ray)."""
    src = Path(rhymerl.__file__).parent
    importers = sorted(p.relative_to(src).as_posix() for p in src.rglob("*.py")
                       if re.search(r"^\s*(import ray|from ray[. ])", p.read_text(), re.MULTILINE))
    assert importers == ["rl/ray_ranks.py", "rollout/ray_actor.py", "rollout/ray_call.py", "rollout/ray_pool.py",
                         "rollout/ray_stream.py"]  # rl/ray_ranks.py: the update's ranks as Ray actors


def test_a_worker_whose_rollout_raises_is_restarted_as_the_local_one_is(pool, capfd):
    """The local pool's policy: a rollout that raises inside the worker (here its HistoSpec state is corrupt,
    so drafting raises a TypeError) does not end the call: the worker is replaced on the current weights and
    its groups run again there, the same tokens as undisturbed (the fresh actor's state is whole)."""
    prompts = random_prompts(4, seed=13)
    first = pool.rollout(groups(prompts, tag="x1"), PARAMS)
    for i, p in enumerate(prompts):  # history to draft from: worker 1 drafts in the next call
        pool.record(p, [o.token_ids for o in first.outputs[2 * i: 2 * i + 2]], [1.0, 0.0])
    undisturbed = pool.rollout(groups(prompts, tag="x2"), PARAMS)
    assert undisturbed.spec_totals().drafted > 0
    state = ray.get(pool.actors[1].spec_state.remote())
    corrupt = {**state, "calibration": {k: [[None] * len(r) for r in rows] for k, rows in state["calibration"].items()}}
    ray.get(pool.actors[1].load_spec_state.remote(corrupt))
    restarts, victim = list(pool.restarts), pool.pids[1]
    result = pool.rollout(groups(prompts, tag="x2"), PARAMS)
    assert pool.restarts == [restarts[0], restarts[1] + 1] and pool.pids[1] != victim
    assert tokens(result) == tokens(undisturbed)
    assert re.search(r"worker 1 raised TypeError: .*: restarting it", capfd.readouterr().err)


def test_more_gpu_workers_than_gpus_are_refused_at_once(cluster, policy, peaky_dir):
    """On CUDA each worker takes a GPU; this cluster has none, so two CUDA workers could never start: Ray
    would wait for the GPUs forever. Refused before any actor is asked for, naming the key."""
    started = time.monotonic()
    with pytest.raises(UserError, match=r"rollout.num_workers=2: .*the Ray cluster has 0"):
        RayPool(policy, None, peaky_dir, CONFIG, HistoryStore(), num_workers=2, device="cuda")
    assert time.monotonic() - started < 30


def test_a_hung_worker_times_out_and_one_failing_too_often_is_dropped(pool, policy):
    """The module's last test on the pool (it leaves one worker): a second pool would not fit the 2 CPUs."""
    pool.timeout_s, pool.max_restarts = 3.0, pool.restarts[1] + 1  # worker 1 may be restarted once more
    prompts = random_prompts(6, seed=11)
    quarter = {name: p.detach() * 0.25 for name, p in policy.named_parameters()}
    pool.load_weights(quarter, pool.weights_version + 1)
    local = local_pool(policy)
    local.load_weights(quarter, pool.weights_version)
    expected = tokens(local.rollout(groups(prompts), LONG))
    restarts = list(pool.restarts)
    os.kill(pool.pids[1], signal.SIGSTOP)  # alive but not answering
    hung = pool.rollout(groups(prompts), LONG)
    assert pool.restarts == [restarts[0], restarts[1] + 1] and tokens(hung) == expected
    os.kill(pool.pids[1], signal.SIGKILL)  # a failure past max_restarts: dropped
    dropped = pool.rollout(groups(prompts), LONG)
    assert pool.workers == [0] and tokens(dropped) == expected
    assert [w.worker for w in dropped.workers] == [0, 0]  # its own share, then worker 1's
    pool.max_restarts = pool.restarts[0]
    os.kill(pool.pids[0], signal.SIGKILL)
    with pytest.raises(WorkersFailed, match="no rollout worker is left"):
        pool.rollout(groups(prompts), LONG)

