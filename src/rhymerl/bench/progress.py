"""What a bench is doing, on stderr: "[bench X] stage k/n: what ... elapsed, ~ETA left".

Every `rhymerl bench ...` command runs for minutes to an hour on a 2-core machine; stdout holds only its
table and its JSON line, so each one announces its stages here (start-up phases included: model loads,
cost-model grids, warm-ups). The estimate of what is left comes from the stages done so far: their mean time
per unit of work times the units still to do. A stage that runs longer than `heartbeat_s` is re-announced
every `heartbeat_s` seconds (a thread), so that no bench stays silent for minutes inside one long stage (a
whole training run, a TRL baseline, a cost-model grid).

Torch-free: `bench pipe`'s simulation imports no torch.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from typing import Callable, TextIO

HEARTBEAT_S = 60.0  # "nothing silent for more than about a minute" (issue 26, item 15)


def format_seconds(seconds: float) -> str:
    """12 s, 3m05s, 1h02m."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    return f"{minutes // 60}h{minutes % 60:02d}m"


class Progress:
    """The stages of bench `bench` (its name, as in `[bench spec]`), `total` units of work in all (each stage
    is 1 unit unless it says otherwise; `total` may be raised once a bench knows more, and grows by itself
    when the stages outrun it). `stage(what)` ends the current stage and starts the next; `done()` ends the
    last and stops the heartbeat. `clock` and `stream` (default: sys.stderr at the time of each line) are
    there for tests; `heartbeat_s=None` turns the heartbeat off."""

    def __init__(self, bench: str, total: float, *, heartbeat_s: float | None = HEARTBEAT_S,
                 clock: Callable[[], float] = time.monotonic, stream: TextIO | None = None):
        self.bench = bench
        self.total = float(total)
        self.clock = clock
        self.stream = stream
        self.started = clock()
        self.done_units = 0.0  # units of the stages finished
        self.done_at = self.started  # when the last of them finished (= when the current stage began)
        self.index = 0  # the current stage's number (1-based; 0 before the first)
        self.current: tuple[str, float] | None = None  # (what, units) of the running stage
        self.unit_stages = True  # every stage so far was 1 unit: "stage k/n" counts stages
        self._last_line = self.started  # when a line was last printed (the heartbeat waits for silence)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        if heartbeat_s:
            # The thread holds the stop event and a weak reference only: a bench that raises before done()
            # leaves no thread printing once its Progress is gone.
            threading.Thread(target=_heartbeat, args=(weakref.ref(self), self._stop, heartbeat_s),
                             name=f"bench-{bench}-progress", daemon=True).start()
            weakref.finalize(self, self._stop.set)

    # ---- the arithmetic -------------------------------------------------------------------------------
    def elapsed_s(self, now: float | None = None) -> float:
        return (self.clock() if now is None else now) - self.started

    def left_s(self, now: float | None = None) -> float | None:
        """Seconds left, estimated from the stages done so far (None before the first is done): their time
        per unit times the units not done, less what the current stage has already run, but never below
        the estimate for the stages after the current one."""
        if self.done_units <= 0:
            return None
        now = self.clock() if now is None else now
        per_unit = (self.done_at - self.started) / self.done_units
        units_left = max(self.total - self.done_units, 0.0)
        after_current = max(units_left - (self.current[1] if self.current else 0.0), 0.0)
        return max(per_unit * units_left - (now - self.done_at), per_unit * after_current)

    # ---- the calls a bench makes ----------------------------------------------------------------------
    def stage(self, what: str, units: float = 1.0) -> None:
        """The current stage (if any) is done; `what` (`units` of work) starts now."""
        with self._lock:
            now = self.clock()
            self._finish(now)
            self.index += 1
            self.current = (what, float(units))
            self.unit_stages &= units == 1
            self.total = max(self.total, self.done_units + units)
            self._emit(self._line(now))

    def note(self, msg: str) -> None:
        """A line of its own under the bench's prefix (a result worth seeing before the table)."""
        with self._lock:
            self._emit(f"[bench {self.bench}] {msg}")

    def done(self, what: str = "done") -> None:
        """The last stage is done: one closing line with the total time; the heartbeat stops."""
        with self._lock:
            now = self.clock()
            self._finish(now)
            self._stop.set()
            self._emit(f"[bench {self.bench}] {what} in {format_seconds(self.elapsed_s(now))}")

    def _finish(self, now: float) -> None:
        if self.current is not None:
            self.done_units += self.current[1]
            self.done_at = now
            self.current = None

    def _line(self, now: float, still: bool = False) -> str:
        what = self.current[0] if self.current else "waiting"
        n = self.total
        left = self.left_s(now)
        eta = f"~{format_seconds(left)} left" if left is not None else "ETA after the first stage"
        running = f", this stage {format_seconds(now - self.done_at)}" if still else ""
        count = f"{self.index}/{n:.0f}" if self.unit_stages and n == int(n) else \
            f"{self.index} ({100 * self.done_units / n:.0f}% of the work done)"
        return (f"[bench {self.bench}] stage {count}: {what}{' (still running)' if still else ''} ... "
                f"{format_seconds(self.elapsed_s(now))} elapsed{running}, {eta}")

    def _emit(self, line: str) -> None:
        stream = self.stream or sys.stderr
        stream.write(line + "\n")
        stream.flush()
        self._last_line = self.clock()

    def _beat(self, heartbeat_s: float) -> None:
        """Re-announce the current stage when nothing was printed for `heartbeat_s` seconds."""
        with self._lock:
            now = self.clock()
            if self.current is not None and now - self._last_line >= heartbeat_s:
                self._emit(self._line(now, still=True))


def _heartbeat(ref: weakref.ref, stop: threading.Event, heartbeat_s: float) -> None:
    while not stop.wait(min(heartbeat_s, 5.0)):
        progress = ref()
        if progress is None:
            return
        progress._beat(heartbeat_s)
        del progress  # no strong reference kept while waiting
