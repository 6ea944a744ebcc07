"""rollout.mode=one_step_off: the truncated importance-sampling correction (verl's TIS) in the loss and the
trainer, the local backend's refusal, the alternating admission order across steps, and a tiny training run
on a real local Ray cluster whose steps roll out one weights version behind."""

from __future__ import annotations

import copy
import math
import shutil
from pathlib import Path

import pytest
import torch

from rhymerl.config import ConfigError, TrainSection, load_config
from rhymerl.cost_model import CostModel
from rhymerl.history import HistoryStore
from rhymerl.rl.logprobs import Sample, token_logprobs
from rhymerl.rl.loop import TrainingRun
from rhymerl.rl.losses import policy_loss, tis_weights
from rhymerl.rl.trainer import PolicyTrainer
from rhymerl.rollout import LocalPool, RolloutGroup, RolloutWorker, SamplingParams
from helpers import learned as _learned, one_step_off_overrides, train_rows as _train, worker_config
from tiny_models import VOCAB, random_prompts, tiny_decoder, tiny_smol_checkpoint

FLAT = CostModel([1, 64], [1, 64], [[1.0, 1.0], [1.0, 1.0]])  # drafting is free: always draft


# ---- the TIS weights and the loss ----------------------------------------------------------------------

def test_tis_weights_by_hand():
    """w = min(exp(old - rollout), cap): ratios 2.0, 0.8 and 4.0 (cut to the cap 1.5), on hand-picked logs."""
    old = torch.tensor([[math.log(0.5), math.log(0.4)], [math.log(0.8), 0.0]])  # [B=2, T=2]
    rollout = torch.tensor([[math.log(0.25), math.log(0.5)], [math.log(0.2), 0.0]])
    w, truncated = tis_weights(old, rollout, cap=1.5)
    torch.testing.assert_close(w, torch.tensor([[1.5, 0.8], [1.5, 1.0]]))
    assert truncated.tolist() == [[True, False], [True, False]]
    w, truncated = tis_weights(old, rollout, cap=5.0)  # nothing truncated: the plain ratios
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.8], [4.0, 1.0]]))
    assert not truncated.any()
    with pytest.raises(ValueError, match="cap must be > 0"):
        tis_weights(old, rollout, cap=0.0)


def test_policy_loss_weights_each_tokens_pg_term_and_gradient():
    """At ratio 1 (logp = old) with A = 1 and dapo's token mean over 3 tokens, each token's loss is -w and its
    gradient -w / 3; the KL term is not weighted; without weights the loss is the plain one."""
    old = torch.tensor([[math.log(0.5), math.log(0.4), math.log(0.3)]])  # [1, 3]
    rollout = torch.tensor([[math.log(0.25), math.log(0.5), math.log(0.3)]])  # ratios 2.0, 0.8, 1.0
    w, _ = tis_weights(old, rollout, cap=1.5)  # 1.5, 0.8, 1.0
    mask, adv = torch.ones(1, 3), torch.tensor([1.0])
    logp = old.clone().requires_grad_(True)
    loss, _ = policy_loss(logp, old, adv, mask, loss_type="dapo", tis_weight=w)
    assert loss.item() == pytest.approx(-(1.5 + 0.8 + 1.0) / 3)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, -0.8 / 3, -1.0 / 3]]))
    plain, _ = policy_loss(old, old, adv, mask, loss_type="dapo")
    assert plain.item() == pytest.approx(-1.0)
    ref = old - 0.1  # k3 KL = exp(-0.1) + 0.1 - 1 per token, added unweighted
    kl = math.exp(-0.1) + 0.1 - 1.0
    with_kl, _ = policy_loss(old, old, adv, mask, loss_type="dapo", ref_logp=ref, beta=0.5, tis_weight=w)
    assert with_kl.item() == pytest.approx(-(1.5 + 0.8 + 1.0) / 3 + 0.5 * kl)


def _samples(seed: int = 0) -> list[Sample]:
    """Six samples whose rollout log-probs are far from the trainer's (a stale behaviour policy)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, p in enumerate(random_prompts(6, seed=seed)):
        k = int(torch.randint(2, 9, (1,), generator=g))
        comp = torch.randint(0, VOCAB, (k,), generator=g).tolist()
        out.append(Sample(p, comp, (-torch.rand(k, generator=g) * 6).tolist(), float(torch.randn(1, generator=g))))
    return out


def _update(model, samples, cap=None):
    cfg = TrainSection(micro_batch_size=4, loss_type="dapo", dtype="fp32", learning_rate=1e-3)
    kw = {} if cap is None else {"tis_imp_ratio_cap": cap}
    model = copy.deepcopy(model)
    metrics = PolicyTrainer(model, cfg, temperature=0.7, max_completion_length=8, **kw).update(samples)
    return metrics, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_the_trainer_applies_tis_only_with_a_cap():
    model = tiny_decoder().train()
    samples = _samples()
    plain_m, plain = _update(model, samples)
    off_m, off = _update(model, samples, cap=0.0)
    on_m, on = _update(model, samples, cap=2.0)
    assert off_m == plain_m and all(torch.equal(off[n], plain[n]) for n in plain)  # cap off: nothing changes
    assert "actor/tis_weight_mean" not in plain_m
    assert any(not torch.equal(on[n], plain[n]) for n in plain)  # the weights enter the gradient
    # the metrics, from the trainer's own (proximal) log-probs of the unchanged model, over every token once
    with torch.no_grad():
        logp, mask, _ = token_logprobs(model, samples, 0.7, None)
    rollout = torch.zeros_like(logp)
    for b, s in enumerate(samples):
        rollout[b, : len(s.logprobs)] = torch.tensor(s.logprobs)
    ratio = torch.exp(logp - rollout)[mask.bool()]
    assert on_m["actor/tis_weight_mean"] == pytest.approx(ratio.clamp(max=2.0).mean().item(), rel=1e-5)
    assert on_m["actor/tis_clipfrac"] == pytest.approx((ratio > 2.0).float().mean().item())
    assert 0 < on_m["actor/tis_clipfrac"] < 1


def test_tis_is_the_identity_when_the_rollout_ran_on_the_trained_weights():
    """Rollout log-probs equal to the trainer's (sync mode, exact numerics): every weight is 1, the update the
    plain one."""
    model = tiny_decoder().train()
    samples = _samples(1)
    with torch.no_grad():
        logp, _, _ = token_logprobs(model, samples, 0.7, None)
    samples = [Sample(s.prompt_ids, s.completion_ids, logp[b, : len(s.completion_ids)].tolist(), s.advantage)
               for b, s in enumerate(samples)]
    plain_m, plain = _update(model, samples)
    on_m, on = _update(model, samples, cap=2.0)
    assert on_m["actor/tis_weight_mean"] == pytest.approx(1.0, abs=1e-5) and on_m["actor/tis_clipfrac"] == 0
    for n in plain:
        torch.testing.assert_close(on[n], plain[n], rtol=1e-5, atol=1e-7)


# ---- config -------------------------------------------------------------------------------------------

def test_the_local_backend_refuses_one_step_off():
    with pytest.raises(ConfigError, match=r"rollout\.mode: must be 'sync' with rollout\.backend=local.*"
                                          r"set rollout\.backend=ray"):
        load_config(None, ["rollout.mode=one_step_off"])
    cfg = load_config(None, ["rollout.mode=one_step_off", "rollout.backend=ray", "rollout.num_workers=2"])
    assert cfg.rollout.mode == "one_step_off" and cfg.train.tis_imp_ratio_cap == 2.0
    with pytest.raises(ConfigError, match="rollout.mode"):
        load_config(None, ["rollout.mode=async"])


# ---- HistoPipe across steps: odd steps short to long, even steps long to short -------------------------

def test_alternate_admission_flips_with_the_step_and_keeps_the_tokens():
    policy = tiny_decoder()
    prompts = random_prompts(4, seed=10)
    history = HistoryStore()
    for p, n in zip(prompts, [3, 12, 6, 9]):  # recorded lengths: longest first is groups 1, 3, 2, 0
        history.record_rollout(p, [[5] * n] * 2)
    config = worker_config(num_slots=4, max_draft_tokens=8, admission_order="alternate")
    pool = LocalPool(RolloutWorker(policy, None, config, cost_model=FLAT), history)
    admitted = []
    generate = pool.worker.engine.generate
    pool.worker.engine.generate = lambda ps, *a, **kw: admitted.append(kw["request_ids"][::2]) or generate(ps, *a, **kw)
    groups = [RolloutGroup(p, [f"s-p{i}-g{g}" for g in range(2)]) for i, p in enumerate(prompts)]
    params = SamplingParams(temperature=0.3, max_tokens=16, seed=3)
    odd, even, val = (pool.rollout(groups, params, step=s) for s in (3, 4, None))
    assert [[rid.split("-")[1] for rid in ids] for ids in admitted] == [
        ["p0", "p2", "p3", "p1"],  # odd: shortest predicted first
        ["p1", "p3", "p2", "p0"],  # even: longest first
        ["p1", "p3", "p2", "p0"]]  # no step (validation): longest first
    tokens = [[(o.request_id, o.token_ids) for o in r.outputs] for r in (odd, even, val)]
    assert tokens[0] == tokens[1] == tokens[2]  # keyed randomness: the order changes nothing else


# ---- a tiny run on a real local Ray cluster --------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_dir) -> Path:
    """A tiny model with the real SmolLM2 tokenizer, logits flat enough that siblings differ, and a reward that
    differs between almost any two completions, so that every step trains (non-zero advantages)."""
    path = tiny_smol_checkpoint(tmp_path_factory.mktemp("tiny-smol"), smollm2_dir, embed_std=0.3)
    (path / "reward_fns.py").write_text("def length_mod(completion, ground_truth, data_source, prompt):\n"
                                        "    return len(completion or '') % 7 / 6\n")
    return path


def _config(tiny_dir: Path, out: Path, *extra: str):
    return load_config(None, one_step_off_overrides(tiny_dir, out, "length_mod", *extra))


def test_one_step_off_rolls_out_one_version_behind_and_corrects_with_tis(cluster, tiny_dir, tmp_path):
    rows = _train(TrainingRun(_config(tiny_dir, tmp_path / "run", "train.total_steps=3", "run.save_every=0",
                                      "rollout.admission_order=alternate"), cost_model=FLAT))
    assert [r["step"] for r in rows] == [1, 2, 3]
    # the first step rolls out synchronously on the initial weights; the next two on the weights before the
    # last update, in the background during the previous step's update
    assert [r["rollout/staleness"] for r in rows] == [0, 1, 1]
    assert all(r["timing_s/rollout_wait"] >= 0 for r in rows)
    assert all(r["actor/trained_seqs"] > 0 for r in rows)
    assert all(0 < r["actor/tis_weight_mean"] <= 2.0 and 0 <= r["actor/tis_clipfrac"] <= 1 for r in rows)
    # on stale samples the trainer's log-probs (weights t) differ from the rollout's (weights t - 1), and the
    # TIS weights with them; on the first step's fresh ones they agree to rounding
    assert rows[0]["actor/logprob_diff_max"] < 1e-4 and abs(rows[0]["actor/tis_weight_mean"] - 1) < 1e-4
    assert all(r["actor/logprob_diff_max"] > 1e-2 and r["actor/tis_weight_mean"] != 1.0 for r in rows[1:])


def test_the_step_after_a_checkpoint_rolls_out_synchronously_and_a_resume_repeats_it(cluster, tiny_dir, tmp_path):
    """A checkpoint holds its step's weights only, so the step after it rolls out on them, in the run and in a
    run resumed there alike: the resumed step repeats the uninterrupted one (fp32)."""
    out = tmp_path / "run"
    rows = _train(TrainingRun(_config(tiny_dir, out, "train.total_steps=3", "run.save_every=2"), cost_model=FLAT))
    assert [r["rollout/staleness"] for r in rows] == [0, 1, 0]
    shutil.rmtree(out / "checkpoints" / "step_000003")  # as if killed during step 3: resume from step 2
    resumed = _train(TrainingRun.resume(out, cost_model=FLAT))
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert _learned(resumed[2]) == _learned(rows[2]) and resumed[2]["actor/trained_seqs"] > 0
