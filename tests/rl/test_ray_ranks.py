"""The update's ranks as Ray actors (`rollout.backend=ray`) on a real local Ray cluster, 2 ranks over gloo:
the same losses, grad norms and weights as one process; a rank actor killed with SIGKILL stops the group with
one line."""

from __future__ import annotations

import copy

import torch

from rhymerl.rl.ray_ranks import RayRankGroup
from helpers import (UPDATE_MAX_LEN, UPDATE_TEMPERATURE, assert_metrics_close, flat_params, killed_rank_message,
                     one_process_updates, update_batches, update_cfg)
from tiny_models import tiny_decoder


def test_two_ray_rank_actors_update_as_one_process_and_a_killed_one_stops_them(cluster):
    cfg = update_cfg(strategy="fsdp", loss_type="dapo", beta=0.04)  # the KL term: the reference sharded too
    base = tiny_decoder()
    ref = tiny_decoder().eval().requires_grad_(False)
    batches = update_batches(2)
    one, expected = one_process_updates(copy.deepcopy(base).train(), cfg, batches, ref)
    group = RayRankGroup(copy.deepcopy(base), cfg, UPDATE_TEMPERATURE, UPDATE_MAX_LEN, ref_model=ref, dtype="fp32")
    try:
        for step, b in enumerate(batches):
            assert_metrics_close(expected[step], group.update(b), f"update {step + 1} on 2 Ray rank actors")
        w1, w2 = flat_params(one.model), flat_params(group.model)
        assert not torch.equal(w1, flat_params(base)) and (w2 - w1).norm() / w1.norm() <= 1e-5
        assert expected[-1]["actor/kl"] > 0
        msg = killed_rank_message(group, batches[0])
    finally:
        group.close()
    assert "rank 1 of the update (Ray actor" in msg and "died" in msg
