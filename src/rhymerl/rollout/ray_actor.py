"""The Ray actor behind `RayPool` (`rollout.backend=ray`): one `RolloutWorker` in a process of its own. One of
the Ray backend's modules (with `ray_pool` and `ray_call`, which drive the actors, and `ray_stream`); no other
module of rhymerl imports ray.

- **Start-up**: an actor gets the model directory (the architecture), the `WorkerConfig`, the run's seed and
  device, its torch thread count (`worker_resources`: its share of the CPU cores; Ray sets OMP threads to 1,
  and N workers must not oversubscribe the cores; on CUDA each actor takes one GPU), and the initial weights
  through the object store. It calls `setup_process` first.
- **Weights**: the driver puts them in the object store as numpy arrays (`to_store`), once per version, and
  every actor reads that one object in place (`_from_store`), copying it into its model.
"""

from __future__ import annotations

import math
import os
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import ray
import torch

from rhymerl.cost_model import CostModel
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.engine.sequence import Continuation, RequestOutput
from rhymerl.model.pretrained import parse_dtype
from rhymerl.model.weights import load_decoder
from rhymerl.process import setup_process
from rhymerl.rollout.types import RolloutGroup, WorkerStats
from rhymerl.rollout.worker import RolloutWorker, WorkerConfig

__all__ = ["WorkerActor", "to_store", "worker_resources"]


def worker_resources(num_workers: int, device: str, cluster_cpus: float) -> tuple[float, int, int]:
    """(CPUs reserved per actor, GPUs per actor, torch threads per actor): the cluster's CPUs divided among
    the workers (Ray takes fractions only below 1), one GPU each on CUDA."""
    share = cluster_cpus / num_workers
    cpus = float(math.floor(share)) if share >= 1 else share
    return cpus, int(torch.device(device).type == "cuda"), max(1, math.floor(share))


def to_store(params: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, np.ndarray]:
    """The weights as the object store should hold them: on the CPU in the workers' dtype, as numpy arrays
    (bf16 as int16). Ray stores numpy arrays without pickling them and an actor reads them in place
    (`_from_store`), where torch tensors are pickled and copied at both ends."""
    out = {}
    for name, p in params.items():
        t = p.detach().to("cpu", dtype).contiguous()
        out[name] = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
    return out


def _from_store(weights: dict[str, np.ndarray], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Tensors over the arrays `to_store` made (read-only views of the object store, no copy: the worker
    copies them into its model)."""
    with warnings.catch_warnings():  # torch warns that the arrays are not writable: they are only read
        warnings.simplefilter("ignore", UserWarning)
        return {name: torch.from_numpy(a).view(dtype) for name, a in weights.items()}


# `hand_over` runs in a concurrency group of its own, beside a running `rollout` (the default group keeps one
# thread: a worker's rollouts and weight loads never overlap). Ray then runs every method on a thread of its
# own, and __init__ on yet another. Each thread that enters an OpenMP region gets a thread pool of its own, and
# once libgomp manages more threads than there are cores it stops spinning at barriers: a bf16 matmul took
# 2.3x as long, a rollout 1.5x (docs/notebook). So all of the worker's compute runs
# on one thread, `_compute`, and the process keeps one OpenMP pool. `hand_over` computes nothing (it sets a
# flag the rollout honours between engine steps).
#
# `stream_rollout` runs in a group of its own too: Ray does not keep a threaded actor's calls in submission
# order, and a stream's share of step t+1 once ran before its share of step t (each step of a run then waited for
# two shares). Each share carries its place in the worker's queue (`seq`), and a share enters the compute thread
# only after the one before it has (`_stream_turn`); its group has threads enough for the shares a stream keeps
# in flight on one worker (two steps and a validation).
@ray.remote(concurrency_groups={"handover": 1, "stream": 4})
class WorkerActor:
    """A rollout worker in its own process: the `RolloutWorker` it wraps, built on the model directory's
    architecture with the weights it is sent."""

    def __init__(self, model_dir: str, tokenizer, config: WorkerConfig, worker_id: int, seed: int, device: str,
                 threads: int, weights: dict[str, np.ndarray], version: int, cost_model: CostModel | None):
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="rollout-worker")
        self._stream_turn, self._stream_next = threading.Condition(), 0  # the next `stream_rollout` seq to enter

        def build() -> RolloutWorker:
            setup_process(seed, device)
            torch.set_num_threads(threads)
            # fp32 as the driver's policy; the worker copies it into its rollout dtype, then takes the weights
            worker = RolloutWorker(load_decoder(model_dir, torch.float32, device), tokenizer, config, worker_id,
                                   cost_model=cost_model)
            worker.load_weights(_from_store(weights, parse_dtype(config.rollout.dtype)), version)
            return worker

        self.worker = self._compute.submit(build).result()

    def _on_compute(self, fn, *args):
        """fn(*args) on the compute thread (see above); its exception raises here."""
        return self._compute.submit(fn, *args).result()

    def pid(self) -> int:
        return os.getpid()

    def threads(self) -> int:
        return self._on_compute(torch.get_num_threads)

    def load_weights(self, weights: dict[str, np.ndarray], version: int) -> int:
        self._on_compute(self.worker.load_weights, _from_store(weights, parse_dtype(self.worker.config.rollout.dtype)),
                         version)
        return version

    def rollout(self, groups: list[RolloutGroup], params: SamplingParams, history: dict,
                weights_version: int, step: int | None = None,
                continuations: list[Continuation] = (), early: bool = False) -> tuple[list[RequestOutput], WorkerStats]:
        return self._on_compute(lambda: self.worker.rollout(groups, params, history, weights_version, step,
                                                            continuations, early=early))

    @ray.method(concurrency_group="stream", num_returns=2)
    def stream_rollout(self, seq: int, weights: dict[str, np.ndarray] | None, version: int,
                       groups: list[RolloutGroup], params: SamplingParams, history: dict,
                       step: int | None, defer: bool = False, max_staleness: int = 1,
                       *carry: list[Continuation]
                       ) -> tuple[tuple[list[RequestOutput], WorkerStats], list[Continuation]]:
        """`RayStream`'s share: load weights `version` first if this worker holds another (the share carries
        them, so it runs right where the worker's previous share ended, and a share run again after a failure
        or out of order still gets its own version), then roll out. `weights` None: the version the pool
        started its workers on (the worker refuses the share if it holds another). `seq`: the share's place in
        this actor's queue (0, 1, ...): shares enter the compute thread in that order (see above).
        `rollout.defer_tail`: `defer`, `max_staleness` as in `RolloutWorker.rollout`, and `carry`, the lists of
        what earlier shares deferred, run first (each a top-level argument, so Ray resolves it); the second return
        is what the share deferred (its own object: the worker's next training share takes it as its `carry`)."""
        def run():
            if self.worker.weights_version != version and weights is not None:
                self.worker.load_weights(_from_store(weights, parse_dtype(self.worker.config.rollout.dtype)), version)
            out = self.worker.rollout(groups, params, history, version, step, carry=[c for cs in carry for c in cs],
                                      defer=defer,
                                      max_staleness=max_staleness)
            return out, out[1].deferred
        with self._stream_turn:
            self._stream_turn.wait_for(lambda: self._stream_next == seq)
            done = self._compute.submit(run)  # the compute thread runs its queue in order
            self._stream_next += 1
            self._stream_turn.notify_all()
        return done.result()

    @ray.method(concurrency_group="handover")
    def hand_over(self, n: int | None = None, rule: str = "half_busiest", timeout: float | None = 60.0,
                  receiver_version: int | None = None) -> list[Continuation]:
        """`RolloutWorker.hand_over`: rule "tail" waits (up to `timeout`, None: the rollout's end) for a request
        that qualifies; `receiver_version`: the weights version the receiving worker holds (rule "remaining"
        prices its load when it is not this worker's; None: the same)."""
        return self.worker.hand_over(n, timeout, rule, receiver_version=receiver_version)

    def spec_state(self) -> dict | None:
        return self._on_compute(self.worker.spec_state)

    def load_spec_state(self, state: dict | None) -> None:
        self._on_compute(self.worker.load_spec_state, state)
