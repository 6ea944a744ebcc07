"""One rank of a multi-rank update (`train.world_size` > 1), whichever way it was started: a local process
(`rl/ranks.py`), a Ray actor (`rl/ray_ranks.py`) or a torchrun process (`rl/torchrun.py`). Each launcher only
starts the process, joins torch.distributed's group and carries commands; what a rank is and does is here,
once: `RankSpec`, what it builds itself from, and `Rank`, the wrapped policy (`rl/sharding.py`) with its
`PolicyTrainer`, answering the driver's commands ('update', 'state_dict', 'load_state_dict').

After each update every rank joins the gather of the full weights; rank 0 then either writes them into the
driver's shared-memory copy (`RankSpec.mirror`: local processes on the driver's machine) or returns them with
its answer (Ray actors, torchrun: ranks that may share no memory with the driver).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rhymerl.config import TrainSection
from rhymerl.model.decoder import Decoder
from rhymerl.process import deterministic_algorithms, release_freed_memory
from rhymerl.rl.sharding import CommCounter, Sharding
from rhymerl.rl.trainer import PolicyTrainer

COMMANDS = ("update", "state_dict", "load_state_dict")


@dataclass
class RankSpec:
    """What a rank builds itself from (picklable; for local processes the tensors travel as shared memory)."""

    world_size: int
    strategy: str
    seed: int
    model_cfg: object
    weights: dict[str, torch.Tensor]  # the driver's policy weights at the start
    ref: dict[str, torch.Tensor] | None  # the reference model's (train.beta > 0)
    train: TrainSection
    trainer_kw: dict  # PolicyTrainer's other arguments (temperature, max_completion_length, dtype, ...)
    threads: int  # torch threads of a rank on a CPU: the machine's cores shared among the ranks on it
    count_comm: bool  # `CommCounter` in every rank; each update's answer then carries rank 0's bytes
    mirror: bool  # `weights` is the driver's shared memory, which rank 0 writes each update's weights into


def backend(device: torch.device) -> str:
    """torch.distributed's backend for ranks on `device`: NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device.type == "cuda" else "gloo"


class Rank:
    """One rank's policy and trainer, built inside an initialised default process group; `answer` runs a
    command, which every rank of the group must run in the same order (they meet in its collectives)."""

    def __init__(self, rank: int, spec: RankSpec, device: torch.device):
        self.rank, self.spec = rank, spec
        self.sharding = Sharding(spec.strategy, rank, spec.world_size, device)
        model = _from_weights(spec.model_cfg, spec.weights, device).train()
        ref = _from_weights(spec.model_cfg, spec.ref, device).eval().requires_grad_(False) if spec.ref else None
        model, ref = self.sharding.wrap(model, ref)
        self.trainer = PolicyTrainer(model, spec.train, ref_model=ref, sharding=self.sharding, **spec.trainer_kw)
        self.counter = CommCounter() if spec.count_comm else None
        if self.counter:
            self.counter.install(model)

    def answer(self, command: str, payload=None):
        """'update' -> (metrics, weights): rank 0's metrics (reduced over ranks), and the full weights where
        rank 0 returns them (else {}); 'state_dict' -> the full trainer state on rank 0 (None elsewhere);
        'load_state_dict' -> None."""
        if command == "update":
            with deterministic_algorithms():
                metrics = self.trainer.update(payload)
            full = self.sharding.full_params(self.trainer.model)  # every rank joins; rank 0 holds the result
            if self.counter:  # the update's collectives, then the weights' gather (FSDP: DTensor's own, unseen)
                metrics = metrics | {f"comm_bytes/{k}": v for k, v in self.counter.take().items()}
            if self.spec.mirror:
                with torch.no_grad():
                    for name, value in full.items():
                        self.spec.weights[name].copy_(value)
                full = {}
            else:  # to travel to the driver (Ray's store, or the driver's own process under torchrun)
                full = {name: value.cpu() for name, value in full.items()}
            release_freed_memory()
            return metrics, full
        if command == "state_dict":
            state = self.trainer.state_dict()
            return state if self.rank == 0 else None
        if command == "load_state_dict":
            self.trainer.load_state_dict(payload)
            return None
        raise ValueError(f"unknown command {command!r}; a rank answers {COMMANDS}")


def _from_weights(cfg, weights: dict[str, torch.Tensor], device: torch.device) -> Decoder:
    model = Decoder(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])
    return model.to(device)
