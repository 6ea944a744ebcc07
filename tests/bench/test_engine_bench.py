"""`bench engine`: its figures per transformers mode, the bandwidth bound, the per-device defaults, and a failing
mode reported in its row rather than ending the bench. Offline and fast: a tiny random Llama with a byte-level
tokenizer written here (the `compiled` mode is left out: inductor on a CPU takes tens of seconds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from rhymerl import cli
from rhymerl.bench import engine_bench
from rhymerl.bench.hf_generate import mode_keys, parse_hf_modes
from rhymerl.engine.backends import CudaBackend
from rhymerl.engine.kv_cache import KVCache
from rhymerl.engine.model_runner import ModelRunner
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.engine.stats import EngineStats
from rhymerl.errors import UserError

from tiny_models import byte_model_dir, tiny_decoder

# a Llama layer's computing ops in the static step (`static_forward`): 2 RMSNorms with their weights (1 each),
# 4 matmuls (the o_proj and down ones adding the residual in place), rope (2), the K/V write (one index_put:
# padding writes the cache's tail), attention, SiLU x up (2); a verification step (T > 1) adds 2 copies,
# folding the query heads for attention and back
LAUNCHES_PER_LLAMA_LAYER = 12
OURS = ("prompts", "ours_tokens", "ours_s", "ours_tok_s", "ours_forwards", "ours_forward_ms", "bound_tok_s",
        "ours_of_bound")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A 2-layer random Llama with a byte-level BPE tokenizer (one token a byte) and a plain chat template."""
    return byte_model_dir(tmp_path_factory.mktemp("tiny-bytes"), 1024)


def _run(model_dir: Path, **kw) -> dict:
    args = dict(dtype="fp32", batches=[1, 2], num_prompts=3, max_tokens=4, device="cpu", hf_modes="eager,static")
    return engine_bench.run(str(model_dir), **{**args, **kw})


def test_run_reports_every_mode_and_the_bound(model_dir, capsys):
    # 3 prompts at batch 2: a smaller last batch, which the static mode warms up for as well
    summary = _run(model_dir)
    assert summary["hf_modes"] == ["eager", "static"]
    assert summary["bandwidth_gb_s"] > 0 and summary["weight_bytes"] > 0 and summary["bound_forward_ms"] > 0
    assert set(summary["batches"]) == {"1", "2"}
    for b, row in summary["batches"].items():
        for key in OURS + ("hf_tokens", "hf_s", "hf_tok_s", "speedup",
                           "hf_static_tokens", "hf_static_s", "hf_static_tok_s", "speedup_vs_static"):
            assert key in row, (b, key)
        assert not any(k.endswith("_error") for k in row)
        # transformers runs HF_BATCHES (2) batches at most: 2 prompts at batch 1, all 3 at batch 2
        assert row["prompts"] == 3 and row["hf_prompts"] == min(3, engine_bench.HF_BATCHES * int(b))
        assert 0 < row["hf_tokens"] <= row["hf_prompts"] * 4 and 0 < row["hf_static_tokens"] <= row["hf_prompts"] * 4
        # from the bandwidth and bytes: bound_forward_ms is rounded to 0.1 us, coarse for so tiny a model
        bound = int(b) * summary["bandwidth_gb_s"] * 1e9 / summary["weight_bytes"]
        assert row["bound_tok_s"] == pytest.approx(bound, rel=1e-2)
        assert row["ours_forward_ms"] > 0
    json.dumps(summary)  # the bench's last line
    engine_bench.print_table(summary, Console(width=250, record=True))


def test_measure_bandwidth_is_positive():
    assert engine_bench.measure_bandwidth("cpu", nbytes=1 << 22, repeats=2) > 0


def test_default_batches_by_device():
    assert engine_bench.default_batches("cpu") == [1, 8, 32]
    assert engine_bench.default_batches("cuda") == [1, 8, 32, 128]
    assert engine_bench.DEFAULT_PROMPTS[128] == 4 * 128


def test_weight_bytes_counts_a_tied_embedding_once_and_skips_an_untied_one():
    tied = tiny_decoder("llama")
    every = sum(p.numel() * p.element_size() for p in tied.parameters())  # a shared Parameter is yielded once
    assert tied.lm_head.weight is tied.embed_tokens.weight
    assert engine_bench.weight_bytes(tied) == every
    untied = tiny_decoder("qwen2")
    embed = untied.embed_tokens.weight
    every = sum(p.numel() * p.element_size() for p in untied.parameters())
    assert engine_bench.weight_bytes(untied) == every - embed.numel() * embed.element_size()


def test_a_failing_mode_is_an_error_entry_not_a_crash(model_dir, monkeypatch):
    real = engine_bench.hf_generate

    def failing(*args, **kw):
        mode = args[6] if len(args) > 6 else kw.get("mode", "eager")
        if mode == "static":
            raise RuntimeError("no static cache today\nsecond line")
        return real(*args, **kw)

    monkeypatch.setattr(engine_bench, "hf_generate", failing)
    monkeypatch.setattr("rhymerl.bench.hf_generate.hf_generate", failing)  # what warm_up calls
    summary = _run(model_dir, batches=[1], num_prompts=1)
    row = summary["batches"]["1"]
    assert row["hf_static_error"] == "RuntimeError: no static cache today"
    assert "hf_static_tok_s" not in row and "speedup_vs_static" not in row
    assert row["hf_tok_s"] > 0 and row["ours_tok_s"] > 0
    console = Console(width=250, record=True)
    engine_bench.print_table(summary, console)
    text = console.export_text()
    assert "error" in text and "no static cache today" in text


def test_a_failing_eager_mode_fails_each_row(model_dir, monkeypatch):
    def failing(*args, **kw):
        raise OSError("out of something")

    monkeypatch.setattr(engine_bench, "hf_generate", failing)
    summary = _run(model_dir, hf_modes="eager", max_tokens=2)
    assert [row["hf_error"] for row in summary["batches"].values()] == ["OSError: out of something"] * 2


def test_hf_modes_parsing():
    assert parse_hf_modes("eager") == ["eager"]
    assert parse_hf_modes("compiled, static,static") == ["compiled", "static"]
    assert parse_hf_modes("eager,static", skip_hf=True) == []
    for bad in ("fast", "", "eager,jit"):
        with pytest.raises(ValueError, match="--hf-modes"):
            parse_hf_modes(bad)
    assert mode_keys("eager") == ("hf", "speedup")
    assert mode_keys("compiled") == ("hf_compiled", "speedup_vs_compiled")
    with pytest.raises(UserError, match="--hf-modes"):  # before any model loads
        engine_bench.run("no-such-model", hf_modes="eager,jit")


def test_cli_passes_the_modes_and_leaves_the_batches_to_the_device(monkeypatch, capsys):
    seen = {}

    def fake_run(*args):
        seen["args"] = args
        return {"model": "m", "dtype": "fp32", "device": "cpu", "threads": 1, "max_tokens": 4, "temperature": 1.0,
                "top_p": 1.0, "hf_modes": [], "batches": {}}

    monkeypatch.setattr(engine_bench, "run", fake_run)
    assert cli.main(["bench", "engine", "--hf-modes", "eager,compiled", "--device", "cpu"]) == 0
    assert seen["args"][2] is None and seen["args"][-3:] == ("eager,compiled", engine_bench.HF_BATCHES, "auto")
    assert cli.main(["bench", "engine", "--device", "cpu", "--backend", "static"]) == 0
    assert seen["args"][-1] == "static"
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["model"] == "m"


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_every_shape_is_captured_before_the_timed_run_and_counted_apart(temperature):
    """Where the backend replays CUDA graphs, every step shape is captured before the timed run, with the draws
    of the bench's SamplingParams (greedy too): the engine's counters are the timed run's, and the timed run
    captures nothing ("static" mode: the CPU's stand-in, which runs each bucket once where a GPU captures it,
    `shapes_first_run_timed`; `--backend static`)."""
    model = tiny_decoder("llama")
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    params = SamplingParams(temperature=temperature, max_tokens=5, seed=0)
    tok, _, engine, runner, capture, clock = engine_bench.ours_generate(model, None, prompts, 2, params, 32, "static")
    backend = runner.backend
    assert isinstance(backend, CudaBackend) and backend.mode == "static"
    assert engine.stats.generated_tokens == tok and capture[1] > 0
    assert len(backend.buckets) == len(backend.shapes.every(4))  # every bucket, chains up to the longest prompt
    fields = engine_bench.step_fields(engine.stats, backend, capture, clock)
    assert fields["ours_step_ms"] >= fields["ours_outside_forward_ms"] >= fields["ours_host_ms"] > 0
    assert fields["graph_replays"] > 0 and fields["eager_parts"] == 0 and fields["graphs_captured_timed"] == 0
    assert fields["shapes_first_run_timed"] == 0 and capture[2] == len(backend.shapes.every(4))
    assert 0 < fields["ours_host_share"] <= 1  # its draws were verified on the "device" and waited for once a step
    # one host time per step, together the engine's whole host time
    assert len(clock.host_s) == engine.stats.forward_passes
    assert sum(clock.host_s) == pytest.approx(engine.stats.host_s)
    assert min(clock.host_s) <= fields["ours_host_ms_median"] / 1e3 <= max(clock.host_s)


def test_step_clock_takes_each_steps_host_time_outside_the_forward_and_the_wait():
    """A step's host time is its wall time less the forward and the wait for the device (`EngineStats.host_s`),
    counted only across one forward (a call between two steps that ran no forward adds nothing)."""
    class FakeEngine:
        stats = EngineStats()

    engine = FakeEngine()
    clock = engine_bench.StepClock(engine)
    clock()
    for busy, forward, wait in ((0.010, 0.006, 0.001), (0.004, 0.001, 0.0), (0.020, 0.010, 0.002)):
        s = engine.stats
        s.busy_s, s.forward_s, s.device_wait_s, s.forward_passes = (s.busy_s + busy, s.forward_s + forward,
                                                                     s.device_wait_s + wait, s.forward_passes + 1)
        clock()
        clock()  # no step in between: nothing
    assert clock.host_s == pytest.approx([0.003, 0.003, 0.008])
    assert clock.median_ms() == 3.0 and engine.stats.host_s == pytest.approx(0.014)
    with pytest.raises(UserError, match="--backend"):
        engine_bench.run("no-such-model", backend="graphs")


def test_kernels_per_step_counts_the_static_steps_computing_ops():
    """One launch per computing op, whatever the rows; each layer adds the same ops."""
    model = tiny_decoder("llama")
    runner = ModelRunner(model, KVCache.for_model(model, 8, 32))
    two_layers = [engine_bench.kernels_per_step(runner, rows) for rows in (1, 8)]
    verify = engine_bench.kernels_per_step(runner, 8, engine_bench.VERIFY_TOKENS)
    model.layers = model.layers[:1]
    one_layer = engine_bench.kernels_per_step(runner, 8)
    assert two_layers[0] == two_layers[1] and two_layers[0] - one_layer == LAUNCHES_PER_LLAMA_LAYER
    assert verify - engine_bench.kernels_per_step(runner, 8, engine_bench.VERIFY_TOKENS) == LAUNCHES_PER_LLAMA_LAYER + 2
