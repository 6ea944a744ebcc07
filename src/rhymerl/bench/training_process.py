"""One training run in a process of its own: how `bench e2e` runs each of the runs it compares.

Two runs timed one after the other in one process are not independent: the second inherits the first's
allocator and page state, its threads, and whatever of it the garbage collector has not reached yet (once, the
first run's two Ray actors, 3.3 GB each, slowed the second: docs/notebook/2026-11-28-c.md). Each run here is
`rhymerl train` with the given config overrides in a fresh Python process, as a user starts it; its figures are
read back from the run's metrics.jsonl, the file a user reads.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TAIL_LINES = 20  # of a failed run's stderr, in the error


def train_in_process(overrides: list[str], out_dir: Path) -> Path:
    """Run `rhymerl train *overrides run.output_dir=out_dir` in a child process and wait for it; the run's
    directory (`out_dir`). The child's stdout (its report) is dropped, its stderr kept in `out_dir`.log beside
    the run and quoted (last lines) in the RuntimeError raised when the run fails."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    log = out_dir.parent / f"{out_dir.name}.log"
    cmd = [sys.executable, "-m", "rhymerl.cli", "train", *overrides, f"run.output_dir={out_dir}"]
    with open(log, "w") as err:
        rc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=err).returncode
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-TAIL_LINES:])
        raise RuntimeError(f"rhymerl train (run.output_dir={out_dir}) exited with {rc}; the end of its stderr:\n{tail}")
    return out_dir
