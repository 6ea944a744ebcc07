"""The update's ranks as Ray actors (`rollout.backend=ray`) on a real local Ray cluster, 2 ranks over gloo:
the same losses, grad norms and weights as one process; a rank actor killed with SIGKILL stops the group with
one line."""

from __future__ import annotations

import copy
import os
import signal

import pytest
import torch

from rhymerl.rl.ranks import RankFailure
from rhymerl.rl.ray_ranks import RayRankGroup
from ray_cluster import cluster  # noqa: F401  (the fixture)
from test_ranks import MAX_LEN, TEMPERATURE, _batches, _cfg, _close, _flat, _one_process
from tiny_models import tiny_decoder


def test_two_ray_rank_actors_update_as_one_process_and_a_killed_one_stops_them(cluster):  # noqa: F811
    cfg = _cfg(strategy="fsdp", loss_type="dapo", beta=0.04)  # the KL term: the reference sharded too
    base = tiny_decoder()
    ref = tiny_decoder().eval().requires_grad_(False)
    batches = _batches(2)
    one, expected = _one_process(copy.deepcopy(base).train(), cfg, batches, ref)
    group = RayRankGroup(copy.deepcopy(base), cfg, TEMPERATURE, MAX_LEN, ref_model=ref, dtype="fp32")
    try:
        for step, b in enumerate(batches):
            _close(expected[step], group.update(b), f"update {step + 1} on 2 Ray rank actors")
        w1, w2 = _flat(one.model), _flat(group.model)
        assert not torch.equal(w1, _flat(base)) and (w2 - w1).norm() / w1.norm() <= 1e-5
        assert expected[-1]["actor/kl"] > 0
        os.kill(group.rank_pids()[1], signal.SIGKILL)
        with pytest.raises(RankFailure) as failure:
            group.update(batches[0])
    finally:
        group.close()
    msg = str(failure.value)
    assert "\n" not in msg and "rank 1 of the update (Ray actor" in msg and "died" in msg and "--resume" in msg
