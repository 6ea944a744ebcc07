"""rollout.defer_tail and rollout.max_staleness: a worker stops its share's tail (rollout/deferral.py) and its
next share continues it (same weights: the same tokens; after an update: the new version's, recorded so) or
runs it again past max_staleness; the loop (rl/group_assembly.py) trains a deferred group at the step where
it completes; a tiny run on a real local Ray cluster defers, keeps every token within max_staleness, and
resumes exactly."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rhymerl.config import ConfigError, load_config
from rhymerl.engine.sequence import RequestOutput
from rhymerl.history import HistoryStore
from rhymerl.rl.group_assembly import GroupAssembly
from rhymerl.rl.loop import TrainingRun
from rhymerl.rl.step_metrics import staleness_metrics
from rhymerl.rollout import RolloutGroup, RolloutResult, RolloutWorker, SamplingParams
from helpers import FLAT, learned, one_step_off_overrides, train_rows, worker_config
from tiny_models import VOCAB, random_prompts, tiny_decoder, tiny_smol_checkpoint

PARAMS = SamplingParams(temperature=1.0, max_tokens=16, seed=3)
NO_HISTORY = HistoryStore().export([])


def _worker(model=None) -> RolloutWorker:
    """A worker on the tiny random model with every 8th token an end of sequence (lengths that vary), whose
    history predicts every group's longest member at 2 tokens (deferral threshold 2.4)."""
    model = model or tiny_decoder()
    model.cfg = dataclasses.replace(model.cfg, eos_token_ids=tuple(range(0, VOCAB, 8)))
    worker = RolloutWorker(model, None, worker_config(128, num_slots=8, speculative="off"))
    worker._predict_longest = lambda prompt, size: 2.0
    return worker


def _groups(step: int) -> list[RolloutGroup]:
    return [RolloutGroup(p, [f"s{step}-p{i}-g{g}" for g in range(3)]) for i, p in enumerate(random_prompts(4, seed=5))]


def test_a_deferred_request_continues_with_its_own_tokens_or_runs_again():
    groups = _groups(1)
    ref = {o.request_id: o for o in _worker().rollout(groups, PARAMS, NO_HISTORY, 0, step=1)[0]}
    worker = _worker()
    outs, stats = worker.rollout(groups, PARAMS, NO_HISTORY, 0, step=1, defer=True)
    deferred = {c.request_id: c for c in stats.deferred}
    assert deferred, "the tiny model's lengths vary: some group's last request is past 2.4 tokens"
    returned = {o.request_id for o in outs}
    assert returned | deferred.keys() == set(ref) and not returned & deferred.keys()
    assert all(o.token_ids == ref[o.request_id].token_ids for o in outs)  # the rest as without deferral
    for rid, c in deferred.items():
        assert len(c.output_ids) >= 3 and c.versions == [0] * len(c.output_ids)
        assert c.output_ids == ref[rid].token_ids[:len(c.output_ids)]
    # the next share on the same weights (step 2 trains from version 1: staleness 1): the same tokens
    cont, st = worker.rollout([], PARAMS, NO_HISTORY, 0, step=2, carry=stats.deferred, max_staleness=1)
    assert st.reruns == 0 and {o.request_id: o.token_ids for o in cont} == {r: ref[r].token_ids for r in deferred}
    # after an update: the tokens it had, then the new version's
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in worker.model.named_parameters()}
    worker.load_weights(new, 1)
    cont, st = worker.rollout([], PARAMS, NO_HISTORY, 1, step=2, carry=stats.deferred, max_staleness=1)
    for o in cont:
        k = len(deferred[o.request_id].output_ids)
        assert o.token_ids[:k] == deferred[o.request_id].output_ids
        assert o.versions == [0] * k + [1] * (len(o.token_ids) - k)
    # trained at step 3 (from version 2) its first tokens would be 2 versions old: past max_staleness=1, so it
    # runs again from scratch on version 1, as a fresh request of that id would
    again, st = worker.rollout([], PARAMS, NO_HISTORY, 1, step=3, carry=stats.deferred, max_staleness=1)
    fresh = _worker()
    fresh.load_weights(new, 1)
    plain = {o.request_id: o for o in fresh.rollout(groups, PARAMS, NO_HISTORY, 1, step=3)[0]}
    assert st.reruns == len(deferred)
    assert {o.request_id: o.token_ids for o in again} == {r: plain[r].token_ids for r in deferred}
    assert all(set(o.versions) == {1} for o in again)


def test_a_group_trains_at_the_step_where_it_completes():
    def out(rid):
        return RequestOutput(rid, [1], [7], [0.0], "stop", versions=[0])
    g1 = [RolloutGroup([1], ["a0", "a1"]), RolloutGroup([2], ["b0", "b1"])]
    g2 = [RolloutGroup([3], ["c0", "c1"])]
    assembly = GroupAssembly()
    prompts, outs = assembly.take(["A", "B"], g1, RolloutResult([out("a0"), out("a1"), out("b0")], [], 0,
                                                                deferred=["b1"]))
    assert prompts == ["A"] and [o.request_id for o in outs[0]] == ["a0", "a1"]
    prompts, outs = assembly.take(["C"], g2, RolloutResult([out("c0"), out("c1"), out("b1")], [], 0))
    assert prompts == ["B", "C"] and [[o.request_id for o in g] for g in outs] == [["b0", "b1"], ["c0", "c1"]]
    assert assembly.waiting == []
    with pytest.raises(RuntimeError, match="belong to no group"):
        assembly.take([], [], RolloutResult([out("zz")], [], 0))


def test_max_staleness_is_one_rule_for_every_mode():
    old = RequestOutput("r", [1], [7, 7], [0.0, 0.0], "stop", versions=[1, 3])
    assert staleness_metrics(3, [old], max_staleness=2)["rollout/staleness_max"] == 2
    with pytest.raises(RuntimeError, match=r"trained 2 versions after .* past rollout.max_staleness=1"):
        staleness_metrics(3, [old], max_staleness=1)
    ray = ["rollout.backend=ray", "rollout.num_workers=2"]
    with pytest.raises(ConfigError, match=r"rollout\.defer_tail: must be false unless rollout\.stream=true"):
        load_config(None, ray + ["rollout.mode=one_step_off", "rollout.defer_tail=true"])
    with pytest.raises(ConfigError, match=r"rollout\.max_staleness: must be >= 1 with rollout\.mode=one_step_off"):
        load_config(None, ray + ["rollout.mode=one_step_off", "rollout.max_staleness=0"])
    assert load_config(None, ["rollout.max_staleness=0"]).rollout.max_staleness == 0  # sync: staleness 0


# ---- a tiny run on a real local Ray cluster -------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_dir) -> Path:
    """The tiny SmolLM2-shaped model, its end-of-sequence token made likely (every embedding's first entry 1,
    the EOS row's 4.4: a constant lift of its logit; median length ~6), so that lengths vary within a group
    and a tail exists below the length cap."""
    path = tiny_smol_checkpoint(tmp_path_factory.mktemp("tiny-eos"), smollm2_dir, embed_std=0.3)
    weights = load_file(path / "model.safetensors")
    embed = weights["model.embed_tokens.weight"]
    embed[:, 0], embed[2, 0] = 1.0, 4.4
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    (path / "reward_fns.py").write_text("def length_mod(completion, ground_truth, data_source, prompt):\n"
                                        "    return len(completion or '') % 7 / 6\n")
    return path


def _config(tiny_dir: Path, out: Path, *extra: str):
    return load_config(None, one_step_off_overrides(
        tiny_dir, out, "length_mod", "rollout.speculative=off", "rollout.stream=true", "rollout.defer_tail=true",
        "train.prompts_per_step=4", "rollout.max_completion_length=48", "rollout.num_slots=12", *extra,
        prompts=4, micro_batch=12))


def test_a_deferred_group_trains_where_it_completes_and_a_run_resumes_exactly(cluster, tiny_dir, tmp_path):
    out = tmp_path / "run"
    rows = train_rows(TrainingRun(_config(tiny_dir, out, "train.total_steps=5", "run.save_every=3"),
                                  cost_model=FLAT))
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    # step 4 is the first whose share sees a history (step 2's is made before step 1 is recorded; step 3 ends
    # in a checkpoint and step 5 is the last, so neither defers)
    deferred = [r["rollout/deferred"] for r in rows]
    assert [d > 0 for d in deferred] == [False, False, False, True, False]
    # a group with a deferred request trains at step 5, where it completes, beside step 5's own 4
    assert rows[3]["train/groups"] < 4 and rows[3]["train/groups"] + rows[4]["train/groups"] == 8
    # step 4 follows the checkpoint (on its weights, as in sync) and its continuations are trained at step 5,
    # one version later: within the default max_staleness 1, so none re-runs
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 1, 0, 1]
    assert all(r["rollout/rerun"] == 0 for r in rows)
    shutil.rmtree(out / "checkpoints" / "step_000005")
    resumed = train_rows(TrainingRun.resume(out, cost_model=FLAT))
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5] and resumed[3]["rollout/deferred"] == deferred[3]
    assert [learned(r) for r in resumed[3:]] == [learned(r) for r in rows[3:]]
