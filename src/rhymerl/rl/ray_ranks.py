"""The update's ranks as Ray actors (`train.world_size` > 1 with `rollout.backend=ray`): `RayRankGroup`, a
`RankDriver` (`rl/ranks.py`) over `world_size` `RankActor`s of the cluster the rollout pool uses. Each actor
is one `Rank` (`rl/rank.py`): the same maths as the local processes, only started and reached through Ray.

- **Placement**: on CUDA one GPU per rank (`num_gpus=1`; Ray sets the actor's visible device), and the
  cluster must hold world_size GPUs beside the rollout workers' (refused otherwise: Ray would wait forever).
  On a CPU a rank reserves no logical CPU (the rollout workers hold them all, and in sync mode the update
  and the rollout take turns) and runs the cluster's CPUs / world_size torch threads: one CPU share each.
- **Rendezvous** (as verl's and Ray Train's worker groups do it): rank 0's actor reports its node's address
  and a port free there; every actor then joins torch.distributed's group at that address (gloo on a CPU,
  NCCL on CUDA), so the ranks may sit on different nodes.
- **Weights**: every actor reads the starting weights from one object in the store; after each update rank
  0 returns the full weights with its answer (no shared memory with the driver) and the driver copies them
  into its model, which the rollout pool then puts in the store once for its workers, as with one process.
- **Faults**: an actor that dies (SIGKILL, a lost node) fails its call with `RayActorError`; its peers fail
  in, or block on, their next collective. The driver names the dead rank, kills every rank actor and raises
  `RankFailure` (one line); the checkpoint the run last wrote stays as it was.
"""

from __future__ import annotations

import os

import ray
import torch
from ray.exceptions import RayActorError, RayTaskError

from rhymerl.config import TrainSection
from rhymerl.errors import UserError
from rhymerl.model.decoder import Decoder
from rhymerl.process import setup_process
from rhymerl.rl.rank import Rank, RankSpec, backend
from rhymerl.rl.ranks import GRACE_S, RankDriver, free_port, rank_spec
from rhymerl.rl.sharding import init_group
from rhymerl.rollout.types import first_line


@ray.remote
class RankActor:
    """One rank in a Ray worker process: `address` (rank 0), then `start` on every rank at once (they meet
    in the rendezvous), then `call` per command."""

    def __init__(self):
        self.rank: Rank | None = None

    def pid(self) -> int:
        return os.getpid()

    def address(self) -> tuple[str, int]:
        """This node's address and a port free on it: where the group meets when this actor is rank 0."""
        host = ray.util.get_node_ip_address()
        return host, free_port("")

    def start(self, rank: int, spec: RankSpec, addr: str, port: int) -> None:
        cuda = torch.cuda.is_available()  # Ray made this actor's one GPU its only visible one
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(spec.threads)
        setup_process(spec.seed, device.type)
        init_group(backend(device), rank, spec.world_size, addr, port)
        self.rank = Rank(rank, spec, device)

    def call(self, command: str, payload=None):
        return self.rank.answer(command, payload)


class RayRankGroup(RankDriver):
    """`world_size` `RankActor`s on the connected Ray cluster (the rollout pool's: build the pool first).
    Arguments as `RankGroup`'s. Call `close` when done."""

    def __init__(self, model: Decoder, cfg: TrainSection, temperature: float, max_completion_length: int,
                 ref_model: Decoder | None = None, dtype: str | None = None, tis_imp_ratio_cap: float = 0.0,
                 seed: int = 0, count_comm: bool = False):
        self.model, n = model, cfg.world_size
        resources = ray.cluster_resources()
        cuda = next(model.parameters()).device.type == "cuda"
        if cuda and resources.get("GPU", 0) < n:
            raise UserError(f"train.world_size={n}: each rank of the update on CUDA takes a GPU of the Ray cluster, "
                            f"which has {resources.get('GPU', 0):g} (Ray would wait for more forever)")
        threads = max(1, int(resources.get("CPU", 1)) // n)
        spec = rank_spec(model, cfg, temperature, max_completion_length, ref_model, dtype, tis_imp_ratio_cap, seed,
                         count_comm, threads, mirror=False)
        spec_ref = ray.put(spec)  # the starting weights in the store once, for every rank
        self._actors = [RankActor.options(num_cpus=0, num_gpus=int(cuda)).remote() for _ in range(n)]
        self._pids = [None] * n
        self._pids = self._wait([a.pid.remote() for a in self._actors], "start")
        addr, port = self._wait([self._actors[0].address.remote()], "start")[0]
        self._wait([a.start.remote(r, spec_ref, addr, port) for r, a in enumerate(self._actors)], "start")

    def rank_pids(self) -> list[int]:
        return list(self._pids)

    def _call(self, command: str, payload=None):
        """Send `command` to every rank (the payload put in the store once) and wait for all; rank 0's answer."""
        payload = ray.put(payload)
        return self._wait([a.call.remote(command, payload) for a in self._actors], command)[0]

    def _wait(self, refs: list, command: str) -> list:
        """The answers to `refs` (ref r: rank r's call), in rank order. A rank whose actor died, or whose call
        raised, stops the group (`RankFailure`)."""
        rank_of = {ref: r for r, ref in enumerate(refs)}
        answers, pending = [None] * len(refs), list(refs)
        while pending:
            (ref,), pending = ray.wait(pending, num_returns=1)
            try:
                answers[rank_of[ref]] = ray.get(ref)
            except RayActorError:
                self._fail(self._death(rank_of[ref], command))
            except RayTaskError as e:  # a peer's death surfaces in the survivors as a failed collective
                dead = self._dead_among(pending, rank_of, command)
                cause = getattr(e, "cause", None) or e
                self._fail(dead or f"rank {rank_of[ref]} of the update failed during '{command}': "
                                   f"{type(cause).__name__}: {first_line(cause)}")
        return answers

    def _dead_among(self, pending: list, rank_of: dict, command: str) -> str:
        """The death of a rank among `pending`'s that shows within GRACE_S ('' if none)."""
        done, _ = ray.wait(pending, num_returns=len(pending), timeout=GRACE_S)
        for ref in done:
            try:
                ray.get(ref)
            except RayActorError:
                return self._death(rank_of[ref], command)
            except RayTaskError:
                pass
        return ""

    def _death(self, rank: int, command: str) -> str:
        pid = f", pid {self._pids[rank]}" if self._pids[rank] else ""
        return f"rank {rank} of the update (Ray actor{pid}) died during '{command}'"

    def close(self) -> None:
        """Stop the rank actors (killed: a rank may be blocked in a collective whose peer is gone)."""
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        self._actors = []
