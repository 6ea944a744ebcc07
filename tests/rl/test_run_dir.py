"""A run's directory (rl/run_dir.py): each fresh run gets its own, config.yaml is claimed once, atomically."""

from __future__ import annotations

import datetime

import pytest

from rhymerl.config import TrainConfig, load_config
from rhymerl.errors import UserError
from rhymerl.rl.run_dir import claim, new_run_dir, record_overrides, recorded_overrides


def test_two_runs_started_in_the_same_second_get_two_directories(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first, second = new_run_dir(""), new_run_dir("")
    assert first != second and first.is_dir() and second.is_dir()
    assert second.name == first.name + "-2" or second.name > first.name  # -2 within one second
    monkeypatch.setattr("rhymerl.rl.run_dir.datetime", _Frozen)
    assert [new_run_dir("").name for _ in range(3)] == ["20261127-101500", "20261127-101500-2", "20261127-101500-3"]


class _Frozen:
    @staticmethod
    def now(tz=None):
        return datetime.datetime(2026, 11, 27, 10, 15, 0, tzinfo=tz)


def test_config_yaml_is_claimed_by_one_run_only(tmp_path):
    cfg = TrainConfig()
    claim(tmp_path, cfg)
    assert load_config(tmp_path / "config.yaml") == cfg
    text = (tmp_path / "config.yaml").read_text()
    with pytest.raises(UserError, match="another run started"):
        claim(tmp_path, load_config(None, ["train.total_steps=5"]))
    assert (tmp_path / "config.yaml").read_text() == text  # the first run's, untouched
    assert [p.name for p in tmp_path.iterdir()] == ["config.yaml"]  # no temporary file left
    with pytest.raises(UserError, match="already holds a run"):
        new_run_dir(str(tmp_path))


def test_overrides_are_recorded_in_order(tmp_path):
    assert recorded_overrides(tmp_path) == []
    record_overrides(tmp_path, 2, [])  # nothing given: nothing recorded
    assert not (tmp_path / "overrides.jsonl").exists()
    record_overrides(tmp_path, 2, ["train.total_steps=4"])
    record_overrides(tmp_path, 4, ["train.total_steps=6", "rollout.temperature=0.5"])
    assert recorded_overrides(tmp_path) == ["train.total_steps=4", "train.total_steps=6", "rollout.temperature=0.5"]
