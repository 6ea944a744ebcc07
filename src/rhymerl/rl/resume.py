"""Resuming a training run (`TrainingRun.resume`, `rl/loop.py`) from its latest checkpoint: the run
directory and the checkpoint checked before anything loads from them, HistoSpec's learned state, and the
trainer, RNG and history restored. The files themselves are `rl/checkpoint.py`'s."""

from __future__ import annotations

from pathlib import Path

import torch

from rhymerl.config import ConfigError
from rhymerl.cost_model import CostModel
from rhymerl.rl.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, read_spec_state, set_rng_state


def check_resume_dir(run_dir: str | Path) -> Path:
    """`--resume RUN_DIR` checked before its config is read: a run directory holding a checkpoint."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"--resume {run_dir}: no such run directory")
    if latest_checkpoint(run_dir) is None:
        raise CheckpointError(f"--resume {run_dir}: no checkpoint in {run_dir / 'checkpoints'} (a run saves "
                              f"one every run.save_every steps and at its end)")
    return run_dir


def check_total_steps(path: Path, state: dict, total_steps: int) -> None:
    """ConfigError when the run's `total_steps` is below the step of its checkpoint `path` (whose state.json
    is `state`, read by `check_checkpoint` before anything loads from it)."""
    if total_steps < state["step"]:
        raise ConfigError(f"train.total_steps={total_steps} is below the step of the checkpoint to resume from "
                          f"({path}: step {state['step']}): set train.total_steps={state['step']} or more")


def resume_spec_state(path: Path | None, cost_model: CostModel | None) -> tuple[list | None, CostModel | None]:
    """HistoSpec's learned state to restore into the workers (None: nothing to restore) and the cost model
    they start with. A resumed worker reuses the saved cost model rather than measuring a new one, and then
    takes the calibration, correction ratios and idle counters too; a `cost_model` given wins over the saved."""
    spec_states = read_spec_state(path) if path is not None else None
    if cost_model is not None and spec_states:
        spec_states = [s and {k: v for k, v in s.items() if k not in ("cost", "correct_cost")} for s in spec_states]
    elif spec_states and spec_states[0] is not None and "cost" in spec_states[0]:
        cost_model = CostModel.from_dict(spec_states[0]["cost"])
    return spec_states, cost_model


def restore_training(path: Path, trainer, history, lora_model: torch.nn.Module | None = None) -> dict:
    """Load checkpoint `path` into a run's `trainer` (optimizer, scheduler), the RNG states, its `history`
    store and, for a LoRA run, `lora_model`'s base + adapters; returns its state.json. A trainer state or
    history that does not fit the run raises CheckpointError naming the file."""
    state, trainer_state, history_state = load_checkpoint(path)
    try:  # a trainer state of another model or optimizer (e.g. model.lora_r changed by an override)
        if lora_model is not None:
            lora_model.load_state_dict(trainer_state["lora_model"])
        trainer.load_state_dict(trainer_state)
        set_rng_state(trainer_state["rng"])
    except (KeyError, ValueError, TypeError, RuntimeError) as e:
        raise CheckpointError(f"{Path(path) / 'trainer.pt'}: does not fit this run's model and optimizer "
                              f"({type(e).__name__}: {str(e)[:200]}); was a model.* or train.* key changed "
                              f"by an override on --resume?") from None
    if history_state is not None:
        try:
            history.load_state_dict(history_state)
        except (KeyError, ValueError, TypeError) as e:
            raise CheckpointError(f"{Path(path) / 'history.json'}: not a history rhymerl wrote "
                                  f"({type(e).__name__}: {str(e)[:200]})") from None
    return state
