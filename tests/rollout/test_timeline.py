"""Per-worker timelines of real rollout calls: the bubble metrics on hand-made timelines, a real
LocalPool call's timeline, RUN_DIR/timeline.jsonl across a resume, and the report's Gantt chart."""

import json

import pytest

from rhymerl.cost_model import CostModel
from rhymerl.histopipe.gantt import _lanes, gantt_figure
from rhymerl.histopipe.simulate import simulate
from rhymerl.histopipe.timeline import Timeline
from rhymerl.history import HistoryStore
from rhymerl.report import write_report
from rhymerl.rl.step_metrics import rollout_metrics
from rhymerl.rollout import LocalPool, RolloutGroup, RolloutResult, RolloutWorker, SamplingParams
from rhymerl.rollout.timeline import (TIMELINE_FILE, append_timeline, call_interval, read_timeline, timeline_metrics,
                                      timeline_row, to_timeline)
from rhymerl.rollout.types import RequestSpan, WorkerStats
from helpers import worker_config
from tiny_models import random_prompts, tiny_decoder

T0 = 1_000.0  # a wall clock origin


def stats(worker, spans, **kw):
    """A worker's stats with spans given as (start, end, tokens) seconds after T0."""
    return WorkerStats(worker, requests=len(spans),
                       spans=[RequestSpan(f"w{worker}-r{i}", T0 + s, T0 + e, n) for i, (s, e, n) in enumerate(spans)],
                       **kw)


def hand_made(span=10.0):
    # worker 0: [0, 4] and [2, 6] overlap -> busy [0, 6] = 6 s; worker 1: [1, 3], then [5, 10] in a second
    # share (sent again after a failure) -> 2 + 5 = 7 s. Busy 13 of 2 x 10 worker-seconds: bubble 0.35.
    workers = [stats(0, [(0, 4, 10), (2, 6, 20)]), stats(1, [(1, 3, 5)]), stats(1, [(5, 10, 15)])]
    return RolloutResult([], workers, 0, started=T0, finished=T0 + span)


def test_metrics_of_a_hand_made_timeline():
    m = timeline_metrics(hand_made())
    assert m["rollout/bubble_ratio"] == pytest.approx(0.35)
    assert m["rollout/finish_gap_s"] == pytest.approx(4.0)  # worker 0 ends at 6, worker 1 at 10
    assert m["perf/throughput"] == pytest.approx(50 / (2 * 10))
    assert (m["rollout/worker0/busy_s"], m["rollout/worker1/busy_s"]) == pytest.approx((6.0, 7.0))
    assert (m["rollout/worker0/tokens"], m["rollout/worker1/tokens"]) == (30, 20)
    assert (m["rollout/worker0/requests"], m["rollout/worker1/requests"]) == (2, 2)
    # the call's wall time, not the makespan, is the span: the same work in a longer call is more bubble
    assert timeline_metrics(hand_made(span=20.0))["rollout/bubble_ratio"] == pytest.approx(1 - 13 / 40)
    # validation's throughput does not overwrite the training rollout's in the step's row
    val = timeline_metrics(hand_made(), "val")
    assert "perf/throughput" not in val and val["val/perf/throughput"] == pytest.approx(2.5)


def test_an_idle_worker_counts_and_finishes_at_zero():
    result = hand_made()
    result.workers.append(WorkerStats(2))  # given nothing
    m = timeline_metrics(result)
    assert m["rollout/bubble_ratio"] == pytest.approx(1 - 13 / 30)
    assert m["rollout/finish_gap_s"] == pytest.approx(10.0)
    assert m["rollout/worker2/busy_s"] == 0 and m["rollout/worker2/requests"] == 0
    assert timeline_metrics(RolloutResult([], [WorkerStats(0)], 0, started=T0, finished=T0 + 1)) == {}


def test_busy_intervals_are_the_union_of_the_requests():
    tl = Timeline.from_requests(2, [0, 0, 0, 0, 1], [0, 1, 3, 5, 2], [2, 1.5, 5, 6, 2.5])
    assert tl.busy == [[(0, 2), (3, 6)], [(2, 2.5)]]  # nested, touching, and disjoint intervals
    assert Timeline.from_dict(tl.as_dict()) == tl
    with pytest.raises(ValueError, match="end no earlier"):
        Timeline.from_requests(1, [0], [2.0], [1.0])
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        Timeline.from_requests(1, [1], [0.0], [1.0])


def test_a_pool_that_stamped_no_interval_falls_back_to_its_workers():
    result = hand_made()
    result.started = result.finished = 0.0
    result.workers[0].started, result.workers[0].finished = T0 - 1, T0 + 7
    result.workers[2].started, result.workers[2].finished = T0 + 4, T0 + 11
    assert call_interval(result) == (T0 - 1, T0 + 11)
    row = timeline_row(result)
    assert row["span_s"] == pytest.approx(12.0) and row["requests"][0]["start"] == pytest.approx(1.0)


def test_a_local_pool_call_reports_every_request_once_with_plausible_times():
    slots = 3
    config = worker_config(num_slots=slots, max_draft_tokens=4)
    flat = CostModel([1, 64], [1, 64], [[1.0, 1.0], [1.0, 1.0]])
    pool = LocalPool(RolloutWorker(tiny_decoder("llama"), None, config, cost_model=flat), HistoryStore())
    groups = [RolloutGroup(p, [f"p{i}-g{g}" for g in range(2)]) for i, p in enumerate(random_prompts(4, seed=5))]
    result = pool.rollout(groups, SamplingParams(temperature=1.0, max_tokens=12, seed=1))
    row = timeline_row(result)
    assert sorted(r["id"] for r in row["requests"]) == sorted(o.request_id for o in result.outputs)
    by_id = {o.request_id: o for o in result.outputs}
    for r in row["requests"]:
        assert 0 <= r["start"] <= r["end"] <= row["span_s"]
        assert r["tokens"] == len(by_id[r["id"]].token_ids) and r["worker"] == 0
    (w,) = result.workers
    assert result.started <= w.started <= w.finished <= result.finished
    # 8 requests on 3 slots: never more than 3 at once, and the 4th admitted only once a first one finished
    reqs = sorted(row["requests"], key=lambda r: r["start"])
    assert max(_lanes([(r["start"], r["end"]) for r in reqs])) + 1 <= slots
    assert reqs[slots]["start"] >= min(r["end"] for r in reqs[:slots]) - 1e-3
    m = rollout_metrics("rollout", result)
    assert 0 <= m["rollout/bubble_ratio"] < 1 and m["rollout/worker0/requests"] == 8
    assert m["rollout/worker0/busy_s"] <= row["span_s"]
    assert m["perf/throughput"] == pytest.approx(sum(len(o.token_ids) for o in result.outputs) / row["span_s"],
                                                 rel=1e-4)


def test_the_timeline_file_keeps_every_step_once_across_a_resume(tmp_path):
    for step in (1, 2, 3):
        append_timeline(tmp_path, step, hand_made(span=float(step)))
    assert [r["step"] for r in read_timeline(tmp_path)] == [1, 2, 3]
    assert to_timeline(read_timeline(tmp_path)[0]).busy[1] == [(1.0, 1.0)]  # clipped into the 1 s call
    # resumed from the checkpoint of step 1 (killed after writing steps 2 and 3): they are written again
    append_timeline(tmp_path, 2, hand_made(span=20.0))
    rows = read_timeline(tmp_path / TIMELINE_FILE)
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["span_s"] == 20.0
    # a torn last line (killed while writing it) is dropped, and the next line starts on a line of its own
    with open(tmp_path / TIMELINE_FILE, "a") as f:
        f.write('{"step": 3, "span')
    append_timeline(tmp_path, 3, hand_made())
    lines = (tmp_path / TIMELINE_FILE).read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]


def test_the_report_draws_the_timeline_as_a_gantt_chart(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "critic/rewards/mean": 0.5}) + "\n")
    assert not any(p.name == "timeline.png" for p in write_report(tmp_path))  # no timeline.jsonl: no chart
    append_timeline(tmp_path, 1, hand_made(span=12.0))  # the slowest step
    append_timeline(tmp_path, 2, hand_made())
    (png,) = [p for p in write_report(tmp_path) if p.name == "timeline.png"]
    assert png.parent == tmp_path / "report" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_simulated_step_is_drawn_by_the_same_chart():
    cost = CostModel([1, 64], [1, 64], [[1.0, 1.0], [1.0, 1.0]])
    tl = simulate([[5, 9], [3], [7, 7, 2]], 2, "static", slots=2, cost_model=cost)
    measured = to_timeline(timeline_row(hand_made()))
    fig = gantt_figure([tl, measured], ["static", "measured"], spans=[None, 10.0], worker_labels=[None, [0, 1]])
    titles = [ax.get_title() for ax in fig.axes]
    assert titles[0].startswith("static: bubble") and "bubble 35.0%" in titles[1]
    assert len(fig.axes[1].collections[0].get_paths()) == 4  # one bar per measured request
