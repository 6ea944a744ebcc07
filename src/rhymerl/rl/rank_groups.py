"""Which ranks run a multi-rank update (`train.world_size` > 1; docs/design.md, section 4): torchrun's
processes when this process is torchrun's rank 0 (`rl/torchrun.py`), Ray actors of the rollout's cluster with
`rollout.backend=ray` (`rl/ray_ranks.py`), else processes of this machine (`rl/ranks.py`). Each is a
`RankDriver`: the loop holds it in place of a `PolicyTrainer`."""

from __future__ import annotations

import sys

from rhymerl.config import TrainSection
from rhymerl.model.decoder import Decoder
from rhymerl.rl import torchrun
from rhymerl.rl.ranks import RankDriver, RankGroup


def rank_group(rollout_backend: str, model: Decoder, cfg: TrainSection, *args, **kw) -> RankDriver:
    """The driver's side of `cfg.world_size` ranks (said on stderr); the other arguments are `RankGroup`'s."""
    where = "torchrun's processes" if torchrun.launched() else "Ray actors" if rollout_backend == "ray" else \
        "processes of this machine"
    print(f"[update] {cfg.world_size} ranks ({cfg.strategy}) as {where}", file=sys.stderr)
    if torchrun.launched():
        return torchrun.TorchrunGroup(model, cfg, *args, **kw)
    if rollout_backend == "ray":
        from rhymerl.rl.ray_ranks import RayRankGroup  # the Ray backend's import, where it is chosen
        return RayRankGroup(model, cfg, *args, **kw)
    return RankGroup(model, cfg, *args, **kw)
