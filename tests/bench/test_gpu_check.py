"""What `scripts/gpu_check.sh` does that a CPU can check: a file split into pieces and joined back, checked
against its manifest (a changed or missing piece is refused), and the goals table from bench outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rhymerl.bench import goals, pieces

ROOT = Path(__file__).resolve().parents[2]


def test_split_and_join_round_trip_in_pieces_of_at_most_the_limit(tmp_path):
    data = os.urandom((5 << 20) + 123)
    src = tmp_path / "model.gguf"
    src.write_bytes(data)
    manifest = pieces.split(src, tmp_path / "carry", max_mib=2)
    spec = json.loads(manifest.read_text())
    sizes = [(tmp_path / "carry" / p["name"]).stat().st_size for p in spec["parts"]]
    assert sizes == [2 << 20, 2 << 20, (1 << 20) + 123] and spec["size"] == len(data)
    out = pieces.join(manifest, tmp_path / "back.gguf")
    assert out.read_bytes() == data


def test_join_refuses_a_changed_or_missing_piece_and_leaves_no_file(tmp_path):
    src = tmp_path / "w.bin"
    src.write_bytes(os.urandom(3 << 20))
    manifest = pieces.split(src, tmp_path / "carry", max_mib=1)
    part = tmp_path / "carry" / "w.bin.part001"
    good = part.read_bytes()
    part.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(pieces.PiecesError, match="part w.bin.part001 has sha256"):
        pieces.join(manifest, tmp_path / "out.bin")
    part.unlink()
    with pytest.raises(pieces.PiecesError, match="missing"):
        pieces.join(manifest, tmp_path / "out.bin")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["carry", "w.bin"]


def test_the_command_line_splits_and_joins_and_names_a_bad_piece(tmp_path):
    src = tmp_path / "f"
    src.write_bytes(b"x" * 1000)
    run = [sys.executable, "-m", "rhymerl.bench.pieces"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    manifest = subprocess.run(run + ["split", str(src), str(tmp_path / "c")], env=env, capture_output=True,
                              text=True, check=True).stdout.strip()
    subprocess.run(run + ["join", manifest, str(tmp_path / "g")], env=env, check=True)
    assert (tmp_path / "g").read_bytes() == b"x" * 1000
    (tmp_path / "c" / "f.part000").write_bytes(b"y")
    bad = subprocess.run(run + ["join", manifest, str(tmp_path / "h")], env=env, capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stderr.startswith("error: ") and "Traceback" not in bad.stderr


def _engine(model, b1, b32):
    return {"model": model, "gpu": "NVIDIA H100 80GB HBM3", "batches": {"1": b1, "32": b32}}


ENGINE = _engine("qwen2.5-1.5b-random",
                 {"ours_tok_s": 150.0, "bound_tok_s": 957.0, "ours_of_bound": 0.157, "hf_tok_s": 30.0,
                  "hf_compiled_tok_s": 120.0, "ours_host_ms": 2.0},
                 {"ours_tok_s": 3000.0, "bound_tok_s": 30000.0, "ours_of_bound": 0.1, "hf_tok_s": 500.0,
                  "hf_compiled_error": "RuntimeError: no compiler", "ours_host_ms": 0.9})
SMOL = _engine("smollm2-135m", {"ours_tok_s": 300.0}, {"ours_tok_s": 3000.0, "ours_host_ms": 0.4})
SPEC = {"repeats": 2, "temperatures": {
    "0.3": {"plain_tok_s": 2216.0, "speedup": 2.1, "speedup_paired": 1.02, "tail_speedup": 1.05,
            "plain_tail_tok_s": 300.0},
    "0.6": {"speedup": 1.5, "speedup_paired": 0.99},
    "1.0": {"speedup": 0.86, "speedup_paired": 0.862}}}


def test_goals_beside_the_figures_and_their_baselines():
    result = goals.summary([SMOL, ENGINE], SPEC, {"passed": 11, "failed": 0, "skipped": 1, "error": 0})
    by_name = {g["name"]: g for g in result["goals"]}
    bound = by_name["engine batch 1: share of the bandwidth bound"]
    assert (bound["measured"], bound["met"]) == (0.157, False) and "957.0" in bound["baseline"]
    b1 = by_name["engine batch 1: x transformers' fastest mode"]
    assert (b1["measured"], b1["met"]) == (1.25, False) and "compiled 120.0" in b1["baseline"]
    b32 = by_name["engine batch 32: x transformers' fastest mode"]  # compiled failed: eager is the fastest that ran
    assert (b32["measured"], b32["met"]) == (6.0, True) and "eager 500.0" in b32["baseline"]
    assert by_name["HistoSpec T=0.3 full batch: speed-up"]["met"] is True
    assert by_name["HistoSpec T=0.3 tail: speed-up"]["met"] is False
    never = by_name["HistoSpec never slower: lowest paired speed-up, T=0.3/0.6/1.0"]
    assert (never["measured"], never["met"]) == (0.862, False)
    host = by_name["plain 32-slot step: host ms outside the forward"]
    assert (host["measured"], host["met"], host["baseline"]) == (0.4, True, "smollm2-135m")
    assert (result["met"], result["of"], result["not_measured"]) == (3, 7, 0)
    assert result["device"] == "NVIDIA H100 80GB HBM3"


def test_a_bench_that_did_not_run_leaves_its_goals_not_measured():
    result = goals.summary([], None, None)
    assert result["met"] == 0 and result["not_measured"] == result["of"] == 7
    spec = {"repeats": 2, "temperatures": {"0.3": SPEC["temperatures"]["0.3"]}}  # 0.6 and 1.0 missing
    never = goals.summary([ENGINE], spec, None)["goals"][5]
    assert never["measured"] is None and never["met"] is None


def test_the_command_reads_bench_outputs_and_ends_with_one_json_line(tmp_path, capsys):
    (tmp_path / "engine.out").write_text("table\n" + json.dumps(ENGINE) + "\n")
    (tmp_path / "smol.out").write_text(json.dumps(SMOL) + "\n")
    (tmp_path / "spec.out").write_text("[bench spec] progress\n{not json\n" + json.dumps(SPEC) + "\n")
    (tmp_path / "tests.log").write_text("....s\n=== 11 passed, 1 skipped in 40.2s ===\n")
    assert goals.main(["--engine", str(tmp_path / "engine.out"), "--engine", str(tmp_path / "smol.out"),
                       "--spec", str(tmp_path / "spec.out"), "--tests", str(tmp_path / "tests.log"),
                       "--engine", str(tmp_path / "absent.out"), "--exits", "tests=0,spec=124"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    last = json.loads(lines[-1])
    assert last["tests"] == {"passed": 11, "failed": 0, "skipped": 1, "error": 0} and last["met"] == 3
    assert last["exits"] == {"tests": 0, "spec": 124} and "spec 124" in lines[-2]
    assert any("x transformers' fastest mode" in line and "NO" in line for line in lines[:-1])


def test_pytest_counts_reads_the_closing_line():
    assert goals.pytest_counts("== 2 failed, 9 passed, 1 skipped, 1 error in 3s ==") == \
        {"passed": 9, "failed": 2, "skipped": 1, "error": 1}
    assert goals.pytest_counts("no tests ran") == {"passed": 0, "failed": 0, "skipped": 0, "error": 0}


def test_a_spec_run_cut_short_still_gives_the_temperatures_it_finished(tmp_path, capsys):
    """`bench spec` writes its finished rows to stderr after each temperature (`goals.PARTIAL`); the summary
    reads the last such line when the run was cut before its JSON line."""
    rows = {"repeats": 2, "partial": True, "gpu": "NVIDIA H200", "temperatures": {"0.3": SPEC["temperatures"]["0.3"]}}
    (tmp_path / "spec.out").write_text("")  # cut before the table
    (tmp_path / "spec.err").write_text("[bench spec] stage 6/29 ...\n" + goals.PARTIAL + json.dumps({"temperatures": {}})
                                       + "\n" + goals.PARTIAL + json.dumps(rows) + "\n[bench spec] stage 22/29 ...\n")
    assert goals.main(["--spec", str(tmp_path / "spec.out"), "--spec-progress", str(tmp_path / "spec.err")]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    by_name = {g["name"]: g for g in last["goals"]}
    assert by_name["HistoSpec T=0.3 full batch: speed-up"]["measured"] == 2.1
    assert by_name["HistoSpec never slower: lowest paired speed-up, T=0.3/0.6/1.0"]["met"] is None  # 0.6, 1.0 not run
    assert last["device"] == "NVIDIA H200"
    assert goals.partial_rows("no such line") is None


def test_pytest_counts_reads_a_run_where_every_test_skipped():
    assert goals.pytest_counts("sssss\n13 skipped in 3.98s\n")["skipped"] == 13


def test_the_script_keeps_its_summary_inside_the_call_budget(tmp_path):
    """GPU_CHECK_BUDGET_S cuts the stages so that the summary still prints inside the device call: with no
    time left for any stage, each is skipped and the goals table and JSON line come all the same."""
    cache = tmp_path / "cache"
    (cache / "models" / "smollm2-135m").mkdir(parents=True)
    (cache / "models" / "smollm2-135m" / ".complete").touch()  # no conversion
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"), "RHYMERL_CACHE": str(cache),
           "GPU_CHECK_DEVICE": "cpu", "GPU_CHECK_BUDGET_S": "21"}
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    last = json.loads(run.stdout.strip().splitlines()[-1])
    assert last["exits"] == {"tests": "skipped", "engine_qwen": "skipped", "engine_smol": "skipped",
                             "spec": "skipped"}
    assert last["not_measured"] == last["of"] == 7
