"""The in-process rollout pool: one worker, no services (the default, `rollout.backend=local`)."""

from __future__ import annotations

import time
from typing import Sequence

import torch

from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.history import HistoryStore
from rhymerl.rollout.types import RolloutGroup, RolloutResult
from rhymerl.rollout.worker import RolloutWorker


class LocalPool:
    """`RolloutPool` over one `RolloutWorker` in this process. `history` is the truth (the loop's, saved
    with every checkpoint); the worker drafts from its own replica, brought up to date with each call, as a
    worker in another process would be."""

    def __init__(self, worker: RolloutWorker, history: HistoryStore):
        self.worker = worker
        self.history = history
        self.weights_version = worker.weights_version

    def rollout(self, groups: Sequence[RolloutGroup], params: SamplingParams, step: int | None = None) -> RolloutResult:
        started = time.time()  # the call's wall interval: the timeline's origin and the bubble ratio's span
        history = self.history.export(g.prompt_ids for g in groups)
        outputs, stats = self.worker.rollout(groups, params, history, self.weights_version, step)
        return RolloutResult(outputs, [stats], self.weights_version, started=started, finished=time.time())

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

    def record(self, prompt_ids: list[int], responses: list[list[int]],
               rewards: list[float | None] | None = None) -> None:
        self.history.record_rollout(prompt_ids, responses, rewards)
