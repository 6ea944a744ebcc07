"""`rhymerl bench pipe`: the simulation on a small hand-made trace and a hand-written cost model (the JSON's
shape, oracle <= histopipe, the lower bound below every makespan, through the CLI too), and the real
FIFO vs longest-first runs on a tiny random model (same tokens either way)."""

import json
import random

import pytest

from rhymerl.bench import pipe_bench, pipe_sim
from rhymerl.cli import main
from rhymerl.cost_model import CostModel
from rhymerl.histopipe.plan import POLICIES
from rhymerl.histopipe.predict import LengthPredictor
from tiny_models import random_prompts, tiny_checkpoint

# A step of n sequences costs a little more than one of 1: batching pays, as on a real machine.
COST = CostModel([1, 4, 16], [1, 2, 4, 8], [[0.010, 0.011, 0.012, 0.014], [0.012, 0.014, 0.017, 0.022],
                                            [0.020, 0.028, 0.040, 0.064]])


def write_trace(path, steps=4, prompts=12, group=4, seed=0):
    """Each prompt has a typical length of its own (lengths rhyme across steps), its group spread around it."""
    rng = random.Random(seed)
    typical = {f"p{i}": rng.choice([8, 16, 40, 120, 300]) for i in range(prompts)}
    with open(path, "w") as f:
        for step in range(steps):
            groups = [{"prompt": k, "lengths": [max(1, int(t * rng.uniform(0.6, 1.3))) for _ in range(group)]}
                      for k, t in typical.items()]
            f.write(json.dumps({"step": step, "groups": groups}) + "\n")
        f.write('{"step": 99, "gro')  # a torn last line is skipped
    return path


@pytest.fixture
def trace(tmp_path):
    return write_trace(tmp_path / "lengths.jsonl")


@pytest.fixture
def cost_file(tmp_path):
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(COST.as_dict()))
    return path


def check_sim(sim, workers):
    assert set(sim) == {str(w) for w in workers}
    for w in workers:
        row = sim[str(w)]
        assert row["requests"] >= w * 4  # as many requests as the workers' slots hold
        for policy in POLICIES:
            r = row[policy]
            for key in ("makespan_s", "lower_bound_s", "makespan_over_lb", "bubble", "finish_gap_s",
                        "speedup_vs_static"):
                assert isinstance(r[key], float), (policy, key)
            assert r["lower_bound_s"] <= r["makespan_s"] * (1 + 1e-9)
            assert r["makespan_over_lb"] >= 1 - 1e-9 and 0 <= r["bubble"] < 1
        assert row["oracle"]["makespan_s"] <= row["histopipe"]["makespan_s"] * (1 + 1e-9)
        assert 0 < row["histopipe"]["share_of_oracle"] <= 1 + 1e-9
        assert row["static"]["speedup_vs_static"] == 1.0


def test_draws_start_where_history_exists_and_predict_from_earlier_steps(trace):
    steps = pipe_bench.read_trace(trace)
    draws, first = pipe_bench.trace_draws(steps)
    assert first == 1 and len(draws) == 3 * 12 and all(known for *_, known in draws)
    # step 1's prediction of p0 comes from step 0's lengths only (the scheduler's predictor, censored at the
    # trace's cap when it has one: this one has none)
    assert pipe_sim.trace_cap(steps) is None
    predictor = LengthPredictor()
    for g in steps[0]["groups"]:
        predictor.record(g["prompt"], g["lengths"])
    assert draws[0][0] == "p0" and draws[0][2] == pytest.approx(predictor.predict("p0"))
    lengths, predicted, _ = pipe_bench.draw_step(draws, 200, seed=None)  # cycles past the trace's 144 requests
    assert sum(map(len, lengths)) >= 200 and len(lengths) == len(predicted) == 50
    assert lengths[36] == draws[0][1] and predicted[36] == draws[0][2]
    shuffled = pipe_bench.draw_step(draws, 200, seed=3)
    assert shuffled[0] != lengths  # a random arrival order, the same groups with their own predictions
    assert sorted(zip(map(tuple, shuffled[0]), shuffled[1])) == sorted(zip(map(tuple, lengths), predicted))


def test_simulation_shape_and_bounds(trace):
    sim = pipe_bench.simulate_trace(trace, COST, workers=(2, 8), slots=4)
    assert sim["draws_from_step"] == 1 and sim["groups_with_history"] == 36 and sim["rank_corr"] > 0.5
    check_sim(sim["workers"], (2, 8))


def test_cli_sim_only_prints_a_table_then_one_json_line(trace, cost_file, tmp_path, capsys):
    rc = main(["bench", "pipe", "--trace", str(trace.parent), "--cost-from", str(cost_file), "--workers", "2,8",
               "--slots", "4", "--no-real", "--out", str(tmp_path / "out")])
    assert rc == 0
    out, err = capsys.readouterr()
    summary = json.loads(out.strip().splitlines()[-1])
    assert "HistoPipe simulation" in out and "[bench pipe]" in err
    check_sim(summary["sim"], (2, 8))
    assert summary["trace"] == str(trace.parent) and "real" not in summary
    assert CostModel.from_dict(summary["cost_model"]).as_dict() == COST.as_dict()


def test_cli_missing_trace_is_one_error_line(tmp_path, cost_file, capsys):
    rc = main(["bench", "pipe", "--trace", str(tmp_path / "nope.jsonl"), "--cost-from", str(cost_file),
               "--no-real"])
    assert rc == 2 and "nope.jsonl" in capsys.readouterr().err


def test_default_trace_is_shipped_with_the_package():
    assert pipe_bench.DEFAULT_TRACE.parts[-3:] == ("histopipe", "traces", "default.jsonl")


def test_real_runs_fifo_vs_longest_first_give_the_same_tokens():
    model_dir, _ = tiny_checkpoint("llama")
    real = pipe_bench.run_real(model_dir, random_prompts(4, seed=5), num_generations=2, slots=2, max_tokens=12,
                               repeats=2, dtype="fp32", device="cpu", speculative="histospec", cost_model=COST)
    assert real["identical"] is True
    for mode in ("fifo", "longest_first"):
        assert real[mode]["median_s"] > 0 and len(real[mode]["runs_s"]) == 2
    assert real["prompts"] == 4 and real["tokens"] > 0 and real["speedup"] > 0


def test_two_ray_workers_run_every_schedule_with_the_same_tokens(cluster, capsys):
    """Part (b) on two Ray workers: static, least_loaded, histopipe (tier 2) and histopipe with each migration
    rule on the same groups, each twice; the figures' shape, the same tokens, and the table."""
    model_dir, _ = tiny_checkpoint("llama")
    real = pipe_bench.run_ray(model_dir, random_prompts(6, seed=5), num_generations=2, slots=2, max_tokens=16,
                              repeats=2, dtype="fp32", device="cpu", speculative="histospec", cost_model=COST)
    assert real["identical"] is True and real["workers"] == 2 and real["tokens"] > 0
    for name, _, _ in pipe_bench.RAY_VARIANTS:
        r = real[name]
        assert r["makespan_s"] > 0 and len(r["runs_s"]) == 2 and 0 <= r["bubble"] < 1 and r["finish_gap_s"] >= 0
        assert r["speedup_vs_static"] > 0
        assert r["migrations"] == 0 or name in ("histopipe+migration", "histopipe+tail", "histopipe+remaining+early")
        assert r["spread_s"] == pytest.approx(max(r["runs_s"]) - min(r["runs_s"]), abs=2e-4)
    assert real["static"]["speedup_vs_static"] == 1.0
    for name, _, _ in pipe_bench.RAY_VARIANTS:  # each schedule's plan: every request once, the same each round
        plan = real[name]["plan"]
        assert sorted((g, i) for share in plan for g, idx in share for i in idx) == [(g, i) for g in range(6)
                                                                                     for i in range(2)]
        assert real[name]["plan_same_each_round"] is True
    pipe_bench.print_real_tables({**real, "one_worker": None}, pipe_bench.table_console())
    assert "2 Ray workers" in capsys.readouterr().out


def test_the_real_workers_get_the_benchs_cost_model(trace, cost_file, tmp_path, monkeypatch):
    """`--cost-from`'s model is the real runs' (their workers' HistoSpec and their plan), not the simulation's
    alone: each worker measuring its own at start-up made the plan follow the machine's load."""
    got = {}

    def fake(name):
        return lambda *args, **kwargs: (got.__setitem__(name, kwargs["cost_model"]), {})[1]

    monkeypatch.setattr(pipe_bench, "run_real", fake("one"))
    monkeypatch.setattr(pipe_bench, "run_ray", fake("ray"))
    pipe_bench.run(trace, str(cost_file), "unused-model", workers=[2], slots=2, run_steps=0, out=tmp_path / "c",
                   context="0", modes=["sync"])
    assert got["one"].as_dict() == got["ray"].as_dict() == COST.as_dict()


def test_runs_per_mode_and_gantt_charts(trace, cost_file, tmp_path, capsys):
    """Sync and one_step_off runs per policy (JSON, table) and one Gantt PNG per worker count up
    to 64, policy and mode, in --out."""
    out = tmp_path / "charts"
    rc = main(["bench", "pipe", "--trace", str(trace), "--cost-from", str(cost_file), "--workers", "2,65",
               "--slots", "2", "--run-steps", "3", "--train-s", "0.5", "--out", str(out), "--no-real",
               "--no-defer-tail"])
    assert rc == 0
    stdout, err = capsys.readouterr()
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["out"] == str(out) and str(out) in err and "HistoPipe runs of 3 steps" in stdout
    assert summary["sim_info"]["modes"] == ["sync", "one_step_off"] and summary["sim_info"]["train_s"] == 0.5
    for w in ("2", "65"):
        modes = summary["sim"][w]["modes"]
        assert set(modes) == {"sync", "one_step_off"}
        for mode, by_policy in modes.items():  # one_step_off adds the stream with migration (stream_fleet.py)
            stream = {f"{p}+{r}" for p in ("histopipe", "static") for r in ("half_busiest", "remaining")
                      } if mode == "one_step_off" else set()
            assert set(by_policy) == set(POLICIES) | stream
            assert all(by_policy[p]["moved"] >= 0 for p in stream)
            for r in by_policy.values():
                assert r["step_s"] == pytest.approx(r["total_s"] / 3, rel=1e-3) and 0 <= r["bubble"] < 1
            assert by_policy["static"]["speedup_vs_static"] == 1.0
        # the updates overlap the rollouts: the baselines, in the same order in both modes, can only gain (a
        # deferral's re-runs, off here, may cost more than that: tests/histopipe/test_deferral.py)
        for policy in ("static", "least_loaded"):
            assert modes["one_step_off"][policy]["speedup_vs_sync"] > 1.0
    pngs = sorted(p.name for p in out.iterdir())
    assert pngs == sorted([f"gantt_2_{p}_{m}.png" for p in POLICIES for m in ("sync", "one_step_off")]
                          + [f"gantt_2_{p}+{r}_one_step_off.png" for p in ("histopipe", "static")
                             for r in ("half_busiest", "remaining")])
    assert all((out / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


def test_modes_option_is_checked(trace, cost_file, tmp_path, capsys):
    rc = main(["bench", "pipe", "--trace", str(trace), "--cost-from", str(cost_file), "--modes", "sync,async",
               "--no-real", "--out", str(tmp_path / "o")])
    assert rc == 2 and "--modes" in capsys.readouterr().err and not (tmp_path / "o").exists()
    rc = main(["bench", "pipe", "--trace", str(trace), "--cost-from", str(cost_file), "--workers", "2",
               "--slots", "2", "--modes", "one_step_off", "--out", str(tmp_path / "o"), "--no-real"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and list(summary["sim"]["2"]["modes"]) == ["one_step_off"]


RHYMING_SMALL = ["--trace", "rhyming", "--rhyming-median", "40", "--rhyming-cap", "400",
                 "--rhyming-num-generations", "4", "--rhyming-epoch-steps", "2", "--rhyming-history-epochs", "2",
                 "--slots", "2", "--no-real", "--context-cost", "0.001,0.0001"]


def test_cli_rhyming_workload_keeps_the_json_layout(cost_file, tmp_path, capsys):
    """`--trace rhyming` (issue 32): the built-in workload, its options, tier 2 and migration rows beside the
    policies, the same JSON layout (sim -> workers -> policy -> makespan_over_lb, bubble)."""
    rc = main(["bench", "pipe", *RHYMING_SMALL, "--cost-from", str(cost_file), "--workers", "2,4",
               "--run-steps", "2", "--out", str(tmp_path / "o")])
    assert rc == 0
    out, err = capsys.readouterr()
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["trace"] == "rhyming" and "rhyming workload" in out and "rhyming workload, 2 workers" in err
    check_sim(summary["sim"], (2, 4))
    info = summary["sim_info"]["rhyming"]
    assert info["median"] == 40 and info["cap"] == 400 and info["num_generations"] == 4
    for w in ("2", "4"):
        row, stats = summary["sim"][w], info["workers"][w]
        assert row["requests"] >= 4 * int(w) * 2  # at least 4 waves per worker
        assert stats["with_history"] == 1.0 and stats["step"] == 4  # after 2 epochs of 2 steps
        for name in ("histopipe_tier1", "histopipe+half_busiest", "histopipe+tail", "histopipe+remaining",
                     "histopipe+steal", "static+half_busiest"):
            assert row[name]["makespan_over_lb"] >= 1 - 1e-9 and 0 <= row[name]["bubble"] < 1
        assert "moved" in row["histopipe+tail"] and "speedup_vs_least_loaded" in row["histopipe"]
        assert row["histopipe+remaining"]["share_of_oracle"] == pytest.approx(
            row["oracle"]["makespan_s"] / row["histopipe+remaining"]["makespan_s"], rel=1e-3)
        assert set(row["modes"]["sync"]) == set(POLICIES)
    assert summary["cost_model"]["per_key_s"] == 0.001 and summary["context_cost"]["prefill_per_pair_s"] == 0.0001


def test_rhyming_options_are_listed_and_checked(cost_file, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "pipe", "--help"])
    help_text = capsys.readouterr().out
    for key in ("median", "p99-ratio", "cap", "num-generations", "shift-share", "drift", "drift-steps", "waves"):
        assert f"--rhyming-{key}" in help_text
    rc = main(["bench", "pipe", *RHYMING_SMALL, "--cost-from", str(cost_file), "--rhyming-median", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and "median" in err and "Traceback" not in err
    rc = main(["bench", "pipe", *RHYMING_SMALL, "--cost-from", str(cost_file), "--context-cost", "fast"])
    assert rc == 2 and "--context-cost" in capsys.readouterr().err


def test_a_trace_cap_is_its_longest_length_when_many_share_it():
    rows = [{"step": 0, "groups": [{"prompt": "a", "lengths": [128, 128, 50]}, {"prompt": "b", "lengths": [7]}]}]
    assert pipe_sim.trace_cap(rows) == 128
    assert pipe_sim.trace_cap([{"step": 0, "groups": [{"prompt": "a", "lengths": list(range(1, 41))}]}]) is None


def test_migrations_option_runs_the_simulated_only_push_and_checks_names(cost_file, tmp_path, capsys):
    """`--migrations` picks the simulated step's rules, the simulated-only `half_busiest+push` among them (a
    row of its own beside half_busiest's); an unknown rule is one error line naming the option."""
    rc = main(["bench", "pipe", *RHYMING_SMALL, "--cost-from", str(cost_file), "--workers", "4", "--run-steps", "0",
               "--migrations", "half_busiest,half_busiest+push", "--out", str(tmp_path / "o")])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    row = summary["sim"]["4"]
    assert summary["sim_info"]["migrations"] == ["half_busiest", "half_busiest+push"]
    assert {"histopipe+half_busiest", "histopipe+half_busiest+push", "static+half_busiest"} <= set(row)
    assert "histopipe+tail" not in row and "moved" in row["histopipe+half_busiest+push"]
    assert row["histopipe+half_busiest+push"]["makespan_over_lb"] >= 1 - 1e-9
    rc = main(["bench", "pipe", *RHYMING_SMALL, "--cost-from", str(cost_file), "--migrations", "push"])
    err = capsys.readouterr().err
    assert rc == 2 and "--migrations push" in err and "Traceback" not in err
