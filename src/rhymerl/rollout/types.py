"""The rollout interface's data: what goes to the workers and what comes back (plain, picklable)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

from rhymerl.engine.stats import EngineStats
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.engine.sequence import Continuation, RequestOutput
from rhymerl.histospec.stats import SpecStats


class StaleWeightsError(RuntimeError):
    """A worker was asked to roll out on weights of another version than the ones it holds."""


def first_line(error: BaseException) -> str:
    """`error`'s message up to its first line break (an out-of-memory error's runs on for lines), or its type."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class WorkersFailed(RuntimeError):
    """No rollout worker is left: each failed (its rollout raised, its actor died or did not answer) more than
    `rollout.max_worker_restarts` times. One line naming the last fault and the key; the run stops there, its
    last checkpoint intact (`rhymerl` prints it as `rhymerl: error: ...`, exit code 1)."""


@dataclass
class RolloutGroup:
    """One prompt's requests: the `num_generations` siblings of a GRPO group (they share the prompt's prefill
    and draft from each other), each with its request id (the key of its random draws)."""

    prompt_ids: list[int]
    request_ids: list[str]


@dataclass
class RequestSpan:
    """One request's time on a worker: admitted to a slot at `start`, finished at `end` (both `time.time()`,
    so that the spans of workers in other processes of one machine line up), `tokens` generated."""

    request_id: int | str
    start: float
    end: float
    tokens: int


@dataclass
class WorkerStats:
    """One worker's share of a rollout call."""

    worker: int
    requests: int = 0
    engine: EngineStats = field(default_factory=EngineStats)
    spec: SpecStats | None = None  # None: HistoSpec off
    started: float = 0.0  # time.time() when the worker began the call
    finished: float = 0.0  # ... and ended it
    history_prompts_replaced: int = 0  # prompts of its history replica brought up to date by the call
    spans: list[RequestSpan] = field(default_factory=list)  # its timeline: one per request, in the order given
    # rollout.defer_tail: requests of the share stopped for the worker's next share (rollout/deferral.py), and
    # how many carried from its previous share ran again from scratch (rollout.max_staleness)
    deferred: list[Continuation] = field(default_factory=list)
    reruns: int = 0


@dataclass
class RolloutResult:
    """The outputs of every request, groups in the order given and siblings in order, and per-worker stats
    (a worker may appear more than once: a share sent again after a failure). `started` and `finished`: the
    whole call's wall interval (`time.time()`), stamped by the pool; 0.0 when a pool did not."""

    outputs: list[RequestOutput]
    workers: list[WorkerStats]
    weights_version: int
    started: float = 0.0
    finished: float = 0.0
    deferred: list = field(default_factory=list)  # rollout.defer_tail: request ids left for the next step

    def engine_totals(self) -> EngineStats:
        """The workers' engine stats added up."""
        total = EngineStats()
        for w in self.workers:
            total.merge(w.engine)
        return total

    def spec_totals(self) -> SpecStats | None:
        """The workers' HistoSpec stats added up (None when HistoSpec is off)."""
        specs = [w.spec for w in self.workers if w.spec is not None]
        if not specs:
            return None
        total = SpecStats()
        for spec in specs:
            total.merge(spec)
        return total


class RolloutPool(Protocol):
    """What the RL loop calls (LocalPool here; a Ray pool implements the same)."""

    weights_version: int

    # step: the training step rolled out (from 1; None for validation), for the workers' admission order
    def rollout(self, groups: Sequence[RolloutGroup], params: SamplingParams,
                step: int | None = None) -> RolloutResult: ...

    def load_weights(self, params: dict, version: int) -> None: ...

    def record(self, prompt_ids: list[int], responses: list[list[int]], rewards: list[float | None] | None) -> None: ...

    def spec_state(self) -> list[dict | None]: ...  # each worker's HistoSpec state, plain data (checkpointed)

    def load_spec_state(self, states: list[dict | None]) -> None: ...  # restore it on a resume

    def close(self) -> None: ...  # end the workers that live outside this process (a Ray pool's actors)
