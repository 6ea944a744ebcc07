"""A rollout worker's admission under the siblings' early warning (`rollout.migration_rule=remaining+early`;
the rule is `histopipe.early_warning`, which the simulator's `fleet.py` runs too; docs/design.md, section 4).

The engine admits its waiting requests in the order they were queued, and a request can be put ahead of
others only before it enters the engine. So under the rule the worker holds its call's requests itself, in
`probe_order` (one member of each group first), and gives the engine one each time a slot is free (`feed`:
at a finish and at every step boundary), the renewed ones first (`renewed_first`: a waiting request whose
siblings, running or finished, have passed its predicted length, longest renewed first). For a hand-over
(`moves`) what it holds counts as waiting, every waiting request priced at its renewed length when it has
one. Keyed randomness (seed, request id, position) makes the tokens those of any other admission order."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.engine.sequence import RequestOutput, Status
from rhymerl.histopipe.early_warning import evidence, probe_order, renewed_first, renewed_length
from rhymerl.histopipe.predict import LengthPredictor
from rhymerl.histopipe.rebalance import pool_moves


@dataclass
class Held:
    """A request the worker holds back from its engine: waiting, no tokens yet."""

    request_id: object
    prompt_ids: list[int]
    output_ids: tuple = ()
    status: Status = Status.WAITING


class EarlyQueue:
    """One call's requests held back from the engine (see the module doc). `prompts`, `ids`: the call's
    requests in the worker's admission order; `predictor`: the call's live `LengthPredictor` (built on first
    use); `slots`: the engine's."""

    def __init__(self, prompts: Sequence[list[int]], ids: Sequence, params: SamplingParams, slots: int,
                 predictor: Callable[[], LengthPredictor]):
        if len(prompts) != len(ids):
            raise ValueError(f"{len(prompts)} prompts but {len(ids)} request ids")
        self.held = probe_order([Held(i, list(p)) for p, i in zip(prompts, ids)], [tuple(p) for p in prompts])
        self.params, self.slots, self._predictor = params, slots, predictor
        self.outputs: dict = {}  # request id -> output, of the requests given to the engine by `feed`
        self.renewals = 0  # requests given to the engine on a renewed prediction (the rule acted)
        self._fed: set = set()
        self._longest: dict[tuple, int] = {}  # prompt -> its longest member finished in this call
        self._base: dict = {}  # request id -> its predicted length when first asked (as the simulator's)

    def start(self, adopted: int) -> tuple[list[list[int]], list]:
        """The prompts and ids the engine starts with: as many as its slots hold beside the `adopted`
        continuations it takes first, at least one (a continuation rejected would leave the engine with none
        to run, and the held ones with no finish to follow); the rest held."""
        room = max(self.slots - adopted, 1)
        first, self.held = self.held[:room], self.held[room:]
        return [h.prompt_ids for h in first], [h.request_id for h in first]

    def finished(self, output: RequestOutput, engine) -> None:
        """A request finished (an engine event): its length is its siblings' evidence; its slot is free."""
        key = tuple(output.prompt_ids)
        self._longest[key] = max(self._longest.get(key, 0), len(output.token_ids))
        if output.request_id in self._fed:
            self.outputs[output.request_id] = output
        self.feed(engine)

    def feed(self, engine) -> None:
        """Give the engine held requests for its free slots, the renewed ones first (`renewed_first`)."""
        unfinished = engine.unfinished()
        room = self.slots - len(unfinished)
        if room <= 0 or not self.held:
            return
        renew = self._renewal(unfinished)
        order = renewed_first(self.held, renew)
        self.renewals += sum(1 for h in order[:room] if renew(h))
        self.held = order[room:]
        for h in order[:room]:
            self._admit(engine, h)

    def moves(self, engine, cost, load: float = 0.0) -> list:
        """Rule "remaining+early"'s hand-over: `pool_moves` over the engine's running requests and its waiting
        ones then the held ones (the simulator's queue: they run in that order), the waiting ones priced at
        their renewed lengths; `cost`, `load`: the worker's cost model and the receiver's weights load, as
        `pool_moves` takes them. A held request picked is queued in the engine first, so that
        `Engine.extract` hands it over as any waiting request. The requests to extract."""
        unfinished = engine.unfinished()
        renew = self._renewal(unfinished)
        running = [q for q in unfinished if q.status != Status.WAITING]
        waiting = [q for q in unfinished if q.status == Status.WAITING] + self.held
        picked = pool_moves(running, waiting, self._predictor(), cost, self.slots, load,
                            [renew(q) for q in waiting])
        held = {id(h) for h in self.held}
        for q in picked:
            if id(q) in held:
                self.held.remove(q)
                self._admit(engine, q)
        return picked

    def _admit(self, engine, h: Held) -> None:
        try:
            engine.add_request(h.prompt_ids, self.params, h.request_id)
        except ValueError as e:  # rejected alone, as `Engine.generate` rejects one
            self.outputs[h.request_id] = RequestOutput(h.request_id, list(h.prompt_ids), [], [], "error",
                                                       error=str(e))
        else:
            self._fed.add(h.request_id)

    def _renewal(self, unfinished: Sequence) -> Callable[[object], float]:
        """A waiting request's renewed length (0.0: not renewed), from what its siblings reached now: the
        longest finished in this call and the most tokens a running one holds (`early_warning`)."""
        running: dict[tuple, int] = {}
        for q in unfinished:
            if q.status != Status.WAITING:
                key = tuple(q.prompt_ids)
                running[key] = max(running.get(key, 0), len(q.output_ids))
        predictor, memo = self._predictor(), {}

        def renew(q) -> float:
            key = tuple(q.prompt_ids)
            if q.request_id not in self._base:
                self._base[q.request_id] = predictor.predict_past(q.prompt_ids, len(q.output_ids))

            def past(tokens: float) -> float:  # one prediction per prompt and evidence, however many wait
                if (key, tokens) not in memo:
                    memo[key, tokens] = predictor.predict_past(q.prompt_ids, tokens)
                return memo[key, tokens]
            return renewed_length(evidence(self._longest.get(key, 0), [running.get(key, 0)]),
                                  self._base[q.request_id], past)
        return renew
