"""The rollout engine: continuous batching over a preallocated KV cache.

`step()` reads as schedule -> run -> postprocess: admit waiting requests into free slots, run one forward
over every running slot's new tokens, sample one token per slot with keyed randomness, and retire the
sequences that hit EOS, a stop string or their length limit (their slots are refilled next step).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from tqdm import tqdm

from rhymerl.engine.kv_cache import KVCache
from rhymerl.engine.model_runner import ModelRunner, SlotInput
from rhymerl.engine.sampler import sample
from rhymerl.engine.sampling_params import SamplingParams, keyed_uniform
from rhymerl.engine.scheduler import Scheduler
from rhymerl.engine.sequence import RequestOutput, Sequence
from rhymerl.model.decoder import Decoder


@dataclass
class EngineStats:
    forward_passes: int = 0
    tokens_forwarded: int = 0  # tokens fed through the model: prompts + decode tokens (+ drafts)
    prompt_tokens: int = 0
    generated_tokens: int = 0  # tokens appended to outputs
    busy_s: float = 0.0  # wall time inside step()
    forward_s: float = 0.0  # of which in the model's forward

    @property
    def tokens_per_forward(self) -> float:
        """Generated tokens per forward pass: the number speculative decoding raises above 1 per slot."""
        return self.generated_tokens / max(self.forward_passes, 1)


@dataclass
class StepEvent:
    """One request's progress in one step (for streaming)."""

    request_id: int | str
    new_token_ids: list[int]
    output: RequestOutput | None  # set when the request finished in this step


class Engine:
    def __init__(self, model: Decoder, tokenizer=None, *, num_slots: int = 8, max_model_len: int = 2048,
                 max_prefill_tokens: int = 4096, eos_token_ids: Iterable[int] | None = None):
        cfg = model.cfg
        param = next(model.parameters())
        self.model, self.tokenizer = model, tokenizer
        self.max_model_len = max_model_len
        self.cache = KVCache(cfg.num_layers, num_slots, max_model_len, cfg.num_kv_heads, cfg.head_dim,
                             param.dtype, param.device)
        self.runner = ModelRunner(model, self.cache)
        self.scheduler = Scheduler(num_slots, max_prefill_tokens)
        eos = set(cfg.eos_token_ids if eos_token_ids is None else eos_token_ids)
        if eos_token_ids is None and tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.stats = EngineStats()
        self._next_id = 0

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: int | str | None = None) -> int | str:
        """Queue a request; raise ValueError (naming the request and the broken rule) if it is invalid."""
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
        self.scheduler.add(Sequence(request_id, list(prompt_ids), params))
        return request_id

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step -------------------------------------------------------------------------------
    def step(self) -> list[StepEvent]:
        t0 = time.perf_counter()
        seqs = self.scheduler.schedule()
        if not seqs:
            return []
        inputs = []
        for seq in seqs:
            new = seq.uncached_ids
            inputs.append(SlotInput(seq.slot, seq.num_cached, new, logits_from=len(new) - 1))
            self.stats.prompt_tokens += len(new) if seq.num_cached == 0 else 0
            self.stats.tokens_forwarded += len(new)
        t1 = time.perf_counter()
        logits = self.runner.run(inputs)  # [len(seqs), vocab]: one row per slot (its last new token)
        self.stats.forward_s += time.perf_counter() - t1
        self.stats.forward_passes += 1
        tokens, logprobs = self._sample(seqs, logits)
        events = [self._append(seq, tok, lp) for seq, tok, lp in zip(seqs, tokens, logprobs)]
        self.stats.busy_s += time.perf_counter() - t0
        return events

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """Sample one token per row; rows with the same SamplingParams share one call."""
        groups: dict[SamplingParams, list[int]] = defaultdict(list)
        for i, seq in enumerate(seqs):
            groups[seq.params].append(i)
        tokens, logprobs = [0] * len(seqs), [0.0] * len(seqs)
        for params, rows in groups.items():
            # The draw for output token j of a request depends on (seed, request, j) only.
            u = [keyed_uniform(params.seed, seqs[i].key, len(seqs[i].output_ids)) for i in rows]
            sel = logits if len(rows) == len(seqs) else logits[rows]
            toks, lps = sample(sel, params, u)
            for i, t, lp in zip(rows, toks, lps):
                tokens[i], logprobs[i] = t, lp
        return tokens, logprobs

    def _append(self, seq: Sequence, token: int, logprob: float) -> StepEvent:
        seq.num_cached = seq.num_tokens  # everything fed this step is now in the cache
        if not seq.output_ids:
            seq.first_token = time.perf_counter()
        seq.output_ids.append(token)
        seq.logprobs.append(logprob)
        self.stats.generated_tokens += 1
        reason = self._finish_reason(seq)
        if reason is None:
            return StepEvent(seq.request_id, [token], None)
        seq.finish_reason = reason
        self.scheduler.finish(seq)
        return StepEvent(seq.request_id, [token], self._output(seq))

    def _finish_reason(self, seq: Sequence) -> str | None:
        p = seq.params
        if not p.ignore_eos and seq.output_ids[-1] in self.eos_token_ids:
            return "stop"
        if p.stop and self.tokenizer is not None:
            # Only the tail can hold a stop string that was just completed.
            window = max(len(s) for s in p.stop) + 4
            tail = self.tokenizer.decode(seq.output_ids[-window:], skip_special_tokens=False)
            if any(s in tail for s in p.stop):
                return "stop"
        if len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _output(self, seq: Sequence) -> RequestOutput:
        if self.tokenizer is not None:
            text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
            for s in seq.params.stop:
                if s in text:  # the stop string and what follows are not part of the answer
                    text = text[: text.index(s)]
            seq.text = text
        return seq.to_output()

    # ---- batch API ------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 request_ids: list | None = None, progress: bool = False,
                 on_event: Callable[[StepEvent], None] | None = None) -> list[RequestOutput]:
        """Run prompts (token ids) to completion; results in input order. An invalid request is rejected
        alone: its result has finish_reason "error" and the message, the others complete."""
        if not prompts:
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
        bar = tqdm(total=len(prompts), desc="generate", unit="req", disable=not progress)
        bar.update(len(results))
        while self.has_unfinished():
            for ev in self.step():
                if on_event is not None:
                    on_event(ev)
                if ev.output is not None:
                    results[ev.request_id] = ev.output
                    bar.update(1)
            bar.set_postfix(tok_s=f"{self.stats.generated_tokens / max(self.stats.busy_s, 1e-9):.0f}")
        bar.close()
        return [results[rid] for rid in ids]
