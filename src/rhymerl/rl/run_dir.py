"""A training run's directory: claimed by one run, its config kept as the run started it.

- A fresh run gets a directory of its own: `run.output_dir` when it holds no run yet (a run there is
  refused, never appended to or overwritten: resume it instead), else `runs/<UTC timestamp>`, with `-2`,
  `-3`, ... where another run started in the same second (the `mkdir` that creates it is the claim).
- `config.yaml` is written atomically and exclusively (`claim`): of two runs started into one directory,
  the second is refused before it writes anything there.
- `--resume RUN_DIR key=value ...` never rewrites `config.yaml`. The overrides of each resume are appended
  to `overrides.jsonl` (`{"step": N, "overrides": [...]}`, one line per resume that gave some), and a resume
  applies the recorded ones, in order, before its own: config.yaml + overrides.jsonl is the run's config.
  Each checkpoint's state.json also holds the whole config it ran with.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

from rhymerl.atomic_file import atomic_write
from rhymerl.config import TrainConfig, save_config
from rhymerl.errors import UserError

CONFIG = "config.yaml"
OVERRIDES = "overrides.jsonl"
# What a run writes into its directory first: where one of them is, a run has started there.
_RUN_FILES = (CONFIG, "metrics.jsonl", "checkpoints")


def new_run_dir(output_dir: str) -> Path:
    """The directory of a fresh run (created): `output_dir` when given and holding no run, else a new
    `runs/<timestamp>[-k]`. UserError when `output_dir` holds a run already."""
    if output_dir:
        path = Path(output_dir)
        found = [name for name in _RUN_FILES if (path / name).exists()]
        if found:
            raise UserError(f"run.output_dir={path}: already holds a run ({', '.join(found)}); a new run would "
                            f"append to its metrics and overwrite its checkpoints: continue it with `rhymerl "
                            f"train --resume {path}`, or choose another run.output_dir")
        path.mkdir(parents=True, exist_ok=True)
        return path
    stamp = Path("runs") / datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    stamp.parent.mkdir(parents=True, exist_ok=True)
    for k in range(1, 1000):
        path = stamp if k == 1 else stamp.with_name(f"{stamp.name}-{k}")
        try:
            path.mkdir()  # atomic: of two runs started in the same second, one gets each name
            return path
        except FileExistsError:
            continue
    raise UserError(f"{stamp}: 999 runs started in the same second; set run.output_dir")


def claim(run_dir: Path, cfg: TrainConfig) -> None:
    """Write a fresh run's config.yaml, atomically and only where none is (UserError if another run got
    there first)."""
    try:
        save_config(cfg, run_dir / CONFIG, exclusive=True)
    except FileExistsError:
        raise UserError(f"{run_dir / CONFIG}: another run started in {run_dir} meanwhile; choose another "
                        f"run.output_dir") from None


def recorded_overrides(run_dir: Path) -> list[str]:
    """The overrides earlier resumes of the run gave, in order (none where overrides.jsonl is absent)."""
    path = Path(run_dir) / OVERRIDES
    if not path.exists():
        return []
    out = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            row = json.loads(line)
            items = row["overrides"]
            if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UserError(f"{path}, line {i}: not a record of overrides ({line[:80]!r}); rhymerl writes "
                            f'{{"step": N, "overrides": ["key=value", ...]}} per line') from None
        out += items
    return out


def record_overrides(run_dir: Path, step: int, overrides: Sequence[str]) -> None:
    """Append a resume's overrides (at checkpoint `step`) to overrides.jsonl, atomically."""
    if not overrides:
        return
    path = Path(run_dir) / OVERRIDES
    before = path.read_text(encoding="utf-8") if path.exists() else ""
    with atomic_write(path) as f:
        f.write(before + json.dumps({"step": step, "overrides": list(overrides)}) + "\n")
