"""The update on two ranks (real gloo collectives between two processes) against the one-process update: the
same losses, grad norms and metrics, the same weights; checkpoints that move between world sizes; a rank
killed with SIGKILL stops the group with one line."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from rhymerl.rl.ranks import RankGroup
from helpers import (UPDATE_MAX_LEN, UPDATE_TEMPERATURE, assert_metrics_close, flat_params, killed_rank_message,
                     one_process_updates, update_batches, update_cfg)
from tiny_models import tiny_decoder

@pytest.mark.parametrize("strategy,extra", [
    ("fsdp", {"loss_type": "dapo", "beta": 0.04, "num_iterations": 2}),  # KL term, reference sharded too
    ("ddp", {"loss_type": "grpo", "max_grad_norm": 0.0}),  # per-sequence normaliser, the norm unclipped
])
def test_two_ranks_update_as_one_process_and_their_checkpoint_resumes_in_one(strategy, extra):
    """3 updates at 2 ranks equal 3 in one process; the trainer state saved at 2 ranks then takes a single
    process through a 4th update as the uninterrupted one-process run does."""
    cfg = update_cfg(strategy=strategy, **extra)
    base = tiny_decoder()
    ref = tiny_decoder().eval().requires_grad_(False) if cfg.beta > 0 else None
    batches = update_batches(4)
    one, expected = one_process_updates(copy.deepcopy(base).train(), cfg, batches, ref)
    group = RankGroup(copy.deepcopy(base), cfg, UPDATE_TEMPERATURE, UPDATE_MAX_LEN, ref_model=ref, dtype="fp32")
    try:
        got = [group.update(b) for b in batches[:3]]
        state = group.state_dict()
    finally:
        group.close()
    for step, (a, b) in enumerate(zip(expected, got)):
        assert_metrics_close(a, b, f"update {step + 1}")
    assert expected[0]["actor/trained_seqs"] == (12 if cfg.beta > 0 else 8) and expected[0]["actor/grad_norm"] > 0
    if cfg.beta > 0:
        assert expected[-1]["actor/kl"] > 0
    assert state["optimizer"]["param_groups"][0]["params"] == list(range(len(list(base.parameters()))))

    resumed, fourth = one_process_updates(group.model, dataclasses.replace(cfg, world_size=1), batches[3:], ref, state)
    assert_metrics_close(expected[3], fourth[0], "update 4 resumed in 1 process from 2 ranks' state")
    w1, w2 = flat_params(one.model), flat_params(resumed.model)
    assert not torch.equal(w1, flat_params(base))
    assert (w2 - w1).norm() / w1.norm() <= 1e-5


def test_a_one_process_checkpoint_resumes_at_two_ranks_and_a_killed_rank_stops_them():
    cfg = update_cfg(strategy="fsdp")
    batches = update_batches()
    one, expected = one_process_updates(tiny_decoder().train(), cfg, batches[:1])
    after_one, state_one = copy.deepcopy(one.model), copy.deepcopy(one.state_dict())
    expected += [one.update(b) for b in batches[1:]]
    group = RankGroup(after_one, cfg, UPDATE_TEMPERATURE, UPDATE_MAX_LEN, dtype="fp32")
    try:
        group.load_state_dict(state_one)
        for step, b in enumerate(batches[1:]):
            assert_metrics_close(expected[step + 1], group.update(b), f"update {step + 2} resumed at 2 ranks")
        assert (flat_params(group.model) - flat_params(one.model)).norm() / flat_params(one.model).norm() <= 1e-5
        msg = killed_rank_message(group, batches[0])
    finally:
        group.close()
    assert "rank 1 of the update" in msg and "killed by SIGKILL" in msg
