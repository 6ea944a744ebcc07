"""A rollout worker: one engine, its HistoSpec state and the history replica it drafts from."""

from __future__ import annotations

import copy
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import torch

from rhymerl.config import RolloutSection
from rhymerl.cost_model import CostModel
from rhymerl.engine.engine import Engine
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.engine.sequence import Continuation, RequestOutput
from rhymerl.histopipe.deferral import GROW, TAIL_SHARE
from rhymerl.histopipe.plan import admission_order
from rhymerl.histopipe.predict import LengthPredictor
from rhymerl.histospec.speculator import Speculator
from rhymerl.history import HistoryStore
from rhymerl.model.decoder import Decoder
from rhymerl.model.pretrained import parse_dtype
from rhymerl.rollout.deferral import TailDeferral, carried
from rhymerl.rollout.early_queue import EarlyQueue
from rhymerl.rollout.handover import HandoverRequest, half_busiest_picks, remaining_picks, tail_picks
from rhymerl.rollout.types import RequestSpan, RolloutGroup, StaleWeightsError, WorkerStats


@dataclass
class WorkerConfig:
    """What a worker is built with (plain data: a worker in another process gets a copy). `rollout`: the
    rollout section, the one owner of every rollout option (its default, choices and range:
    `config/sections.py`), with its machine defaults resolved (`rl/run_settings.resolve_machine_defaults`);
    the worker reads its options from there and builds its engine and `Speculator` from them.
    `max_model_len`: a sequence's context, a prompt plus the longest completion (no single key sets it:
    `rl/run_settings.worker_config` derives it)."""

    rollout: RolloutSection
    max_model_len: int

    def __post_init__(self):
        r, errors = self.rollout, self.rollout.validate()
        if r.dtype not in ("bf16", "fp32"):  # "auto" names no dtype: the run resolves it for its machine
            errors.append(f"rollout.dtype: must be resolved to 'bf16' or 'fp32' before a worker is built, got "
                          f"{r.dtype!r} (rl/run_settings.resolve_machine_defaults)")
        if r.speculative == "histospec" and r.max_draft_tokens < 1:  # 0 = "by the machine", resolved likewise
            errors.append(f"rollout.max_draft_tokens: must be resolved to >= 1 before a HistoSpec worker is "
                          f"built, got {r.max_draft_tokens} (rl/run_settings.resolve_machine_defaults)")
        if self.max_model_len < 2:
            errors.append(f"max_model_len: must be >= 2 (a prompt token and a completion token), got "
                          f"{self.max_model_len}")
        if errors:
            raise ValueError("; ".join(errors))


class RolloutWorker:
    """Rolls out groups on its own copy of the policy. `policy`: the model whose weights it starts from
    (copied, in `rollout.dtype`); `cost_model`: the step-cost model of HistoSpec and of rule "remaining" (`cost`)."""

    def __init__(self, policy: Decoder, tokenizer, config: WorkerConfig, worker_id: int = 0,
                 cost_model: CostModel | None = None):
        self.worker_id = worker_id
        self.config = config
        self.tokenizer = tokenizer
        r = config.rollout  # every option below is the rollout section's (config/sections.py)
        self.model = copy.deepcopy(policy).to(parse_dtype(r.dtype)).eval().requires_grad_(False)
        self.history = HistoryStore(max_rollouts=r.history_rollouts)  # a replica of the pool's
        speculator = None
        if r.speculative == "histospec":  # None for the cost model: the engine measures one
            speculator = Speculator(cost_model, self.history, r.draft_rule, r.max_draft_tokens,
                                    reward_weighted=r.reward_aware_drafting)
        self.engine = Engine(self.model, tokenizer, num_slots=r.num_slots, max_model_len=config.max_model_len,
                             speculator=speculator)
        self._cost = cost_model  # `cost`; measured now (no request holds a slot) when a remaining rule needs one
        if r.migration and "remaining" in r.migration_rule and not (cost_model or self.engine.cost_model):
            self._cost = self.engine.measure_cost_model(max_draft_tokens=0)  # plain steps
        self.weights_version, self.load_s = 0, 0.0  # load_s: seconds its last `load_weights` took (a move's load)
        # Migration: another thread's `hand_over` leaves a request here; the thread running
        # `rollout` serves it between two engine steps (`_serve_handover`).
        self._handover_lock = threading.Lock()
        self._handover: HandoverRequest | None = None
        self._generating = False
        # The running call's length predictor, built on first use (the admission order, a hand-over) from the
        # call's prompts: once a call at most, and never for a call that needs none (fifo, no hand-over).
        self._call_prompts: list[list[int]] = []
        self._call_cap: int | None = None  # the call's max_tokens: a recorded length there was cut (censored)
        self._predictor: LengthPredictor | None = None
        # The call's requests that have finished so far, (prompt, length), fed to the predictor as they finish
        # (`LengthPredictor.observe_finished`: a prompt's unfinished siblings are longer than its finished ones;
        # without history, they are the prompt's only evidence), replayed into it when it is built later.
        self._finished: list[tuple[list[int], int]] = []
        self._given: Counter = Counter()  # the call's requests per prompt (a tuple): the tail rule's group size
        self._thresholds: dict[tuple, float] = {}  # the tail rule's threshold per prompt, for the running call
        self._prior: dict = {}  # request id -> the token versions a continuation brought, for the running call
        self._deferral: TailDeferral | None = None  # the running call's (rollout.defer_tail)
        self._early: EarlyQueue | None = None  # the running call's held requests (rule remaining+early)
        self._step_wall = 0.0  # time.time() when the running call's current engine step started
        self._spans: dict = {}  # request id -> [start, end] (time.time()) in the running call

    def admission_order(self, groups: Sequence[RolloutGroup], step: int | None = None) -> list[RolloutGroup]:
        """The order the groups enter the engine's queue (`rollout.admission_order`: "fifo" as given,
        "longest_first" by predicted length from the replica's history, "alternate" shortest first on odd
        steps and longest first on even ones; `step`, the training step number as logged, from 1, picks the
        direction, and a call without one, validation, goes longest first). A group stays together, so that
        its siblings share their prompt's prefill; keyed randomness makes the tokens the same in any order."""
        order = self.config.rollout.admission_order
        if order == "fifo":
            return list(groups)
        predicted = [self.predicted_length(g.prompt_ids) for g in groups]
        if order == "alternate" and step is not None and step % 2 == 1:
            predicted = [-p for p in predicted]  # shortest first (ties still in arrival order)
        return admission_order(list(groups), predicted)

    def predicted_length(self, prompt_ids: list[int]) -> float:
        """The predicted response length of a request of this prompt (one of the running or last call's), from
        the history replica (`LengthPredictor`, over the call's prompts, lengths at the call's max_tokens
        censored: the predictor the pool plans with and `histopipe/rank_corr` reports) and the call's
        requests finished so far (`LengthPredictor.observe_finished`: the unfinished siblings of a prompt are
        longer than its finished ones, and without history they are all there is to go on)."""
        return self._live_predictor().predict(prompt_ids)

    def _live_predictor(self) -> LengthPredictor:
        """The running call's predictor: the replica's history of the call's prompts, and the siblings
        finished so far (`observe_finished`)."""
        if self._predictor is None:
            self._predictor = LengthPredictor.from_history(self.history, self._call_prompts, cap=self._call_cap)
            for prompt, length in self._finished:
                self._predictor.observe_finished(prompt, length)
        return self._predictor

    def _observe(self, event) -> None:
        """An engine step's event (one per running request): the first dates the request's admission to the
        step's start, the last its end; a request that finished informs the prediction of its unfinished
        siblings."""
        self._spans.setdefault(event.request_id, [self._step_wall, 0.0])
        if event.output is not None:
            self._spans[event.request_id][1] = time.time()
        if event.output is not None and event.output.finish_reason != "error":
            self._finished.append((event.output.prompt_ids, len(event.output.token_ids)))
            if self._predictor is not None:
                self._predictor.observe_finished(event.output.prompt_ids, len(event.output.token_ids))
        if event.output is not None and self._early is not None:
            self._early.finished(event.output, self.engine)

    def load_weights(self, params: dict[str, torch.Tensor], version: int) -> None:
        """Copy the trainer's weights (Decoder names, LoRA merged) into this worker's model, casting to its
        dtype. In place (`copy_`), and it must stay so: the engine's CUDA graphs read the parameters' memory
        (a new tensor would leave them reading the old weights), and the CPU backends' weight copies
        (prepacked, tiles: `cpu_weights.ModelWeights.copy`) notice an update only by the parameter's
        `data_ptr` and torch's version counter, which every in-place op bumps (tests/rollout/test_local_pool.py
        checks both)."""
        start = time.perf_counter()
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(params[name])
        self.weights_version = version
        self.load_s = time.perf_counter() - start

    @property
    def cost(self):
        """Rule "remaining"'s cost model: HistoSpec's, else the one given, else measured at start-up, or None."""
        return self.engine.cost_model or self._cost

    def spec_state(self) -> dict | None:
        """HistoSpec's learned state (`Speculator.state_dict`: calibration, cost model and its correction,
        idle counters) as plain data, or None with speculation off."""
        return self.engine.state_dict()

    def load_spec_state(self, state: dict | None) -> None:
        """Restore what `spec_state` returned (a resume); nothing with speculation off or no state."""
        self.engine.load_state_dict(state)

    def rollout(self, groups: Sequence[RolloutGroup], params: SamplingParams, history: dict,
                weights_version: int, step: int | None = None,
                continuations: Sequence[Continuation] = (), carry: Sequence[Continuation] = (),
                defer: bool = False, max_staleness: int = 1,
                early: bool = False) -> tuple[list[RequestOutput], WorkerStats]:
        """Every request of `groups` to completion, after bringing the history replica up to date with
        `history` (a `HistoryStore.export` slice). Refuses weights of another version than `weights_version`.
        `step`: the training step the call rolls out (from 1; None for validation), for the admission order.
        `continuations`: requests another worker handed over (`hand_over`), adopted before the groups; their
        outputs come after the groups'. A request this worker hands over meanwhile has no output here.
        `rollout.defer_tail` (rollout/deferral.py; `step` is then a training step's): `carry`, what this worker's
        previous training share deferred, runs first (continued, or from scratch past `max_staleness`; its
        outputs come last); with `defer`, the share's tail requests are stopped into `stats.deferred`.
        `early`: the siblings' early warning admits the requests (rule remaining+early, rollout/early_queue.py)."""
        if weights_version != self.weights_version:
            raise StaleWeightsError(f"worker {self.worker_id} holds weights version {self.weights_version}, "
                                    f"the rollout asks for version {weights_version}")
        stats = WorkerStats(self.worker_id, started=time.time())
        stats.history_prompts_replaced = self.history.merge(history)
        self._call_prompts = [g.prompt_ids for g in groups] + [c.prompt_ids for c in continuations]
        self._call_cap, self._predictor, self._finished, self._thresholds = params.max_tokens, None, [], {}
        self._given = Counter(tuple(g.prompt_ids) for g in groups for _ in g.request_ids)
        self._given.update(tuple(c.prompt_ids) for c in continuations)
        self.engine.take_stats()  # this call's counters start here
        keep, rerun = carried(carry, (step or 1) - 1, max_staleness)  # training step s trains from version s - 1
        stats.reruns = len(rerun)
        order = self.admission_order(groups, step)
        prompts = [c.prompt_ids for c in rerun] + [g.prompt_ids for g in order for _ in g.request_ids]
        ids = [c.request_id for c in rerun] + [rid for g in order for rid in g.request_ids]
        continuations = list(keep) + list(continuations)  # adopted before the prompts (Engine.generate)
        self._early = EarlyQueue(prompts, ids, params, self.config.rollout.num_slots,
                                 self._live_predictor) if early else None
        if self._early is not None:  # the rest enter the engine as its slots free (`_observe`, `_between_steps`)
            prompts, ids = self._early.start(len(continuations))
        self._deferral = TailDeferral(groups, self._predict_longest) if defer else None
        # Each request's span: from the start of the step that admitted it to the end of its last (`_observe`,
        # `_between_steps`); one that never ran (rejected) from wall0 by the engine's own times.
        wall0 = self._step_wall = time.time()
        self._spans = {}
        # the versions of the tokens a continuation brings (sampled before it came here); its new ones are ours
        self._prior = {c.request_id: self._known_versions(c) for c in continuations}
        by_id = {o.request_id: o for o in self._generate(prompts, params, ids, continuations)}
        while self._early is not None and self._early.held:  # the engine ran dry first (its requests rejected)
            more, more_ids = self._early.start(0)
            by_id.update({o.request_id: o for o in self._generate(more, params, more_ids, [])})
        by_id.update(self._early.outputs if self._early is not None else {})
        given = ([rid for g in groups for rid in g.request_ids] + [c.request_id for c in continuations]
                 + [c.request_id for c in rerun])
        # back in the order given; what was handed over (hand_over) is the adopting worker's to return
        outputs = [by_id[rid] for rid in given if rid in by_id]
        for o in outputs:
            o.versions = self._stamped(o.request_id, len(o.token_ids))
        ran = {o.request_id: self._spans.get(o.request_id, (wall0 + o.queued_s, wall0 + o.total_s)) for o in outputs}
        stats.spans = [RequestSpan(o.request_id, *ran[o.request_id], len(o.token_ids)) for o in outputs]
        stats.requests = len(outputs)
        if self._deferral is not None:
            stats.deferred = self._deferral.deferred
            for c in stats.deferred:
                c.versions = self._stamped(c.request_id, len(c.output_ids))
        stats.engine, stats.spec = self.engine.take_stats()
        stats.finished = time.time()
        return outputs, stats

    def _predict_longest(self, prompt_ids: list[int], size: int) -> float:
        """The predicted longest of a group of `size` requests of this prompt from its history alone (the
        paper's tail rule, migration's and deferral's, measures growth against the history: what siblings
        finished since does not move it), cached for the call."""
        key = (tuple(prompt_ids), size)
        if key not in self._thresholds:
            history = self._live_predictor().copy()  # a copy knows the rollouts, nothing observed this call
            self._thresholds[key] = max(history.predict_group(prompt_ids, size))
        return self._thresholds[key]

    def _known_versions(self, c: Continuation) -> list[int]:
        """A continuation's token versions; one that carries none was sampled on this worker's version (a
        migration within one call: every worker holds the call's version)."""
        return list(c.versions) if len(c.versions) == len(c.output_ids) else [self.weights_version] * len(c.output_ids)

    def _stamped(self, request_id, num_tokens: int) -> list[int]:
        """Each of a request's `num_tokens` tokens' policy version: what it brought, then this worker's."""
        prior = self._prior.get(request_id, [])
        return prior + [self.weights_version] * (num_tokens - len(prior))

    # ---- migration ----------------------------------------------------------------------------------------
    def hand_over(self, n: int | None = None, timeout: float | None = 60.0, rule: str = "half_busiest",
                  tail_share: float = TAIL_SHARE, grow: float = GROW,
                  receiver_version: int | None = None) -> list[Continuation]:
        """Called from another thread while `rollout` runs: at the engine's next step boundary, take up to `n`
        unfinished requests out of it and return them as continuations for another worker to adopt.

        rule "half_busiest" (`rollout.migration_rule`): default n is half of them; it always keeps one.
        Waiting requests go first, from the back of the queue (they would start last, and carry no generated
        tokens to re-prefill), then running ones furthest past their predicted length.
        rule "tail" (the paper's, as `histopipe.fleet` simulates it): only running requests in their group's
        tail (the last `tail_share` of the group's requests on this worker still unfinished) that have grown
        past (1 + `grow`) x the group's predicted longest member (its history's, `predict_group`), furthest
        past first, and only while at least two run (a request alone gains nothing by moving); the request
        waits for the first step boundary where one qualifies (default n 1).
        rule "remaining" (`histopipe.rebalance.pool_moves`, priced as the simulator prices it, on `cost`): the
        requests with the most predicted work left while the move pays, the receiver paying `load_s` (this
        worker's last `load_weights`, measured) when it holds another version (`receiver_version`; None: this
        worker's); "remaining+early" also the requests the call holds back (`EarlyQueue.moves`).
        [] when no rollout runs (it ended meanwhile) or within `timeout` seconds (None: no limit) nothing
        was taken."""
        if rule.startswith("remaining") and self.cost is None:
            raise ValueError(f"worker {self.worker_id}: rule {rule!r} prices moves on a cost model and it has none "
                             f"(give it cost_model=, or set rollout.migration and migration_rule in its config)")
        request = HandoverRequest(n, rule, tail_share, grow, receiver_version)
        with self._handover_lock:
            if not self._generating:
                return []
            self._handover = request
        if not request.done.wait(timeout):
            with self._handover_lock:
                if self._handover is request:  # not picked up: withdrawn
                    self._handover = None
                    return []
            request.done.wait()  # picked up just now: its extraction is under way
        return request.taken

    def _generate(self, prompts: list[list[int]], params: SamplingParams, ids: list,
                  continuations: list[Continuation]) -> list[RequestOutput]:
        """`engine.generate`, serving `hand_over` between its steps."""
        if not prompts and not continuations:
            return []
        with self._handover_lock:
            self._generating = True
        try:
            return self.engine.generate(prompts, params, request_ids=ids, continuations=continuations,
                                        on_event=self._observe, between_steps=self._between_steps)
        finally:
            with self._handover_lock:
                self._generating = False
                request, self._handover = self._handover, None
            if request is not None:  # the call ended before its next step: nothing to hand over
                request.done.set()

    def _between_steps(self) -> None:
        """A step boundary: the next step starts now (the admission time of what it admits); a hand-over
        waiting for a boundary is served; with `rollout.defer_tail`, the share's tail is stopped."""
        self._step_wall = time.time()
        self._serve_handover()
        if self._early is not None:  # slots a hand-over freed
            self._early.feed(self.engine)
        if self._deferral is not None:
            self._deferral.check(self.engine)

    def _serve_handover(self) -> None:
        with self._handover_lock:
            request, self._handover = self._handover, None
        if request is None:
            return
        try:
            unfinished = self.engine.unfinished()  # waiting in queue order, then running
            if request.rule == "tail":
                picked = tail_picks(unfinished, self._given, self._predict_longest, request)[:request.n or 1]
                if not picked:  # none qualifies yet: ask again at the next boundary
                    with self._handover_lock:
                        if self._handover is None:
                            self._handover, request = request, None
                    if request is None:
                        return
            elif request.rule == "remaining+early" and self._early is not None:  # held ones too, renewed
                picked = self._early.moves(self.engine, self.cost, request.load(self.load_s, self.weights_version))
            elif request.rule.startswith("remaining"):  # histopipe/rebalance.py, priced as the simulator does
                picked = remaining_picks(unfinished, self._live_predictor(), self.cost, self.config.rollout.num_slots,
                                         request.load(self.load_s, self.weights_version))
            else:
                picked = half_busiest_picks(unfinished, request.n, self.predicted_length)
            request.taken = [self.engine.extract(q.request_id) for q in picked]
            for c in request.taken:
                c.versions = self._stamped(c.request_id, len(c.output_ids))
        finally:
            if request is not None:  # None: put back for the next boundary (rule "tail")
                request.done.set()
