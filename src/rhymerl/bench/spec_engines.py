"""The engines of `rhymerl bench spec` (`rhymerl.bench.spec_bench`), made on the way, with what engines of one
shape share: one cost model and one model runner per model and engine shape."""

from __future__ import annotations

from rhymerl.cost_model import CostModel
from rhymerl.engine.engine import Engine
from rhymerl.engine.kv_cache import KVCache
from rhymerl.engine.model_runner import ModelRunner
from rhymerl.histospec.speculator import Speculator


class SpecEngines:
    """The bench's engines. One cost model per model and engine shape, measured by the first HistoSpec engine
    of that shape, as a training run measures once at start-up. Re-measuring for every timed run made the run
    right after the measurement's large forwards the slow one of a pair (one-off A/B at T=1.0, where HistoSpec
    drafts almost nothing: only the measured-just-before runs lost to plain). Likewise one runner (KV cache,
    and on a GPU the CUDA graphs captured on it) per engine shape, made here when the first HistoSpec engine of
    the shape is: every engine of the shape made from then on runs on it, so a step shape is captured once,
    not in every timed run."""

    def __init__(self, tokenizer, draft_rule: str, max_draft_tokens: int):
        self.tokenizer, self.draft_rule, self.max_draft_tokens = tokenizer, draft_rule, max_draft_tokens
        self.costs: dict[tuple, CostModel] = {}  # (id(model), slots, length) -> the measured cost model
        self.runners: dict[tuple, ModelRunner] = {}  # the same keys -> the shape's runner

    def make(self, m, spec: str, history=None, *, n_slots: int, length: int, aware: bool = False) -> Engine:
        """An engine on model `m`: plain (`spec` "off") or HistoSpec drafting from `history`."""
        key = (id(m), n_slots, length)
        speculator = None
        if spec == "histospec":
            speculator = Speculator(self.costs.get(key), history, self.draft_rule, self.max_draft_tokens,
                                    reward_weighted=aware)
            if key not in self.runners:  # its cache with room for the drafts (the plain engines' too)
                self.runners[key] = ModelRunner(m, KVCache.for_model(m, n_slots, length, self.max_draft_tokens))
        engine = Engine(m, self.tokenizer, num_slots=n_slots, max_model_len=length, speculator=speculator,
                        runner=self.runners.get(key))
        if spec == "histospec":
            self.costs.setdefault(key, engine.cost_model)
        return engine
