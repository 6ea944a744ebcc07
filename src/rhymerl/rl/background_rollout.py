"""`rollout.mode=one_step_off`: the next step's rollout, run by one driver thread while this step trains.

Right after step t's rollout returned and the history recorded it, `start` hands step t+1's rollout to a
thread; it runs on the workers on the weights step t trains from (version t), while the driver scores and
trains step t. The driver `join`s it before loading the weights of version t+1, so a weight load never races
a rollout, and step t+1 `take`s it. Step t+1's tokens are still a function of (seed, request ids, weights
version t). The thread only waits on the workers (Ray), so it does not compete with the update for cores.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from rhymerl.rollout.types import RolloutResult


def rolls_ahead(step: int, total_steps: int, save_every: int) -> bool:
    """Whether step `step` (0-based) of a one_step_off run rolls out ahead, on the weights one update older
    than the ones it trains: not past the last step, and not the first step nor the step right after a
    checkpoint. A checkpoint holds its own step's weights only, so a run resumed there could not roll that step
    out on the weights one step older; that step rolls out on the checkpoint's weights in the uninterrupted run
    too, and a resume stays exact."""
    return 0 < step < total_steps and not (save_every > 0 and step % save_every == 0)


class BackgroundRollout:
    """At most one rollout in flight, of the step after the one training. `enabled` False (sync mode): every
    call is a no-op and `take` returns None, so the loop rolls every step out itself."""

    def __init__(self, enabled: bool, total_steps: int, save_every: int):
        self.total_steps = total_steps
        self.save_every = save_every
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="rollout-ahead") if enabled else None
        self._ahead: tuple[int, Future] | None = None  # (step, its rollout)

    @property
    def enabled(self) -> bool:
        return self._executor is not None

    def rolls_ahead(self, step: int) -> bool:
        """Whether step `step` (0-based) rolls out in the background while step - 1 trains (`rolls_ahead`)."""
        return self.enabled and rolls_ahead(step, self.total_steps, self.save_every)

    def start(self, step: int, rollout: Callable[[], RolloutResult]) -> None:
        """Run `rollout` (step `step`'s) in the background if that step rolls ahead."""
        if self.rolls_ahead(step):
            self._ahead = (step, self._executor.submit(rollout))

    def join(self) -> float:
        """Wait for the rollout in flight, if any (its error, if it failed, raises here); the seconds waited."""
        t0 = time.perf_counter()
        if self._ahead is not None:
            self._ahead[1].result()
        return time.perf_counter() - t0

    def take(self, step: int) -> RolloutResult | None:
        """Step `step`'s rollout if it ran in the background (waiting for it), else None."""
        if self._ahead is None:
            return None
        ahead, future = self._ahead
        if ahead != step:
            raise RuntimeError(f"the background rollout is step {ahead}'s, but step {step} runs: one_step_off rolls "
                               f"out only the step after the one training")
        self._ahead = None
        return future.result()

    def close(self) -> None:
        """Wait for a rollout left in flight (a failed step may leave one) and end the thread."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
