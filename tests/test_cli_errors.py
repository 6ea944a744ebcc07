"""Bad input through the command line, as a new user hands it over (issue 26 item 13): each case ends with one
line `rhymerl: error: ...` naming the file, key or option, exit code 2 and no traceback; `--debug` shows the
traceback. Most cases call `cli.main` in-process (a subprocess costs seconds of imports); a few run the real
command as a subprocess, including the one that used to hang.

The model is a tiny random Llama with a byte-level tokenizer written here, so nothing needs the real model."""

from __future__ import annotations

import errno
import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rhymerl import cli
from rhymerl.config import ConfigError
from rhymerl.errors import UserError
from rhymerl.rl import checkpoint
from rhymerl.rl.checkpoint import latest_checkpoint
from tiny_models import byte_model_dir

CLI = [sys.executable, "-m", "rhymerl.cli"]
NOT_UTF8 = b"rollout:\n  temperature: 0.5  # caf\xe9\n"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A 2-layer random Llama (context 256) with a byte-level BPE tokenizer (no merges: one token a byte)."""
    return byte_model_dir(tmp_path_factory.mktemp("tiny-bytes"), 256)


def _train_args(model_dir: Path, out: Path, *extra: str) -> list[str]:
    return ["train", f"model.name={model_dir}", f"run.output_dir={out}", "data.num_train_prompts=4",
            "data.num_val_prompts=0", "data.max_prompt_length=240", "train.prompts_per_step=2",
            "rollout.num_generations=2", "rollout.max_completion_length=4", "val.max_completion_length=4",
            "val.every=0", "rollout.num_slots=4",
            "train.micro_batch_size=4", "train.dtype=fp32", "rollout.dtype=fp32", "rollout.speculative=off",
            "run.progress=false", "run.tensorboard=false", *extra]


def _fails(capsys, argv: list[str], *names: str) -> str:
    """Run `rhymerl argv` in-process; assert exit code 2 and one error line naming each of `names`."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("rhymerl: error: ")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for name in names:
        assert str(name) in lines[0], (name, lines[0])
    return lines[0]


def _run(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------- real subprocesses


def test_the_command_reports_bad_input_in_one_line_and_debug_shows_the_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(NOT_UTF8)
    proc = _run("train", "--config", str(bad))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"rhymerl: error: {bad}: not UTF-8")
    # --debug lets the error out of main, where Python prints its traceback (in-process: a subprocess costs seconds)
    with pytest.raises(ConfigError, match="not UTF-8"):
        cli.main(["--debug", "train", "--config", str(bad)])


def test_generate_with_no_slots_is_refused_not_a_hang(tmp_path, model_dir):
    proc = _run("generate", "--model", str(model_dir), "--num-slots", "0", "hi", timeout=60)
    assert proc.returncode == 2 and "--num-slots" in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------------------------------- config and run directory


def test_config_errors_name_the_file_or_key(tmp_path, capsys, model_dir):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(NOT_UTF8)
    _fails(capsys, ["train", "--config", str(bad)], bad, "UTF-8")
    _fails(capsys, ["train", "rollout.temprature=0.5"], "rollout.temprature", "rollout.temperature")
    _fails(capsys, ["train", "--config", str(tmp_path)], tmp_path)  # a directory
    _fails(capsys, ["train", "--resume", str(tmp_path / "run"), "--config", str(bad)], "--config", "--resume")
    _fails(capsys, ["train", "--resume", str(tmp_path / "nothing")], "nothing", "no such run directory")
    (tmp_path / "empty_run").mkdir()
    _fails(capsys, ["train", "--resume", str(tmp_path / "empty_run")], "empty_run", "no checkpoint")
    with pytest.raises(UserError):
        cli.main(["--debug", "train", "--resume", str(tmp_path / "nothing")])


def test_a_run_directory_that_cannot_be_written(tmp_path, capsys, model_dir):
    # (root may write anywhere, so "unwritable" is a path below a file: mkdir fails the same way)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    _fails(capsys, _train_args(model_dir, blocker / "run", "train.total_steps=1"), blocker, "Not a directory")


def test_a_full_disk_while_checkpointing_leaves_no_checkpoint(tmp_path, capsys, model_dir, monkeypatch):
    def full(tensors, filename, metadata=None):
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    monkeypatch.setattr(checkpoint, "save_file", full)
    _fails(capsys, _train_args(model_dir, tmp_path / "run", "train.total_steps=1"), "model.safetensors", "disk is full")
    assert latest_checkpoint(tmp_path / "run") is None
    assert not list((tmp_path / "run" / "checkpoints").iterdir())  # no half-written step_000001.tmp either


# ---------------------------------------------------------------- data, model, context


def test_data_and_prompt_file_errors_name_the_file(tmp_path, capsys, model_dir):
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b'{"prompt": "caf\xe9"}\n')
    _fails(capsys, ["generate", "--model", str(model_dir), "--file", str(prompts)], prompts, "UTF-8")
    _fails(capsys, ["generate", "--model", str(model_dir), "--file", str(tmp_path)], tmp_path, "directory")
    _fails(capsys, ["generate", "--model", str(model_dir), "--file", str(tmp_path / "none.jsonl")], "none.jsonl")
    _fails(capsys, _train_args(model_dir, tmp_path / "r", f"data.train_files={tmp_path}"), tmp_path, "directory")


def test_model_directory_errors_name_the_file(tmp_path, capsys, model_dir):
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    _fails(capsys, ["generate", "--model", str(broken), "hi"], weights, "truncated")
    weights.write_bytes(b"garbage" * 100)
    _fails(capsys, _train_args(broken, tmp_path / "r"), weights, "not a safetensors file")
    _fails(capsys, ["generate", "--model", str(broken), "hi"], weights)
    shutil.copy(model_dir / "model.safetensors", weights)
    (broken / "config.json").write_text("")
    _fails(capsys, ["generate", "--model", str(broken), "hi"], broken / "config.json", "empty")
    (broken / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    _fails(capsys, _train_args(broken, tmp_path / "r"), broken / "config.json", "gpt2")


def test_contexts_that_cannot_fit_are_refused(tmp_path, capsys, model_dir):
    _fails(capsys, _train_args(model_dir, tmp_path / "r", "data.max_prompt_length=100000000"),
           "data.max_prompt_length", "max_position_embeddings")
    _fails(capsys, ["generate", "--model", str(model_dir), "--max-model-len", "100000000", "hi"],
           "--max-model-len", "max_position_embeddings")
    # within the model's context, but not in memory: 10^9 slots of 256 tokens
    _fails(capsys, ["generate", "--model", str(model_dir), "--num-slots", "1000000000", "hi"], "--num-slots", "GiB")


def test_generate_options_are_checked(tmp_path, capsys, model_dir):
    _fails(capsys, ["generate", "--model", str(model_dir), "--device", "bogus", "hi"], "--device", "bogus")
    _fails(capsys, ["generate", "--model", str(model_dir), "--top-p", "1.5", "hi"], "top_p")
    _fails(capsys, ["generate", "--model", str(model_dir)], "no prompts")
    with pytest.raises(SystemExit) as exit_:  # argparse: its usage line, then the option named
        cli.main(["generate", "--model", str(model_dir), "--dtype", "fp8", "hi"])
    assert exit_.value.code == 2 and "--dtype" in capsys.readouterr().err
    # a prompt longer than the context is refused, not run (and the command fails when nothing ran)
    assert cli.main(["generate", "--model", str(model_dir), "--no-chat-template", "x" * 300]) == 1
    assert "the context holds 256" in capsys.readouterr().out


def test_reward_modules_that_cannot_work_stop_the_run(tmp_path, capsys, model_dir):
    module = tmp_path / "rewards.py"
    module.write_text("def two_args(completion, ground_truth):\n    return 1.0\n\n"
                      "def broken(**kwargs):\n    raise KeyError('answer')\n\n"
                      "import no_such_module_here\n")
    _fails(capsys, _train_args(model_dir, tmp_path / "r", f"reward.function={module}:two_args"),
           "rewards.py", "no_such_module_here")
    module.write_text(module.read_text().replace("import no_such_module_here\n", ""))
    _fails(capsys, _train_args(model_dir, tmp_path / "r", f"reward.function={module}:two_args"),
           "rewards.py:two_args", "cannot be called", "data_source")
    # every completion's reward failing: the run stops at its first step with the first error
    _fails(capsys, _train_args(model_dir, tmp_path / "r2", f"reward.function={module}:broken", "train.total_steps=3"),
           "step 1", "every completion", "KeyError")
    assert latest_checkpoint(tmp_path / "r2") is None


def test_a_model_whose_weights_do_not_match_its_config_is_named(tmp_path, capsys, model_dir):
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    config = json.loads((model_dir / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    _fails(capsys, ["generate", "--model", str(broken), "hi"], broken / "config.json", "gate_proj", "shape")
    _fails(capsys, ["bench", "engine", "--model", str(broken), "--skip-hf", "--device", "cpu", "--batches", "1"],
           broken / "config.json", "does not match the weights")
    (broken / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    _fails(capsys, ["generate", "--model", str(broken), "hi"], broken / "config.json", "model.layers.2.")


# ---------------------------------------------------------------- bench (each fails before anything loads)


def test_bench_options_are_checked(capsys):
    _fails(capsys, ["bench", "engine", "--batches", "1,x"], "--batches", "'1,x'", "integers")
    _fails(capsys, ["bench", "engine", "--batches", "8,0"], "--batches", "at least 1")
    _fails(capsys, ["bench", "engine", "--dtype", "fp8"], "--dtype", "fp8")
    _fails(capsys, ["bench", "engine", "--top-p", "1.5"], "bench engine", "top_p")
    _fails(capsys, ["bench", "spec", "--temperatures", "0.3,hot"], "--temperatures", "numbers")
    _fails(capsys, ["bench", "pipe", "--workers", "8,sixty", "--no-real"], "--workers")
    _fails(capsys, ["bench", "matmul", "--rows", "1,,8"], "--rows")
    _fails(capsys, ["bench", "e2e", "--num-prompts", "7", "--prompts-per-step", "2"], "--num-prompts", "--prompts-per-step")
    _fails(capsys, ["bench", "e2e", "--dtype", "fp16"], "--dtype", "fp16", "--skip-trl")
    _fails(capsys, ["bench", "e2e", "--micro-batch-size", "3"], "--micro-batch-size", "8")
    with pytest.raises(UserError):
        cli.main(["--debug", "bench", "engine", "--batches", "x"])


def test_bench_pipe_trace_and_cost_model_errors_name_the_file(tmp_path, capsys):
    trace = tmp_path / "lengths.jsonl"
    # the default --cost-from measure: the trace is checked before the cost model is measured on a model
    trace.write_text("")
    _fails(capsys, ["bench", "pipe", "--trace", str(trace), "--no-real"], trace, "an empty trace")
    trace.write_bytes(b'{"step": 1, "groups": [{"prompt": "caf\xe9", "lengths": [3]}]}\n')
    _fails(capsys, ["bench", "pipe", "--trace", str(trace), "--no-real"], trace, "UTF-8")
    trace.write_text("[1, 2]\n")
    _fails(capsys, ["bench", "pipe", "--trace", str(trace), "--no-real"], trace, "not a length trace")
    trace.write_text(json.dumps({"step": 1, "groups": [{"prompt": "a", "lengths": []}]}) + "\n")
    _fails(capsys, ["bench", "pipe", "--trace", str(trace), "--no-real"], trace, "no group with recorded lengths")
    trace.write_text(json.dumps({"step": 1, "groups": [{"prompt": "a", "lengths": [3, "x"]}]}) + "\n")
    _fails(capsys, ["bench", "pipe", "--trace", str(trace), "--no-real"], trace, "not a length trace")

    trace.write_text(json.dumps({"step": 1, "groups": [{"prompt": "a", "lengths": [3, 4]}]}) + "\n")
    cost = tmp_path / "cost.json"
    _fails(capsys, ["bench", "pipe", "--trace", str(trace), "--cost-from", str(cost), "--no-real"],
           "--cost-from", cost, "no such file")
    cost.write_text(json.dumps({"seqs": [1]}))
    _fails(capsys, ["bench", "pipe", "--trace", str(trace), "--cost-from", str(cost), "--no-real"],
           "--cost-from", cost, "not a cost model")


# ---------------------------------------------------------------- report


def test_report_errors_name_the_file(tmp_path, capsys):
    out_file = tmp_path / "taken.png"
    out_file.write_text("")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "critic/rewards/mean": 0.5}) + "\n")
    _fails(capsys, ["report", str(run), "--out", str(out_file)], out_file, "existing file")
    _fails(capsys, ["report", str(tmp_path / "nope")], "nope", "no such run directory")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "critic/rewards/mean": "0.5"}) + "\n" +
                                       json.dumps({"step": 2, "critic/rewards/mean": 0.6}) + "\n")
    _fails(capsys, ["report", str(run)], run / "metrics.jsonl", "critic/rewards/mean", "expected a number")
    (run / "metrics.jsonl").write_text(json.dumps({"step": "1"}) + "\n" + json.dumps({"step": 2}) + "\n")
    _fails(capsys, ["report", str(run)], "'step'")


# ---------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def trained(tmp_path_factory, model_dir) -> Path:
    """A run of 2 steps with a checkpoint after each."""
    out = tmp_path_factory.mktemp("trained") / "run"
    assert cli.main(_train_args(model_dir, out, "train.total_steps=2", "run.save_every=1")) == 0
    assert latest_checkpoint(out).name == "step_000002"
    return out


def _copy(trained: Path, tmp_path: Path) -> tuple[Path, Path]:
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    return run, latest_checkpoint(run)


class _Payload:
    """What a crafted trainer.pt holds: unpickling it would create the marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_bad_checkpoints_are_named_and_never_run(tmp_path, capsys, trained):
    run, ckpt = _copy(trained, tmp_path)
    resume = ["train", "--resume", str(run)]

    pt = ckpt / "trainer.pt"
    good = pt.read_bytes()
    pt.write_bytes(good[: len(good) // 2])
    _fails(capsys, resume, pt, "truncated")
    marker = tmp_path / "pwned"
    torch.save({"optimizer": _Payload(marker), "scheduler": {}, "rng": {}}, pt)
    _fails(capsys, resume, pt, "not written by rhymerl")
    assert not marker.exists(), "a crafted trainer.pt ran code on --resume"
    pt.write_bytes(good)

    state_file = ckpt / "state.json"
    state = json.loads(state_file.read_text())
    for bad_step in ("2", 999, 1):
        state_file.write_text(json.dumps({**state, "step": bad_step}))
        _fails(capsys, resume, state_file, "step")
    state_file.write_text(json.dumps(state)[:50])
    _fails(capsys, resume, state_file, "truncated")
    state_file.write_text(json.dumps(state))

    history = ckpt / "history.json"
    text = history.read_text()
    history.write_text(text[: len(text) // 2])
    _fails(capsys, resume, history, "truncated")
    history.write_text(text)

    weights = ckpt / "model.safetensors"
    weights_bytes = weights.read_bytes()
    weights.write_bytes(weights_bytes[:-10])
    _fails(capsys, resume, weights, "truncated")
    weights.write_bytes(weights_bytes)

    _fails(capsys, resume + ["train.total_steps=1"], "train.total_steps=1", "step 2")
    assert cli.main(resume) == 0  # restored, it resumes (at its end: nothing left to do)


def test_a_trainer_state_of_another_model_is_named(tmp_path, capsys, trained):
    run, ckpt = _copy(trained, tmp_path)
    _fails(capsys, ["train", "--resume", str(run), "model.lora_r=4", "train.total_steps=3"],
           ckpt / "trainer.pt", "does not fit")


# ---------------------------------------------------------------- run directories, resumes, backends (issue 37)


def _one_error_line(proc: subprocess.CompletedProcess, *names: str) -> str:
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("rhymerl: error: ")]
    assert len(lines) == 1, proc.stderr
    for name in names:
        assert str(name) in lines[0], (name, lines[0])
    return lines[0]


def test_failures_through_the_command(tmp_path, model_dir):
    """As a user meets it, in a real process: a Ray address where nothing runs (ray.init would retry for
    minutes, printing Ray's warnings from outside Python, which only a real process's stderr shows). (A fresh
    run into a run directory, a state.json naming a dtype that does not exist and HistoPipe's Ray-only keys
    with the local backend go through `cli.main` in-process, in the tests below: a subprocess costs seconds.)"""
    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = _run(*_train_args(model_dir, tmp_path / "ray", "rollout.backend=ray", f"ray.address=127.0.0.1:{port}"))
    _one_error_line(proc, f"ray.address=127.0.0.1:{port}", "no Ray cluster answers", "ray start --head")
    assert "GCS" not in proc.stderr and "rpc_client" not in proc.stderr  # none of Ray's connection warnings


def test_histopipes_ray_keys_are_refused_with_the_local_backend(capsys):
    _fails(capsys, ["train", "rollout.schedule=least_loaded"], "rollout.schedule", "'static'", "rollout.backend=ray")
    _fails(capsys, ["train", "rollout.migration=true"], "rollout.migration", "rollout.backend=ray")


def test_a_resume_or_run_the_config_cannot_start_is_named(tmp_path, capsys, model_dir, trained):
    """A state.json naming a dtype that does not exist; HistoPipe's split with the local backend (a full
    training command line, as a user types it)."""
    run, ckpt = _copy(trained, tmp_path)
    state_file = ckpt / "state.json"
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({**state, "dtypes": {"rollout": "int8", "train": "fp32"}}))
    _fails(capsys, ["train", "--resume", str(run)], state_file, "'dtypes'", "int8")
    _fails(capsys, _train_args(model_dir, tmp_path / "new", "rollout.schedule=histopipe"),
           "rollout.schedule", "rollout.backend=local")


def test_a_fresh_run_never_writes_into_a_run_directory(tmp_path, capsys, model_dir, trained):
    run, ckpt = _copy(trained, tmp_path)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    _fails(capsys, _train_args(model_dir, run, "train.total_steps=1"), run, "already holds a run", "--resume")
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_a_resume_keeps_config_yaml_and_records_its_overrides(tmp_path, capsys, trained):
    run, _ = _copy(trained, tmp_path)
    config = (run / "config.yaml").read_bytes()
    assert cli.main(["train", "--resume", str(run), "train.total_steps=3"]) == 0
    assert latest_checkpoint(run).name == "step_000003"
    assert (run / "config.yaml").read_bytes() == config  # the config the run started with
    assert [json.loads(line) for line in (run / "overrides.jsonl").read_text().splitlines()] == \
        [{"step": 2, "overrides": ["train.total_steps=3"]}]
    # a later resume applies them again: the run now ends at step 3, so total_steps=2 is below its checkpoint
    _fails(capsys, ["train", "--resume", str(run), "train.total_steps=2"], "train.total_steps=2", "step 3")
    assert cli.main(["train", "--resume", str(run)]) == 0  # at its end (3 steps): nothing left to do
    assert len((run / "overrides.jsonl").read_text().splitlines()) == 1  # a resume without overrides adds none
    (run / "overrides.jsonl").write_text("train.total_steps=3\n")
    _fails(capsys, ["train", "--resume", str(run)], run / "overrides.jsonl", "line 1")


def test_a_worker_failing_past_its_restarts_ends_the_run_in_one_line(tmp_path, capsys, trained, monkeypatch):
    """The rollout raising every time (an out-of-memory error, say, whose message runs on for lines): the
    worker is rebuilt rollout.max_worker_restarts times, then the run stops with one line naming the fault
    and the key, exit code 1, and the checkpoint before it intact. (Ray workers follow the same policy:
    tests/rollout/test_ray_pool.py.)"""
    from rhymerl.engine.engine import Engine

    run, ckpt = _copy(trained, tmp_path)
    rows = (run / "metrics.jsonl").read_bytes()

    def out_of_memory(self):
        raise MemoryError("out of memory: tried to allocate 2.00 GiB\n(the allocator's statistics follow)")

    monkeypatch.setattr(Engine, "step", out_of_memory)
    assert cli.main(["train", "--resume", str(run), "train.total_steps=3", "rollout.max_worker_restarts=2"]) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("rhymerl: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "MemoryError: out of memory" in lines[0] and "rollout.max_worker_restarts" in lines[0]
    assert "statistics" not in err  # the fault's first line only
    assert err.count("rebuilding it") == 2  # (1/2), (2/2), then no worker is left
    assert latest_checkpoint(run) == ckpt and (run / "metrics.jsonl").read_bytes() == rows
