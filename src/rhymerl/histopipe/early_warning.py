"""The siblings' early warning (rule component "early", `rollout.migration_rule=remaining+early`;
docs/design.md, section 4, "HistoPipe, part by part": The siblings' early warning). Torch-free: the simulator
(`fleet.py`) and the rollout worker (`rollout/early_queue.py`) share it.

Why: a group's requests share a prompt and their lengths rhyme, but a plan keeps a group on one worker and
admits it whole, so without help the first evidence of a group that has grown since its history is its
members running late together. The rule, on one worker's requests not yet admitted:
- admission starts with one member of each group, in the plan's order (`probe_order`): every group has a
  running witness within the first wave;
- a waiting request's evidence is the most tokens a sibling has reached, running or finished
  (`evidence`); once that passes the request's own predicted length, the request is renewed: priced at the
  live prediction past that many tokens (`renewed_length`, `LengthPredictor.predict_past`: the prior's wider
  distribution once the prompt has shifted), which the `remaining` rule's moves read;
- renewed requests are admitted before the worker's other waiting ones, the longest renewed first
  (`renewed_first`); the others keep their order.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TypeVar

T = TypeVar("T")


def probe_order(queue: Sequence[T], groups: Sequence[Hashable]) -> list[T]:
    """Admission with the early warning: the first queued member of each group (`groups[k]`: queue[k]'s), in
    the queue's order, then the rest in theirs. Under longest-predicted-first admission a predicted-short
    group otherwise starts last, and a group that has grown since its history goes unseen until then."""
    if len(queue) != len(groups):
        raise ValueError(f"{len(queue)} requests but {len(groups)} groups")
    seen: set = set()
    first = [k for k, g in enumerate(groups) if not (g in seen or seen.add(g))]
    rest = sorted(set(range(len(queue))) - set(first))
    return [queue[k] for k in first + rest]


def evidence(longest_finished: float, running_tokens: Iterable[float]) -> float:
    """The most tokens a member of a group has reached: its longest finished member's length, or the most
    tokens one of its running members holds."""
    return max([float(longest_finished), *map(float, running_tokens)])


def renewed_length(seen: float, predicted: float, predict_past: Callable[[float], float]) -> float:
    """A waiting request's renewed predicted length: `predict_past(seen)` (the live prediction past what a
    sibling reached, `seen`) once `seen` has passed its `predicted` length; 0.0 while it has not (not renewed:
    its own prediction stands)."""
    return predict_past(seen) if seen > predicted else 0.0


def renewed_first(queue: Iterable[T], renewed: Callable[[T], float]) -> list[T]:
    """The admission order of waiting requests: the renewed ones (`renewed(r)` > 0) first, longest renewed
    first, then the rest in the queue's order (stable: ties keep theirs)."""
    def key(r: T) -> tuple[int, float]:
        length = renewed(r)
        return (0, -length) if length else (1, 0)
    return sorted(queue, key=key)
