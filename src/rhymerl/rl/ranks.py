"""The update on several ranks (`train.world_size` > 1), the driver's side: `RankDriver`, what the driver
holds in place of a `PolicyTrainer` whichever way the ranks were started, and `RankGroup`, ranks as local
processes (the others: Ray actors, `rl/ray_ranks.py`; torchrun's processes, `rl/torchrun.py`; which one
runs: `rl/rank_groups.py`). What each rank does is `rl/rank.py`.

The driver keeps the rollout pool, the history and its own copy of the policy (the mirror: what the pool
loads and checkpoints save). `RankGroup` starts N processes of this machine (spawned; gloo on a CPU, NCCL
on CUDA, one GPU per rank) that build the policy from the mirror, wrap it (`rl/sharding.py`) and each run a
`PolicyTrainer` on its share of every batch. Per step the driver sends each rank the whole batch; after the
optimizer step the ranks gather the full weights once and rank 0 writes them into the mirror (shared
memory), so the loop's weight sync and checkpoints read the mirror as they read the single-process model.

A rank that dies (killed, out of memory) leaves the others blocked in a collective: the driver, which polls
the ranks while it waits, stops them all and raises `RankFailure` naming the rank; the checkpoint the
run last wrote stays as it was (the driver writes checkpoints, after the ranks answered).
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import time
import traceback

import torch
import torch.multiprocessing as mp

from rhymerl.config import TrainSection
from rhymerl.errors import UserError
from rhymerl.model.decoder import Decoder
from rhymerl.process import setup_process
from rhymerl.rl.logprobs import Sample
from rhymerl.rl.rank import Rank, RankSpec, backend
from rhymerl.rl.sharding import process_group

_POLL_S = 0.5  # how often the driver looks for a dead rank while it waits
GRACE_S = 2.0  # how long a rank's failure waits for a peer's death to show (the likelier cause)


class RankFailure(UserError):
    """A rank of the update died or failed: the run stops (the message names it and says how to go on)."""


def rank_spec(model: Decoder, cfg: TrainSection, temperature: float, max_completion_length: int,
              ref_model: Decoder | None, dtype: str | None, tis_imp_ratio_cap: float, seed: int, count_comm: bool,
              threads: int, mirror: bool) -> RankSpec:
    """What every rank builds itself from: the model's weights in shared memory where `mirror` (its own
    tensors on a CPU, else CPU copies), else detached CPU tensors."""
    weights = _shared(model) if mirror else _on_cpu(model)
    ref = None if ref_model is None else _shared(ref_model) if mirror else _on_cpu(ref_model)
    return RankSpec(cfg.world_size, cfg.strategy, seed, model.cfg, weights, ref, cfg,
                    {"temperature": temperature, "max_completion_length": max_completion_length, "dtype": dtype,
                     "tis_imp_ratio_cap": tis_imp_ratio_cap}, threads, count_comm, mirror)


class RankDriver:
    """`PolicyTrainer`'s interface (`update`, `state_dict`, `load_state_dict`) over ranks; after `update`
    returns, `model` (the driver's copy) holds the new weights. A launcher provides `_call` (send a command to
    every rank, return rank 0's answer) and `close`."""

    model: Decoder
    _mirror: dict[str, torch.Tensor] | None = None  # shared memory rank 0 writes into (local processes)

    def update(self, samples: list[Sample]) -> dict[str, float]:
        """One `PolicyTrainer.update` over the ranks; returns rank 0's metrics (reduced over ranks)."""
        metrics, weights = self._call("update", samples)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                source = weights[name] if weights else self._mirror[name]
                if p.data_ptr() != source.data_ptr():  # (a CPU model is its own mirror: written already)
                    p.copy_(source)
        return metrics

    def state_dict(self) -> dict:
        return self._call("state_dict")

    def load_state_dict(self, state: dict) -> None:
        self._call("load_state_dict", state)

    def _call(self, command: str, payload=None):
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def _fail(self, what: str):
        self.close()
        raise RankFailure(f"{what}; the run stopped, its last checkpoint is intact: continue it with "
                          f"`rhymerl train --resume RUN_DIR`")


class RankGroup(RankDriver):
    """The ranks as `world_size` processes of this machine, spawned (see the module doc). Call `close` when
    done."""

    def __init__(self, model: Decoder, cfg: TrainSection, temperature: float, max_completion_length: int,
                 ref_model: Decoder | None = None, dtype: str | None = None, tis_imp_ratio_cap: float = 0.0,
                 seed: int = 0, count_comm: bool = False):
        if torch.cuda.is_available() and torch.cuda.device_count() < cfg.world_size:
            raise UserError(f"train.world_size={cfg.world_size}: this machine has {torch.cuda.device_count()} GPUs "
                            f"(one rank a GPU)")
        self.model = model
        threads = max(1, len(os.sched_getaffinity(0)) // cfg.world_size)  # the ranks share this machine's cores
        spec = rank_spec(model, cfg, temperature, max_completion_length, ref_model, dtype, tis_imp_ratio_cap, seed,
                         count_comm, threads, mirror=True)
        self._mirror = spec.weights
        ctx = mp.get_context("spawn")
        self._inboxes = [ctx.Queue() for _ in range(cfg.world_size)]
        self._outbox = ctx.Queue()
        port = free_port()
        self._procs = [ctx.Process(target=_rank_main, args=(r, spec, port, self._inboxes[r], self._outbox),
                                   name=f"rhymerl-rank{r}", daemon=True) for r in range(cfg.world_size)]
        for p in self._procs:
            p.start()
        self._call("ready")

    def rank_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _call(self, command: str, payload=None):
        """Send `command` to every rank and wait for all of them; rank 0's answer."""
        for box in self._inboxes:
            box.put((command, payload))
        answers = {}
        while len(answers) < len(self._procs):
            try:
                rank, ok, value = self._outbox.get(timeout=_POLL_S)
            except queue.Empty:
                if self._died():
                    self._fail(self._died(command))
                continue
            if not ok:  # a peer's death surfaces in the survivors as a failed collective: name the dead one
                deadline = time.monotonic() + GRACE_S
                while not self._died() and time.monotonic() < deadline:
                    time.sleep(0.05)
                self._fail(self._died(command) or f"rank {rank} of the update failed during '{command}': {value}")
            answers[rank] = value
        return answers[0]

    def _died(self, command: str = "") -> str:
        """What happened to the first rank that exited on its own ('' while none has)."""
        for r, p in enumerate(self._procs):
            if p.exitcode not in (None, 0):
                return f"rank {r} of the update (pid {p.pid}) died ({_exit_reason(p.exitcode)}) during '{command}'"
        return ""

    def close(self) -> None:
        """Stop the ranks (politely when they are idle; a rank stuck in a collective is killed)."""
        for p, box in zip(self._procs, self._inboxes):
            if p.exitcode is None:
                box.put(("stop", None))
        for p in self._procs:
            p.join(timeout=5)
            if p.exitcode is None:
                os.kill(p.pid, signal.SIGKILL)
                p.join()
        self._procs = [p for p in self._procs if p.exitcode is None]

    def __del__(self):  # a run that never reached `close` (built, then abandoned)
        if getattr(self, "_procs", None):
            try:
                self.close()
            except (OSError, ValueError):  # queues already closed at interpreter exit: the ranks are daemons
                pass


def _shared(model: Decoder) -> dict[str, torch.Tensor]:
    """The model's parameters by name in shared memory: its own on a CPU (moved there in place), else copies."""
    if all(p.device.type == "cpu" for p in model.parameters()):
        model.share_memory()
        return {n: p.data for n, p in model.named_parameters()}
    return {n: p.detach().to("cpu", copy=True).share_memory_() for n, p in model.named_parameters()}


def _on_cpu(model: Decoder) -> dict[str, torch.Tensor]:
    """The model's parameters by name, detached, on a CPU (copies where they are elsewhere)."""
    return {n: p.detach().cpu() for n, p in model.named_parameters()}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (for a rendezvous about to start there)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _exit_reason(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def _rank_main(rank: int, spec: RankSpec, port: int, inbox, outbox) -> None:
    """One rank: build the wrapped policy and its trainer, then answer the driver's commands until 'stop'."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(spec.threads)
    setup_process(spec.seed, device.type)
    code = 1
    try:
        _serve(rank, spec, port, device, inbox, outbox)
        code = 0
    except BaseException:  # e.g. the rendezvous failed: said to the driver, which stops the others
        outbox.put((rank, False, traceback.format_exc().strip().splitlines()[-1]))
    finally:
        # Flushed, then out without the interpreter's teardown, which took seconds here after every
        # rank had returned (the driver would wait for it, then kill)
        outbox.close()
        outbox.join_thread()
        os._exit(code)


def _serve(rank: int, spec: RankSpec, port: int, device: torch.device, inbox, outbox) -> None:
    with process_group(backend(device), rank, spec.world_size, "127.0.0.1", port):
        try:
            me = Rank(rank, spec, device)
        except Exception:
            outbox.put((rank, False, traceback.format_exc(limit=4).strip().splitlines()[-1]))
            return
        while True:
            command, payload = inbox.get()
            if command == "stop":
                return
            try:
                outbox.put((rank, True, None if command == "ready" else me.answer(command, payload)))
            except Exception:
                outbox.put((rank, False, traceback.format_exc().strip().splitlines()[-1]))
                return
