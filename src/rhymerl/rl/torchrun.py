"""The update's ranks under torchrun: `torchrun --nproc_per_node N -m rhymerl.cli train train.world_size=N ...`
starts N copies of `rhymerl train`. Torchrun's rank 0 is the driver (rollout pool, history, checkpoints, as in a
plain run) and, in the same process, rank 0 of the update (`TorchrunGroup`); ranks 1..N-1 only serve the
update (`serve`, which `rhymerl train` runs in their place before it builds anything). Every rank is the same
`Rank` (`rl/rank.py`) as the local processes and Ray actors: the same maths.

- **Rendezvous**: torchrun's environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE; `env://`), one GPU
  per rank on CUDA (cuda:LOCAL_RANK), gloo between CPU processes. `train.world_size` must equal torchrun's
  number of processes (refused otherwise, in one line: the config says what runs).
- **Commands**: rank 0 broadcasts the starting weights once, then each (command, batch) over a gloo group
  (`broadcast_object_list`); every rank runs it, and rank 0's answer carries the full weights, which the
  driver copies into its own model (the rollout pool's and the checkpoints' source).
- **Threads**: torchrun gives each process OMP_NUM_THREADS=1 unless it is set; set it to the cores per process.
- **Faults**: a rank that dies fails rank 0's next collective (gloo: the connection closes): `RankFailure`,
  one line, the last checkpoint intact; torchrun then stops the other processes and names the failed one in
  its own summary. On NCCL a dead peer may instead block rank 0 until NCCL's timeout.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from rhymerl.config import TrainSection
from rhymerl.errors import UserError
from rhymerl.model.decoder import Decoder
from rhymerl.process import setup_process
from rhymerl.rl.rank import Rank, backend
from rhymerl.rl.ranks import RankDriver, rank_spec
from rhymerl.rl.sharding import init_group
from rhymerl.rollout.types import first_line


def launched() -> bool:
    """Whether this process is one of a group of torchrun processes (torchrun's environment)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


def is_worker() -> bool:
    """Whether this process is torchrun's rank 1..N-1: an update rank only (`serve`)."""
    return launched() and int(os.environ["RANK"]) != 0


def serve() -> int:
    """Ranks 1..N-1: join the group, build this rank from the spec rank 0 broadcasts, then run rank 0's
    commands until 'stop'. Returns the exit code."""
    rank, world, device = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), _device()
    init_group(backend(device), rank, world)
    try:
        commands = dist.new_group(backend="gloo")
        spec = _receive(commands)
        setup_process(spec.seed, device.type)
        me = Rank(rank, spec, device)
        while True:
            command, payload = _receive(commands)
            if command == "stop":
                return 0
            me.answer(command, payload)
    finally:
        dist.destroy_process_group()


class TorchrunGroup(RankDriver):
    """The driver's side under torchrun, in rank 0's process: rank 0 of the update runs here, the others in
    torchrun's other processes (see the module doc). Arguments as `RankGroup`'s. Call `close` when done."""

    def __init__(self, model: Decoder, cfg: TrainSection, temperature: float, max_completion_length: int,
                 ref_model: Decoder | None = None, dtype: str | None = None, tis_imp_ratio_cap: float = 0.0,
                 seed: int = 0, count_comm: bool = False):
        world = int(os.environ["WORLD_SIZE"])
        if cfg.world_size != world:
            raise UserError(f"train.world_size={cfg.world_size} under torchrun with {world} processes: set "
                            f"train.world_size={world} (each torchrun process is a rank of the update)")
        self.model, self._open = model, False
        device = _device()
        init_group(backend(device), 0, world)
        self._open = True
        self._commands = dist.new_group(backend="gloo")
        spec = rank_spec(model, cfg, temperature, max_completion_length, ref_model, dtype, tis_imp_ratio_cap, seed,
                         count_comm, torch.get_num_threads(), mirror=False)
        self._guarded("start", lambda: _send(self._commands, spec))
        self._rank = self._guarded("start", lambda: Rank(0, spec, device))

    def _call(self, command: str, payload=None):
        self._guarded(command, lambda: _send(self._commands, (command, payload)))
        return self._guarded(command, lambda: self._rank.answer(command, payload))

    def _guarded(self, command: str, fn):
        try:
            return fn()
        except RuntimeError as e:  # gloo's error when a peer is gone (torchrun names it once it stops them)
            self._broken = True
            self._fail(f"a rank of the update failed during '{command}' under torchrun "
                       f"({type(e).__name__}: {first_line(e)})")

    def close(self) -> None:
        """Tell the other ranks to stop (unless the group broke), then leave the group."""
        if not self._open:
            return
        self._open = False
        if not getattr(self, "_broken", False):
            _send(self._commands, ("stop", None))
        dist.destroy_process_group()


def _device() -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


def _send(group, obj) -> None:
    dist.broadcast_object_list([obj], src=0, group=group)


def _receive(group):
    box = [None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]
