"""The in-process rollout pool: one worker, no services (the default, `rollout.backend=local`).

Faults, the policy both backends follow (`ray_pool` too): an exception inside the worker's rollout (an
out-of-memory error, say) leaves its engine in an unknown state (slots held, a half-built step), so the pool
rebuilds the worker (`RolloutWorker` on the failed one's model, i.e. the current weights, and its cost model;
a fresh engine, HistoSpec state and history replica, as a Ray worker restarted after a failure) and runs the
call's groups again: keyed randomness makes them the same tokens. Past `max_restarts` rebuilds
(`rollout.max_worker_restarts`) no worker is left and the call raises `WorkersFailed`, one line naming the
fault. A `StaleWeightsError` is the caller's mistake, not a fault: it is raised at once.
"""

from __future__ import annotations

import sys
import time
from typing import Sequence

import torch

from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.history import HistoryStore
from rhymerl.rollout.types import RolloutGroup, RolloutResult, StaleWeightsError, WorkersFailed, first_line
from rhymerl.rollout.worker import RolloutWorker


class LocalPool:
    """`RolloutPool` over one `RolloutWorker` in this process. `history` is the truth (the loop's, saved
    with every checkpoint); the worker drafts from its own replica, brought up to date with each call, as a
    worker in another process would be. A worker whose rollout raises is rebuilt up to `max_restarts` times
    (see the module doc)."""

    def __init__(self, worker: RolloutWorker, history: HistoryStore, max_restarts: int = 3):
        self.worker = worker
        self.history = history
        self.weights_version = worker.weights_version
        self.max_restarts = max_restarts
        self.restarts = [0]  # rebuilds of the worker so far (a list, as RayPool's)

    def rollout(self, groups: Sequence[RolloutGroup], params: SamplingParams, step: int | None = None) -> RolloutResult:
        started = time.time()  # the call's wall interval: the timeline's origin and the bubble ratio's span
        history = self.history.export(g.prompt_ids for g in groups)
        while True:
            try:
                outputs, stats = self.worker.rollout(groups, params, history, self.weights_version, step)
                break
            except StaleWeightsError:
                raise
            except Exception as e:  # noqa: BLE001 - any fault inside the worker: rebuild it, run the groups again
                self._rebuild(e)
        return RolloutResult(outputs, [stats], self.weights_version, started=started, finished=time.time())

    def _rebuild(self, error: Exception) -> None:
        """After the worker's rollout raised `error`: a fresh worker on its model (the current weights) and
        cost model, or, past `max_restarts`, WorkersFailed (chained to `error`)."""
        why = f"raised {type(error).__name__}: {first_line(error)}"
        if self.restarts[0] >= self.max_restarts:
            raise WorkersFailed(f"rollout worker {self.worker.worker_id} {why}, after {self.max_restarts} restarts "
                                f"(rollout.max_worker_restarts), and no rollout worker is left") from error
        self.restarts[0] += 1
        print(f"[rollout] worker {self.worker.worker_id} {why}: rebuilding it ({self.restarts[0]}/"
              f"{self.max_restarts}, rollout.max_worker_restarts) and running its requests again", file=sys.stderr)
        old = self.worker
        self.worker = RolloutWorker(old.model, old.tokenizer, old.config, old.worker_id,
                                    cost_model=old.engine.cost_model)  # None: speculation off
        self.worker.weights_version = old.weights_version

    def load_weights(self, params: dict[str, torch.Tensor], version: int) -> None:
        self.worker.load_weights(params, version)
        self.weights_version = version

    def spec_state(self) -> list[dict | None]:
        """Each worker's HistoSpec state (`RolloutWorker.spec_state`): one here."""
        return [self.worker.spec_state()]

    def load_spec_state(self, states: list[dict | None]) -> None:
        """Restore `spec_state`'s list (a resume)."""
        if states:
            self.worker.load_spec_state(states[0])

    def close(self) -> None:
        """Nothing to end: the worker lives in this process (and stays readable after a run)."""

    def record(self, prompt_ids: list[int], responses: list[list[int]],
               rewards: list[float | None] | None = None) -> None:
        self.history.record_rollout(prompt_ids, responses, rewards)
