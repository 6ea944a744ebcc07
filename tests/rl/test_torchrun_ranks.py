"""`torchrun --nproc_per_node 2`: rank 0 drives and is rank 0 of the update (`TorchrunGroup`), rank 1 enters
through `rhymerl train` and serves the update; 3 updates equal one process's (real torchrun, gloo, 2 CPU
processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("torchrun_ranks_script.py")


def test_torchrun_ranks_update_as_one_process(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(SCRIPT), "ddp"], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["keys_equal"] and result["metrics_rel"] <= 1e-5, result
    assert result["moved"] > 0 and result["weights_rel"] <= 1e-5 and min(result["grad_norm"]) > 0, result
    assert result["optimizer_params"] > 0  # the full AdamW state gathered on rank 0
