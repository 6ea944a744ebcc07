"""A request's state inside the engine (torch-free)."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from enum import Enum

from rhymerl.engine.sampling_params import SamplingParams, draw_prefix, request_key


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """What a finished request returns."""

    request_id: int | str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # log p(token) under the policy (logits / temperature; greedy: temperature 1)
    finish_reason: str  # "stop" (EOS or stop string), "length", or "error"
    text: str | None = None
    error: str | None = None
    queued_s: float = 0.0  # arrival -> admitted to a slot
    first_token_s: float = 0.0  # arrival -> first token
    total_s: float = 0.0  # arrival -> finished
    forwards: int = 0  # forward passes it took part in (prefill included)
    spec: object = None  # HistoSpec's work on it (rhymerl.histospec.stats.SpecStats); None when off
    # the policy version that sampled each token (one per token_ids entry), stamped by the rollout worker
    # (rhymerl.rollout.worker); [] from a bare engine, which knows no versions
    versions: list[int] = field(default_factory=list)

    @property
    def tokens_per_forward(self) -> float:
        """Response tokens per forward pass it took part in (1 or just under without speculation)."""
        return len(self.token_ids) / max(self.forwards, 1)


@dataclass
class StepEvent:
    """One request's progress in one engine step (for streaming)."""

    request_id: int | str
    new_token_ids: list[int]
    output: RequestOutput | None  # set when the request finished in this step


@dataclass
class Continuation:
    """A request handed over between engines at a step boundary (migration): plain, picklable
    data. The engine that adopts it (`Engine.adopt`) prefills prompt + generated tokens and decodes on from
    output position len(output_ids); keyed randomness (seed, request id, position) makes the rest of the
    response the tokens the first engine would have drawn."""

    request_id: int | str
    prompt_ids: list[int]
    output_ids: list[int]  # generated so far
    logprobs: list[float]  # theirs
    params: SamplingParams
    group: object = None  # its sibling group's key (the prompt's `prompt_key` by default)
    versions: list[int] = field(default_factory=list)  # the policy version of each of output_ids ([]: unknown)


@dataclass
class Sequence:
    request_id: int | str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    status: Status = Status.WAITING
    slot: int = -1
    num_cached: int = 0  # tokens whose keys/values are committed in the slot's cache
    finish_reason: str | None = None
    text: str | None = None
    arrival: float = field(default_factory=time.perf_counter)
    admitted: float = 0.0
    first_token: float = 0.0
    forwards: int = 0  # forward passes it took part in
    group: object = None  # siblings share a group (HistoSpec drafts from each other)
    spec: object = None  # the speculator's per-sequence state (rhymerl.histospec.seq_state.SeqSpec)
    resumed: bool = False  # adopted from another engine (`Continuation`) and not yet re-prefilled

    def __post_init__(self):
        self.key = request_key(self.request_id)

    @functools.cached_property
    def draw_prefix(self) -> int:
        """`sampling_params.draw_prefix` of this request (its params and id never change): what every one of
        its draw keys starts from, read every step."""
        return draw_prefix(self.params.seed, self.key)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def room(self, max_model_len: int) -> int:
        """The tokens it may still append: before its max_tokens and the end of a `max_model_len` context."""
        return min(self.params.max_tokens - len(self.output_ids), max_model_len - self.num_tokens)

    @property
    def uncached_ids(self) -> list[int]:
        """Tokens the next forward must feed: the whole prompt at first, then the last sampled token."""
        n_prompt = len(self.prompt_ids)
        if self.num_cached < n_prompt:
            return self.prompt_ids[self.num_cached :] + self.output_ids
        return self.output_ids[self.num_cached - n_prompt :]

    def to_continuation(self) -> "Continuation":
        """This request's state as plain data, for another engine to go on with (`Engine.extract`)."""
        return Continuation(self.request_id, list(self.prompt_ids), list(self.output_ids), list(self.logprobs),
                            self.params, self.group)

    def to_output(self) -> RequestOutput:
        now = time.perf_counter()
        return RequestOutput(
            request_id=self.request_id,
            prompt_ids=self.prompt_ids,
            token_ids=self.output_ids,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason or "length",
            text=self.text,
            queued_s=self.admitted - self.arrival,
            first_token_s=self.first_token - self.arrival,
            total_s=now - self.arrival,
            forwards=self.forwards,
            spec=self.spec.stats if self.spec is not None else None,
        )
