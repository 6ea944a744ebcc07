"""Migration between engines: a request handed over at a step boundary.

`extract` takes an unfinished request out of an engine between two steps, freeing its slot, as a
`Continuation` (plain, picklable data: `rhymerl.engine.sequence`). `resume` sets up the request that another
engine on the same weights builds from it (`Engine.adopt`): its first step prefills prompt + generated
tokens (`count_reprefill` charges that share of the forward to the migration), then it decodes on at output
position len(output_ids). Keyed draws (seed, request, position) make the rest of the response the tokens
the first engine would have drawn.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from rhymerl.engine.sequence import Continuation, Sequence, Status

if TYPE_CHECKING:
    from rhymerl.engine.engine import Engine
    from rhymerl.engine.model_runner import SlotInput
    from rhymerl.engine.stats import EngineStats


def extract(engine: Engine, request_id: int | str) -> Continuation:
    """Take an unfinished request (waiting or running) out of `engine` between two steps, freeing its slot.
    KeyError when no unfinished request has that id."""
    seq = next((q for q in engine.unfinished() if q.request_id == request_id), None)
    if seq is None:
        raise KeyError(f"request {request_id!r} is not unfinished in this engine (extract takes a waiting "
                       f"or running request)")
    if seq.status == Status.WAITING:
        engine.scheduler.waiting.remove(seq)
    else:
        engine.scheduler.finish(seq)
        for moved, old_slot in engine.scheduler.compact():
            engine.runner.move(old_slot, moved.slot, moved.num_cached)
    seq.status = Status.FINISHED
    engine.stats.handed_over += 1
    if engine.speculator is not None and not engine.has_unfinished():
        engine.speculator.groups.clear()  # the batch is over here: its sibling indexes go, as after a step
    return seq.to_continuation()


def resume(engine: Engine, seq: Sequence, c: Continuation) -> None:
    """Give `seq` (a new request of `engine`, built from `c`) the tokens `c` generated; ValueError when they
    do not fit or lack their logprobs."""
    if len(c.logprobs) != len(c.output_ids):
        raise ValueError(f"request {c.request_id!r}: continuation has {len(c.output_ids)} tokens but "
                         f"{len(c.logprobs)} logprobs (one per generated token)")
    if len(c.output_ids) >= c.params.max_tokens or len(c.prompt_ids) + len(c.output_ids) >= engine.max_model_len:
        raise ValueError(f"request {c.request_id!r}: continuation with {len(c.output_ids)} generated tokens "
                         f"has no room left (max_tokens {c.params.max_tokens}, max_model_len {engine.max_model_len})")
    seq.output_ids, seq.logprobs, seq.resumed = list(c.output_ids), list(c.logprobs), True
    seq.first_token = time.perf_counter()
    engine.stats.migrations += 1
    if engine.speculator is not None:  # its own and its siblings' indexes learn what it has generated
        seq.spec = engine.speculator.start(seq.group, seq.prompt_ids)
        engine.speculator.observe(seq.spec, seq.output_ids)


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
