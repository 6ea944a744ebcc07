"""Run by tests/rl/test_torchrun_ranks.py under `torchrun --nproc_per_node 2`: rank 1 enters as `rhymerl
train` does under torchrun (it serves the update); rank 0 updates a tiny model in one process, then through
`TorchrunGroup` (itself rank 0 of the update), and prints the largest differences as one JSON line."""

from __future__ import annotations

import copy
import json
import os
import sys

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))]

from rhymerl.cli import main  # noqa: E402

if os.environ["RANK"] != "0":
    sys.exit(main(["train"]))  # `rhymerl train` on a torchrun rank other than 0: serves the update

from rhymerl.rl.torchrun import TorchrunGroup  # noqa: E402
from helpers import UPDATE_MAX_LEN, UPDATE_TEMPERATURE, update_batches, update_cfg, flat_params, one_process_updates  # noqa: E402
from tiny_models import tiny_decoder  # noqa: E402

cfg = update_cfg(strategy=sys.argv[1], loss_type="dapo")
base = tiny_decoder()
batches = update_batches(3)
one, expected = one_process_updates(copy.deepcopy(base).train(), cfg, batches)
group = TorchrunGroup(copy.deepcopy(base), cfg, UPDATE_TEMPERATURE, UPDATE_MAX_LEN, dtype="fp32")
try:
    got = [group.update(b) for b in batches]
    state = group.state_dict()
finally:
    group.close()
rel = max(abs(a[k] - b[k]) / max(1.0, abs(a[k])) for a, b in zip(expected, got) for k in a)
w1, w2 = flat_params(one.model), flat_params(group.model)
print(json.dumps({"metrics_rel": rel, "keys_equal": all(a.keys() == b.keys() for a, b in zip(expected, got)),
                  "grad_norm": [m["actor/grad_norm"] for m in got], "weights_rel": float((w2 - w1).norm() / w1.norm()),
                  "moved": float((w1 - flat_params(base)).norm()), "optimizer_params": len(state["optimizer"]["state"])}))
