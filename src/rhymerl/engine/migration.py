"""Migration between engines: a request handed over at a step boundary, the parts that are not the engine's.

`Engine.extract` takes an unfinished request out of an engine between two steps, freeing its slot, as a
`Continuation` (plain, picklable data: `rhymerl.engine.sequence`). Another engine on the same weights adopts it
(`Engine.adopt`): `resume` gives the new sequence the generated tokens, its first step prefills prompt +
generated tokens (`count_reprefill` charges that share of the forward to the migration), then it decodes on at
output position len(output_ids). Keyed draws (seed, request, position) make the rest of the response the
tokens the first engine would have drawn. This module knows sequences, continuations and counters, not the
engine: the engine calls it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from rhymerl.engine.sequence import Continuation, Sequence

if TYPE_CHECKING:
    from rhymerl.engine.model_runner import SlotInput
    from rhymerl.engine.stats import EngineStats


def resume(seq: Sequence, c: Continuation, max_model_len: int) -> None:
    """Give `seq` (a new request built from `c`) the tokens `c` generated; ValueError when they do not fit in
    `max_model_len` or `c.params.max_tokens`, or lack their logprobs."""
    if len(c.logprobs) != len(c.output_ids):
        raise ValueError(f"request {c.request_id!r}: continuation has {len(c.output_ids)} tokens but "
                         f"{len(c.logprobs)} logprobs (one per generated token)")
    if len(c.output_ids) >= c.params.max_tokens or len(c.prompt_ids) + len(c.output_ids) >= max_model_len:
        raise ValueError(f"request {c.request_id!r}: continuation with {len(c.output_ids)} generated tokens "
                         f"has no room left (max_tokens {c.params.max_tokens}, max_model_len {max_model_len})")
    seq.output_ids, seq.logprobs, seq.resumed = list(c.output_ids), list(c.logprobs), True
    seq.first_token = time.perf_counter()


def count_reprefill(stats: EngineStats, seqs: list[Sequence], news: list[list[int]], inputs: list[SlotInput],
                    forward_s: float) -> None:
    """After a step's forward: the adopted requests it re-prefilled (`news`: the tokens each sequence fed,
    drafts aside), and their tokens' share of the forward's `forward_s` seconds."""
    resumed = sum(len(new) for seq, new in zip(seqs, news) if seq.resumed)
    if resumed:
        stats.migration_prefill_tokens += resumed
        stats.migration_prefill_s += forward_s * resumed / sum(len(x.tokens) for x in inputs)
        for seq in seqs:
            seq.resumed = False
