"""Atomic writes: the old file or the new one, never a torn mix, and nothing left behind on failure."""

import json

import pytest
import torch

from rhymerl.atomic_file import atomic_write
from rhymerl.rl.checkpoint import latest_checkpoint, save_checkpoint


def test_a_write_replaces_the_file_whole(tmp_path):
    path = tmp_path / "f.json"
    path.write_text("old")
    with atomic_write(path) as f:
        f.write("new")
        assert path.read_text() == "old"  # not visible until the write completes
    assert path.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "f.json"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_write(path) as f:
            f.write("half")
            raise RuntimeError("killed mid-write")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_a_checkpoint_that_fails_while_writing_leaves_nothing_behind(tmp_path):
    """The half-written step_N.tmp directory goes, and the previous checkpoint stays the latest."""
    weights = {"w": torch.zeros(2)}
    first = save_checkpoint(tmp_path, 1, hf_weights=weights, model_dir=tmp_path, trainer_state={},
                            history_state=None, state={})
    with pytest.raises(TypeError):  # a state that JSON cannot hold fails the last file of the checkpoint
        save_checkpoint(tmp_path, 2, hf_weights=weights, model_dir=tmp_path, trainer_state={},
                        history_state=None, state={"bad": object()})
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == sorted([first.name, "latest"])
    assert latest_checkpoint(tmp_path) == first
    assert json.loads((first / "state.json").read_text())["step"] == 1
