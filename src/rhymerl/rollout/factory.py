"""The one place that chooses a rollout backend (`rollout.backend`, `rollout.num_workers`, `ray.address`).

Ray is imported only where the Ray backend is chosen (`ray_pool`, `ray_call`, `ray_actor` and `ray_stream` are
the only modules that import it), so a local run, `generate`, `report` and the benches that need no Ray work
where ray is missing or broken.
"""

from __future__ import annotations

import os
import socket

from rhymerl.cost_model import CostModel
from rhymerl.errors import UserError
from rhymerl.history import HistoryStore
from rhymerl.model.decoder import Decoder
from rhymerl.rollout.local import LocalPool
from rhymerl.rollout.types import RolloutPool
from rhymerl.rollout.worker import RolloutWorker, WorkerConfig


def check_ray_address(address: str, timeout_s: float = 3.0) -> None:
    """UserError, in one line, when `ray.address` is host:port (or ray://host:port) and nothing accepts a
    connection there within `timeout_s`: `ray.init` would retry for minutes, printing a screen of warnings,
    before it gave up. '' (a fresh local cluster) and 'auto' (Ray finds it) are left to Ray."""
    if address in ("", "auto"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else (str(e) or type(e).__name__)
        raise UserError(f"ray.address={address}: no Ray cluster answers at {host}:{port} ({why}); start one "
                        f"there with `ray start --head --port={port}`, or set ray.address='' for a fresh local "
                        f"one") from None


def make_pool(config: WorkerConfig, ray_address: str, policy: Decoder, tokenizer, model_dir: str | os.PathLike,
              history: HistoryStore, *, seed: int = 0, device: str = "cpu",
              cost_model: CostModel | None = None) -> RolloutPool:
    """The pool of rollout workers the rollout section (`config.rollout`) asks for: `backend` 'local' (one
    worker in this process) or 'ray' (`num_workers` Ray actors, on the cluster `ray_address` names, '' = a
    fresh local one). Each worker is built from `config` and starts from `policy`'s weights (version 0);
    `history` is the truth the pool ships slices of. Workers that fail (a Ray actor that dies, a local worker
    whose rollout raises) are restarted up to `max_worker_restarts` times; `worker_timeout_s` > 0 makes an
    unanswering Ray worker a failure. `schedule` (with `tier2`) splits each call's groups among the Ray workers
    and `migration` (by `migration_rule`) moves requests to idle ones in the tail; one local worker has
    nothing to split.

    `policy` must be the plain Decoder, before LoRA adapters are added to it (the loop calls this before
    `add_lora`): each worker copies its modules and parameter names, and `load_weights` later sends it
    `merged_parameters`, under those plain names. ValueError for a policy with adapters."""
    adapted = next((n for n, _ in policy.named_parameters() if "lora_" in n or "base_layer" in n), None)
    if adapted is not None:
        raise ValueError(f"make_pool needs the plain policy, before add_lora: it has the LoRA parameter {adapted!r} "
                         f"(the rollout workers copy the policy's modules and take merged weights by plain names)")
    r = config.rollout
    if r.backend == "local":  # one worker: the section refuses num_workers > 1 with it (`WorkerConfig`)
        return LocalPool(RolloutWorker(policy, tokenizer, config, cost_model=cost_model), history,
                         max_restarts=r.max_worker_restarts)
    if r.backend == "ray":
        from rhymerl.rollout import ray_pool  # the optional backend's import, where it is chosen

        check_ray_address(ray_address)
        try:
            ray_pool.connect(ray_address)
        except ConnectionError as e:  # e.g. 'auto' with no cluster running on this machine
            raise UserError(f"ray.address={ray_address}: {str(e).splitlines()[0]}; start the cluster with "
                            f"`ray start --head`, or set ray.address='' for a fresh local one") from None
        return ray_pool.RayPool(policy, tokenizer, model_dir, config, history, r.num_workers, seed=seed,
                                device=device, cost_model=cost_model, timeout_s=r.worker_timeout_s or None,
                                max_restarts=r.max_worker_restarts, schedule=r.schedule, migration=r.migration,
                                migration_rule=r.migration_rule, tier2=r.tier2)
    raise ValueError(f"unknown rollout backend {r.backend!r} (local or ray)")


def make_stream(pool: RolloutPool, max_staleness: int = 1):
    """`rollout.stream`: a `ray_stream.RayStream` over a Ray pool's workers (the stream needs the Ray backend:
    the config's rules refuse it otherwise); `max_staleness`: `rollout.max_staleness`, for deferred requests."""
    from rhymerl.rollout import ray_stream  # the optional backend's import, where it is chosen

    return ray_stream.RayStream(pool, max_staleness)
