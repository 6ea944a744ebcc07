"""The Ray rollout pool (`rollout.backend=ray`): one Ray actor per worker, each a `RolloutWorker` in a process
of its own. The only module of rhymerl that imports ray.

- **Cluster**: `connect(address)`: '' starts a fresh local cluster (`ray.init(address="local")`, never a
  stray one that happens to run), 'auto' or 'host:port' joins a running one (`ray start --head`). A process
  already connected (a test's cluster) keeps its connection.
- **Workers**: each actor gets the model directory (the architecture), the `WorkerConfig`, the run's seed and
  device, its share of the CPU cores as its torch thread count (Ray sets OMP threads to 1, and N workers must
  not oversubscribe the cores; on CUDA each actor takes one GPU), and the initial weights through the object
  store. It calls `setup_process` first.
- **Weights**: `load_weights` puts them in the object store once (cast to the rollout dtype, on the CPU) and
  every worker loads that one object; a worker refuses a rollout on any other version than the one it holds
  (`StaleWeightsError`, raised through Ray).
- **History**: the pool's `history` is the truth (the loop's, checkpointed). Each call sends a worker the
  slice its prompts need (`HistoryStore.export`), which it merges into its replica; `record` writes to the
  truth only. No reference is shared across processes.
- **Faults**: a worker whose actor dies (killed, out of memory) or does not answer within `timeout_s` is
  replaced by a fresh actor on the current weights, and its groups of the call run again there: keyed
  randomness makes them the same tokens. After `max_restarts` replacements of one worker the call fails.
- **Split**: `static_split` (equal contiguous shares, in order); HistoPipe's length-aware schedule plugs in
  there.
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Sequence

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError

from rhymerl.cost_model import CostModel
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.engine.sequence import RequestOutput
from rhymerl.history import HistoryStore
from rhymerl.model.decoder import Decoder
from rhymerl.model.pretrained import parse_dtype
from rhymerl.model.weights import load_decoder
from rhymerl.process import setup_process
from rhymerl.rollout.types import RolloutGroup, RolloutResult, WorkerStats
from rhymerl.rollout.worker import RolloutWorker, WorkerConfig


def connect(address: str = "") -> None:
    """Connect this process to Ray (`ray.address`): '' = start a fresh local cluster for this process,
    'auto' / 'host:port' = join a running one. Nothing when this process is already connected."""
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address)
    else:  # no dashboard: it costs a process and CPU, and the plain `ray` package lacks its dependencies
        ray.init(address="local", include_dashboard=False)


def static_split(num_groups: int, num_workers: int) -> list[range]:
    """Which groups each worker rolls out: equal contiguous shares in order, the first `num_groups %
    num_workers` workers one group more. (HistoPipe's length-aware schedule replaces this.)"""
    base, extra = divmod(num_groups, num_workers)
    shares, start = [], 0
    for w in range(num_workers):
        size = base + (w < extra)
        shares.append(range(start, start + size))
        start += size
    return shares


def worker_resources(num_workers: int, device: str, cluster_cpus: float) -> tuple[float, int, int]:
    """(CPUs reserved per actor, GPUs per actor, torch threads per actor): the cluster's CPUs divided among
    the workers (Ray takes fractions only below 1), one GPU each on CUDA."""
    share = cluster_cpus / num_workers
    cpus = float(math.floor(share)) if share >= 1 else share
    return cpus, int(torch.device(device).type == "cuda"), max(1, math.floor(share))


@ray.remote
class WorkerActor:
    """A rollout worker in its own process: the `RolloutWorker` it wraps, built on the model directory's
    architecture with the weights it is sent."""

    def __init__(self, model_dir: str, tokenizer, config: WorkerConfig, worker_id: int, seed: int, device: str,
                 threads: int, weights: dict[str, torch.Tensor], version: int, cost_model: CostModel | None):
        setup_process(seed, device)
        torch.set_num_threads(threads)
        # fp32 as the driver's policy; the worker copies it into its rollout dtype, then takes the weights
        self.worker = RolloutWorker(load_decoder(model_dir, torch.float32, device), tokenizer, config, worker_id,
                                    cost_model=cost_model)
        self.worker.load_weights(weights, version)

    def pid(self) -> int:
        return os.getpid()

    def threads(self) -> int:
        return torch.get_num_threads()

    def load_weights(self, weights: dict[str, torch.Tensor], version: int) -> int:
        self.worker.load_weights(weights, version)
        return version

    def rollout(self, groups: list[RolloutGroup], params: SamplingParams, history: dict,
                weights_version: int) -> tuple[list[RequestOutput], WorkerStats]:
        return self.worker.rollout(groups, params, history, weights_version)


class RayPool:
    """`RolloutPool` over `num_workers` Ray actors (see the module doc). `policy`: the model whose weights the
    workers start from (version 0), `model_dir` its architecture; `timeout_s`: how long a worker's share of a
    call may take before the worker counts as dead (None: no limit); `max_restarts`: replacements of one
    worker before a call fails. Call `connect` first."""

    def __init__(self, policy: Decoder, tokenizer, model_dir: str | os.PathLike, config: WorkerConfig,
                 history: HistoryStore, num_workers: int, seed: int = 0, device: str = "cpu",
                 cost_model: CostModel | None = None, timeout_s: float | None = None, max_restarts: int = 3):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.history = history
        self.config = config
        self.timeout_s = timeout_s
        self.max_restarts = max_restarts
        self.weights_version = 0
        self.restarts = [0] * num_workers  # replacements of each worker so far
        self._dtype = parse_dtype(config.dtype)
        self._weights = self._put({name: p for name, p in policy.named_parameters()})
        cpus, gpus, self.threads = worker_resources(num_workers, device, ray.cluster_resources().get("CPU", 1.0))
        self._new_actor = WorkerActor.options(num_cpus=cpus, num_gpus=gpus).remote
        self._args = (str(model_dir), ray.put(tokenizer), config, seed, device, self.threads)
        self._cost_model = cost_model
        self.actors = [self._spawn(w) for w in range(num_workers)]
        self.pids = ray.get([a.pid.remote() for a in self.actors])  # built (and their cost models measured)

    @property
    def num_workers(self) -> int:
        return len(self.actors)

    def _put(self, params: dict[str, torch.Tensor]) -> ray.ObjectRef:
        """The weights in the object store, once, on the CPU in the workers' dtype."""
        return ray.put({name: p.detach().to("cpu", self._dtype) for name, p in params.items()})

    def _spawn(self, worker: int):
        model_dir, tokenizer, config, seed, device, threads = self._args
        return self._new_actor(model_dir, tokenizer, config, worker, seed, device, threads, self._weights,
                               self.weights_version, self._cost_model)

    def _replace(self, worker: int, why: str) -> None:
        """A fresh actor for `worker` on the current weights (its history replica refills from the next
        slice it is sent), or RuntimeError past `max_restarts`."""
        if self.restarts[worker] >= self.max_restarts:
            raise RuntimeError(f"rollout worker {worker} failed ({why}) after {self.max_restarts} restarts "
                               f"(rollout.max_worker_restarts); giving up")
        self.restarts[worker] += 1
        print(f"[rollout] worker {worker} {why}: restarting it ({self.restarts[worker]}/{self.max_restarts}) "
              f"and running its requests again", file=sys.stderr)
        ray.kill(self.actors[worker], no_restart=True)
        self.actors[worker] = self._spawn(worker)
        self.pids[worker] = ray.get(self.actors[worker].pid.remote())

    def rollout(self, groups: Sequence[RolloutGroup], params: SamplingParams) -> RolloutResult:
        groups = list(groups)
        shares = [[groups[i] for i in share] for share in static_split(len(groups), self.num_workers)]
        slices = [self.history.export(g.prompt_ids for g in share) for share in shares]

        def send(w: int):
            return self.actors[w].rollout.remote(shares[w], params, slices[w], self.weights_version)

        pending = {w: send(w) for w in range(self.num_workers) if shares[w]}
        done: dict[int, tuple[list[RequestOutput], WorkerStats]] = {}
        deadline = {w: time.monotonic() + self.timeout_s for w in pending} if self.timeout_s else {}
        while pending:
            ready, _ = ray.wait(list(pending.values()), num_returns=1,
                                timeout=None if not deadline else max(0.0, min(deadline.values()) - time.monotonic()))
            for w in [w for w, ref in pending.items() if ref in ready]:
                try:
                    done[w] = ray.get(pending.pop(w))
                except RayActorError as e:
                    self._replace(w, f"died ({type(e).__name__})")
                    pending[w] = send(w)
                    if self.timeout_s:
                        deadline[w] = time.monotonic() + self.timeout_s
            now = time.monotonic()
            for w in [w for w in pending if deadline and deadline[w] <= now]:
                self._replace(w, f"did not answer within {self.timeout_s:g}s")
                pending[w] = send(w)
                deadline[w] = time.monotonic() + self.timeout_s
        outputs = [o for w in range(self.num_workers) if w in done for o in done[w][0]]
        stats = [done[w][1] if w in done else WorkerStats(w) for w in range(self.num_workers)]
        return RolloutResult(outputs, stats, self.weights_version)

    def load_weights(self, params: dict[str, torch.Tensor], version: int) -> None:
        self._weights, self.weights_version = self._put(params), version  # kept: a replaced worker starts from them
        refs = [a.load_weights.remote(self._weights, version) for a in self.actors]
        for w, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=self.timeout_s)
            except (RayActorError, GetTimeoutError) as e:  # a fresh actor starts on these weights
                self._replace(w, f"failed to load weights version {version} ({type(e).__name__})")

    def record(self, prompt_ids: list[int], responses: list[list[int]],
               rewards: list[float | None] | None = None) -> None:
        self.history.record_rollout(prompt_ids, responses, rewards)

    def close(self) -> None:
        """End the workers' actors (the cluster itself ends with the process that started it)."""
        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors = []
