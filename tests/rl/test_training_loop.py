"""The RL loop end to end on a tiny random model (with the real tokenizer, so chat templates and text rewards
are real): spec on/off fidelity, exact resume after SIGKILL, reward errors, data errors, checkpoints that
transformers loads."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rhymerl import cli
from rhymerl.bench import e2e_bench, spec_bench
from rhymerl.config import ConfigError, load_config
from rhymerl.data.dataset import DatasetError
from rhymerl.cost_model import CostModel
from rhymerl.engine.engine import Engine
from rhymerl.metrics import MetricsLogger, read_metrics
from rhymerl.model import pretrained
from rhymerl.engine.backends.cpu_weights import cpu_packing_supported
from rhymerl.rl.checkpoint import latest_checkpoint
from rhymerl.histopipe.trace import read_trace
from rhymerl.process import deterministic_algorithms
from rhymerl.rl.loop import TrainingRun
from rhymerl.rl.prompts import batch_indices
from rhymerl.rl.run_settings import DEFAULT_MAX_DRAFT_TOKENS, DEFAULT_PROMPTS_PER_STEP, resolve_machine_defaults
from tiny_models import tiny_smol_checkpoint

EMBED_STD = 0.8
FLAT = CostModel([1, 64], [1, 64], [[1.0, 1.0], [1.0, 1.0]])  # drafting is free: always draft

# A reward that varies between completions of random text, so advantages (and the updates) are non-zero.
REWARD_PY = '''
def vowels(completion, ground_truth, data_source, prompt):
    text = completion or " "
    return sum(c in "aeiou" for c in text) / len(text)

CALLS = [0]

def flaky(completion, ground_truth, data_source, prompt):
    CALLS[0] += 1
    if CALLS[0] % 3 == 0:
        raise RuntimeError("scorer crashed")
    if CALLS[0] % 3 == 1:
        return float("nan")
    return 1.0
'''


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_dir) -> Path:
    """A 2-layer random Llama with the real SmolLM2 tokenizer and chat template, and the reward functions."""
    path = tiny_smol_checkpoint(tmp_path_factory.mktemp("tiny-smol"), smollm2_dir, embed_std=EMBED_STD)
    (path / "reward_fns.py").write_text(REWARD_PY)
    return path


def _overrides(tiny_dir: Path, out: Path, *extra: str) -> list[str]:
    return [f"model.name={tiny_dir}", f"run.output_dir={out}", "data.num_train_prompts=4", "data.num_val_prompts=2",
            "train.prompts_per_step=2", "rollout.num_generations=3", "rollout.max_completion_length=8",
            "val.max_completion_length=6", "rollout.num_slots=6", "train.micro_batch_size=4",
            "train.learning_rate=0.01", "train.dtype=fp32", "rollout.dtype=fp32", "run.progress=false",
            "run.tensorboard=false", f"reward.function={tiny_dir / 'reward_fns.py'}:vowels", *extra]


# Metrics that depend on wall time or speculation, not on what was learned (the rollout's log-probs round
# differently with drafts; the trainer's do not, so only their difference, a metric, changes; which prompt
# prefixes are shared depends on which sequences still run when another is admitted; the timeline's bubble
# ratio, finish gap, throughput and per-worker figures are wall times or depend on the worker count).
_TIMING = ("timing_s/", "tokens_per_s", "draft_time_share", "spec_", "tokens_per_forward", "forward_passes",
           "logprob_diff", "prefill_", "bubble_ratio", "finish_gap_s", "throughput", "/worker")


def _learned(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not any(t in k for t in _TIMING)} for r in rows]


def test_batch_indices_cover_each_epoch_once():
    rows = [i for s in range(6) for i in batch_indices(s, 4, 2, seed=3, shuffle=True)]
    assert sorted(rows[:4]) == [0, 1, 2, 3] and sorted(rows[4:8]) == [0, 1, 2, 3] and sorted(rows[8:]) == [0, 1, 2, 3]
    assert rows[:4] != rows[4:8] or rows[4:8] != rows[8:]  # reshuffled each epoch
    assert batch_indices(5, 4, 2, 3, True) == batch_indices(5, 4, 2, 3, True)


_UNINTERRUPTED = ("train.total_steps=4", "run.save_every=2", "val.every=2")


@pytest.fixture(scope="module")
def uninterrupted(tiny_dir, tmp_path_factory) -> dict[str, Path]:
    """The run directories of one 4-step job (fp32, a checkpoint every 2 steps) trained with speculation off and
    with HistoSpec drafting always (FLAT): the fidelity test compares the two, and the SIGKILL test's killed
    and resumed run must repeat the HistoSpec one."""
    out = tmp_path_factory.mktemp("uninterrupted")
    runs = {}
    for mode in ("off", "histospec"):
        cfg = load_config(None, _overrides(tiny_dir, out / mode, *_UNINTERRUPTED, f"rollout.speculative={mode}"))
        runs[mode] = TrainingRun(cfg, cost_model=FLAT).run()
    return runs


def test_speculation_on_and_off_train_identically(uninterrupted):
    """Fidelity: same seed, same rollouts, same rewards and losses, step after step (fp32)."""
    runs = {mode: read_metrics(run_dir) for mode, run_dir in uninterrupted.items()}
    off, spec = _learned(runs["off"]), _learned(runs["histospec"])
    assert [r["step"] for r in off] == [0, 1, 2, 3, 4]
    assert off == spec  # every learned figure, bit for bit: rewards, lengths, losses, grad norms, entropy
    assert any(r.get("actor/trained_seqs", 0) > 0 for r in off)  # the test trains, not just rolls out
    later = [r for r in runs["histospec"] if r["step"] > 2 and "rollout/spec_drafted" in r]
    assert sum(r["rollout/spec_drafted"] for r in later) > 0  # the second epoch drafts from history
    # The length trace (HistoPipe's simulator replays it): every step's groups with their lengths, the same
    # with and without speculation; from the second epoch on, the history's predictions are scored.
    trace = read_trace(uninterrupted["histospec"])
    assert trace == read_trace(uninterrupted["off"])
    assert [row["step"] for row in trace] == [1, 2, 3, 4]
    assert all(len(row["groups"]) == 2 and all(len(g["lengths"]) == 3 for g in row["groups"]) for row in trace)
    lengths = {r["step"]: r["response_length/mean"] for r in off if "response_length/mean" in r}
    assert all(sum(sum(g["lengths"]) for g in row["groups"]) / 6 == pytest.approx(lengths[row["step"]])
               for row in trace)
    assert [r.get("histopipe/prompts_with_history", 0) for r in off if r["step"] > 0] == [0, 0, 2, 2]


def _train_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "rhymerl.cli", "train", *args]


def test_sigkill_and_resume_repeat_the_uninterrupted_run(tiny_dir, uninterrupted, tmp_path):
    """`rhymerl train` killed by SIGKILL after its step-2 checkpoint and resumed with `--resume` (both real
    processes, HistoSpec drafting with the cost model the process measures) logs what the uninterrupted run
    logs (the fixture's, in-process: in fp32 the tokens do not depend on what was drafted)."""
    common = [*_UNINTERRUPTED, "rollout.speculative=histospec"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    full = uninterrupted["histospec"]

    killed = tmp_path / "killed"
    proc = subprocess.Popen(_train_cmd(*_overrides(tiny_dir, killed, *common)), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600  # a loaded 2-core machine can take minutes to reach step 2
    while time.time() < deadline and not (killed / "checkpoints" / "step_000002" / "state.json").exists():
        time.sleep(0.05)
    assert (killed / "checkpoints" / "step_000002").exists(), "the run did not write its step-2 checkpoint in time"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL  # killed, not finished (nor failed) before the signal
    ckpt = latest_checkpoint(killed)
    assert ckpt is not None
    ckpt_step = int(ckpt.name.split("_")[1])
    assert 0 < ckpt_step < 4  # mid-run: the resume has steps left to do, and a checkpoint to start from
    assert (ckpt / "histospec.json").exists()  # what HistoSpec learned, restored by the resume
    before = [r for r in read_metrics(killed) if r["step"] <= ckpt_step]  # timings included: not rewritten
    # (the checkpoint's own row may be missing: killed between the two, the resume writes it from the checkpoint)
    assert [r["step"] for r in before] in (list(range(ckpt_step + 1)), list(range(ckpt_step)))
    done = subprocess.run(_train_cmd("--resume", str(killed)), check=True, env=env, capture_output=True, text=True)
    # It started from that checkpoint: not from scratch, not after the end.
    assert f"[train] resumed from {ckpt} at step {ckpt_step} of 4" in done.stderr
    assert read_metrics(killed)[:len(before)] == before  # the rows up to the checkpoint are the killed run's

    a, b = _learned(read_metrics(full)), _learned(read_metrics(killed))
    assert [r["step"] for r in b] == [r["step"] for r in a] == [0, 1, 2, 3, 4]
    assert read_trace(killed) == read_trace(full)  # every step's lengths once, as uninterrupted
    assert a == b  # bit for bit (in fp32 whatever was drafted: the step times it measures steer HistoSpec too)
    # The final checkpoint is a Hugging Face directory that transformers loads, with the trained weights.
    hf = AutoModelForCausalLM.from_pretrained(latest_checkpoint(killed), dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 200, 3000]])
    assert not torch.allclose(hf(ids).logits, base(ids).logits)
    ours = TrainingRun.resume(killed).model
    logits = ours(ids.to(next(ours.parameters()).device)).cpu()  # the run's device: cuda if any
    torch.testing.assert_close(logits, hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_resume_in_dtype_auto_repeats_the_run_with_its_measured_cost_model(tiny_dir, tmp_path, monkeypatch):
    """Exact resume in the default dtype (bf16 where bf16 matmuls are native), HistoSpec drafting with the cost
    model it measured (no FLAT): what the speculator learned (edge calibration, cost model, its online
    correction, idle counters) is checkpointed in histospec.json and restored before the first rollout, so
    the resumed run drafts the same trees as the uninterrupted one, and bf16, which rounds a verification
    differently with another draft shape, gives the same tokens. HistoSpec's decisions also follow the step
    times it measures; the clock is made a fixed tick per reading during the rollouts so that only what the
    checkpoint carries can make the two runs differ (with a real clock two uninterrupted runs may differ)."""
    common = ["train.dtype=auto", "rollout.dtype=auto", "rollout.speculative=histospec", "train.total_steps=4",
              "run.save_every=2", "run.keep_checkpoints=2", "val.every=0"]
    real = time.perf_counter
    ticks = iter(range(10**9))

    def tick() -> float:  # 2**-14 s (61 us) a reading: exact in floats, so a difference of two readings
        return next(ticks) * 2.0 ** -14  # does not depend on how many came before (the resumed run has fewer)

    full = TrainingRun(load_config(None, _overrides(tiny_dir, tmp_path / "full", *common)))  # measures (real clock)
    assert full.pool.worker.engine.cost_model.measured
    monkeypatch.setattr(time, "perf_counter", tick)
    full.run()
    monkeypatch.setattr(time, "perf_counter", real)
    saved = json.loads((tmp_path / "full" / "checkpoints" / "step_000002" / "histospec.json").read_text())
    assert len(saved) == 1 and saved[0]["cost"]["measured"] and saved[0]["ratio"] and saved[0]["idle"]

    half = tmp_path / "half"  # the run as it stood after step 2: its step-4 checkpoint gone
    shutil.copytree(tmp_path / "full", half)
    shutil.rmtree(half / "checkpoints" / "step_000004")

    def no_measuring(*a, **k):
        raise AssertionError("a resumed engine re-measured its cost model")

    monkeypatch.setattr(Engine, "measure_cost_model", no_measuring)
    resumed = TrainingRun.resume(half)
    assert resumed.start_step == 2
    assert resumed.pool.spec_state() == saved  # restored before the first rollout, cost model included
    monkeypatch.setattr(time, "perf_counter", tick)
    resumed.run()
    monkeypatch.setattr(time, "perf_counter", real)

    want = pretrained.resolve_dtype("auto", "cpu") if not torch.cuda.is_available() else None
    if want is not None:
        assert resumed.dtypes == {"rollout": want, "train": want}
    a, b = read_metrics(tmp_path / "full"), read_metrics(half)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1, 2, 3, 4]
    assert sum(r.get("rollout/spec_drafted", 0) for r in a if r["step"] > 2) > 0  # it drafted after the resume
    assert _learned(a) == _learned(b)  # bit for bit
    spec = ("rollout/spec_drafted", "rollout/spec_accepted")  # the same drafts, the same acceptances
    assert [[r.get(k) for k in spec] for r in a] == [[r.get(k) for k in spec] for r in b]
    assert resumed.pool.spec_state() == full.pool.spec_state()  # and it learned the same from them
    assert (latest_checkpoint(half) / "histospec.json").read_text() == \
        (latest_checkpoint(tmp_path / "full") / "histospec.json").read_text()


def test_latest_checkpoint_is_the_newest_complete_directory(tmp_path):
    """Killed after renaming step_000002.tmp into place but before `latest` was rewritten: resume uses step 2;
    a half-written .tmp directory is never used."""
    root = tmp_path / "checkpoints"
    assert latest_checkpoint(tmp_path) is None
    for name in ("step_000001", "step_000002", "step_000003.tmp"):
        (root / name).mkdir(parents=True)
        (root / name / "state.json").write_text("{}")
    (root / "latest").write_text("step_000001")
    assert latest_checkpoint(tmp_path) == root / "step_000002"


def test_a_crash_between_checkpoint_and_metrics_row_loses_no_step(tiny_dir, tmp_path, monkeypatch):
    """The window the SIGKILL test can only hit by chance: step 2's checkpoint is written, its metrics row not
    yet. The resumed run writes the row the checkpoint kept, so the curve has no hole."""
    common = ["train.total_steps=3", "run.save_every=2", "val.every=2", "rollout.speculative=off"]
    full = read_metrics(TrainingRun(load_config(None, _overrides(tiny_dir, tmp_path / "full", *common))).run())

    log = MetricsLogger.log

    def crash_at_step_2(self, step, metrics):
        if step == 2:
            raise KeyboardInterrupt("killed after the checkpoint, before the row")
        log(self, step, metrics)

    monkeypatch.setattr(MetricsLogger, "log", crash_at_step_2)
    with pytest.raises(KeyboardInterrupt):
        TrainingRun(load_config(None, _overrides(tiny_dir, tmp_path / "killed", *common))).run()
    monkeypatch.setattr(MetricsLogger, "log", log)
    assert [r["step"] for r in read_metrics(tmp_path / "killed")] == [0, 1]
    assert latest_checkpoint(tmp_path / "killed").name == "step_000002"

    rows = read_metrics(TrainingRun.resume(tmp_path / "killed").run())
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert _learned(rows) == _learned(full)


def test_reward_errors_are_counted_and_do_not_stop_the_run(tiny_dir, tmp_path):
    cfg = load_config(None, _overrides(tiny_dir, tmp_path / "r", "train.total_steps=2", "val.every=0",
                                       f"reward.function={tiny_dir / 'reward_fns.py'}:flaky"))
    rows = read_metrics(TrainingRun(cfg, cost_model=FLAT).run())
    assert rows[-1]["reward/errors_total"] == sum(r.get("reward/errors", 0) for r in rows) > 0
    assert all(r["critic/rewards/max"] <= 1.0 + cfg.reward.format_weight for r in rows[1:])  # errors: 0, not NaN


def test_malformed_dataset_rows_fail_with_location_or_are_skipped(tiny_dir, tmp_path):
    data = tmp_path / "train.jsonl"
    good = {"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}
    data.write_text("\n".join([json.dumps(good), json.dumps({"question": 7, "answer": "#### 1"}),
                               json.dumps(good), "{not json"]) + "\n")
    base = _overrides(tiny_dir, tmp_path / "d", "train.total_steps=1", "val.every=0", f"data.train_files={data}",
                      "reward.function=")
    with pytest.raises(DatasetError, match=r"train.jsonl:2.*question"):
        TrainingRun(load_config(None, base))
    run = TrainingRun(load_config(None, base + ["data.skip_malformed=true"]), cost_model=FLAT)
    assert len(run.train_prompts) == 2 and run.data_notes["data/skipped_rows"] == 2
    rows = read_metrics(run.run())
    assert rows[-1]["step"] == 1 and rows[0]["data/skipped_rows"] == 2


def test_countdown_task_and_too_long_prompts(tiny_dir, tmp_path):
    """The built-in countdown task trains with its own scorer; prompts over data.max_prompt_length are
    skipped and counted, and a run with none left says why."""
    base = _overrides(tiny_dir, tmp_path / "c", "data.task=countdown", "reward.function=", "train.total_steps=1",
                      "val.every=1")
    rows = read_metrics(TrainingRun(load_config(None, base), cost_model=FLAT).run())
    assert rows[0]["data/skipped_long_prompts"] == 0 and "val/accuracy" in rows[-1]
    with pytest.raises(ValueError, match="max_prompt_length"):
        TrainingRun(load_config(None, [*base, f"run.output_dir={tmp_path / 'short'}", "data.max_prompt_length=5"]))


def test_bad_config_names_the_key(tiny_dir, tmp_path, capsys):
    with pytest.raises(ConfigError, match="rollout.temperature"):
        load_config(None, _overrides(tiny_dir, tmp_path, "rollout.temperature=-1"))
    # through `rhymerl train`'s main, in-process (tests/test_cli_errors.py runs bad input through the real
    # command in a subprocess)
    assert cli.main(["train", "rollout.num_generation=4"]) == 2
    assert "rollout.num_generations" in capsys.readouterr().err


def test_lora_trains_adapters_only_and_resumes_exactly(tiny_dir, tmp_path):
    lora = ["model.lora_r=4", "model.lora_alpha=8", "val.every=0", "run.save_every=2", "rollout.speculative=off"]
    full = TrainingRun(load_config(None, _overrides(tiny_dir, tmp_path / "full", *lora, "train.total_steps=4")))
    base = {n: p.detach().clone() for n, p in full.model.named_parameters() if "lora_" not in n}
    assert all(not p.requires_grad for n, p in full.model.named_parameters() if "lora_" not in n)
    rows_full = read_metrics(full.run())
    assert all(torch.equal(base[n], p) for n, p in full.model.named_parameters() if "lora_" not in n)
    assert any(r.get("actor/trained_seqs", 0) > 0 for r in rows_full)
    # The rollout model got the merged weights: it differs from the base now.
    assert not torch.equal(full.pool.worker.model.layers[0].mlp.down_proj.weight, base["layers.0.mlp.down_proj.base_layer.weight"])

    half = TrainingRun(load_config(None, _overrides(tiny_dir, tmp_path / "half", *lora, "train.total_steps=2")))
    half.run()
    resumed = TrainingRun.resume(tmp_path / "half", ["train.total_steps=4"])
    assert resumed.start_step == 2
    rows = read_metrics(resumed.run())
    assert _learned(rows) == _learned(rows_full)
    hf = AutoModelForCausalLM.from_pretrained(latest_checkpoint(tmp_path / "half"), dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 200, 3000]])
    ours = resumed.model(ids.to(next(resumed.model.parameters()).device)).cpu()  # the run's device: cuda if any
    torch.testing.assert_close(ours, hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_bench_spec_drafts_from_a_training_runs_history(tiny_dir, tmp_path):
    cfg = load_config(None, _overrides(tiny_dir, tmp_path / "run", "train.total_steps=2", "val.every=0"))
    run_dir = TrainingRun(cfg, cost_model=FLAT).run()
    s = spec_bench.run(spec_bench.SpecBenchConfig(
        "unused", "fp32", (1.0,), num_prompts=4, num_generations=2, slots=4, max_tokens=8, identity_prompts=2,
        identity_max_tokens=8, history_from=run_dir, repeats=1, epoch_seeds=2, reward_aware=True))
    row = s["temperatures"]["1.0"]
    ra = row["reward_aware"]  # a third run per round, paired with the plain-priority one: fp32, the same tokens
    assert ra["identity_vs_plain"] == 1.0 and len(ra["runs_tok_s"]) == 2 and ra["vs_histospec_paired"] > 0
    assert s["data"] == f"history-from:{run_dir}" and s["num_prompts"] == 4
    assert row["identity_rate"] == 1.0 and row["tokens_plain"] == row["tokens_spec"]
    # two timed epochs (4 prompts x 2 generations each), totalled
    assert len(row["speedup_by_seed"]) == 2 and row["forwards_plain"] >= 2 * 8 and row["identity_rate_fp32"] == 1.0
    assert len(row["runs_tok_s"]["plain"]) == len(row["runs_tok_s"]["spec"]) == 2 and row["speedup_paired"] > 0
    assert "tail_speedup_fp32" not in row  # the timed tail already ran in fp32
    assert set(s["ceiling"]) == {"full", "tail"} and s["ceiling"]["full"]["speedup"] >= 1.0
    assert row["plain_ms_per_forward"] > 0 and row["spec_ms_per_forward"] > 0
    assert row["plain_other_ms_per_step"] >= 0 and row["spec_other_ms_per_step"] >= 0
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        spec_bench.run(spec_bench.SpecBenchConfig("unused", "fp32", (1.0,), history_from=tmp_path))


def test_bench_e2e_rhymerl_side_curves_match(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    s = e2e_bench.run(str(tiny_dir), "fp32", num_prompts=4, prompts_per_step=2, num_generations=3,
                      max_completion_length=8, micro_batch_size=3, learning_rate=0.01, epochs=2, skip_trl=True)
    assert s["steps"] == 4 and s["reward_curve_max_abs_diff"] == 0.0
    assert len(s["runs"]["off"]["reward_by_step"]) == 4 and "trl" not in s["runs"]
    assert not list(tmp_path.iterdir())  # the runs' directories (checkpoints: GBs for a real model) are gone


def test_the_update_runs_with_deterministic_algorithms_and_the_rollout_without(tiny_dir, tmp_path, monkeypatch):
    """On a CPU the update's kernels were not reproducible across processes without torch's deterministic
    algorithms (rl/loop.py: deterministic_algorithms). They are on for the update only (on for the rollout
    they slowed it), and the setting is restored after it."""
    seen = {}
    cfg = load_config(None, _overrides(tiny_dir, tmp_path / "d", "train.total_steps=1", "val.every=0"))
    run = TrainingRun(cfg, cost_model=FLAT)

    def recording(name, fn):
        def wrapped(*args, **kwargs):
            seen.setdefault(name, torch.are_deterministic_algorithms_enabled())
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(run.trainer, "update", recording("update", run.trainer.update))
    monkeypatch.setattr(run.pool, "rollout", recording("rollout", run.pool.rollout))
    before = torch.are_deterministic_algorithms_enabled()
    run.run()
    assert seen == {"update": True, "rollout": before}
    assert torch.are_deterministic_algorithms_enabled() == before
    with deterministic_algorithms():
        assert torch.is_deterministic_algorithms_warn_only_enabled()  # an op without one warns, not fails


@pytest.mark.parametrize("native_bf16", [True, False])
def test_auto_dtype_is_bf16_only_where_bf16_matmuls_are_native(tiny_dir, tmp_path, monkeypatch, native_bf16):
    """dtype=auto (the default) runs the rollout in bf16 and the update under bf16 autocast where the device
    multiplies bf16 natively, and both in fp32 elsewhere: on an AVX2-only CPU a bf16 matmul is several times
    slower than fp32 (docs/notebook, bench engine at 733015d). What "auto" became, and the
    default job's batch that follows from it (train.prompts_per_step left at 0 here), is what the run uses and
    writes into its config.yaml."""
    monkeypatch.setattr(pretrained, "has_fast_bf16", lambda device: native_bf16)
    cfg = load_config(None, _overrides(tiny_dir, tmp_path / "a", "train.dtype=auto", "rollout.dtype=auto",
                                       "train.prompts_per_step=0"))
    run = TrainingRun(cfg, cost_model=FLAT)
    want = torch.bfloat16 if native_bf16 else torch.float32
    assert next(run.pool.worker.model.parameters()).dtype == want
    assert run.trainer.autocast == (torch.bfloat16 if native_bf16 else None)
    assert next(run.model.parameters()).dtype == torch.float32  # master weights
    name = "bf16" if native_bf16 else "fp32"
    assert (run.cfg.rollout.dtype, run.cfg.train.dtype) == (name, name)
    assert run.cfg.train.prompts_per_step == DEFAULT_PROMPTS_PER_STEP[name]
    assert run.pool.worker.engine.speculator.max_draft_tokens == DEFAULT_MAX_DRAFT_TOKENS[name]  # what drafts
    assert load_config(tmp_path / "a" / "config.yaml", []) == run.cfg


def test_the_default_batch_follows_the_updates_dtype_and_explicit_values_win():
    """train.prompts_per_step left at 0 takes the default job's batch for the update's dtype (a smaller one where
    the update runs in fp32: a 2-core AVX2 CPU took 37 min for the bf16 machines' 40-step job), and
    rollout.max_draft_tokens the cap for the rollout's (shallow in fp32, where verification rows cost about
    what decode rows do); given values are kept; dtypes come out resolved."""
    cfg = load_config(None, [])
    assert (cfg.train.total_steps, cfg.train.prompts_per_step, cfg.rollout.max_draft_tokens) == (16, 0, 0)
    for dtype in ("bf16", "fp32"):
        out = resolve_machine_defaults(cfg, {"rollout": dtype, "train": dtype})
        assert out.train.prompts_per_step == DEFAULT_PROMPTS_PER_STEP[dtype] and out.train.total_steps == 16
        assert out.rollout == dataclasses.replace(cfg.rollout, dtype=dtype, max_draft_tokens=DEFAULT_MAX_DRAFT_TOKENS[dtype])
        assert out.train.dtype == dtype
    assert DEFAULT_PROMPTS_PER_STEP["fp32"] < DEFAULT_PROMPTS_PER_STEP["bf16"]
    assert DEFAULT_MAX_DRAFT_TOKENS["fp32"] < DEFAULT_MAX_DRAFT_TOKENS["bf16"]
    given = load_config(None, ["train.prompts_per_step=3", "rollout.dtype=bf16", "rollout.max_draft_tokens=9"])
    out = resolve_machine_defaults(given, {"rollout": "bf16", "train": "fp32"})
    assert (out.train.prompts_per_step, out.train.dtype, out.rollout.dtype) == (3, "fp32", "bf16")
    assert out.rollout.max_draft_tokens == 9


def test_resolve_dtype(monkeypatch):
    """An explicit dtype is kept whatever the device; auto follows `has_fast_bf16`, which on a CPU is oneDNN's
    own check (the one that also decides whether bf16 weights are prepacked)."""
    for native in (True, False):
        monkeypatch.setattr(pretrained, "has_fast_bf16", lambda device: native)
        assert pretrained.resolve_dtype("fp32", "cpu") == "fp32" and pretrained.resolve_dtype("bf16", "cpu") == "bf16"
        assert pretrained.resolve_dtype("auto", "cpu") == ("bf16" if native else "fp32")
        assert pretrained.parse_dtype("auto", "cpu") == (torch.bfloat16 if native else torch.float32)
    monkeypatch.undo()
    assert pretrained.has_fast_bf16("cpu") == cpu_packing_supported(torch.zeros(1, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="unknown dtype 'int3'"):
        pretrained.parse_dtype("int3")
    assert load_config(None, []).rollout.dtype == load_config(None, []).train.dtype == "auto"


def test_a_resumed_auto_run_keeps_the_dtypes_it_started_with(tiny_dir, tmp_path, monkeypatch, capfd):
    """dtype=auto is resolved once, when the run starts, and kept in its checkpoints: resumed on a machine
    where auto would choose otherwise (here: bf16 native at the start, not at the resume), the run goes on
    in bf16, as its config.yaml says; an explicit dtype given with the resume switches. A config that still
    says auto at the resume (an override) keeps the checkpoint's dtypes and says why."""
    monkeypatch.setattr(pretrained, "has_fast_bf16", lambda device: True)
    out = tmp_path / "run"
    cfg = load_config(None, _overrides(tiny_dir, out, "train.dtype=auto", "rollout.dtype=auto", "train.total_steps=1",
                                       "val.every=0"))
    TrainingRun(cfg, cost_model=FLAT).run()
    saved = json.loads((latest_checkpoint(out) / "state.json").read_text())["dtypes"]
    assert saved == {"rollout": "bf16", "train": "bf16"}

    monkeypatch.setattr(pretrained, "has_fast_bf16", lambda device: False)
    capfd.readouterr()
    kept = TrainingRun.resume(out, cost_model=FLAT)
    assert next(kept.pool.worker.model.parameters()).dtype == torch.bfloat16 and kept.trainer.autocast == torch.bfloat16
    assert kept.cfg.rollout.dtype == kept.cfg.train.dtype == "bf16"  # resolved at the start, saved
    auto = TrainingRun.resume(out, ["rollout.dtype=auto"], cost_model=FLAT)
    assert next(auto.pool.worker.model.parameters()).dtype == torch.bfloat16
    assert "rollout.dtype=auto: keeping bf16" in capfd.readouterr().err
    switched = TrainingRun.resume(out, ["rollout.dtype=fp32"], cost_model=FLAT)
    assert next(switched.pool.worker.model.parameters()).dtype == torch.float32
    assert switched.trainer.autocast == torch.bfloat16  # train.dtype as saved


# Dynamic sampling's input: the groups of half of the prompts (by a hash of the prompt) score a constant.
HALF_CONSTANT_PY = '''
import zlib

def half_constant(completion, ground_truth, data_source, prompt):
    if zlib.crc32(str(prompt).encode()) % 2:
        return 0.5
    text = completion or " "
    return sum(c in "aeiou" for c in text) / len(text)
'''


def test_dynamic_sampling_draws_more_prompts_and_resumes_exactly(tiny_dir, tmp_path):
    """train.filter_groups (DAPO): groups whose rewards are all equal are dropped and further batches of
    prompts are rolled out until prompts_per_step groups are kept; the data position, ahead of the step,
    is checkpointed, so a resumed run repeats the uninterrupted one."""
    (tmp_path / "half.py").write_text(HALF_CONSTANT_PY)
    extra = ("train.total_steps=4", "val.every=0", "train.filter_groups=true", "train.max_num_gen_batches=4",
             "data.num_train_prompts=8", f"reward.function={tmp_path / 'half.py'}:half_constant")
    full = read_metrics(TrainingRun(load_config(None, _overrides(tiny_dir, tmp_path / "full", *extra))).run())
    steps = [r for r in full if r["step"] > 0]
    assert any(r["train/num_gen_batches"] > 1 for r in steps)  # some step drew more than one batch
    assert any(r["train/filtered_groups_frac"] > 0 for r in steps)
    for r in steps:
        assert r["train/kept_groups"] <= 2
        if r["train/kept_groups"] == 2:
            assert r["critic/zero_std_frac"] == 0.0  # every trained group has non-zero advantages
    # Lengths of the trace: every drawn group is recorded, dropped ones included.
    drawn = {row["step"]: len(row["groups"]) for row in read_trace(tmp_path / "full")}
    assert [drawn[r["step"]] for r in steps] == [2 * r["train/num_gen_batches"] for r in steps]

    cut = _overrides(tiny_dir, tmp_path / "cut", *extra, "run.save_every=2")
    TrainingRun(load_config(None, [*cut, "train.total_steps=2"])).run()
    resumed = read_metrics(TrainingRun.resume(tmp_path / "cut", ["train.total_steps=4"]).run())
    assert _learned(resumed) == _learned(full)


def test_dynamic_sampling_needs_sync_mode(tiny_dir, tmp_path):
    with pytest.raises(ConfigError, match="train.filter_groups: needs rollout.mode=sync"):
        load_config(None, _overrides(tiny_dir, tmp_path, "train.filter_groups=true", "rollout.backend=ray",
                                     "rollout.mode=one_step_off"))


def _rank_pids(driver: int, n: int) -> list[int]:
    """The update's `n` rank processes of a `rhymerl train` driver: the first of its children started by
    multiprocessing's spawn (the run starts its ranks before the reward scorer's process)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmd = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if int(fields[1]) == driver and b"spawn_main" in cmd:
            found.append((int(fields[19]), int(stat.parent.name)))  # (start time, pid)
    return [pid for _, pid in sorted(found)[:n]]


def test_two_update_ranks_train_as_one_process_survive_a_killed_rank_and_resume_in_one(tiny_dir, tmp_path):
    """train.world_size=2 (FSDP2 over gloo, ranks as processes): a rank killed with SIGKILL stops `rhymerl
    train` with one line and the last checkpoint intact; resumed with train.world_size=1, the run logs what the
    uninterrupted one-process run logs."""
    common = ["val.every=0", "run.save_every=1", "train.max_grad_norm=0.1", "train.total_steps=3"]
    one = _learned(read_metrics(TrainingRun(load_config(None, _overrides(tiny_dir, tmp_path / "one", *common))).run()))
    two = tmp_path / "two"
    proc = subprocess.Popen(_train_cmd(*_overrides(tiny_dir, two, "train.world_size=2", *common)),
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and not (two / "checkpoints" / "step_000002" / "state.json").exists():
        time.sleep(0.05)
    ranks = _rank_pids(proc.pid, 2)
    assert len(ranks) == 2
    os.kill(ranks[1], signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith("rhymerl: error: rank ") and "killed by SIGKILL" in last and "--resume" in last
    assert "Traceback" not in err
    assert latest_checkpoint(two).name == "step_000002"
    TrainingRun.resume(two, ["train.world_size=1"]).run()
    rows = _learned(read_metrics(two))
    assert [r["step"] for r in rows] == [r["step"] for r in one] == [0, 1, 2, 3]
    assert sum(r.get("actor/trained_seqs", 0) for r in one) > 0
    for a, b in zip(one, rows):  # reductions in another order: equal to 1e-5, not bit for bit
        assert b == pytest.approx(a, rel=1e-5, abs=1e-5)
