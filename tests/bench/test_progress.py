"""The benches' progress lines (bench/progress.py): the stage count, the time-left arithmetic on a fake clock,
the heartbeat inside a long stage, and that it stops."""

import io
import time

import pytest

from rhymerl.bench.progress import Progress, format_seconds


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_time_left_comes_from_the_stages_done_so_far():
    clock, out = Clock(), io.StringIO()
    p = Progress("x", 4, heartbeat_s=None, clock=clock, stream=out)
    p.stage("load")
    assert p.left_s() is None  # nothing done yet: no estimate
    clock.now += 10
    p.stage("a")  # 1 of 4 done in 10 s: 3 left at 10 s each
    assert p.left_s() == pytest.approx(30.0)
    clock.now += 4  # 4 s into stage 2: 30 - 4
    assert p.left_s() == pytest.approx(26.0)
    clock.now += 16  # stage 2 overran: at least the 2 stages after it are left
    assert p.left_s() == pytest.approx(20.0)
    p.stage("b")  # 2 done in 30 s: 15 s each, 2 left
    assert p.left_s() == pytest.approx(30.0)
    p.stage("c", units=2)  # 3 done in 30 s; the total grows to hold this stage's 2 units
    assert p.total == 5 and p.left_s() == pytest.approx(20.0)
    clock.now += 5
    p.done()
    assert lines(out) == [
        "[bench x] stage 1/4: load ... 0 s elapsed, ETA after the first stage",
        "[bench x] stage 2/4: a ... 10 s elapsed, ~30 s left",
        "[bench x] stage 3/4: b ... 30 s elapsed, ~30 s left",
        "[bench x] stage 4 (60% of the work done): c ... 30 s elapsed, ~20 s left",
        "[bench x] done in 35 s",
    ]


def test_format_seconds():
    assert [format_seconds(s) for s in (0.4, 59.4, 65, 3599, 3725)] == ["0 s", "59 s", "1m05s", "59m59s", "1h02m"]


def test_a_long_stage_is_re_announced_until_done():
    out = io.StringIO()
    p = Progress("y", 2, heartbeat_s=0.05, stream=out)
    p.stage("slow")
    time.sleep(0.4)
    beats = [line for line in lines(out) if "(still running)" in line]
    assert len(beats) >= 2 and beats[0].startswith("[bench y] stage 1/2: slow (still running) ...")
    p.done()
    time.sleep(0.2)
    assert lines(out)[-1].startswith("[bench y] done in")  # nothing after done()
