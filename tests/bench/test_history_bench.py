"""`rhymerl bench e2e --compare history` end to end on a tiny random model (the real SmolLM2 tokenizer) and a real
local Ray cluster with 2 workers: history on (HistoSpec, histopipe split, migration) and off (plain, static) train
the same run in fp32 sync mode, so every step's rewards and response lengths are equal; a table, progress on
stderr, then one JSON line with `history_speedup`."""

import json
import tempfile

import pytest

from rhymerl.bench import history_bench
from rhymerl.bench.history_bench import sides, workload
from rhymerl.bench.pipe_real import real_workload
from rhymerl.cli import main
from tiny_models import tiny_smol_checkpoint


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_dir):
    return tiny_smol_checkpoint(tmp_path_factory.mktemp("tiny-smol"), smollm2_dir, embed_std=0.8)


def test_history_on_and_off_train_the_same_run(cluster, tiny_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    rc = main(["bench", "e2e", "--compare", "history", "--model", str(tiny_dir), "--dtype", "fp32",
               "--train-dtype", "bf16", "--num-prompts", "4", "--prompts-per-step", "2", "--num-generations", "4",
               "--max-completion-length", "12", "--slots", "2", "--epochs", "2", "--learning-rate", "0.01",
               "--skip-steps", "2", "--set", f"ray.address={cluster}"])  # each run a child process, on this cluster
    assert rc == 0
    out, err = capsys.readouterr()
    summary = json.loads(out.strip().splitlines()[-1])
    assert "history on vs off" in out and "rollout fp32, update bf16" in out and "[bench e2e-history] done in" in err
    assert summary["steps"] == 4 and summary["num_workers"] == 2 and summary["mode"] == "sync"
    assert (summary["dtype"], summary["train_dtype"]) == ("fp32", "bf16")
    on, off = summary["runs"]["on"], summary["runs"]["off"]
    assert len(on) == len(off) == 4
    assert [s["response_length"] for s in on] == [s["response_length"] for s in off]
    assert [s["reward"] for s in on] == [s["reward"] for s in off]
    assert summary["reward_curve_max_abs_diff"] == 0  # the same samples, a deterministic update (bf16 autocast)
    # sync: the loss reads the trainer's own log-probs only, so the two updates agree to the bit; no TIS weights
    assert [s["pg_loss"] for s in on] == [s["pg_loss"] for s in off] and on[0]["pg_loss"] is not None
    assert all(s["tis_weight_mean"] is None and s["logprob_diff_mean"] is not None for s in on + off)
    assert all(s["driver_s"] is not None and s["exposed_s"] > 0 for s in on + off)  # sync: every rollout in its step
    assert summary["history_speedup"] == pytest.approx(summary["off_s_per_step"] / summary["on_s_per_step"], rel=1e-2)
    assert not list(tmp_path.iterdir())  # the runs' directories are removed


def test_bad_options_fail_before_anything_loads(capsys):
    assert main(["bench", "e2e", "--compare", "history", "--num-prompts", "5", "--prompts-per-step", "2"]) == 2
    assert "--num-prompts (5)" in capsys.readouterr().err
    assert main(["bench", "e2e", "--compare", "history", "--epochs", "1", "--num-prompts", "4",
                 "--prompts-per-step", "2", "--skip-steps", "2"]) == 2
    assert "--skip-steps" in capsys.readouterr().err
    assert main(["bench", "e2e", "--compare", "stream", "--mode", "sync"]) == 2
    assert "the stream is a one_step_off mode" in capsys.readouterr().err
    assert main(["bench", "e2e", "--train-dtype", "bf16"]) == 2  # TRL's comparison has one dtype
    assert "--train-dtype: only with --compare history|stream" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: its usage line, then the option named
        main(["bench", "e2e", "--compare", "history", "--train-dtype", "fp16"])
    assert "--train-dtype: invalid choice: 'fp16'" in capsys.readouterr().err


def _row(step: int, staleness: int, rollout: float, busy: float, wait: float | None = None) -> dict:
    """A step's metrics row as the loop logs it: 30 s of update, 0.5 s of weight sync, 0.1 s of reward."""
    row = {"step": step, "timing_s/step": rollout + 30.0 + 0.5 + 0.1 + (wait or 0.0), "timing_s/rollout": rollout,
           "timing_s/update": 30.0, "timing_s/sync": 0.5, "timing_s/reward": 0.1, "critic/rewards/mean": 0.5,
           "rollout/staleness": staleness, "rollout/worker0/busy_s": busy, "rollout/worker1/busy_s": busy - 1.0,
           "rollout/worker0/tokens": 100, "rollout/worker1/tokens": 90}
    return row | ({} if wait is None else {"timing_s/rollout_wait": wait})


def test_driver_seconds_only_where_the_rollout_ran_inside_its_step(tmp_path):
    """`driver_s` is the rollout's wall time less its busiest worker's busy time where the rollout ran in its own
    step (sync; one_step_off's first step). A step rolled out ahead ran its rollout during the previous update:
    its busy time (40 s here) is no part of the step, whose driver seconds are then unknown (None), not 0.3 - 40.
    `exposed_s`, every step: the seconds outside the update, the weight sync and the reward."""
    rows = [_row(1, 0, 12.0, 11.5), _row(2, 1, 0.3, 40.0, wait=9.0), _row(3, 1, 0.2, 38.0, wait=8.0)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    steps = history_bench._steps(tmp_path)
    assert steps[0]["driver_s"] == pytest.approx(0.5) and steps[0]["worker_busy_s"] == 11.5
    assert [s["driver_s"] for s in steps[1:]] == [None, None]
    assert [s["exposed_s"] for s in steps] == pytest.approx([12.0, 9.3, 8.2])
    assert [s["rollout_wait_s"] for s in steps] == [None, 9.0, 8.0] and steps[0]["tokens"] == 190
    assert history_bench._median_after(steps, "driver_s", 1) is None  # the JSON line then leaves it out
    assert history_bench._median_after(steps, "exposed_s", 1) == pytest.approx(8.75)


def test_the_stream_on_and_off_train_the_same_one_step_off_run(cluster, tiny_dir, tmp_path, monkeypatch, capsys):
    """`--compare stream`: one_step_off with rollout.stream on and off, the same history settings; the stream
    changes when a worker starts the next step, not what it samples (fp32)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    rc = main(["bench", "e2e", "--compare", "stream", "--mode", "one_step_off", "--model", str(tiny_dir),
               "--dtype", "fp32", "--num-prompts", "4", "--prompts-per-step", "2", "--num-generations", "4",
               "--max-completion-length", "12", "--slots", "2", "--epochs", "2", "--learning-rate", "0.01",
               "--skip-steps", "2", "--set", f"ray.address={cluster}"])  # each run a child process, on this cluster
    assert rc == 0
    out, err = capsys.readouterr()
    summary = json.loads(out.strip().splitlines()[-1])
    assert "stream vs no_stream" in out and "[bench e2e-stream] done in" in err
    assert "rollout.stream=true" in summary["sides"]["stream"] and "rollout.schedule=histopipe" in summary["sides"]["stream"]
    assert "rollout.stream=false" in summary["sides"]["no_stream"]
    stream, plain = summary["runs"]["stream"], summary["runs"]["no_stream"]
    assert [s["reward"] for s in stream] == [s["reward"] for s in plain]
    assert summary["reward_curve_max_abs_diff"] == 0
    assert all(s["tis_weight_mean"] is not None and s["pg_loss"] is not None for s in stream + plain)  # TIS on
    assert (summary["dtype"], summary["train_dtype"]) == ("fp32", "fp32")  # --train-dtype defaults to --dtype
    # the first step rolls out in its own time; the later ones ahead, during the previous update: no driver_s
    for steps in (stream, plain):
        assert steps[0]["driver_s"] is not None and [s["driver_s"] for s in steps[1:]] == [None] * 3
        assert all(s["exposed_s"] >= 0 for s in steps)
    assert "stream_driver_s" not in summary and summary["stream_exposed_s"] >= 0
    assert summary["stream_speedup"] == pytest.approx(summary["no_stream_s_per_step"] / summary["stream_s_per_step"],
                                                      rel=1e-2)


def test_the_history_sides_by_mode():
    """History on in one_step_off streams instead of migrating; off does neither."""
    assert sides("history", "sync")["on"][-1] == "rollout.migration=true"
    assert sides("history", "one_step_off")["on"][-2:] == ["rollout.stream=true", "rollout.migration=true"]
    assert "rollout.migration=true" in sides("stream", "one_step_off")["no_stream"]
    assert "rollout.stream=false" in sides("history", "one_step_off")["off"]
    assert sides("stream", "one_step_off", "off")["stream"][0] == "rollout.speculative=off"


def test_the_default_job_is_part_1s_rhyming_workload():
    """`--compare history|stream` without workload options trains what `bench pipe --trace rhyming` rolls out on
    its real workers (one definition, `pipe_real.real_workload`): a step is that bench's call; options win."""
    real = real_workload("rhyming", None, ray_workers=2)
    job = workload(2)
    assert (job["data"], job["num_prompts"], job["prompts_per_step"], job["num_generations"]) == \
        (real.task, real.prompts, real.prompts, real.num_generations)
    assert (job["max_completion_length"], job["temperature"], job["num_slots"]) == \
        (real.max_tokens, real.temperature, real.slots)
    assert job["max_draft_tokens"] is None and job["epochs"] > 2  # the machine's draft cap; steps after the 2 skipped
    assert workload(4)["num_slots"] == real_workload("rhyming", None, ray_workers=4).slots  # waves kept
    smaller = workload(2, prompts_per_step=4)  # a smaller step keeps its waves: 16 requests a worker on 4 slots
    assert (smaller["prompts_per_step"], smaller["num_prompts"], smaller["num_slots"]) == (4, 12, 4)
    given = workload(2, num_slots=2, temperature=1.0, epochs=None)
    assert (given["num_slots"], given["temperature"], given["epochs"]) == (2, 1.0, job["epochs"])
    with pytest.raises(TypeError, match="bogus"):
        workload(2, bogus=1)


def test_the_cli_passes_only_the_options_given(monkeypatch):
    """The e2e command's workload options default to None, so that each comparison keeps its own job (the TRL
    comparison's small arithmetic one, the history comparison's part 1 workload)."""
    seen = {}
    monkeypatch.setattr(history_bench, "run", lambda *a, **kw: seen.update(kw) or {"x": 1})
    monkeypatch.setattr(history_bench, "print_table", lambda summary: None)
    assert main(["bench", "e2e", "--compare", "history", "--epochs", "5"]) == 0
    assert seen["epochs"] == 5 and "temperature" not in seen and seen["num_slots"] is None
    assert seen["data"] is None and seen["max_draft_tokens"] is None and seen["train_dtype"] is None
    assert main(["bench", "e2e", "--compare", "history", "--dtype", "fp32", "--train-dtype", "bf16",
                 "--temperature", "0"]) == 0
    assert seen["train_dtype"] == "bf16" and seen["temperature"] == 0.0
