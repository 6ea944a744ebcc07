"""Groups whose requests come back over several steps (`rollout.defer_tail`; docs/design.md, section 4).

A deferred request comes back with the next step's rollout, so its group is complete only then: the loop
trains a group at the step where its last request comes back, beside that step's own complete groups. Without
deferral every group is complete at its own step and `take` gives the step's groups in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rhymerl.engine.sequence import RequestOutput
from rhymerl.rollout import RolloutGroup, RolloutResult


class GroupAssembly:
    """The groups still waiting for a deferred request (`waiting`), and `take`, a step's complete groups."""

    def __init__(self):
        self.waiting: list[tuple[Any, RolloutGroup, dict]] = []  # (prompt, group, its outputs so far by id)

    def take(self, prompts: Sequence[Any], groups: Sequence[RolloutGroup],
             result: RolloutResult) -> tuple[list[Any], list[list[RequestOutput]]]:
        """This step's `prompts` and their `groups` (request ids) against its `result`: the prompts and the
        outputs (siblings in order) of every group complete now, the earlier steps' first; a group with a
        request deferred waits. An output of no group known here is an error (each request comes back once)."""
        by_id = {o.request_id: o for o in result.outputs}
        if len(by_id) != len(result.outputs):
            raise RuntimeError("rollout: a request came back twice (each request must come back once)")
        self.waiting += [(p, g, {}) for p, g in zip(prompts, groups)]
        ready_prompts, ready_outputs, still = [], [], []
        for prompt, group, have in self.waiting:
            have.update((rid, by_id.pop(rid)) for rid in group.request_ids if rid in by_id)
            if len(have) == len(group.request_ids):
                ready_prompts.append(prompt)
                ready_outputs.append([have[rid] for rid in group.request_ids])
            else:
                still.append((prompt, group, have))
        if by_id:
            raise RuntimeError(f"rollout: requests {sorted(map(str, by_id))[:3]} belong to no group in flight")
        self.waiting = still
        return ready_prompts, ready_outputs
