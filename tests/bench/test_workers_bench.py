"""`rhymerl bench workers` end to end on a tiny random model (the real SmolLM2 tokenizer, so the default job's
chat prompts and rewards are real) and a real local Ray cluster: local 1 worker, Ray 1 worker and Ray 2
workers, a table, progress lines on stderr, then one JSON line of named figures; the three setups roll out
the same tokens (fp32)."""

import json
import tempfile

import pytest
import torch

from rhymerl.bench import workers_bench
from rhymerl.cli import main
from rhymerl.rollout import ray_pool
from rhymerl.rollout.types import WorkerStats
from tiny_models import tiny_smol_checkpoint


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_dir):
    return tiny_smol_checkpoint(tmp_path_factory.mktemp("tiny-smol"), smollm2_dir, embed_std=0.8)


def test_call_figures_split_the_rollout_call():
    workers = [WorkerStats(0, requests=4, started=100.0, finished=102.0),
               WorkerStats(1, requests=4, started=100.5, finished=101.5), WorkerStats(2)]  # 2 ran nothing
    f = workers_bench.call_figures(workers, call_s=2.5, export_s=0.1)
    assert f["worker_s"] == pytest.approx(2.0) and f["dispatch_s"] == pytest.approx(0.4)
    assert f["bubble"] == pytest.approx(1 - 3.0 / (3 * 2.5))


def test_bench_workers_end_to_end(cluster, tiny_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    sets = [f"model.name={tiny_dir}", "data.num_train_prompts=4", "data.num_val_prompts=0",
            "train.prompts_per_step=2", "rollout.num_generations=2", "rollout.max_completion_length=8",
            "rollout.num_slots=4", "train.micro_batch_size=4", "train.learning_rate=0.01"]
    argv = ["bench", "workers", "--steps", "2", "--warmup", "1", "--dtype", "fp32"]
    rc = main(argv + [x for s in sets for x in ("--set", s)])
    assert rc == 0
    out, err = capsys.readouterr()
    summary = json.loads(out.strip().splitlines()[-1])
    assert "GRPO step by rollout setup" in out and "Ray's overhead at 1 worker" in out

    total = 1 + 3 * (1 + 1 + 2)  # the cluster, then per setup: start-up, warm-up, 2 steps
    for k in (1, 2, total):
        assert f"[bench workers] stage {k}/{total}:" in err
    assert "ray2: step 2/2" in err and "[bench workers] done in" in err

    for name, workers in (("local1", 1), ("ray1", 1), ("ray2", 2)):
        r = summary[name]
        assert r["workers"] == workers and r["dtype"] == "fp32" and len(r["steps_s"]) == 2
        for key in workers_bench.PARTS:
            assert isinstance(r[key], float), (name, key)
        assert r["step_s"] > 0 and r["rollout_s"] > 0 and r["update_s"] > 0 and r["sync_s"] >= 0
        assert 0 < r["rollout_worker_s"] <= r["rollout_s"] and r["history_export_s"] >= 0
        assert 0 <= r["bubble_ratio"] < 1
    assert summary["ray2"]["threads_per_worker"] == 1  # 2 CPUs in the cluster, split between 2 workers
    assert summary["ray1"]["threads_per_worker"] == 2
    assert summary["ray1_overhead"] == pytest.approx(
        (summary["ray1"]["step_s"] - summary["local1"]["step_s"]) / summary["local1"]["step_s"], abs=1e-3)
    assert isinstance(summary["ray1_overhead_paired"], float)
    assert summary["ray1_overhead_main"] in summary["ray1_overhead_parts_s"]
    assert summary["same_rollouts"] is True  # fp32: the same tokens wherever the workers run
    assert summary["config"]["steps"] == 2 and summary["config"]["num_generations"] == 2
    assert summary["config"]["prompts_per_step"] == summary["local1"]["prompts_per_step"] == 2
    assert summary["machine"]["cpu_cores"] >= 1
    assert not list(tmp_path.iterdir())  # the runs' directories are removed


def test_two_ray_workers_need_two_gpus_on_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert workers_bench.setups_that_fit() == (["local1", "ray1"], {"ray2": "needs 2 GPUs, this machine has 1"})
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert workers_bench.setups_that_fit() == (["local1", "ray1", "ray2"], {})


def test_bad_arguments_fail_before_ray_starts(monkeypatch, capsys):
    monkeypatch.setattr(ray_pool, "connect", lambda address: pytest.fail("Ray started"))
    assert main(["bench", "workers", "--steps", "0"]) == 2
    assert "steps >= 1" in capsys.readouterr().err
    assert main(["bench", "workers", "--set", "rollout.nope=1"]) == 2
    assert "rollout.nope" in capsys.readouterr().err
