"""Checkpoints that survive crashes and cannot run code (issue 26 item 12): trainer.pt holds plain data and
loads with weights_only=True, the RNG states (CUDA's where present) come back exactly, every file and the
folder are fsynced before the folder becomes visible, and a bad file is named."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.optim.lr_scheduler import LambdaLR

from rhymerl import atomic_file
from rhymerl.rl import checkpoint
from rhymerl.rl.checkpoint import (CheckpointError, latest_checkpoint, load_checkpoint, load_trainer_state, read_state,
                                   rng_state, save_checkpoint, set_rng_state)
from tiny_models import tiny_checkpoint


def _trainer_state() -> dict:
    """An AdamW + LambdaLR state after one step, as PolicyTrainer.state_dict() gives it."""
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.9, 0.99))
    sched = LambdaLR(opt, lambda s: 1.0 / (1 + s))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched.step()
    return {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "lora_model": model.state_dict()}


def _save(run_dir: Path, step: int = 3, **kw) -> Path:
    model_dir = Path(tiny_checkpoint("llama")[0])
    weights = load_file(str(model_dir / "model.safetensors"))
    return save_checkpoint(run_dir, step, hf_weights=weights, model_dir=model_dir, trainer_state=_trainer_state(),
                           history_state={"format": "x"}, state={"reward_errors": 0, "dtypes": {}}, **kw)


def test_trainer_state_loads_with_weights_only_and_repeats_the_random_draws(tmp_path):
    random.seed(5)
    torch.manual_seed(5)
    ckpt = _save(tmp_path)
    expected = (random.random(), random.gauss(0, 1), torch.rand(3))  # gauss leaves a cached second value
    saved_after = rng_state()

    state, trainer, history = load_checkpoint(ckpt)  # weights_only=True inside
    assert state["step"] == 3 and history == {"format": "x"}
    assert set(trainer) >= {"optimizer", "scheduler", "rng", "lora_model"}
    assert isinstance(trainer["rng"]["python"], torch.Tensor) and trainer["rng"]["python"].dtype == torch.int64
    torch.load(ckpt / "trainer.pt", weights_only=True)  # plain data: the strict loader takes it as is

    random.seed(99)
    torch.manual_seed(99)
    set_rng_state(trainer["rng"])
    assert (random.random(), random.gauss(0, 1)) == expected[:2] and torch.equal(torch.rand(3), expected[2])
    # the state saved with a cached gauss value round-trips too
    set_rng_state(saved_after)
    assert rng_state()["python_gauss"] == saved_after["python_gauss"]

    # the optimizer and scheduler states load into fresh ones
    fresh = _trainer_state()
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    opt.load_state_dict(trainer["optimizer"])
    LambdaLR(opt, lambda s: 1.0).load_state_dict(trainer["scheduler"])
    assert trainer["optimizer"]["param_groups"][0]["betas"] == fresh["optimizer"]["param_groups"][0]["betas"]


def test_older_checkpoints_rng_layout_still_restores():
    random.seed(3)
    old = {"python": random.getstate(), "torch": torch.get_rng_state()}
    expected = random.random()
    set_rng_state(old)
    assert random.random() == expected


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_crafted_trainer_state_is_refused_without_running_it(tmp_path):
    ckpt = _save(tmp_path)
    marker = tmp_path / "ran"
    torch.save({"optimizer": _Payload(marker), "scheduler": {}, "rng": {}}, ckpt / "trainer.pt")
    with pytest.raises(CheckpointError, match="trainer.pt: holds objects other than tensors"):
        load_trainer_state(ckpt)
    assert not marker.exists()
    torch.save({"optimizer": {}}, ckpt / "trainer.pt")
    with pytest.raises(CheckpointError, match="trainer.pt: lacks scheduler, rng"):
        load_trainer_state(ckpt)


@pytest.mark.parametrize("step, message", [("3", "'step' must be a non-negative integer"), (True, "integer"),
                                           (999, "says step 999 but its folder is step_000003"),
                                           (1, "says step 1")])
def test_state_json_must_agree_with_its_folder(tmp_path, step, message):
    ckpt = _save(tmp_path)
    state = json.loads((ckpt / "state.json").read_text())
    (ckpt / "state.json").write_text(json.dumps({**state, "step": step}))
    with pytest.raises(CheckpointError, match=message):
        read_state(ckpt)


def test_every_file_and_the_folder_are_on_disk_before_the_rename(tmp_path, monkeypatch):
    """Record each fsync by inode: every file of the checkpoint and its folder must be fsynced before the
    rename that publishes it, and the rename itself (the parent folder) before `latest` names it."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.fstat(fd).st_ino))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", Path(src).name, Path(dst).name))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    ckpt = _save(tmp_path)
    publish = events.index(("replace", "step_000003.tmp", "step_000003"))
    synced_before = {ino for kind, ino, *_ in events[:publish] if kind == "fsync"}
    files = [p for p in ckpt.iterdir()] + [ckpt]
    assert len(files) > 4 and all(p.stat().st_ino in synced_before for p in files)
    latest = next(i for i, e in enumerate(events) if e[0] == "replace" and e[2] == "latest")
    parent = (tmp_path / "checkpoints").stat().st_ino
    assert ("fsync", parent) in events[publish:latest]
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000003"


def test_a_failed_write_leaves_the_previous_checkpoint_latest(tmp_path, monkeypatch):
    _save(tmp_path, step=2)

    def crash(root):
        raise OSError(28, "No space left on device", str(root))

    monkeypatch.setattr(checkpoint, "fsync_tree", crash)
    with pytest.raises(OSError):
        _save(tmp_path, step=4)
    assert latest_checkpoint(tmp_path).name == "step_000002"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_000002"]


def test_fsync_tree_syncs_files_and_folders(tmp_path, monkeypatch):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "f").write_text("x")
    (tmp_path / "g").write_text("y")
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.fstat(fd).st_ino), real(fd)))
    atomic_file.fsync_tree(tmp_path)
    want = [tmp_path / "a" / "b" / "f", tmp_path / "g", tmp_path / "a" / "b", tmp_path / "a", tmp_path]
    assert {p.stat().st_ino for p in want} <= set(synced)


def test_cuda_rng_state_is_saved_and_restored_where_cuda_is(monkeypatch):
    """On CPU with a stand-in for torch.cuda (the real path runs in test_cuda_rng_round_trip on a GPU)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [torch.tensor([7], dtype=torch.uint8)] * 2)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: calls.append((state.tolist(), device)))
    state = rng_state()
    assert [s.tolist() for s in state["cuda"]] == [[7], [7]]
    set_rng_state(state)
    assert calls == [([7], 0)]  # resumed on one GPU: the first GPU's state
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls.clear()
    set_rng_state(state)
    assert calls == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_rng_round_trip(tmp_path):
    torch.cuda.manual_seed_all(11)
    ckpt = _save(tmp_path)
    expected = torch.rand(4, device="cuda")
    torch.cuda.manual_seed_all(12)
    set_rng_state(load_trainer_state(ckpt)["rng"])
    assert torch.equal(torch.rand(4, device="cuda"), expected)


def _marked(ckpt: Path) -> str:
    return json.loads((ckpt / "state.json").read_text()).get("mark", "")


def test_a_step_saved_again_replaces_the_old_one_only_once_the_new_one_is_in_place(tmp_path, monkeypatch):
    model_dir = Path(tiny_checkpoint("llama")[0])
    weights = load_file(str(model_dir / "model.safetensors"))

    def save(mark: str) -> Path:
        return save_checkpoint(tmp_path, 3, hf_weights=weights, model_dir=model_dir, trainer_state=_trainer_state(),
                               history_state=None, state={"mark": mark})

    save("first")
    real_replace = os.replace

    def crash_on_publish(src, dst):  # the power goes out between moving the old one aside and the new one in
        if Path(src).name == "step_000003.tmp":
            raise OSError(5, "Input/output error", str(src))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_publish)
    with pytest.raises(OSError):
        save("second")
    monkeypatch.undo()
    # the old checkpoint was never deleted: it is found (as step_000003.old) and reads as step 3
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt.name == "step_000003.old" and _marked(ckpt) == "first" and read_state(ckpt)["step"] == 3
    assert save("third").name == "step_000003" and _marked(latest_checkpoint(tmp_path)) == "third"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_000003"]
    save("fourth")  # saved again without a crash: the new one, and nothing left over
    assert _marked(latest_checkpoint(tmp_path)) == "fourth"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_000003"]


@pytest.mark.parametrize("field, value", [("dtypes", {"rollout": "int8", "train": "fp32"}), ("dtypes", ["bf16"]),
                                          ("reward_errors", -1), ("reward_errors", 1.5), ("data_pos", "3"),
                                          ("data_pos", 2), ("metrics", {"actor/kl": None}), ("config", {"model": 1})])
def test_every_field_of_state_json_is_checked(tmp_path, field, value):
    ckpt = _save(tmp_path)
    state = json.loads((ckpt / "state.json").read_text())
    (ckpt / "state.json").write_text(json.dumps({**state, field: value}))
    with pytest.raises(CheckpointError, match=f"state.json: '{field}'") as err:
        read_state(ckpt)
    assert "\n" not in str(err.value)
    del state["step"]
    (ckpt / "state.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match="'step' is missing"):
        read_state(ckpt)
