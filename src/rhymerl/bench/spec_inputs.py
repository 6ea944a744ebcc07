"""What `rhymerl bench spec` drafts from and decodes: the prompts (a built-in task or a JSONL prompt file), and
with `--history-from` a training run's history store, read from its checkpoint's history.json alone."""

from __future__ import annotations

from pathlib import Path

from rhymerl.data.dataset import BUILTIN_TASKS, builtin_examples
from rhymerl.errors import UserError
from rhymerl.history import HistoryStore
from rhymerl.model.pretrained import chat_prompt_ids
from rhymerl.rl.checkpoint import latest_checkpoint
from rhymerl.tasks.prompt_file import read_prompt_file


def load_prompts(tokenizer, data: str | None, n: int, seed: int) -> list[list[int]]:
    """n prompts' token ids: of a built-in task (`data` None = arithmetic, or a task's name), fixed by seed, or
    the first n of a JSONL prompt file."""
    if data is None or data in BUILTIN_TASKS:
        texts = [e.prompt for e in builtin_examples(data or "arithmetic", n, seed)]
    else:
        texts = [row.prompt for row in read_prompt_file(Path(data))][:n]
    return [chat_prompt_ids(tokenizer, t) for t in texts]


def history_of_run(run_dir: str | Path) -> tuple[HistoryStore, Path]:
    """The history store of a training run's latest checkpoint, and that checkpoint's directory. Only its
    history.json is read: the checkpoint's trainer.pt, a pickle, is never loaded here. Raises
    FileNotFoundError without a checkpoint or history, UserError for a file that is not a history store."""
    ckpt = latest_checkpoint(Path(run_dir))
    if ckpt is None:
        raise FileNotFoundError(f"--history-from {run_dir}: no checkpoint in {Path(run_dir) / 'checkpoints'}")
    path = ckpt / "history.json"
    if not path.is_file():
        raise FileNotFoundError(f"--history-from {run_dir}: {ckpt} has no history.json")
    history = HistoryStore()
    try:
        history.load(path)
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # JSONDecodeError is a ValueError
        why = f"{path} is not a history store ({type(e).__name__}: {e})"
        raise UserError(f"--history-from {run_dir}: {why}") from None
    return history, ckpt
