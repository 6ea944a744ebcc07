"""Checkpoints of a training run, written atomically and loadable by transformers.

Layout of `RUN_DIR/checkpoints/step_000010/`:
  model.safetensors + config.json + tokenizer files  the policy in Hugging Face names (fp32, LoRA merged):
                                                      `AutoModelForCausalLM.from_pretrained(dir)` loads it
  trainer.pt      optimizer and LR-scheduler state (and the LoRA adapter weights when LoRA is on)
  history.json    the HistoSpec history store
  histospec.json  what each rollout worker's HistoSpec learned (calibration, cost model and its online
                  correction, idle counters; `Speculator.state_dict`), a list by worker; absent with it off
  state.json      step, the run's counters, config and the dtypes it computes in
and `RUN_DIR/checkpoints/latest` names the newest complete one (for people and tools; resuming looks at the
directories themselves).

Atomicity: a checkpoint is written into `step_000010.tmp` and renamed into place, and `latest` is replaced
by rename only after that; a crash at any moment leaves the previous checkpoint intact, and a resume finds
the newest complete one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from rhymerl.atomic_file import atomic_write

LATEST = "latest"
_HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja")


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run, or None.

    Found from the directories, not from `latest`: a run killed right after renaming `step_N.tmp` into place
    has a complete `step_N` that `latest` does not name yet."""
    done = [p for p in _complete(Path(run_dir) / "checkpoints") if (p / "state.json").exists()]
    return done[-1] if done else None


def rng_state() -> dict:
    return {"python": random.getstate(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    v = state["python"]
    random.setstate((v[0], tuple(v[1]), v[2]))
    torch.set_rng_state(state["torch"])


def save_checkpoint(run_dir: Path, step: int, *, hf_weights: dict[str, torch.Tensor], model_dir: Path,
                    trainer_state: dict, history_state: dict | None, state: dict, keep: int = 2,
                    spec_state: list | None = None) -> Path:
    """Write checkpoint `step` atomically, point `latest` at it and delete all but the newest `keep`."""
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)  # left over from a crash while writing
    tmp.mkdir(parents=True)
    try:
        _write_files(tmp, step, hf_weights, model_dir, trainer_state, history_state, state, spec_state)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed write leaves nothing behind
        raise
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    with atomic_write(final.parent / LATEST) as f:
        f.write(final.name)
    _prune(final.parent, keep)
    return final


def _write_files(tmp: Path, step: int, hf_weights: dict[str, torch.Tensor], model_dir: Path, trainer_state: dict,
                 history_state: dict | None, state: dict, spec_state: list | None = None) -> None:
    save_file({k: v.detach().float().contiguous() for k, v in hf_weights.items()}, str(tmp / "model.safetensors"),
              metadata={"format": "pt"})
    for name in _HF_FILES:  # config and tokenizer of the base model, so transformers can load the directory
        if (Path(model_dir) / name).exists():
            shutil.copy2(Path(model_dir) / name, tmp / name)
    _force_fp32_config(tmp / "config.json")
    torch.save({**trainer_state, "rng": rng_state()}, tmp / "trainer.pt")
    if history_state is not None:
        (tmp / "history.json").write_text(json.dumps(history_state))
    if spec_state is not None and any(s is not None for s in spec_state):
        (tmp / "histospec.json").write_text(json.dumps(spec_state))
    (tmp / "state.json").write_text(json.dumps({**state, "step": step}, indent=1))


def _force_fp32_config(path: Path) -> None:
    # The weights are saved in fp32 whatever the base checkpoint's dtype.
    if path.exists():
        cfg = json.loads(path.read_text())
        for key in ("torch_dtype", "dtype"):
            if key in cfg:
                cfg[key] = "float32"
        path.write_text(json.dumps(cfg, indent=2))


def _complete(ckpt_root: Path) -> list[Path]:
    """Checkpoint directories renamed into place (not `.tmp`), oldest first (the names sort by step)."""
    return sorted(p for p in ckpt_root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))


def _prune(ckpt_root: Path, keep: int) -> None:
    for old in _complete(ckpt_root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def read_state(path: Path) -> dict:
    """state.json of a checkpoint directory (cheap: no weights, no optimizer)."""
    return json.loads((Path(path) / "state.json").read_text())


def read_spec_state(path: Path) -> list | None:
    """histospec.json of a checkpoint directory (each worker's HistoSpec state), or None when it has none."""
    f = Path(path) / "histospec.json"
    return json.loads(f.read_text()) if f.exists() else None


def load_checkpoint(path: Path) -> tuple[dict, dict, dict | None]:
    """(state.json, trainer.pt contents, history state or None) of a checkpoint directory."""
    path = Path(path)
    state = read_state(path)
    trainer_state = torch.load(path / "trainer.pt", weights_only=False)
    history = json.loads((path / "history.json").read_text()) if (path / "history.json").exists() else None
    return state, trainer_state, history
