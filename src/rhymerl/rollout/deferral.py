"""A worker's side of `rollout.defer_tail` (docs/design.md, section 4: deferral of the tail): which requests of
its share it stops, and what it does with the ones its previous share stopped. The rule itself, shared with
the simulator, is `histopipe.deferral`.

Between two engine steps (`check`), a running request of this share is deferred when its group is in its tail
(at most `tail_size` of its requests unfinished, deferred ones counted) and it has generated more than
`threshold` tokens (1.2 x its prompt's predicted longest member, from the history). It leaves the engine
through `Engine.extract` as a `Continuation` (prompt, tokens, log-probs, each token's policy version). The
worker's next training share adopts it first (`carried`): re-prefilled, it decodes on with the same keyed draws,
so on the same weights its tokens are the ones it would have drawn; after a weight update its new tokens are
the new version's, recorded so. Unless `max_staleness` forbids it: then it runs again from scratch (a fresh
request with the same id) on the share's weights. Carried requests are not deferred again: every request ends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rhymerl.engine.sequence import Continuation, Status
from rhymerl.histopipe.deferral import continues, tail_size, threshold
from rhymerl.rollout.types import RolloutGroup


class TailDeferral:
    """One share's deferral: `check(engine)` between its steps; the continuations it took in `deferred`.
    `predict_longest(prompt_ids, size)`: the prompt's predicted longest member (the worker's predictor)."""

    def __init__(self, groups: Sequence[RolloutGroup], predict_longest: Callable[[list[int], int], float]):
        self.groups = list(groups)
        self.group_of = {rid: k for k, g in enumerate(self.groups) for rid in g.request_ids}
        self.tails = [tail_size(len(g.request_ids)) for g in self.groups]
        self._thresholds: dict[int, float] = {}
        self._predict_longest = predict_longest
        self.deferred: list[Continuation] = []
        self._deferred_in: dict[int, int] = {}  # group -> its requests deferred so far

    def threshold(self, k: int) -> float:
        if k not in self._thresholds:
            g = self.groups[k]
            self._thresholds[k] = threshold(self._predict_longest(g.prompt_ids, len(g.request_ids)))
        return self._thresholds[k]

    def check(self, engine) -> list[Continuation]:
        """At a step boundary: extract every running request of this share in its group's tail past its
        threshold; returns them (also kept in `deferred`)."""
        unfinished = engine.unfinished()
        count: dict[int, int] = dict(self._deferred_in)
        for seq in unfinished:
            k = self.group_of.get(seq.request_id)
            if k is not None:
                count[k] = count.get(k, 0) + 1
        taken = []
        for seq in unfinished:
            k = self.group_of.get(seq.request_id)
            if (k is None or seq.status == Status.WAITING or count[k] > self.tails[k]
                    or len(seq.output_ids) <= self.threshold(k)):
                continue
            taken.append(engine.extract(seq.request_id))
            self._deferred_in[k] = self._deferred_in.get(k, 0) + 1
        self.deferred += taken
        return taken


def carried(carry: Sequence[Continuation], train_version: int,
            max_staleness: int) -> tuple[list[Continuation], list[Continuation]]:
    """The continuations a share's previous share deferred, split into those that continue and those that run
    again from scratch: a continuation continues when its oldest token, trained by the step that trains from
    `train_version`, stays within `max_staleness` versions (`histopipe.deferral.continues`)."""
    keep, rerun = [], []
    for c in carry:
        oldest = min(c.versions) if c.versions else train_version
        (keep if continues(oldest, train_version, max_staleness) else rerun).append(c)
    return keep, rerun
