"""The rollout engine: continuous batching over a preallocated KV cache.

`step()` reads as schedule -> draft -> run -> verify -> commit: admit waiting requests into free slots; with HistoSpec
on, let it propose a draft tree per decoding sequence (possibly none); run one forward over every running slot's new
tokens and drafts; walk each draft with the policy's keyed draws (`rhymerl.histospec.verify`; plain decoding is the
walk over an empty draft: one token); append the accepted tokens and the bonus token, keep the accepted path's
keys/values, retire the sequences that hit EOS, a stop string or their length limit (`rhymerl.engine.stop_rule`; their
slots are refilled next step, or the survivors are compacted when nothing waits), and hand HistoSpec what was
verified. Between two steps a request can be handed to another engine (`extract` / `adopt`; the continuation's checks
and the re-prefill's accounting: `rhymerl.engine.migration`).

The engine is the only door to its parts: a caller takes its counters (`take_stats`), HistoSpec's learned state
(`state_dict` / `load_state_dict`) and the cost model (`cost_model`) from it, never from the scheduler, the runner or
the speculator.
"""

from __future__ import annotations

import time
from itertools import accumulate
from typing import Callable, Iterable

import torch
from tqdm import tqdm

from rhymerl.cost_model import CostModel
from rhymerl.engine import migration
from rhymerl.engine.device_verification import StepDraws, read_drawn, verify_on_device
from rhymerl.engine.kv_cache import KVCache
from rhymerl.engine.model_runner import ModelRunner, SlotInput
from rhymerl.engine.sampler import sample_rows
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.engine.scheduler import Scheduler
from rhymerl.engine.prefix_sharing import share_prefixes
from rhymerl.engine.sequence import Continuation, RequestOutput, Sequence, Status, StepEvent
from rhymerl.engine.stats import EngineStats
from rhymerl.engine.stop_rule import answer_text, finish_reason
from rhymerl.histospec.drafter import Draft
from rhymerl.histospec.speculator import Speculator
from rhymerl.histospec.stats import SpecStats
from rhymerl.histospec.verify import Verified, verify
from rhymerl.history import prompt_key
from rhymerl.model.decoder import Decoder

# Shorter shared prefixes (a BOS, a role tag) are recomputed rather than copied in every layer.
MIN_SHARED_PREFIX = 8


class Engine:
    """Continuous-batching rollout engine.

    `speculator`: HistoSpec (docs/histospec.md: drafts from the history, the request's siblings and itself,
    verified losslessly), built by the caller; None = plain decoding, one token per slot per step. The engine
    tells it its EOS ids and, when it was built without a cost model, measures one (`measure_cost_model`;
    to reuse what an engine on the same model and slot count measured, build it with `other.cost_model`).
    `runner`: a model runner built by the caller (`ModelRunner(model, KVCache.for_model(...))`: the KV cache
    and, on a GPU, its captured CUDA graphs) for this engine to run on, for the same model, slots and context,
    its cache with room for this engine's drafts; None = one of its own. A benchmark hands one runner to all
    its engines of a shape, which then capture each step shape once, as a training run's long-lived engine
    does.
    """

    def __init__(self, model: Decoder, tokenizer=None, *, num_slots: int = 8, max_model_len: int = 2048,
                 max_prefill_tokens: int = 4096, eos_token_ids: Iterable[int] | None = None,
                 speculator: Speculator | None = None, runner: ModelRunner | None = None):
        cfg = model.cfg
        self.model, self.tokenizer = model, tokenizer
        self.max_model_len = max_model_len
        self.max_draft_tokens = speculator.max_draft_tokens if speculator is not None else 0
        scratch = self.max_draft_tokens  # the cache holds one step's draft past the context
        if runner is None:
            self.cache = KVCache.for_model(model, num_slots, max_model_len, scratch)
            runner = ModelRunner(model, self.cache)
        else:
            runner.check_fits(model, num_slots, max_model_len, scratch)
            self.cache = runner.cache
        self.runner = runner
        self.scheduler = Scheduler(num_slots, max_prefill_tokens)
        eos = set(cfg.eos_token_ids if eos_token_ids is None else eos_token_ids)
        if eos_token_ids is None and tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.stats = EngineStats()  # read it; `take_stats` starts new counters
        self._next_id = 0
        self.speculator = speculator
        if speculator is not None:
            speculator.attach(self.eos_token_ids, lambda: self.measure_cost_model(speculator.max_draft_tokens))

    def measure_cost_model(self, max_draft_tokens: int = 32, context: int = 256) -> CostModel:
        """Time real verification forwards on free slots (`ModelRunner.measure_cost`), each sequence with a
        `context`-token prefix (attention cost grows with it: a typical rollout's). Run at start-up, before
        any request holds a slot; a couple of seconds for a 135M model on a CPU."""
        return self.runner.measure_cost(max_draft_tokens, min(context, self.max_model_len - 1))

    # ---- the engine's door: what its callers read and restore ----------------------------------
    @property
    def cost_model(self) -> CostModel | None:
        """HistoSpec's forward-cost model (measured or given; None with speculation off): another engine of
        the same model and slots can be built with it instead of measuring its own."""
        return self.speculator.cost if self.speculator is not None else None

    def take_stats(self) -> tuple[EngineStats, SpecStats | None]:
        """The engine's and HistoSpec's (None when off) counters since the last call or the start; fresh ones
        count from now."""
        taken = self.stats, (self.speculator.stats if self.speculator is not None else None)
        self.stats = EngineStats()
        if self.speculator is not None:
            self.speculator.stats = SpecStats()
        return taken

    def state_dict(self) -> dict | None:
        """What HistoSpec learned across rollouts (`Speculator.state_dict`), as plain data; None when off."""
        return self.speculator.state_dict() if self.speculator is not None else None

    def load_state_dict(self, state: dict | None) -> None:
        """Restore what `state_dict` returned (a resume); nothing with speculation off or no state."""
        if state is not None and self.speculator is not None:
            self.speculator.load_state_dict(state)

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: int | str | None = None,
                    group=None, continuation: Continuation | None = None) -> int | str:
        """Queue a request; raise ValueError (naming the request and the broken rule) if it is invalid.
        Requests with the same `group` (default: the same prompt) are siblings: HistoSpec drafts from
        each other's responses. With `continuation` (another engine's `extract`; its prompt, params, id and
        group win over the other arguments) the request goes on from the tokens it has generated."""
        if continuation is not None:
            c = continuation
            prompt_ids, params, request_id, group = c.prompt_ids, c.params, c.request_id, c.group
        if request_id is None:
            request_id, self._next_id = self._next_id, self._next_id + 1
        if not prompt_ids:
            raise ValueError(f"request {request_id!r}: empty prompt")
        vocab = self.model.cfg.vocab_size
        bad = [t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"request {request_id!r}: token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"request {request_id!r}: prompt has {len(prompt_ids)} tokens, the context holds "
                             f"{self.max_model_len} (max_model_len) and needs room for at least one new token")
        params.validate()
        seq = Sequence(request_id, list(prompt_ids), params)
        seq.group = prompt_key(prompt_ids) if group is None else group
        if continuation is not None:
            migration.resume(seq, continuation, self.max_model_len)
            self.stats.migrations += 1
            if self.speculator is not None:  # its own and its siblings' indexes learn what it has generated
                seq.spec = self.speculator.start(seq.group, seq.prompt_ids)
                self.speculator.observe(seq.spec, seq.output_ids)
        self.scheduler.add(seq)
        return request_id

    def unfinished(self) -> list[Sequence]:
        """The requests not finished yet: waiting ones in queue order, then running ones in slot order."""
        return list(self.scheduler.waiting) + [self.scheduler.running[s] for s in sorted(self.scheduler.running)]

    # ---- migration: a request handed over at a step boundary ---------------------------------------
    def extract(self, request_id: int | str) -> Continuation:
        """Take an unfinished request (waiting or running) out of this engine between two steps, freeing its
        slot, as plain data another engine can `adopt`. KeyError when no unfinished request has that id."""
        seq = next((q for q in self.unfinished() if q.request_id == request_id), None)
        if seq is None:
            raise KeyError(f"request {request_id!r} is not unfinished in this engine (extract takes a waiting "
                           f"or running request)")
        if seq.status == Status.WAITING:
            self.scheduler.waiting.remove(seq)
        else:
            self.scheduler.finish(seq)
            for moved, old_slot in self.scheduler.compact():
                self.runner.move(old_slot, moved.slot, moved.num_cached)
        seq.status = Status.FINISHED
        self.stats.handed_over += 1
        if self.speculator is not None and not self.has_unfinished():
            self.speculator.end_batch()  # the batch is over here: its sibling indexes go, as after a step
        return seq.to_continuation()

    def adopt(self, continuation: Continuation) -> int | str:
        """Queue a request another engine handed over (`extract`): its first step prefills prompt +
        generated tokens, then it decodes on at output position len(output_ids) with the same keyed draws."""
        return self.add_request(continuation.prompt_ids, continuation.params, continuation=continuation)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step -------------------------------------------------------------------------------
    def step(self) -> list[StepEvent]:
        """schedule -> draft -> run -> verify -> commit."""
        t0 = time.perf_counter()
        seqs = self.scheduler.schedule()
        if not seqs:
            return []
        sources, shared = share_prefixes(seqs, MIN_SHARED_PREFIX)
        self.stats.shared_prompt_tokens += shared
        news = [seq.uncached_ids for seq in seqs]  # whole prompt at first, then the last sampled token
        drafts = self._draft(seqs, sum(map(len, news)))
        inputs = self._inputs(seqs, news, drafts, sources)
        logits, drawn = self._run(seqs, news, inputs)
        verified = self._verify(seqs, drafts, logits, drawn, inputs)
        events = self._commit(seqs, verified)
        for seq, old_slot in self.scheduler.compact():
            self.runner.move(old_slot, seq.slot, seq.num_cached)
        if self.speculator is not None:
            self.speculator.commit(seqs, drafts, verified, [ev.new_token_ids for ev in events], started=t0,
                                   batch_done=not self.has_unfinished())
        self.stats.busy_s += time.perf_counter() - t0
        self.stats.seq_steps += len(seqs)
        return events

    def _inputs(self, seqs: list[Sequence], news: list[list[int]], drafts: list[Draft],
                sources: dict[int, int]) -> list[SlotInput]:
        """What each slot feeds this step: its uncached tokens `new`, then its draft tree, if any, hung from the
        last of them (node 0); without a draft, the prefix it may copy from slot `sources[slot]`."""
        inputs, prompt_tokens = [], 0
        for seq, new, draft in zip(seqs, news, drafts):
            if draft.tokens:
                parents = [-1] + [0 if p < 0 else p + 1 for p in draft.parents]
                inputs.append(SlotInput(seq.slot, seq.num_cached, new + draft.tokens, parents))
            else:
                inputs.append(SlotInput(seq.slot, seq.num_cached, new, None, len(new) - 1,
                                        sources.get(seq.slot) if sources else None))
            if seq.num_cached < len(seq.prompt_ids):  # a prefill feeds the rest of the prompt, then an adopted
                prompt_tokens += len(new) - len(seq.output_ids)  # request's generated tokens
        self.stats.prompt_tokens += prompt_tokens
        self.stats.tokens_forwarded += sum(len(x.tokens) for x in inputs)
        return inputs

    def _run(self, seqs: list[Sequence], news: list[list[int]], inputs: list[SlotInput]):
        """One forward over every running slot -> (logits, None), or (None, its draws) where the backend draws
        in the step (`ModelRunner.run_drawn`). Logits rows: 1 per plain slot, 1 + len(draft) per drafting
        slot; in the model's dtype (the sampler widens the rows it reads: a verification step reads few)."""
        t0 = time.perf_counter()
        drawn = self.runner.run_drawn(inputs, StepDraws.of(seqs) if self.runner.backend.verifies_on_device else None)
        logits = self.runner.run(inputs, float_logits=False) if drawn is None else None
        forward_s = time.perf_counter() - t0
        self.stats.forward_s += forward_s
        migration.count_reprefill(self.stats, seqs, news, inputs, forward_s)  # adopted requests' share
        self.stats.forward_passes += 1
        return logits, drawn

    def _draft(self, seqs: list[Sequence], base_tokens: int) -> list[Draft]:
        if self.speculator is None:
            return [Draft()] * len(seqs)
        # Only decoding sequences draft, and no deeper than they may still grow: a response's last tokens
        # before max_tokens or the context's end draft too (they are a long response's, often a loop's, and
        # decoding them one per step took a sizeable share of a T=0.3 tail), but no draft reaches past that end:
        # its room, less the bonus token every step appends. Its nodes always fit in the cache, whose scratch
        # holds max_draft_tokens positions past the context.
        rooms = [max(min(s.room(self.max_model_len) - 1, self.max_draft_tokens), 0)
                 if s.num_cached >= len(s.prompt_ids) else 0 for s in seqs]
        return self.speculator.propose(seqs, rooms, base_tokens, draining=not self.scheduler.waiting)

    def _verify(self, seqs: list[Sequence], drafts: list[Draft], logits: torch.Tensor | None, drawn,
                inputs: list[SlotInput]) -> list[Verified]:
        """Every sequence's draft walked with the policy's keyed draws (`histospec.verify`), drawing only at
        the nodes the walks reach: sequence i's node j has logits row starts[i] + j + 1 (node -1, its last
        real token, the first of its rows). On a backend that verifies on the device (a GPU), every node is
        drawn and walked there in one go when the sequences share their SamplingParams
        (`device_verification`; the same keyed draws, the same result), or were in the step (`drawn`)."""
        if drawn is not None:
            verified, wait_s = read_drawn(drafts, *drawn)
            self.stats.device_wait_s += wait_s
            if verified is not None:
                return verified
            logits = self.runner.run(inputs, float_logits=False)  # a forking draft (never a Drafter's): again
        starts = [0, *accumulate(len(x.tokens) - x.logits_from for x in inputs[:-1])]
        draws = StepDraws.of(seqs) if self.runner.backend.verifies_on_device else None
        if draws is not None:
            verified, wait_s = verify_on_device(drafts, logits, starts, draws.prefixes, draws.offsets, draws.params)
            self.stats.device_wait_s += wait_s
            if verified is not None:
                return verified

        def draw(live: list[int], nodes: list[int], depths: list[int]):
            return sample_rows(logits, [seqs[i] for i in live], [starts[i] + n + 1 for i, n in zip(live, nodes)],
                               depths, self.runner.ops)

        return verify(drafts, draw)

    def _commit(self, seqs: list[Sequence], verified: list[Verified]) -> list[StepEvent]:
        """Each sequence appends its accepted tokens and the bonus token (stopping at EOS, a stop string or the
        length limit) and keeps the accepted path's keys/values; counts the step's forward."""
        events, generated, eos, now = [], 0, self.eos_token_ids, time.perf_counter()
        for seq, v in zip(seqs, verified):
            path, tokens, output = v.path, v.tokens, seq.output_ids
            seq.forwards += 1
            if path:
                self.runner.commit(seq.slot, seq.num_cached, [0] + [j + 1 for j in path])
            if not output:
                seq.first_token = now
            seq.num_cached = len(seq.prompt_ids) + len(output) + len(path)  # fed + accepted; the bonus is not cached
            reason = None
            for k, tok in enumerate(tokens):  # a plain step's: one
                output.append(tok)
                seq.logprobs.append(v.logprobs[k])
                reason = finish_reason(seq, eos, self.tokenizer, self.max_model_len)
                if reason is not None:
                    tokens = tokens[: k + 1]
                    break
            generated += len(tokens)
            if reason is not None:
                seq.finish_reason = reason
                self.scheduler.finish(seq)
                if self.tokenizer is not None:
                    seq.text = answer_text(seq, self.tokenizer)
            events.append(StepEvent(seq.request_id, tokens, None if reason is None else seq.to_output()))
        self.stats.generated_tokens += generated
        return events

    # ---- batch API ------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 request_ids: list | None = None, progress: bool = False,
                 on_event: Callable[[StepEvent], None] | None = None, continuations: Iterable[Continuation] = (),
                 between_steps: Callable[[], None] | None = None) -> list[RequestOutput]:
        """Run prompts (token ids) and adopted `continuations` to completion (the continuations queued first);
        results in input order, the continuations' after the prompts'. An invalid request is rejected alone: its
        result has finish_reason "error" and the message, the others complete. `between_steps` runs before every
        step (a step boundary): a request it hands over (`extract`) has no result here."""
        continuations = list(continuations)
        if not prompts and not continuations:
            raise ValueError("generate() got an empty prompt list")
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = list(request_ids) if request_ids is not None else [f"req-{self._next_id + i}" for i in range(len(prompts))]
        self._next_id += len(prompts)
        results: dict = {}
        for c in continuations:  # queued first: a continuation has the longest way behind it (deferral)
            try:
                self.adopt(c)
            except ValueError as e:
                results[c.request_id] = RequestOutput(c.request_id, list(c.prompt_ids), [], [], "error", error=str(e))
        for rid, prompt, p in zip(ids, prompts, params_list):
            try:
                self.add_request(prompt, p, rid)
            except ValueError as e:
                results[rid] = RequestOutput(rid, list(prompt), [], [], "error", error=str(e))
        ids += [c.request_id for c in continuations]
        bar = tqdm(total=len(ids), initial=len(results), desc="generate", unit="req", disable=not progress)
        while self.has_unfinished():
            if between_steps is not None:
                between_steps()
            for ev in self.step():
                if on_event is not None:
                    on_event(ev)
                if ev.output is not None:
                    results[ev.request_id] = ev.output
                    bar.update(1)
            if progress:  # a disabled bar formats it all the same, between two steps (a GPU waits)
                bar.set_postfix(tok_s=f"{self.stats.generated_tokens / max(self.stats.busy_s, 1e-9):.0f}")
        bar.close()
        return [results[rid] for rid in ids if rid in results]

