"""`rollout.stream` (with `rollout.mode=one_step_off`): the loop's side of rollout as a stream (the workers'
side: `rollout/ray_stream.py`).

When step t is taken, step t+1 is submitted first (if it rolls ahead: `background_rollout.rolls_ahead`), on
the weights step t trains from (version t), so each worker queues its share of t+1 behind its share of t and
starts it the moment its share of t is done; then the loop waits for step t's groups. Step t+1 therefore runs
on the same version as without the stream, and its tokens are the same (keyed randomness); what changes is
when: a worker no longer idles until the slowest worker of step t is done and the driver has scored step t.
The weights of version t+1, published after step t's update, go to the shares submitted from then on.

With `rollout.defer_tail` a step's tail requests stop and run first in their worker's share of the next step
(`rollout/deferral.py`); the loop trains a group at the step where its last request comes back
(`rl/group_assembly.py`).

The plan and the history slices of step t+1 are made when it is submitted, before step t is recorded: they
see the history up to step t-1 (a prompt of step t drafting in step t+1 is the exception, at an epoch's end).
HistoSpec is lossless, so this changes drafts, not tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from rhymerl.rl.background_rollout import rolls_ahead
from rhymerl.rollout import RolloutGroup, RolloutResult, SamplingParams

if TYPE_CHECKING:  # the Ray backend's modules import ray: `rollout.factory.make_stream` imports them
    from rhymerl.rollout.ray_stream import RayStream, StreamedStep

# step (0-based) -> its rollout's groups, params and step number as logged (from 1)
Request = Callable[[int], tuple[list[RolloutGroup], SamplingParams, int]]


class StreamedRollout:
    """The training steps' rollouts through a `RayStream`: `take(step)` (see the module doc)."""

    def __init__(self, stream: RayStream, request: Request, total_steps: int, save_every: int,
                 defer_tail: bool = False):
        self.stream, self.request = stream, request
        self.total_steps, self.save_every, self.defer_tail = total_steps, save_every, defer_tail
        self._submitted: dict[int, StreamedStep] = {}

    def defers(self, step: int) -> bool:
        """Whether step `step` (0-based) defers its tail (`rollout.defer_tail`) into step + 1: not the last step,
        nor one that ends in a checkpoint (the step after it runs on the checkpoint's weights, and a checkpoint
        holds no request in flight: a resume stays exact)."""
        return self.defer_tail and rolls_ahead(step + 1, self.total_steps, self.save_every)

    def _submit(self, step: int) -> None:
        if step not in self._submitted:
            self._submitted[step] = self.stream.submit(*self.request(step), train=True, defer=self.defers(step))

    def take(self, step: int) -> RolloutResult:
        """Step `step`'s rollout: submitted now unless it was (on the current weights), step + 1's submitted
        behind it if that step rolls ahead, then collected once its groups are all in."""
        self._submit(step)
        if rolls_ahead(step + 1, self.total_steps, self.save_every):
            self._submit(step + 1)
        return self.stream.collect(self._submitted.pop(step))

    def load_weights(self, params: dict[str, torch.Tensor], version: int) -> None:
        """The weights after step version - 1's update, for the shares submitted from now on."""
        self.stream.publish(params, version)

    def rollout(self, groups: list[RolloutGroup], params: SamplingParams, step: int | None = None) -> RolloutResult:
        """Any other rollout (validation): behind the shares in flight, on the current weights."""
        return self.stream.rollout(groups, params, step)
