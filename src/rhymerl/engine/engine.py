"""The rollout engine: continuous batching over a preallocated KV cache.

`step()` reads as schedule -> draft -> run -> verify -> commit: admit waiting requests into free slots;
with HistoSpec on, let it propose a draft tree per decoding sequence (possibly none); run one forward over
every running slot's new tokens and drafts; walk each draft with the policy's keyed draws
(`rhymerl.histospec.verify`; plain decoding is the walk over an empty draft: one token); append the
accepted tokens and the bonus token, keep the accepted path's keys/values, retire the sequences that hit
EOS, a stop string or their length limit (`rhymerl.engine.stop_rule`; their slots are refilled next step,
or the survivors are compacted when nothing waits), and hand HistoSpec what was verified. Between two steps
a request can be handed to another engine (`extract` / `adopt`: `rhymerl.engine.migration`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from tqdm import tqdm

from rhymerl import cost_model
from rhymerl.cost_model import CostModel
from rhymerl.engine import migration
from rhymerl.engine.device_verification import verify_on_device
from rhymerl.engine.kv_cache import KVCache
from rhymerl.engine.model_runner import ModelRunner, SlotInput
from rhymerl.engine.sampler import sample
from rhymerl.engine.sampling_params import SamplingParams, draw_key, draw_prefix
from rhymerl.engine.scheduler import Scheduler
from rhymerl.engine.prefix_sharing import share_prefixes
from rhymerl.engine.sequence import Continuation, RequestOutput, Sequence
from rhymerl.engine.stats import EngineStats
from rhymerl.engine.stop_rule import answer_text, finish_reason
from rhymerl.histospec.drafter import Draft
from rhymerl.histospec.speculator import Speculator
from rhymerl.histospec.verify import Verified, verify
from rhymerl.history import HistoryStore, prompt_key
from rhymerl.model.decoder import Decoder

SPECULATIVE_MODES = ("off", "histospec")
# Shorter shared prefixes (a BOS, a role tag) are recomputed rather than copied in every layer.
MIN_SHARED_PREFIX = 8


@dataclass
class StepEvent:
    """One request's progress in one step (for streaming)."""

    request_id: int | str
    new_token_ids: list[int]
    output: RequestOutput | None  # set when the request finished in this step


class Engine:
    """Continuous-batching rollout engine.

    speculative: "off" (one token per slot per step) or "histospec" (docs/histospec.md: drafts from `history`,
    the request's siblings and itself, verified losslessly). `cost_model` overrides the forward-time
    model that HistoSpec otherwise measures at start-up (pass `other.cost_model` to reuse what an engine
    on the same model and slot count measured); `draft_rule` is "cost" (every
    sequence offers a full tree; the step budget alone decides), "aimd" or "doubling" (docs/benchmarks.md
    compares them). `reward_aware_drafting`: history branches that higher-reward responses took come first
    (`rollout.reward_aware_drafting`; the same tokens, other drafts). `runner`: an earlier engine's
    (`other.runner`: its KV cache and, on a GPU, its captured CUDA graphs) for this one to run on, when both
    have the same model, slots and context and its cache has room for this engine's drafts: a benchmark's
    engines then capture each step shape once, as a training run's long-lived engine does.
    """

    def __init__(self, model: Decoder, tokenizer=None, *, num_slots: int = 8, max_model_len: int = 2048,
                 max_prefill_tokens: int = 4096, eos_token_ids: Iterable[int] | None = None,
                 speculative: str = "off", history: HistoryStore | None = None, max_draft_tokens: int = 32,
                 draft_rule: str = "cost", cost_model: CostModel | None = None, reward_aware_drafting: bool = False,
                 runner: ModelRunner | None = None):
        if speculative not in SPECULATIVE_MODES:
            raise ValueError(f"speculative must be one of {SPECULATIVE_MODES}, got {speculative!r}")
        cfg = model.cfg
        param = next(model.parameters())
        self.model, self.tokenizer = model, tokenizer
        self.max_model_len = max_model_len
        self.max_draft_tokens = max_draft_tokens if speculative != "off" else 0
        scratch = self.max_draft_tokens  # the cache holds one step's draft past the context
        if runner is None:
            self.cache = KVCache(cfg.num_layers, num_slots, max_model_len, cfg.num_kv_heads, cfg.head_dim,
                                 param.dtype, param.device, scratch)
            runner = ModelRunner(model, self.cache)
        else:
            c = runner.cache
            if runner.model is not model or c.kv.shape[1] != num_slots or c.max_len != max_model_len \
                    or c.capacity < max_model_len + scratch:
                raise ValueError(f"runner= needs this engine's model, {num_slots} slots, max_model_len "
                                 f"{max_model_len} and room for {scratch} draft tokens; its cache has "
                                 f"{c.kv.shape[1]} slots of {c.max_len} (+{c.capacity - c.max_len})")
            self.cache = c
        self.runner = runner
        self.scheduler = Scheduler(num_slots, max_prefill_tokens)
        eos = set(cfg.eos_token_ids if eos_token_ids is None else eos_token_ids)
        if eos_token_ids is None and tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.stats = EngineStats()
        self._next_id = 0
        self.speculator = None
        if speculative == "histospec":
            cost = cost_model or self.measure_cost_model(max_draft_tokens)
            self.cost_model = cost
            # A measured cost model (this engine's, or one another engine measured on the same model and
            # slots) is corrected online; one written by hand is taken as is.
            self.speculator = Speculator(cost, history, draft_rule, max_draft_tokens, self.eos_token_ids,
                                         correct_cost=cost.measured, reward_weighted=reward_aware_drafting)

    def measure_cost_model(self, max_draft_tokens: int = 32, context: int = 256) -> CostModel:
        """Time real verification forwards on free slots (`rhymerl.cost_model.measure`): n sequences, each with
        a `context`-token prefix, feeding t tokens as a chain. Run at start-up, before any request holds a
        slot; a couple of seconds for a 135M model on a CPU."""
        slots = self.scheduler.num_slots
        context = min(context, self.max_model_len - 1)  # attention cost grows with it: a typical rollout's
        self.runner.run([SlotInput(s, 0, [0] * context, logits_from=context - 1) for s in range(slots)])

        def time_forward(n: int, t: int) -> float:
            inputs = [SlotInput(s, context, [0] * t, list(range(-1, t - 1))) for s in range(n)]
            t0 = time.perf_counter()
            self.runner.run(inputs)
            self.runner.synchronize()
            return time.perf_counter() - t0

        return cost_model.measure(time_forward, slots, max_draft_tokens)

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
            migration.resume(self, seq, continuation)
        self.scheduler.add(seq)
        return request_id

    def unfinished(self) -> list[Sequence]:
        """The requests not finished yet: waiting ones in queue order, then running ones in slot order."""
        return list(self.scheduler.waiting) + [self.scheduler.running[s] for s in sorted(self.scheduler.running)]

    # ---- migration (`rhymerl.engine.migration`): a request handed over at a step boundary --
    def extract(self, request_id: int | str) -> Continuation:
        """Take an unfinished request out of this engine between two steps, freeing its slot, as plain data
        another engine can `adopt`. KeyError when no unfinished request has that id."""
        return migration.extract(self, request_id)

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
        inputs = [self._input(seq, new, draft, sources.get(seq.slot)) for seq, new, draft in zip(seqs, news, drafts)]
        logits = self._run(seqs, news, inputs)
        verified = self._verify(seqs, drafts, logits, [len(x.tokens) - x.logits_from for x in inputs])
        events = [self._commit(seq, v) for seq, v in zip(seqs, verified)]
        for seq, old_slot in self.scheduler.compact():
            self.runner.move(old_slot, seq.slot, seq.num_cached)
        if self.speculator is not None:
            self.speculator.commit(seqs, drafts, verified, [ev.new_token_ids for ev in events], started=t0,
                                   batch_done=not self.has_unfinished())
        self.stats.busy_s += time.perf_counter() - t0
        self.stats.seq_steps += len(seqs)
        return events

    def _input(self, seq: Sequence, new: list[int], draft: Draft, prefix_from: int | None) -> SlotInput:
        """What `seq`'s slot feeds this step: its uncached tokens `new`, then its draft tree, if any, hung
        from the last of them (node 0); without a draft, the prefix it may copy from slot `prefix_from`."""
        if draft.tokens:
            parents = [-1] + [0 if p < 0 else p + 1 for p in draft.parents]
            x = SlotInput(seq.slot, seq.num_cached, new + draft.tokens, parents)
        else:
            x = SlotInput(seq.slot, seq.num_cached, new, logits_from=len(new) - 1, prefix_from=prefix_from)
        # a prefill feeds the rest of the prompt, then an adopted request's generated tokens
        self.stats.prompt_tokens += len(new) - len(seq.output_ids) if seq.num_cached < len(seq.prompt_ids) else 0
        self.stats.tokens_forwarded += len(x.tokens)
        return x

    def _run(self, seqs: list[Sequence], news: list[list[int]], inputs: list[SlotInput]) -> torch.Tensor:
        """One forward over every running slot. Logits rows: 1 per plain slot, 1 + len(draft) per drafting
        slot; in the model's dtype (the sampler widens the rows it reads: a verification step reads few)."""
        t0 = time.perf_counter()
        logits = self.runner.run(inputs, float_logits=False)
        forward_s = time.perf_counter() - t0
        self.stats.forward_s += forward_s
        migration.count_reprefill(self.stats, seqs, news, inputs, forward_s)  # adopted requests' share
        self.stats.forward_passes += 1
        for seq in seqs:
            seq.forwards += 1
        return logits

    def _draft(self, seqs: list[Sequence], base_tokens: int) -> list[Draft]:
        if self.speculator is None:
            return [Draft()] * len(seqs)
        # Only decoding sequences draft, and no deeper than they may still grow: a response's last tokens
        # before max_tokens or the context's end draft too (they are a long response's, often a loop's, and
        # decoding them one per step took a sizeable share of a T=0.3 tail), but no draft reaches past that end.
        rooms = [self._draft_room(s) if s.num_cached >= len(s.prompt_ids) else 0 for s in seqs]
        return self.speculator.propose(seqs, rooms, base_tokens, draining=not self.scheduler.waiting)

    def _draft_room(self, seq: Sequence) -> int:
        """How deep a draft of `seq` may be: the tokens it may still append (before max_tokens and the end of
        the context), less the bonus token every step appends. The tree's nodes always fit in the cache:
        its scratch holds max_draft_tokens positions past the context."""
        left = min(seq.params.max_tokens - len(seq.output_ids), self.max_model_len - seq.num_tokens)
        return max(min(left - 1, self.max_draft_tokens), 0)

    def _verify(self, seqs: list[Sequence], drafts: list[Draft], logits: torch.Tensor,
                rows_per_seq: list[int]) -> list[Verified]:
        """Every sequence's draft walked with the policy's keyed draws (`histospec.verify`), drawing only at
        the nodes the walks reach: sequence i's node j has logits row starts[i] + j + 1 (node -1, its last
        real token, the first of its rows). On a backend that verifies on the device (a GPU), every node is
        drawn and walked there in one go when the sequences share their SamplingParams
        (`device_verification`; the same keyed draws, the same result)."""
        starts = [0] * len(seqs)
        for i in range(1, len(seqs)):
            starts[i] = starts[i - 1] + rows_per_seq[i - 1]
        params = seqs[0].params
        if self.runner.backend.verifies_on_device and all(s.params == params for s in seqs):
            verified, wait_s = verify_on_device(drafts, logits, starts,
                                                [draw_prefix(params.seed, s.key) for s in seqs],
                                                [len(s.output_ids) for s in seqs], params)
            self.stats.device_wait_s += wait_s
            if verified is not None:
                return verified

        def draw(live: list[int], nodes: list[int], depths: list[int]):
            return self._draw([seqs[i] for i in live], [starts[i] + n + 1 for i, n in zip(live, nodes)], depths, logits)

        return verify(drafts, draw)

    def _draw(self, seqs: list[Sequence], rows: list[int], offsets: list[int], logits: torch.Tensor):
        """Sample one token at each logits row; the draw for output token j of a request depends on
        (seed, request, j) only (here j = its output length + offset), exactly what plain decoding
        uses there. Rows with the same SamplingParams share one call."""
        groups: dict[SamplingParams, list[int]] = defaultdict(list)
        for k, seq in enumerate(seqs):
            groups[seq.params].append(k)
        tokens, logprobs = [0] * len(seqs), [0.0] * len(seqs)
        for params, ks in groups.items():
            keys = [draw_key(params.seed, seqs[k].key, len(seqs[k].output_ids) + offsets[k]) for k in ks]
            toks, lps = sample(logits, params, keys, self.runner.ops, [rows[k] for k in ks])
            for k, t, lp in zip(ks, toks, lps):
                tokens[k], logprobs[k] = t, lp
        return tokens, logprobs

    def _commit(self, seq: Sequence, verified: Verified) -> StepEvent:
        """Append the accepted tokens and the bonus token (stopping at EOS, a stop string or the length
        limit) and keep the accepted path's keys/values."""
        base, path = seq.num_cached, verified.path
        if path:
            self.runner.commit(seq.slot, base, [0] + [j + 1 for j in path])
        seq.num_cached = seq.num_tokens + len(path)  # fed tokens + accepted drafts; the bonus is not cached
        if not seq.output_ids:
            seq.first_token = time.perf_counter()
        reason, appended = None, []
        for tok, lp in zip(verified.tokens, verified.logprobs):
            seq.output_ids.append(tok)
            seq.logprobs.append(lp)
            appended.append(tok)
            reason = finish_reason(seq, self.eos_token_ids, self.tokenizer, self.max_model_len)
            if reason is not None:
                break
        self.stats.generated_tokens += len(appended)
        if reason is None:
            return StepEvent(seq.request_id, appended, None)
        seq.finish_reason = reason
        self.scheduler.finish(seq)
        if self.tokenizer is not None:
            seq.text = answer_text(seq, self.tokenizer)
        return StepEvent(seq.request_id, appended, seq.to_output())

    # ---- batch API ------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 request_ids: list | None = None, progress: bool = False,
                 on_event: Callable[[StepEvent], None] | None = None, continuations: Iterable[Continuation] = (),
                 between_steps: Callable[[], None] | None = None) -> list[RequestOutput]:
        """Run prompts (token ids) and adopted `continuations` to completion; results in input order, the
        continuations' after the prompts'. An invalid request is rejected alone: its result has finish_reason
        "error" and the message, the others complete. `between_steps` runs before every step (a step
        boundary): a request it hands over (`extract`) has no result here."""
        continuations = list(continuations)
        if not prompts and not continuations:
            raise ValueError("generate() got an empty prompt list")
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = list(request_ids) if request_ids is not None else [f"req-{self._next_id + i}" for i in range(len(prompts))]
        self._next_id += len(prompts)
        results: dict = {}
        for rid, prompt, p in zip(ids, prompts, params_list):
            try:
                self.add_request(prompt, p, rid)
            except ValueError as e:
                results[rid] = RequestOutput(rid, list(prompt), [], [], "error", error=str(e))
        for c in continuations:
            ids.append(c.request_id)
            try:
                self.adopt(c)
            except ValueError as e:
                results[c.request_id] = RequestOutput(c.request_id, list(c.prompt_ids), [], [], "error", error=str(e))
        bar = tqdm(total=len(ids), desc="generate", unit="req", disable=not progress)
        bar.update(len(results))
        while self.has_unfinished():
            if between_steps is not None:
                between_steps()
            for ev in self.step():
                if on_event is not None:
                    on_event(ev)
                if ev.output is not None:
                    results[ev.request_id] = ev.output
                    bar.update(1)
            bar.set_postfix(tok_s=f"{self.stats.generated_tokens / max(self.stats.busy_s, 1e-9):.0f}")
        bar.close()
        return [results[rid] for rid in ids if rid in results]

