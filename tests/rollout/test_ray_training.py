"""Training runs on Ray rollout workers, end to end on a real local Ray cluster (one per test session) and a tiny
random model in fp32: the same metrics as the in-process backend, a worker SIGKILLed mid-step now and then
changing nothing, a resume with the same or another number of workers repeating the uninterrupted run, and a
run whose last worker is dropped failing cleanly with its checkpoint intact."""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading
import time
import traceback
from pathlib import Path

import pytest

from rhymerl.config import load_config
from rhymerl.cost_model import CostModel
from rhymerl.metrics import read_metrics
from rhymerl.rl.checkpoint import latest_checkpoint, load_checkpoint
from rhymerl.rl.loop import TrainingRun
from rhymerl.rollout.types import WorkersFailed
from tiny_models import tiny_smol_checkpoint

FLAT = CostModel([1, 64], [1, 64], [[1.0, 1.0], [1.0, 1.0]])  # drafting is free: always draft
STEPS = 4  # two epochs of 4 prompts, 2 a step: the second epoch drafts from the history

REWARD_PY = '''
def vowels(completion, ground_truth, data_source, prompt):
    text = completion or " "
    return sum(c in "aeiou" for c in text) / len(text)
'''

# Metrics that may differ between backends, worker counts and restarts although every token is the same:
# - wall time and throughput (timing_s/, tokens_per_s, draft_time_share);
# - HistoSpec's figures (spec_, tokens_per_forward, forward_passes): each worker drafts from its own history
#   replica with its own calibration and idle counters, and a restarted worker starts from fresh ones, so the
#   draft trees (not the tokens: verification is lossless in fp32) depend on how the groups were split;
# - prefill_ (prefill_shared_tokens): which prompts' prefixes are shared depends on which sequences run side
#   by side in one engine, i.e. on the split;
# - logprob_diff: the rollout's log-probs of a token round differently when it was verified in a draft tree
#   (the trainer recomputes its own, so the losses do not move; only this difference does);
# - the per-worker timeline (rollout/worker<i>/..., val/worker<i>/..., bubble_ratio, finish_gap_s,
#   perf/throughput): one worker or two, a share run twice after a kill, and wall time; their totals over
#   workers are compared instead (`worker_totals`).
# Everything else must be equal bit for bit: rewards, lengths, advantages, losses, grad norms, entropy,
# history size, HistoPipe's length reports.
_MAY_DIFFER = ("timing_s/", "tokens_per_s", "draft_time_share", "spec_", "tokens_per_forward", "forward_passes",
               "prefill_", "logprob_diff", "bubble_ratio", "finish_gap", "perf/throughput")
PER_WORKER = re.compile(r"/worker\d+/")


def learned(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not any(t in k for t in _MAY_DIFFER) and not PER_WORKER.search(k)}
            for r in rows]


# Wall-time figures: the only ones a resume with the same workers may change.
_TIMED = ("timing_s/", "tokens_per_s", "draft_time_share", "bubble_ratio", "finish_gap", "perf/throughput", "/busy_s")


def untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not any(t in k for t in _TIMED)} for r in rows]


def worker_totals(rows: list[dict]) -> list[dict]:
    """Each step's requests and tokens, of its rollout and its validation, added up over the workers'
    timelines: the same however the groups were split."""
    out = []
    for r in rows:
        total = {}
        for k, v in r.items():
            if PER_WORKER.search(k) and k.endswith(("/requests", "/tokens")):
                key = PER_WORKER.sub("/", k)  # rollout/tokens, val/requests, ...
                total[key] = total.get(key, 0) + v
        out.append(total)
    return out


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_dir) -> Path:
    """tests/rl's tiny model (peaked logits: groups vary, history drafts accepted) and its reward."""
    path = tiny_smol_checkpoint(tmp_path_factory.mktemp("tiny-smol"), smollm2_dir, embed_std=0.8)
    (path / "reward_fns.py").write_text(REWARD_PY)
    return path


def overrides(tiny_dir: Path, out: Path, *extra: str) -> list[str]:
    return [f"model.name={tiny_dir}", f"run.output_dir={out}", "data.num_train_prompts=4", "data.num_val_prompts=2",
            "train.prompts_per_step=2", "rollout.num_generations=3", "rollout.max_completion_length=24",
            "val.max_completion_length=24",
            "rollout.num_slots=6", "train.micro_batch_size=6", "train.learning_rate=0.01", "train.dtype=fp32",
            "rollout.dtype=fp32", "rollout.speculative=histospec", f"train.total_steps={STEPS}", "val.every=2",
            "run.save_every=2", "run.progress=false", "run.tensorboard=false",
            f"reward.function={tiny_dir / 'reward_fns.py'}:vowels", *extra]


def ray_args(workers: int = 2, *extra: str) -> list[str]:
    return ["rollout.backend=ray", f"rollout.num_workers={workers}", *extra]


def train(run: TrainingRun) -> list[dict]:
    """Run to the end, then end its workers' actors (the module's cluster holds one pool at a time)."""
    try:
        return read_metrics(run.run())
    finally:
        if hasattr(run.pool, "close"):  # a RayPool (a LocalPool has nothing to end)
            run.pool.close()


@pytest.fixture(scope="module")
def local_rows(tiny_dir, tmp_path_factory) -> list[dict]:
    """The in-process backend's run: the reference every Ray run must repeat."""
    out = tmp_path_factory.mktemp("local")
    return train(TrainingRun(load_config(None, overrides(tiny_dir, out)), cost_model=FLAT))


@pytest.fixture(scope="module")
def ray_run(cluster, tiny_dir, tmp_path_factory) -> Path:
    """An undisturbed run on two Ray workers, checkpointed at steps 2 and 4."""
    out = tmp_path_factory.mktemp("ray2")
    train(TrainingRun(load_config(None, overrides(tiny_dir, out, *ray_args())), cost_model=FLAT))
    return out


def test_two_ray_workers_train_as_the_local_backend(local_rows, ray_run):
    rows = read_metrics(ray_run)
    assert [r["step"] for r in rows] == [r["step"] for r in local_rows] == list(range(STEPS + 1))
    assert learned(rows) == learned(local_rows)
    assert worker_totals(rows) == worker_totals(local_rows)
    assert any(r.get("actor/trained_seqs", 0) > 0 for r in rows)  # it trains, not just rolls out
    assert sum(r.get("rollout/spec_drafted", 0) for r in rows if r["step"] > 2) > 0  # epoch 2 drafts
    assert [r["step"] for r in rows if "val/accuracy" in r] == [0, 2, 4]  # validation too
    assert all(r["rollout/worker1/requests"] == 3 for r in rows[1:])  # both workers took a group each step


def cpu_seconds(pid: int) -> float:
    """The CPU time process `pid` has used (user + system, from /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        utime, stime = f.read().rsplit(")", 1)[1].split()[11:13]
    return (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")


def alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie, killed but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class Faults:
    """Wraps a run's `pool.rollout`: during the rollouts of the training steps in `kill_at` (0-based, as
    `train_step` counts them: request ids "train-s{step}-..."), a helper thread SIGKILLs worker `victim`'s
    actor process once the call is under way and the process has started working (its CPU time grows).
    Records, per call (by its request ids' tag, "train-s1", "val-s2"), the request ids asked for and returned
    and the victim's restarts inside the call; and the pids killed."""

    def __init__(self, run: TrainingRun, kill_at: set[int], victim: int):
        self.pool, self.victim = run.pool, victim
        self.kill_at = {f"train-s{step}" for step in kill_at}
        self.asked, self.returned, self.restarts, self.killed = {}, {}, {}, []
        self._rollout = run.pool.rollout
        run.pool.rollout = self.rollout  # the instance attribute shadows the method

    def _kill_when_busy(self, pid: int) -> None:
        start, deadline = cpu_seconds(pid), time.monotonic() + 30
        while cpu_seconds(pid) <= start and time.monotonic() < deadline:
            time.sleep(0.002)
        os.kill(pid, signal.SIGKILL)
        self.killed.append(pid)

    def rollout(self, groups, params, *args, **kwargs):
        tag = groups[0].request_ids[0].rsplit("-p", 1)[0]
        killer = None
        if tag in self.kill_at:
            killer = threading.Thread(target=self._kill_when_busy, args=(self.pool.pids[self.victim],))
            killer.start()
        before = self.pool.restarts[self.victim]
        try:
            result = self._rollout(groups, params, *args, **kwargs)
        finally:
            if killer is not None:
                killer.join()
            self.restarts[tag] = self.pool.restarts[self.victim] - before
            self.asked[tag] = [rid for g in groups for rid in g.request_ids]
        self.returned[tag] = [o.request_id for o in result.outputs]
        return result


def test_a_worker_killed_every_other_step_changes_nothing(cluster, tiny_dir, tmp_path, ray_run):
    """Worker 1's actor process is SIGKILLed in the middle of the rollouts of steps 1 and 3 (0-based, as
    `train_step` counts them; logged as steps 2 and 4): each time it is restarted and its groups run again,
    every response comes back exactly once, and the run's metrics are the undisturbed run's (keyed
    randomness: the same tokens wherever and however often a request runs)."""
    run = TrainingRun(load_config(None, overrides(tiny_dir, tmp_path, *ray_args(2, "rollout.max_worker_restarts=5"))),
                      cost_model=FLAT)
    faults = Faults(run, kill_at={1, 3}, victim=1)
    rows = train(run)
    assert len(faults.killed) == 2 and not any(map(alive, faults.killed))  # the kills happened
    assert {tag: n for tag, n in faults.restarts.items() if n} == {"train-s1": 1, "train-s3": 1}, \
        "a kill did not land inside its step's rollout call"
    assert len(faults.restarts) == STEPS + 3  # every call seen: 4 steps, 3 validations
    assert run.pool.restarts == [0, 2]
    assert faults.returned == faults.asked  # each response exactly once, in order
    assert all(len(set(ids)) == len(ids) for ids in faults.returned.values())
    assert learned(rows) == learned(read_metrics(ray_run))
    assert worker_totals(rows) == worker_totals(read_metrics(ray_run))


def half_run(ray_run: Path, to: Path) -> Path:
    """The undisturbed run as it stood after step 2 (stopped there): its step-4 checkpoint gone."""
    shutil.copytree(ray_run, to)
    shutil.rmtree(to / "checkpoints" / "step_000004")
    assert latest_checkpoint(to).name == "step_000002"
    return to


@pytest.mark.parametrize("workers", [2, 1])
def test_a_resume_with_two_or_one_workers_repeats_the_run(cluster, ray_run, tmp_path, workers):
    """Stopped after step 2 and resumed with 2 workers, the run repeats the uninterrupted one in every figure
    but wall time: each worker gets back its HistoSpec state (histospec.json, in worker order) and its history
    replica refills from the slices it is sent, so it drafts the same trees. Resumed with 1 worker (another
    split of the same groups) its learned metrics are the same too; its forward passes and shared prefills
    differ (one engine runs both groups side by side) and its drafts may (the single worker drafts for both
    shares with the first saved worker's calibration). The tokens do not differ: fp32 verification is
    lossless and every draw is keyed by (seed, request id, position), not by the worker or the batch."""
    half = half_run(ray_run, tmp_path / "half")
    run = TrainingRun.resume(half, [f"rollout.num_workers={workers}"], cost_model=FLAT)
    assert run.start_step == 2 and len(run.pool.workers) == workers
    rows = train(run)
    full = read_metrics(ray_run)
    assert [r["step"] for r in rows] == list(range(STEPS + 1))
    assert rows[:3] == full[:3]  # the rows up to the checkpoint are the first run's, not rewritten
    assert learned(rows) == learned(full)
    assert worker_totals(rows) == worker_totals(full)
    if workers == 2:
        assert untimed(rows) == untimed(full)
        assert sum(r.get("rollout/spec_drafted", 0) for r in rows[3:]) > 0  # drafts to compare


def test_a_run_whose_last_worker_is_dropped_fails_cleanly(cluster, ray_run, local_rows, tiny_dir, tmp_path, capfd):
    """One worker, allowed one restart: its actor killed during step 3's rollout, and the fresh actor failing to
    start (the model directory it builds from is gone), which counts as its second failure, leave no worker:
    the run stops with one WorkersFailed naming rollout.max_worker_restarts. The checkpoint of step 2 is
    intact: a resume (on the local backend) finishes the run as the uninterrupted one."""
    half = half_run(ray_run, tmp_path / "half")
    model = shutil.copytree(tiny_dir, tmp_path / "model")
    run = TrainingRun.resume(half, ["rollout.num_workers=1", "rollout.max_worker_restarts=1", f"model.name={model}"],
                             cost_model=FLAT)
    shutil.rmtree(model)  # a restarted worker cannot build its model any more
    faults = Faults(run, kill_at={2}, victim=0)  # the resumed run's first rollout (step 3 as logged)
    with pytest.raises(WorkersFailed, match=r"failed to restart .*rollout.max_worker_restarts.*no rollout worker is "
                                           r"left") as err:
        train(run)
    assert type(err.value) is WorkersFailed  # one error, not a trail of Ray's
    assert "".join(traceback.format_exception(err.value)).count("Traceback") == 1
    assert len(faults.killed) == 1 and not alive(faults.killed[0])
    assert run.pool.restarts == [1] and run.pool.workers == []
    assert re.search(r"worker 0 died \(\w+\): restarting it \(1/1", capfd.readouterr().err)  # then it failed
    assert latest_checkpoint(half).name == "step_000002"
    assert [r["step"] for r in read_metrics(half)] == [0, 1, 2]  # step 3 left no row
    load_checkpoint(latest_checkpoint(half))  # readable
    rows = train(TrainingRun.resume(half, ["rollout.backend=local", "rollout.num_workers=1", f"model.name={tiny_dir}"],
                                    cost_model=FLAT))
    assert learned(rows) == learned(local_rows)
