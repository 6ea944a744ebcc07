"""rollout.stream (rollout.mode=one_step_off): each token's policy version carried back with it, the
per-token staleness metrics, and tiny runs on a real local Ray cluster: the stream trains exactly as
one_step_off without it, starts a worker's share of step t+1 as soon as its share of t is done (before the
driver has scored step t), resumes exactly, and its per-worker timeline is the simulator's
(`histopipe.simulate.ready_times`) replayed on the run's own shares and updates."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

import rhymerl.rl.loop as loop_module
from rhymerl.config import ConfigError, load_config
from rhymerl.cost_model import CostModel
from rhymerl.engine.sequence import Continuation, RequestOutput
from rhymerl.histopipe.simulate import ready_times
from rhymerl.history import HistoryStore
from rhymerl.rl.loop import TrainingRun
from rhymerl.rl.step_metrics import staleness_metrics
from rhymerl.rollout import RolloutGroup, RolloutWorker, SamplingParams
from helpers import learned as _learned, one_step_off_overrides, train_rows as _train, worker_config
from tiny_models import random_prompts, tiny_decoder, tiny_smol_checkpoint

FLAT = CostModel([1, 64], [1, 64], [[1.0, 1.0], [1.0, 1.0]])  # drafting is free: always draft
SCORE_S = 0.1  # the reward's sleep per completion: the driver's scoring of a step (6 completions) takes 0.6 s


# ---- versions and staleness, without Ray ------------------------------------------------------------------

def test_a_worker_stamps_each_token_with_the_version_that_sampled_it():
    worker = RolloutWorker(tiny_decoder(), None, worker_config(num_slots=4, speculative="off"))
    worker.load_weights(dict(worker.model.named_parameters()), version=3)
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=1)
    prompt = random_prompts(1, seed=4)[0]
    # a request begun elsewhere on version 1 (two tokens), and one that carries no versions (a migration
    # within one call: sampled on the call's version)
    old = Continuation("c-old", prompt, [5, 6], [-1.0, -1.0], params, versions=[1, 1])
    bare = Continuation("c-bare", prompt, [5], [-1.0], params)
    outputs, _ = worker.rollout([RolloutGroup(prompt, ["g0", "g1"])], params, HistoryStore().export([]), 3,
                                continuations=[old, bare])
    by_id = {o.request_id: o for o in outputs}
    for o in outputs:
        assert len(o.versions) == len(o.token_ids) > 0
    assert set(by_id["g0"].versions) == set(by_id["g1"].versions) == {3}
    assert by_id["c-old"].versions == [1, 1] + [3] * (len(by_id["c-old"].token_ids) - 2)
    assert set(by_id["c-bare"].versions) == {3}


def test_staleness_is_over_the_trained_tokens():
    def out(versions):
        return RequestOutput("r", [1], [7] * len(versions), [0.0] * len(versions), "stop", versions=versions)
    m = staleness_metrics(4, [out([3, 3, 4]), out([2])])  # ages 1, 1, 0 and 2
    assert m == {"rollout/staleness_mean": 1.0, "rollout/staleness_max": 2}
    assert staleness_metrics(4, [out([])]) == {}


def test_the_stream_needs_one_step_off_and_migrates_by_its_rules_without_deferral():
    ray = ["rollout.backend=ray", "rollout.num_workers=2"]
    with pytest.raises(ConfigError, match=r"rollout\.stream: must be false unless rollout\.mode=one_step_off"):
        load_config(None, ray + ["rollout.stream=true"])
    stream = ray + ["rollout.mode=one_step_off", "rollout.stream=true", "rollout.migration=true"]
    with pytest.raises(ConfigError,
                       match=r"rollout\.migration_rule: must be one of half_busiest, remaining with rollout\.stream"):
        load_config(None, stream + ["rollout.migration_rule=tail"])
    assert load_config(None, stream + ["rollout.migration_rule=remaining"]).rollout.migration_rule == "remaining"
    with pytest.raises(ConfigError, match=r"rollout\.defer_tail: must be false with rollout\.migration=true"):
        load_config(None, stream + ["rollout.defer_tail=true"])
    assert load_config(None, stream).rollout.migration
    assert load_config(None, ray + ["rollout.mode=one_step_off", "rollout.stream=true"]).rollout.stream


def test_the_simulators_rule_waits_for_the_checkpoints_weights_after_a_checkpoint():
    """one_step_off: step 4 runs on the update of step 2; right after a checkpoint (run.save_every=3), on the
    update of step 3, as in sync mode and as the loop does (`background_rollout.rolls_ahead`)."""
    updates = [(1.0, 2.0), (3.0, 4.0), (5.0, 6.0)]  # steps 1-3's updates
    assert ready_times([0.0, 5.0], updates, 4, "one_step_off") == [4.0, 5.0]
    assert ready_times([0.0, 5.0], updates, 4, "one_step_off", save_every=3) == [6.0, 6.0]
    assert ready_times([0.0, 5.0], updates, 4, "sync") == [6.0, 6.0]
    assert ready_times([0.0, 0.0], [], 1, "one_step_off", save_every=1) == [0.0, 0.0]  # the first step


# ---- tiny runs on a real local Ray cluster ------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_dir) -> Path:
    path = tiny_smol_checkpoint(tmp_path_factory.mktemp("tiny-smol"), smollm2_dir, embed_std=0.3)
    (path / "reward_fns.py").write_text(
        "import time\n"
        "def slow_length_mod(completion, ground_truth, data_source, prompt):\n"
        f"    time.sleep({SCORE_S})\n"
        "    return len(completion or '') % 7 / 6\n")
    return path


def _config(tiny_dir: Path, out: Path, *extra: str):
    return load_config(None, one_step_off_overrides(tiny_dir, out, "slow_length_mod", "rollout.speculative=off",
                                                    *extra, prompts=8, micro_batch=6))


class Recorder:
    """Each step's rollout result, when the loop had it, and when each weights version was published."""

    def __init__(self, run: TrainingRun, monkeypatch):
        self.results, self.published, self.scored = {}, {0: 0.0}, []
        score = run.scorer.score

        def scored(*args, **kw):
            out = score(*args, **kw)
            self.scored.append(time.time())  # step len(self.scored) scored (val.every=0: one call a step)
            return out
        monkeypatch.setattr(run.scorer, "score", scored)
        write = loop_module.append_timeline

        def record(run_dir, step, result):
            self.results[step] = result
            write(run_dir, step, result)
        monkeypatch.setattr(loop_module, "append_timeline", record)
        sink = run.stream or run.pool
        load = sink.load_weights

        def published(params, version):
            load(params, version)
            self.published[version] = time.time()
        monkeypatch.setattr(sink, "load_weights", published)


def _shares(result) -> dict[int, tuple[float, float]]:
    return {w.worker: (w.started, w.finished) for w in result.workers}


@pytest.fixture(scope="module")
def plain_rows(cluster, tiny_dir, tmp_path_factory):
    """one_step_off without the stream: 4 steps, and the time each step's shares started."""
    with pytest.MonkeyPatch.context() as mp:
        run = TrainingRun(_config(tiny_dir, tmp_path_factory.mktemp("plain"), "train.total_steps=4",
                                  "run.save_every=0"), cost_model=FLAT)
        rec = Recorder(run, mp)
        return _train(run), rec


@pytest.fixture(scope="module")
def stream_rows(cluster, tiny_dir, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        run = TrainingRun(_config(tiny_dir, tmp_path_factory.mktemp("stream"), "train.total_steps=4",
                                  "run.save_every=0", "rollout.stream=true"), cost_model=FLAT)
        rec = Recorder(run, mp)
        return _train(run), rec


def test_the_stream_trains_exactly_as_one_step_off(plain_rows, stream_rows):
    (plain, _), (stream, _) = plain_rows, stream_rows
    assert [r["step"] for r in stream] == [1, 2, 3, 4]
    assert [_learned(r) for r in stream] == [_learned(r) for r in plain]  # the same tokens, versions, losses
    assert [r["rollout/staleness_mean"] for r in stream] == [0, 1, 1, 1]
    assert [r["rollout/staleness_max"] for r in stream] == [0, 1, 1, 1]
    assert all(r["actor/tis_weight_mean"] != 1.0 for r in stream[1:])  # TIS corrects the stale tokens


def test_a_worker_starts_the_next_step_before_the_driver_has_scored_this_one(plain_rows, stream_rows):
    """Scoring a step takes the driver 0.6 s (the reward sleeps). Without the stream, step t+1 starts after
    the driver has scored step t; with it, each worker's share of t+1 is already queued and starts when its
    share of t is done and the weights it runs on exist (the update of step t-1), before step t is scored."""
    for (_, rec), streamed in ((plain_rows, False), (stream_rows, True)):
        for t in (2, 3, 4):  # steps (from 1) rolled out ahead
            scored = rec.scored[t - 2]  # when the driver had scored step t-1
            starts = [a for a, _ in _shares(rec.results[t]).values()]
            if streamed:
                assert max(starts) < scored, (t, [s - scored for s in starts])
            else:
                assert min(starts) > scored, (t, [s - scored for s in starts])


def test_the_simulator_replays_the_streams_timeline(stream_rows):
    """`ready_times`, the simulator's rule for one_step_off, fed the run's own share ends and updates (from a
    step's groups all in to its weights published), gives each worker's start of each share, to within the
    driver's and Ray's overheads."""
    _, rec = stream_rows
    steps = sorted(rec.results)
    updates, worker_end = [], {w: 0.0 for w in _shares(rec.results[1])}
    for t in steps:
        shares = _shares(rec.results[t])
        ready = dict(zip(worker_end, ready_times(list(worker_end.values()), updates, t, "one_step_off")))
        if t > 1:  # the first step starts when the run has started; later ones as the rule says
            for w, (start, _) in shares.items():
                assert abs(start - ready[w]) < 0.3, (t, w, start - ready[w])
                assert start >= worker_end[w], (t, w)  # a worker runs its shares in step order
        worker_end |= {w: end for w, (_, end) in shares.items()}
        updates.append((rec.results[t].finished, rec.published[t]))


def test_a_streamed_run_resumes_exactly(cluster, tiny_dir, tmp_path):
    out = tmp_path / "run"
    rows = _train(TrainingRun(_config(tiny_dir, out, "train.total_steps=4", "run.save_every=2",
                                      "rollout.stream=true"), cost_model=FLAT))
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 0, 1]  # step 3 follows a checkpoint
    shutil.rmtree(out / "checkpoints" / "step_000004")
    resumed = _train(TrainingRun.resume(out, cost_model=FLAT))
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [_learned(r) for r in resumed[2:]] == [_learned(r) for r in rows[2:]]
