"""The stop rule (torch-free): when a request ends, and the answer text it returns.

A request ends on an EOS token (unless `ignore_eos`), a stop string in its decoded tail, `max_tokens`, or
the end of the context; its text is the decoded response cut before the first stop string.
"""

from __future__ import annotations

from collections.abc import Set

from rhymerl.engine.sequence import Sequence


def finish_reason(seq: Sequence, eos_token_ids: Set[int], tokenizer, max_model_len: int) -> str | None:
    """"stop", "length" or None (goes on), just after `seq` appended a token. Stop strings need a tokenizer."""
    p = seq.params
    if not p.ignore_eos and seq.output_ids[-1] in eos_token_ids:
        return "stop"
    if p.stop and tokenizer is not None:
        # Only the tail can hold a stop string that was just completed.
        window = max(len(s) for s in p.stop) + 4
        tail = tokenizer.decode(seq.output_ids[-window:], skip_special_tokens=False)
        if any(s in tail for s in p.stop):
            return "stop"
    if len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= max_model_len:
        return "length"
    return None


def answer_text(seq: Sequence, tokenizer) -> str:
    """The decoded response; a stop string and what follows are not part of the answer."""
    text = tokenizer.decode(seq.output_ids, skip_special_tokens=True)
    for s in seq.params.stop:
        if s in text:
            text = text[: text.index(s)]
    return text
