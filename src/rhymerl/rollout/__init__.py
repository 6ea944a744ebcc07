"""Rollout: the only thing the RL loop calls to generate (docs/design.md, section 5).

A pool of rollout workers behind one interface (`RolloutPool`):

- `rollout(groups, params) -> RolloutResult`: each group's responses, plus each worker's stats;
- `load_weights(params, version)`: the policy's new weights, version-checked by every later rollout;
- `record(prompt_ids, responses, rewards)`: the scored rollout into the history store, the truth the pool
  ships to its workers (a slice per call, `HistoryStore.export` / `merge`: never a shared reference).

`LocalPool` (one in-process worker, `rollout.backend=local`) is the default; `ray_pool.RayPool` (one Ray actor
per worker, `rollout.backend=ray`) implements the same interface. `factory.make_pool` chooses between them; it
and `ray_pool` are not imported here, so that importing this package does not import ray.
"""

from rhymerl.engine.sampling_params import SamplingParams  # what a rollout call takes, re-exported for the loop
from rhymerl.rollout.local import LocalPool
from rhymerl.rollout.types import RolloutGroup, RolloutPool, RolloutResult, StaleWeightsError, WorkerStats
from rhymerl.rollout.worker import RolloutWorker, WorkerConfig

__all__ = ["LocalPool", "RolloutGroup", "RolloutPool", "RolloutResult", "RolloutWorker", "SamplingParams", "StaleWeightsError",
           "WorkerConfig", "WorkerStats"]
