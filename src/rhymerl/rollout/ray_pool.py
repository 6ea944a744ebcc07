"""The Ray rollout pool (`rollout.backend=ray`): one Ray actor per worker (`ray_actor.WorkerActor`), each a
`RolloutWorker` in a process of its own; `ray_call.RayCall` drives one call (shares, faults, migration).
Only the Ray backend (this module, `ray_call`, `ray_actor`, `ray_stream`) imports ray.

- **Cluster**: `connect(address)`: '' starts a fresh local cluster (`ray.init(address="local")`, never a
  stray one that happens to run), 'auto' or 'host:port' joins a running one (`ray start --head`). A process
  already connected (a test's cluster) keeps its connection.
- **Workers**: each actor gets its share of the cluster's CPUs (`worker_resources`; one GPU each on CUDA:
  more workers than GPUs are refused, Ray would wait forever) and what it needs to build its worker.
  HistoSpec's cost model is the pool's when given; else the first worker measures one at start-up and every
  other worker (a replacement too) starts with it: workers that measured their own under each other's load
  got models 2x apart and drafted differently, so a prompt's tokens per forward depended on its worker
  (docs/design.md, section 4, Pricing). Each worker still corrects its copy online against its own steps.
- **Weights**: `load_weights` puts them in the object store once (cast to the rollout dtype, on the CPU) and
  every worker loads that one object; a worker refuses a rollout on any other version than the one it holds
  (`StaleWeightsError`, raised through Ray).
- **History**: the pool's `history` is the truth (the loop's, checkpointed). Each call sends a worker the
  slice its prompts need (`HistoryStore.export`), which it merges into its replica; `record` writes to the
  truth only. No reference is shared across processes.
- **Faults**, as in `local.py`: a worker whose rollout raises (out of memory, say: its engine's state is
  then unknown), whose actor dies or which does not answer within `timeout_s` is replaced by a fresh actor on
  the current weights, and its groups of the call run again there: keyed randomness makes them the same
  tokens. A worker that fails more than `max_restarts` times is dropped and its groups go to the others; the
  call fails (`WorkersFailed`, one line) only when no worker is left. `StaleWeightsError` is raised at once.
- **Split** (`rollout.schedule`): `histopipe.plan.plan`, the planner the simulator runs too:
  `static` (equal contiguous shares), `least_loaded` (request counts balanced) or `histopipe` (each request's
  predicted length from the pool's history, `LengthPredictor.predict_group`, costed with the cost model the
  pool was given or the workers measured, else `DEFAULT_PLAN_COST`). Under HistoSpec (`pricing="replayed"`,
  the default) a request is priced in predicted forwards, its predicted tokens over its prompt's tokens per
  forward replayed from its recorded tokens (`ReplayedRates`: no timing in it, so the same history and cost
  model give the same plan), and a step at a full batch's cost (`histopipe.pricing`); "measured" takes the
  rates the pool's last calls ran at (`TokensPerForward`), "tokens" plans on tokens and `cost(n, n)`. A GRPO group stays whole, except under
  `histopipe` with `rollout.tier2`: `plan.plan_pieces` (the simulator's planner) may cut a long group into
  pieces on several workers; a piece is sent as a group of its request ids, its siblings drafting from each
  other on their worker. Each worker's list is its admission order. Keyed randomness (seed, request id,
  position) makes the tokens the same under every schedule, split or not.
- **Migration** (`rollout.migration`, `rollout.migration_rule`; `ray_call.RayCall` drives it): when a worker
  has finished its shares while another still runs one (the step's tail), the driver asks a busy one to hand
  over requests at a step boundary (`RolloutWorker.hand_over`) and sends them to the idle one, which
  re-prefills prompt + generated tokens and decodes on with the same keyed draws. `half_busiest`: half of the
  busiest worker's unfinished requests (waiting ones first, then those furthest past their prediction).
  `tail` (the paper's rule, `histopipe.fleet`): one running request in its group's tail grown past 1.2x its
  group's predicted longest member, asked of the busiest worker and taken at the first boundary where one
  qualifies. `remaining` (`histopipe.rebalance`): from the worker with the most predicted tokens left, its
  requests with the most left while the move pays. `remaining+early`: that, with the siblings' early warning
  (`histopipe.early_warning`): each worker holds its share back from its engine and admits one member of each
  group first, then waiting siblings whose running or finished siblings passed their prediction, renewed
  (`rollout/early_queue.py`); the call tells its workers so (`RayCall.send`).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Sequence

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from rhymerl.cost_model import CostModel
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.histopipe.plan import SCHEDULES, plan_pieces
from rhymerl.histopipe.pieces import Piece
from rhymerl.histopipe.predict import LengthPredictor
from rhymerl.histopipe.pricing import ReplayedRates, TokensPerForward, speculative_step_cost
from rhymerl.history import HistoryStore
from rhymerl.model.decoder import Decoder
from rhymerl.model.pretrained import parse_dtype
# The actor moved to ray_actor; WorkerActor and worker_resources stay importable from here.
from rhymerl.rollout.ray_actor import WorkerActor, to_store, worker_resources
from rhymerl.rollout.ray_call import RayCall
from rhymerl.errors import UserError
from rhymerl.rollout.types import RolloutGroup, RolloutResult, WorkersFailed, WorkerStats
from rhymerl.rollout.handover import HANDOVER_RULES
from rhymerl.rollout.worker import WorkerConfig


def connect(address: str = "") -> None:
    """Connect this process to Ray (`ray.address`): '' = start a fresh local cluster for this process,
    'auto' / 'host:port' = join a running one. Nothing when this process is already connected."""
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address)
    else:  # no dashboard: it costs a process and CPU, and the plain `ray` package lacks its dependencies
        ray.init(address="local", include_dashboard=False)


# The plan's cost model when the pool has none and its workers measured none (speculation off): a step of 64
# sequences costing 3x one of 1, the shape of a small model on a few CPU cores. Only its shape matters to the
# plan: how much a step slows with the sequences it runs.
DEFAULT_PLAN_COST = CostModel([1, 64], [1, 2], [[0.010, 0.011], [0.030, 0.050]])


def _last_line(error: Exception) -> str:
    """The last line of `error`'s message: for an actor whose constructor raised, Ray's message ends with that
    exception (type and message) after its traceback."""
    lines = str(error).strip().splitlines()
    return lines[-1].strip() if lines else type(error).__name__


class RayPool:
    """`RolloutPool` over `num_workers` Ray actors (see the module doc). `policy`: the model whose weights the
    workers start from (version 0), `model_dir` its architecture; `timeout_s`: how long a worker's share of a
    call may take before the worker counts as dead (None: no limit); `max_restarts`: replacements of one
    worker, after which it is dropped and the others take its groups; `schedule` (one of SCHEDULES) splits each
    call's groups (`tier2`: histopipe may split a long group), `migration` moves requests to idle workers in the
    tail by `migration_rule` (one of HANDOVER_RULES; see the module doc). Call `connect` first."""

    def __init__(self, policy: Decoder, tokenizer, model_dir: str | os.PathLike, config: WorkerConfig,
                 history: HistoryStore, num_workers: int, seed: int = 0, device: str = "cpu",
                 cost_model: CostModel | None = None, timeout_s: float | None = None, max_restarts: int = 3,
                 schedule: str = "static", migration: bool = False, migration_rule: str = "half_busiest",
                 tier2: bool = False):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if migration_rule not in HANDOVER_RULES:
            raise ValueError(f"migration_rule must be one of {HANDOVER_RULES}, got {migration_rule!r}")
        self.schedule, self.migration, self.migration_rule, self.tier2 = schedule, migration, migration_rule, tier2
        self.migrations = 0  # requests moved between workers so far (each counted once)
        self.pricing = "replayed"  # histopipe's unit of work under HistoSpec: "replayed", "measured" or "tokens"
        self.rates = TokensPerForward()  # each prompt's tokens per forward in the calls so far (`rollout`)
        self.replayed = ReplayedRates(config.rollout.max_draft_tokens)  # ... from its recorded tokens (split)
        self.history = history
        self.config = config
        self.timeout_s = timeout_s or None
        self.max_restarts = max_restarts
        self.weights_version = 0
        self.restarts = [0] * num_workers  # replacements of each worker so far
        resources = ray.cluster_resources()
        cpus, gpus, self.threads = worker_resources(num_workers, device, resources.get("CPU", 1.0))
        if gpus and resources.get("GPU", 0) < num_workers * gpus:
            raise UserError(f"rollout.num_workers={num_workers}: each rollout worker on CUDA takes a GPU, and the "
                            f"Ray cluster has {resources.get('GPU', 0):g} (Ray would wait for more forever): set "
                            f"rollout.num_workers to at most that, or add GPU nodes to the cluster")
        self._dtype = parse_dtype(config.rollout.dtype)
        self._weights = self._put({name: p for name, p in policy.named_parameters()})
        self._new_actor = WorkerActor.options(num_cpus=cpus, num_gpus=gpus).remote
        self._args = (str(model_dir), ray.put(tokenizer), config, seed, device, self.threads)
        self._cost_model = cost_model
        self._measured_cost: CostModel | None = None  # the first worker's, for the others and the plan
        self.actors = {}  # the live workers, by id
        if cost_model is None and config.rollout.speculative != "off" and num_workers > 1:
            self.actors[0] = self._spawn(0)  # it measures; the others start with its model (module doc)
            self._measured_cost = self._asked_cost(self.actors[0])
        self.actors |= {w: self._spawn(w) for w in range(num_workers) if w not in self.actors}
        self.pids = dict(zip(self.actors, ray.get([a.pid.remote() for a in self.actors.values()])))  # built

    @property
    def workers(self) -> list[int]:
        """The ids of the live workers (a dropped worker's id is not reused)."""
        return list(self.actors)

    @property
    def weights_ref(self) -> ray.ObjectRef:
        """The weights of `weights_version` in the object store (what a fresh actor starts from)."""
        return self._weights

    def _put(self, params: dict[str, torch.Tensor]) -> ray.ObjectRef:
        """The weights in the object store, once, as the actors read them (`ray_actor.to_store`)."""
        return ray.put(to_store(params, self._dtype))

    def _spawn(self, worker: int):
        model_dir, tokenizer, config, seed, device, threads = self._args
        return self._new_actor(model_dir, tokenizer, config, worker, seed, device, threads, self._weights,
                               self.weights_version, self._cost_model or self._measured_cost)

    def replace_worker(self, worker: int, why: str) -> bool:
        """After `worker` failed: a fresh actor for it on the current weights (its history replica refills from
        the next slice it is sent; True), or, past `max_restarts`, drop it (False). A fresh actor that fails to
        start counts as one more failure. RuntimeError when no worker is left."""
        ray.kill(self.actors[worker], no_restart=True)
        while self.restarts[worker] < self.max_restarts:
            self.restarts[worker] += 1
            print(f"[rollout] worker {worker} {why}: restarting it ({self.restarts[worker]}/{self.max_restarts}, "
                  f"rollout.max_worker_restarts) and running its requests again", file=sys.stderr)
            self.actors[worker] = self._spawn(worker)
            try:
                self.pids[worker] = ray.get(self.actors[worker].pid.remote())
                return True
            except RayActorError as e:  # its constructor raised (this once escaped the pool)
                why = f"failed to restart ({_last_line(e)})"
                ray.kill(self.actors[worker], no_restart=True)
        del self.actors[worker], self.pids[worker]
        if not self.actors:  # one error, not chained to Ray's (raised while handling it): `why` says what it was
            raise WorkersFailed(f"rollout worker {worker} {why} after {self.max_restarts} restarts "
                                f"(rollout.max_worker_restarts) and no rollout worker is left") from None
        print(f"[rollout] worker {worker} {why} after {self.max_restarts} restarts (rollout.max_worker_restarts): "
              f"dropped; {len(self.actors)} workers go on", file=sys.stderr)
        return False

    def rollout(self, groups: Sequence[RolloutGroup], params: SamplingParams, step: int | None = None) -> RolloutResult:
        started = time.time()  # the call's wall interval: the timeline's origin and the bubble ratio's span
        groups = list(groups)
        call = RayCall(self, params, step)
        for share, w in zip(self.shares(groups, params.max_tokens), self.workers):
            if share:
                call.send(call.add_share(share, []), w)
        done = call.run()
        # A request comes back once; twice only when a worker that handed some over failed afterwards and its
        # share ran again: the same tokens (keyed randomness), so either copy will do.
        by_id = {o.request_id: o for k in sorted(done) for o in done[k][0]}
        missing = [rid for g in groups for rid in g.request_ids if rid not in by_id]
        if missing:
            raise RuntimeError(f"rollout: requests {missing[:3]} came back from no worker (every request of a "
                               f"call must come back once)")
        outputs = [by_id[rid] for g in groups for rid in g.request_ids]
        self.rates.observe(outputs)
        ran = {stats.worker for _, stats in done.values()}
        stats = [done[k][1] for k in sorted(done)] + [WorkerStats(w) for w in self.actors if w not in ran]
        return RolloutResult(outputs, stats, self.weights_version, started=started, finished=time.time())

    def split(self, groups: list[RolloutGroup], num_workers: int, cap: int | None = None) -> list[list[Piece]]:
        """Each live worker's pieces (group index, its request indices), in admission order, under
        `self.schedule` (a whole group is one piece of all its requests; `tier2`: histopipe may cut a long
        group). `cap`: the call's max_tokens, where a recorded length was cut (the predictor takes it as a
        lower bound, as the worker's admission order and `histopipe/rank_corr` do)."""
        sizes = [len(g.request_ids) for g in groups]
        if self.schedule != "histopipe":
            return plan_pieces(sizes, num_workers, self.schedule)
        predictor = LengthPredictor.from_history(self.history, [g.prompt_ids for g in groups], cap=cap)
        predicted = [predictor.predict_group(g.prompt_ids, n) for g, n in zip(groups, sizes)]
        slots, cost = self.config.rollout.num_slots, self._plan_cost()
        if self.pricing != "tokens" and self.config.rollout.speculative != "off":  # histopipe.pricing
            prompts = [g.prompt_ids for g in groups]
            rates = (self.replayed.rates(self.history, prompts, cost, slots) if self.pricing == "replayed"
                     else [self.rates.rate(p) for p in prompts])
            predicted = [[n / r for n in p] for p, r in zip(predicted, rates)]
            cost = speculative_step_cost(cost, slots, True)
        return plan_pieces(sizes, num_workers, "histopipe", predicted, cost, slots=slots, tier2=self.tier2)

    def shares(self, groups: list[RolloutGroup], cap: int | None = None) -> list[list[RolloutGroup]]:
        """Each live worker's share of `groups` (`split`), in worker-id order: a piece as a group of its
        request ids."""
        return [[RolloutGroup(groups[g].prompt_ids, [groups[g].request_ids[i] for i in idx]) for g, idx in share]
                for share in self.split(groups, len(self.actors), cap)]

    def _plan_cost(self) -> CostModel:
        """The cost model `histopipe` plans with: the pool's, else the one the workers measured at start-up
        (HistoSpec's, asked of one worker once), else `DEFAULT_PLAN_COST`."""
        if self._cost_model is None and self._measured_cost is None and self.config.rollout.speculative != "off":
            self._measured_cost = self._asked_cost(next(iter(self.actors.values())))
        return self._cost_model or self._measured_cost or DEFAULT_PLAN_COST

    def _asked_cost(self, actor) -> CostModel | None:
        """The cost model `actor`'s speculator holds (None when it does not answer or holds none)."""
        try:
            state = ray.get(actor.spec_state.remote(), timeout=self.timeout_s)
        except (RayActorError, GetTimeoutError):
            return None
        return CostModel.from_dict(state["cost"]) if state and "cost" in state else None

    def load_weights(self, params: dict[str, torch.Tensor], version: int) -> None:
        self._weights, self.weights_version = self._put(params), version  # kept: a replaced worker starts from them
        refs = {w: a.load_weights.remote(self._weights, version) for w, a in self.actors.items()}
        for w, ref in refs.items():
            try:
                ray.get(ref, timeout=self.timeout_s)
            except (RayActorError, RayTaskError, GetTimeoutError) as e:  # a fresh actor starts on these weights
                self.replace_worker(w, f"failed to load weights version {version} ({type(e).__name__})")

    def record(self, prompt_ids: list[int], responses: list[list[int]],
               rewards: list[float | None] | None = None) -> None:
        self.history.record_rollout(prompt_ids, responses, rewards)

    def spec_state(self) -> list[dict | None]:
        """Each live worker's HistoSpec state (`RolloutWorker.spec_state`), in worker-id order; None for a
        worker that does not answer (it re-learns after a resume)."""
        out = []
        for a in self.actors.values():
            try:
                out.append(ray.get(a.spec_state.remote(), timeout=self.timeout_s))
            except (RayActorError, GetTimeoutError):
                out.append(None)
        return out

    def load_spec_state(self, states: list[dict | None]) -> None:
        """Restore `spec_state`'s list on a resume: the i-th live worker takes entry i (modulo its length,
        when the worker count changed). A worker restarted later starts from the first saved cost model and
        re-learns the rest."""
        if not states:
            return
        first = next((s for s in states if s is not None and "cost" in s), None)
        if first is not None:
            self._cost_model = CostModel.from_dict(first["cost"])
        refs = [a.load_spec_state.remote(states[i % len(states)]) for i, a in enumerate(self.actors.values())]
        ray.get(refs, timeout=self.timeout_s)

    def close(self) -> None:
        """End the workers' actors (the cluster itself ends with the process that started it)."""
        for a in self.actors.values():
            ray.kill(a, no_restart=True)
        self.actors = {}
