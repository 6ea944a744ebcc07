"""MetricsLogger (JSONL + TensorBoard, resume trimming) and the PNG report."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rhymerl import metrics as metrics_module
from rhymerl.metrics import MetricsLogger, read_metrics
from rhymerl.report import summary, write_report


def _step_metrics(step: int) -> dict[str, float]:
    """A full set of verl-style metrics for one synthetic step; validation every 10 steps."""
    m = {
        "critic/rewards/mean": 0.2 + 0.02 * step,
        "critic/score/mean": 0.1 + 0.02 * step,
        "response_length/mean": 100.0 + step,
        "response_length/max": 256.0,
        "response_length/clip_ratio": 0.1,
        "actor/pg_loss": -0.01,
        "actor/pg_clipfrac": 0.02,
        "actor/entropy": 1.5,
        "actor/kl": 0.001 * step,
        "actor/grad_norm": 0.5,
        "actor/lr": 1e-6,
        "actor/logprob_diff_max": 0.01,
        "rollout/spec_accept_rate": 0.6,
        "rollout/tokens_per_forward": 2.5,
        "rollout/tokens_per_s": 4000.0,
        "rollout/draft_time_share": 0.1,
        "reward/errors": 0.0,
        "timing_s/rollout": 5.0,
        "timing_s/reward": 0.5,
        "timing_s/update": 3.0,
        "timing_s/sync": 0.2,
        "timing_s/step": 9.0,
        "epoch": 0.0,
    }
    if step % 10 == 0:
        m.update({"val/accuracy": 0.3 + 0.01 * step, "val/reward/mean": 0.35, "timing_s/val": 4.0})
        m["timing_s/step"] += 4.0
    if step % 15 == 0:
        m["timing_s/save"] = 1.0
    return m


def _write_run(run_dir, steps=range(1, 31), **kwargs):
    with MetricsLogger(run_dir, tensorboard=False, **kwargs) as logger:
        for step in steps:
            logger.log(step, _step_metrics(step))


def test_log_writes_jsonl_and_tensorboard(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        logger.log(1, {"critic/rewards/mean": np.float32(0.5), "actor/kl": float("nan"), "step": 99})
        logger.log(2, {"critic/rewards/mean": 0.75, "reward/errors": np.int64(3)})

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 1, "critic/rewards/mean": 0.5, "actor/kl": None},  # NaN is written as null, strict JSON
        {"step": 2, "critic/rewards/mean": 0.75, "reward/errors": 3},
    ]
    assert read_metrics(tmp_path)[1]["reward/errors"] == 3

    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    scalars = acc.Scalars("critic/rewards/mean")
    assert [(s.step, s.value) for s in scalars] == [(1, 0.5), (2, 0.75)]
    assert math.isnan(acc.Scalars("actor/kl")[0].value)
    assert "step" not in acc.Tags()["scalars"]


def test_rejects_non_numeric_values(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        with pytest.raises(TypeError, match="actor/kl"):
            logger.log(1, {"actor/kl": object()})


def test_wandb_missing_names_install_command(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics_module, "wandb", None)
    with pytest.raises(ImportError, match="pip install wandb"):
        MetricsLogger(tmp_path, wandb=True)


def test_resume_trims_steps_past_checkpoint(tmp_path):
    _write_run(tmp_path, steps=range(1, 8))
    # Killed at step 7 with the last checkpoint at step 5: steps 6..7 are logged again after the resume.
    with MetricsLogger(tmp_path, tensorboard=False, resume_step=5) as logger:
        assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]
        logger.log(6, {"critic/rewards/mean": 1.0})
    assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2, 3, 4, 5, 6]
    assert read_metrics(tmp_path)[-1] == {"step": 6, "critic/rewards/mean": 1.0}
    assert not list(tmp_path.glob("*.tmp"))


def test_resume_purges_tensorboard_steps(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        for step in range(1, 6):
            logger.log(step, {"x": float(step)})
    with MetricsLogger(tmp_path, resume_step=3) as logger:
        logger.log(4, {"x": 40.0})
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(s.step, s.value) for s in acc.Scalars("x")] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]


def test_torn_last_line_is_ignored_and_repaired(tmp_path):
    _write_run(tmp_path, steps=range(1, 4))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "critic/rew')  # a crash mid-write
    assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2, 3]

    # Appending after the crash must not glue the next line onto the torn one.
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(4, {"critic/rewards/mean": 0.5})
    assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2, 3, 4]


def test_corrupt_middle_line_raises(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2"):
        read_metrics(tmp_path)


def test_report_writes_all_plots(tmp_path):
    _write_run(tmp_path)
    paths = write_report(tmp_path)
    assert sorted(p.name for p in paths) == ["response_length.png", "reward.png", "speculation.png", "timing.png"]
    for path in paths:
        assert path.parent == tmp_path / "report"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    s = summary(tmp_path)
    assert s["steps"] == 30 and s["last_step"] == 30
    assert s["reward_first"] == pytest.approx(0.22)
    assert s["reward_last"] == s["reward_max"] == pytest.approx(0.8)
    assert s["val_accuracy_last"] == pytest.approx(0.6)
    assert s["step_time_median_s"] == pytest.approx(9.0)
    assert s["accept_rate_mean"] == pytest.approx(0.6)


def test_report_skips_absent_plots(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(0, {"data/skipped_long_prompts": 0})  # the loop's starting-point row: not a training step
        for step in range(1, 6):
            logger.log(step, {"critic/rewards/mean": 0.1 * step, "timing_s/rollout": 1.0, "timing_s/step": 1.5})
    paths = write_report(tmp_path, out_dir=tmp_path / "plots")
    assert sorted(p.name for p in paths) == ["reward.png", "timing.png"]
    assert all(p.parent == tmp_path / "plots" for p in paths)
    s = summary(tmp_path)
    assert s["steps"] == 5 and s["last_step"] == 5
    assert s["val_accuracy_last"] is None and s["accept_rate_mean"] is None


def test_report_missing_or_empty_metrics(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        write_report(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(FileNotFoundError, match="no metrics rows"):
        write_report(tmp_path)
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        summary(tmp_path)


class _FakeWandbRun:
    def __init__(self, run_id):
        self.id, self.logged, self.finished = run_id, [], False

    def log(self, metrics, step):
        self.logged.append((step, dict(metrics)))

    def finish(self):
        self.finished = True


class _FakeWandb:
    """Records what MetricsLogger asks of wandb (the real package is optional and needs an account)."""

    def __init__(self):
        self.inits, self.runs = [], []

    def init(self, **kwargs):
        self.inits.append(kwargs)
        self.runs.append(_FakeWandbRun(kwargs["id"] or f"run{len(self.runs)}"))
        return self.runs[-1]


def test_wandb_gets_numeric_metrics_and_a_resumed_run_reuses_its_id(tmp_path, monkeypatch):
    fake = _FakeWandb()
    monkeypatch.setattr(metrics_module, "wandb", fake)
    with MetricsLogger(tmp_path, tensorboard=False, wandb=True, wandb_project="p", config={"a": 1}) as log:
        log.log(1, {"critic/rewards/mean": 0.5, "note": "text stays in the JSONL"})
    assert fake.inits[0]["project"] == "p" and fake.inits[0]["config"] == {"a": 1} and fake.inits[0]["id"] is None
    assert fake.runs[0].logged == [(1, {"critic/rewards/mean": 0.5})] and fake.runs[0].finished
    # A resume finds the run id saved in the run directory and continues that wandb run.
    with MetricsLogger(tmp_path, tensorboard=False, wandb=True, resume_step=1) as log:
        log.log(2, {"critic/rewards/mean": 0.7})
    assert fake.inits[1]["id"] == "run0" and fake.inits[1]["resume"] == "allow"
    assert fake.runs[1].logged == [(2, {"critic/rewards/mean": 0.7})]
