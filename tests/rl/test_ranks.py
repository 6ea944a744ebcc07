"""The update on two ranks (real gloo collectives between two processes) against the one-process update: the
same losses, grad norms and metrics, the same weights; checkpoints that move between world sizes; a rank
killed with SIGKILL stops the group with one line."""

from __future__ import annotations

import copy
import dataclasses
import os
import signal

import pytest
import torch

from rhymerl.config import TrainSection
from rhymerl.rl.ranks import RankFailure, RankGroup
from rhymerl.rl.trainer import PolicyTrainer
from helpers import training_samples
from tiny_models import tiny_decoder

TEMPERATURE, MAX_LEN = 0.7, 8


def _batches(n: int = 3) -> list:
    """Updates of 12 samples in groups of 3: with micro_batch_size 2, 5 micro-batches (an odd number, so one
    rank runs a padding micro-batch) of the 8 sequences with a non-zero advantage."""
    return [training_samples(seed=k, n=12, group=3) for k in range(n)]


def _cfg(**kw) -> TrainSection:
    return TrainSection(**{"micro_batch_size": 2, "dtype": "fp32", "learning_rate": 1e-3, "total_steps": 4,
                           "lr_scheduler": "linear", "warmup_steps": 1,
                           "world_size": 2, **kw})


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _close(a: dict, b: dict, what: str) -> None:
    """Every metric to 1e-5 relative (absolute below 1)."""
    assert a.keys() == b.keys(), what
    for k in a:
        assert abs(a[k] - b[k]) <= 1e-5 * max(1.0, abs(a[k])), f"{what}: {k} {a[k]} vs {b[k]}"


def _one_process(model, cfg, batches, ref=None, state=None):
    trainer = PolicyTrainer(model, cfg, TEMPERATURE, MAX_LEN, ref_model=ref, dtype="fp32")
    if state is not None:
        trainer.load_state_dict(state)
    return trainer, [trainer.update(b) for b in batches]


@pytest.mark.parametrize("strategy,extra", [
    ("fsdp", {"loss_type": "dapo", "beta": 0.04, "num_iterations": 2}),  # KL term, reference sharded too
    ("ddp", {"loss_type": "grpo", "max_grad_norm": 0.0}),  # per-sequence normaliser, the norm unclipped
])
def test_two_ranks_update_as_one_process_and_their_checkpoint_resumes_in_one(strategy, extra):
    """3 updates at 2 ranks equal 3 in one process; the trainer state saved at 2 ranks then takes a single
    process through a 4th update as the uninterrupted one-process run does."""
    cfg = _cfg(strategy=strategy, **extra)
    base = tiny_decoder()
    ref = tiny_decoder().eval().requires_grad_(False) if cfg.beta > 0 else None
    batches = _batches(4)
    one, expected = _one_process(copy.deepcopy(base).train(), cfg, batches, ref)
    group = RankGroup(copy.deepcopy(base), cfg, TEMPERATURE, MAX_LEN, ref_model=ref, dtype="fp32")
    try:
        got = [group.update(b) for b in batches[:3]]
        state = group.state_dict()
    finally:
        group.close()
    for step, (a, b) in enumerate(zip(expected, got)):
        _close(a, b, f"update {step + 1}")
    assert expected[0]["actor/trained_seqs"] == (12 if cfg.beta > 0 else 8) and expected[0]["actor/grad_norm"] > 0
    if cfg.beta > 0:
        assert expected[-1]["actor/kl"] > 0
    assert state["optimizer"]["param_groups"][0]["params"] == list(range(len(list(base.parameters()))))

    resumed, fourth = _one_process(group.model, dataclasses.replace(cfg, world_size=1), batches[3:], ref, state)
    _close(expected[3], fourth[0], "update 4 resumed in 1 process from 2 ranks' state")
    w1, w2 = _flat(one.model), _flat(resumed.model)
    assert not torch.equal(w1, _flat(base))
    assert (w2 - w1).norm() / w1.norm() <= 1e-5


def test_a_one_process_checkpoint_resumes_at_two_ranks_and_a_killed_rank_stops_them():
    cfg = _cfg(strategy="fsdp")
    batches = _batches()
    one, expected = _one_process(tiny_decoder().train(), cfg, batches[:1])
    after_one, state_one = copy.deepcopy(one.model), copy.deepcopy(one.state_dict())
    expected += [one.update(b) for b in batches[1:]]
    group = RankGroup(after_one, cfg, TEMPERATURE, MAX_LEN, dtype="fp32")
    try:
        group.load_state_dict(state_one)
        for step, b in enumerate(batches[1:]):
            _close(expected[step + 1], group.update(b), f"update {step + 2} resumed at 2 ranks")
        assert (_flat(group.model) - _flat(one.model)).norm() / _flat(one.model).norm() <= 1e-5
        os.kill(group.rank_pids()[1], signal.SIGKILL)
        with pytest.raises(RankFailure) as failure:
            group.update(batches[0])
    finally:
        group.close()
    msg = str(failure.value)
    assert "\n" not in msg and "rank 1 of the update" in msg and "killed by SIGKILL" in msg and "--resume" in msg
