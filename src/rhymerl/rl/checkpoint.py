"""Checkpoints of a training run, written atomically and loadable by transformers.

Layout of `RUN_DIR/checkpoints/step_000010/`:
  model.safetensors + config.json + tokenizer files  the policy in Hugging Face names (fp32, LoRA merged):
                                                      `AutoModelForCausalLM.from_pretrained(dir)` loads it
  trainer.pt      optimizer and LR-scheduler state, the RNG states (Python's, torch's and, where CUDA is used,
                  each GPU's) and the LoRA adapter weights when LoRA is on: tensors, numbers and plain
                  containers only, loaded with `torch.load(weights_only=True)`, so a crafted file cannot run code
  history.json    the HistoSpec history store
  histospec.json  what each rollout worker's HistoSpec learned (calibration, cost model and its online
                  correction, idle counters; `Speculator.state_dict`), a list by worker; absent with it off
  state.json      step, the run's counters, config and the dtypes it computes in
and `RUN_DIR/checkpoints/latest` names the newest complete one (for people and tools; resuming looks at the
directories themselves).

Atomicity: a checkpoint is written into `step_000010.tmp`, every file and the folder are fsynced, and only
then is it renamed into place (and the rename fsynced); `latest` is replaced by rename only after that. A
step saved again (a resumed run re-saving it) first moves the old folder aside to `step_000010.old`, renames
the new one in, and only then deletes the old: a crash between the two renames leaves `.old`, which counts as
that step's checkpoint while no `step_000010` exists. A crash or power loss at any moment leaves the previous
checkpoint intact, and a resume finds the newest complete one.

Reading validates what it reads: a file that is missing, truncated, not what rhymerl writes, or a state.json
with a field of the wrong type or value (`STATE_FIELDS`; its step must agree with its folder) raises
`CheckpointError` naming the file, the field and what to do.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import zipfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from rhymerl.atomic_file import atomic_write, fsync_dir, fsync_tree
from rhymerl.errors import UserError
from rhymerl.model.directory import check_model_dir

LATEST = "latest"
_PREFIX = "step_"


class CheckpointError(UserError):
    """A checkpoint file that is missing, truncated, edited or not written by rhymerl (the message names it)."""

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
    """The process's random states as tensors and numbers (loadable with weights_only=True): Python's Mersenne
    Twister state as an int64 tensor, torch's CPU generator and, where CUDA is available, every GPU's."""
    version, mt, gauss = random.getstate()
    state = {"python_version": version, "python": torch.tensor(mt, dtype=torch.int64), "python_gauss": gauss,
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore `rng_state()`'s states (also the older layout with Python's state as a tuple). A CUDA state is
    restored where CUDA is available; one saved without CUDA leaves the GPUs' generators as seeded."""
    if "python_version" in state:
        random.setstate((state["python_version"], tuple(int(x) for x in state["python"].tolist()),
                         state["python_gauss"]))
    else:
        v = state["python"]
        random.setstate((v[0], tuple(v[1]), v[2]))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        cuda = list(state["cuda"])[: torch.cuda.device_count()]  # a run resumed on fewer GPUs
        for i, s in enumerate(cuda):
            torch.cuda.set_rng_state(s, i)


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
        # On disk before the rename publishes the folder: a power loss after it must not leave a complete-
        # looking step_N whose files are empty or torn (the resume would take it as the newest).
        fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed write (a full disk included) leaves nothing behind
        raise
    old = final.with_name(final.name + ".old")
    if old.exists():
        if final.exists():  # left over from a crash after the swap below: the new one is in place
            shutil.rmtree(old)
        else:  # left over from a crash between the renames: it is this step's checkpoint until replaced
            os.replace(old, final)
    if final.exists():  # saved again: the new one goes in place before the old one goes
        os.replace(final, old)
        fsync_dir(final.parent)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old)
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
    """Checkpoint directories renamed into place, oldest first (the names sort by step): `step_N`, or
    `step_N.old` where a crash between the two renames of a re-save left no `step_N`; never `.tmp`."""
    dirs = {p.name: p for p in ckpt_root.glob("step_*") if p.is_dir()}
    done = [p for name, p in dirs.items() if name.removeprefix(_PREFIX).isdigit()]
    done += [p for name, p in dirs.items()
             if name.endswith(".old") and name.removesuffix(".old").removeprefix(_PREFIX).isdigit()
             and name.removesuffix(".old") not in dirs]
    return sorted(done, key=lambda p: p.name.removesuffix(".old"))


def _prune(ckpt_root: Path, keep: int) -> None:
    for old in _complete(ckpt_root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


_ADVICE = "resume from an intact copy, or delete this folder to resume from the checkpoint before it"


def _read_json(path: Path) -> object:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; the checkpoint is incomplete: {_ADVICE}") from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{path}: not UTF-8 text, so not a file rhymerl wrote: {_ADVICE}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: truncated or corrupt JSON ({e.msg} at line {e.lineno}): {_ADVICE}") from None


def _is_int(value: object, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


# state.json's fields: (what the field must be, the check). `step` is required; the others were added over
# time and may be absent from an older checkpoint. Unknown keys are ignored (a newer rhymerl may add some).
STATE_FIELDS = {
    "step": ("a non-negative integer", _is_int),
    "reward_errors": ("a non-negative integer", _is_int),
    "data_pos": ("a non-negative integer", _is_int),
    "dtypes": ("an object whose 'rollout' and 'train' are each 'bf16' or 'fp32'",
               lambda v: isinstance(v, dict) and set(v) <= {"rollout", "train"}
               and all(d in ("bf16", "fp32") for d in v.values())),
    "config": ("an object of config sections, each an object",
               lambda v: isinstance(v, dict) and all(isinstance(s, dict) for s in v.values())),
    "metrics": ("an object of metric names to numbers or strings",
                lambda v: isinstance(v, dict) and all(isinstance(x, (int, float, str)) and not isinstance(x, bool)
                                                      for x in v.values())),
}


def read_state(path: Path) -> dict:
    """state.json of a checkpoint directory (cheap: no weights, no optimizer), checked field by field
    (`STATE_FIELDS`): an object whose integer `step` is the step its folder is named after, whose
    `data_pos` is not behind it, and whose dtypes are ones rhymerl computes in. Raises CheckpointError naming
    the file and the field."""
    path = Path(path)
    f = path / "state.json"
    state = _read_json(f)
    if not isinstance(state, dict):
        raise CheckpointError(f"{f}: expected a JSON object, got {type(state).__name__}: {_ADVICE}")
    if "step" not in state:
        raise CheckpointError(f"{f}: 'step' is missing; not a state rhymerl wrote: {_ADVICE}")
    for key, (rule, holds) in STATE_FIELDS.items():
        if key in state and not holds(state[key]):
            raise CheckpointError(f"{f}: {key!r} must be {rule}, got {json.dumps(state[key])[:200]}: {_ADVICE}")
    step = state["step"]
    folder = path.name.removesuffix(".old").removeprefix(_PREFIX)
    if path.name.startswith(_PREFIX) and folder.isdigit() and int(folder) != step:
        raise CheckpointError(f"{f}: says step {step} but its folder is {path.name} (step {int(folder)}); the "
                              f"checkpoint was edited or moved: {_ADVICE}")
    if state.get("data_pos", step) < step:
        raise CheckpointError(f"{f}: 'data_pos' ({state['data_pos']}) is behind 'step' ({step}): each step draws "
                              f"at least one batch of prompts: {_ADVICE}")
    return state


def read_spec_state(path: Path) -> list | None:
    """histospec.json of a checkpoint directory (each worker's HistoSpec state), or None when it has none."""
    f = Path(path) / "histospec.json"
    if not f.exists():
        return None
    states = _read_json(f)
    if not isinstance(states, list) or not all(s is None or isinstance(s, dict) for s in states):
        raise CheckpointError(f"{f}: expected a list of per-worker objects: {_ADVICE}")
    return states


def check_checkpoint(path: Path) -> dict:
    """Check a checkpoint before anything is loaded from it (cheap: headers and small files only) and return
    its state.json: state.json as `read_state` checks it, the weights and config as a model directory
    (`check_model_dir`), trainer.pt a whole zip archive, history.json and histospec.json valid JSON. Raises
    CheckpointError (or the model directory's UserError) naming the file."""
    path = Path(path)
    state = read_state(path)
    try:
        check_model_dir(path)
    except UserError as e:
        raise CheckpointError(f"{e}; in checkpoint {path}: {_ADVICE}") from None
    trainer = path / "trainer.pt"
    if not trainer.is_file():
        raise CheckpointError(f"{trainer}: missing; the checkpoint is incomplete: {_ADVICE}")
    if not zipfile.is_zipfile(trainer):  # torch.save's format; a truncated file loses its central directory
        raise CheckpointError(f"{trainer}: truncated or not a torch checkpoint: {_ADVICE}")
    if (path / "history.json").exists():
        _read_json(path / "history.json")
    read_spec_state(path)
    return state


def load_trainer_state(path: Path) -> dict:
    """trainer.pt of a checkpoint directory, loaded with weights_only=True: tensors, numbers and plain
    containers, never arbitrary pickled objects (a crafted file could run code when unpickled). Raises
    CheckpointError naming the file when it is truncated, corrupt, holds other objects or lacks a part."""
    f = Path(path) / "trainer.pt"
    try:
        state = torch.load(f, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise CheckpointError(f"{f}: missing; the checkpoint is incomplete: {_ADVICE}") from None
    except pickle.UnpicklingError as e:  # weights_only refused an object: not the trainer state rhymerl writes
        raise CheckpointError(f"{f}: holds objects other than tensors, numbers and containers, so it was not "
                              f"written by rhymerl and is not loaded ({str(e).splitlines()[0][:200]}): "
                              f"{_ADVICE}") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile) as e:  # torch's zip reader on a torn file
        raise CheckpointError(f"{f}: truncated or corrupt ({str(e).splitlines()[0][:200]}): {_ADVICE}") from None
    missing = [k for k in ("optimizer", "scheduler", "rng") if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointError(f"{f}: lacks {', '.join(missing)}; not a trainer state rhymerl wrote: {_ADVICE}")
    return state


def load_checkpoint(path: Path) -> tuple[dict, dict, dict | None]:
    """(state.json, trainer.pt contents, history state or None) of a checkpoint directory, each checked
    (`read_state`, `load_trainer_state`); raises CheckpointError naming a bad file."""
    path = Path(path)
    state = read_state(path)
    trainer_state = load_trainer_state(path)
    history = _read_json(path / "history.json") if (path / "history.json").exists() else None
    if history is not None and not isinstance(history, dict):
        raise CheckpointError(f"{path / 'history.json'}: expected a JSON object: {_ADVICE}")
    return state, trainer_state, history
