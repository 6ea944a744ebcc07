"""How well a prompt's answers draft, read from its recorded tokens alone (docs/design.md, section 4, Pricing).

HistoPipe prices a request under HistoSpec in predicted forwards, its predicted tokens over its prompt's
tokens per forward. Measured in the calls (`RequestOutput.forwards`) that rate follows each worker's timing:
HistoSpec drafts what its cost model, its online correction and its pause (drafts that stopped paying, by
the wall clock) say, so one prompt ran at 1.07 to 2.35 tokens per forward over four runs on the same tokens.
Here it is counted from the tokens instead, which keyed sampling makes the same in every run: each recorded
response of the prompt is replayed against a suffix-match drafter that drafts from the prompt's other
recorded responses and from the response's own earlier tokens (HistoSpec's sources: history, siblings,
self), and `draftable_runs` gives, at each position, how many of the next tokens the draft would have
matched (-1 where nothing matched: no draft). A walk at a fixed draft length k (`replay_walk`) then counts
the forwards, one committing min(run, k) + 1 tokens, and the draft tokens verified (k wherever a match
proposed a draft, accepted or not). `pricing.ReplayedRates` picks k from the cost model.

The drafter replayed is simpler than HistoSpec's (one chain, from the latest occurrence of the longest
match in HistoSpec's window, where HistoSpec grows a tree by counts and verifies what its calibration
expects to pay): it ranks prompts by how well they draft, which is what the plan needs, not each forward.
"""

from __future__ import annotations

from collections.abc import Sequence

WINDOW = 7  # the longest context suffix matched (HistoSpec's `SuffixIndex.longest_match` window)
MIN_MATCH = 2  # the shortest (its min_len)


def _index(sources: Sequence[Sequence[int]]) -> dict[tuple[int, ...], list[tuple[int, int]]]:
    """n-gram (MIN_MATCH..WINDOW tokens) -> its two latest occurrences from distinct sources, newest first,
    each (source, index of the token after it); only occurrences with a continuation."""
    out: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for s, seq in enumerate(sources):
        for end in range(MIN_MATCH, len(seq)):  # a continuation: seq[end] exists
            for m in range(MIN_MATCH, min(WINDOW, end) + 1):
                key = tuple(seq[end - m:end])
                hits = out.get(key)
                if hits is None:
                    out[key] = [(s, end)]
                elif hits[0][0] == s:
                    hits[0] = (s, end)
                else:
                    out[key] = [(s, end), hits[0]]
    return out


def _common(a: Sequence[int], i: int, b: Sequence[int], j: int, limit: int, b_end: int | None = None) -> int:
    """Length of the common prefix of a[i:] and b[j:b_end], at most `limit`."""
    b_end = len(b) if b_end is None else b_end
    n = 0
    while n < limit and i + n < len(a) and j + n < b_end and a[i + n] == b[j + n]:
        n += 1
    return n


def draftable_runs(prompt: Sequence[int], responses: Sequence[Sequence[int]], max_draft: int) -> list[list[int]]:
    """Per response, per position i >= 1: how many of tokens i, i + 1, ... a draft made after token i - 1
    would have matched (at most `max_draft`). The draft is the continuation of the latest occurrence of the
    longest suffix (WINDOW down to MIN_MATCH tokens) of prompt + response[:i] in the prompt's other
    responses (each after the prompt's last WINDOW tokens, as HistoSpec indexes siblings), else in the
    prompt's tail and the response's own committed tokens (HistoSpec's "self"); at equal length the other
    responses win, as HistoSpec trusts them more. -1 where no suffix matched (and at position 0, the
    prefill's token): nothing is drafted there."""
    tail = list(prompt[-WINDOW:])
    sources = [tail + list(r) for r in responses]
    shared = _index(sources)
    out = []
    for j, response in enumerate(responses):
        seq = sources[j]
        runs = [-1] * len(response)
        own: dict[tuple[int, ...], int] = {}  # n-gram -> the latest end (index of its next token) committed
        filled = MIN_MATCH  # own holds the grams ending before this
        for i in range(1, len(response)):
            at = len(tail) + i  # seq[:at] is committed; seq[at] is the token to draft
            for end in range(filled, at):  # each gram's next token seq[end] is committed
                for m in range(MIN_MATCH, min(WINDOW, end) + 1):
                    own[tuple(seq[end - m:end])] = end
            filled = max(filled, at)
            for m in range(min(WINDOW, at), MIN_MATCH - 1, -1):  # longest match first
                key = tuple(seq[at - m:at])
                hit = next((h for h in shared.get(key, ()) if h[0] != j), None)
                if hit is not None:
                    runs[i] = _common(seq, at, sources[hit[0]], hit[1], max_draft)
                    break
                mine = own.get(key)
                if mine is not None:  # its continuation is committed up to at only
                    runs[i] = _common(seq, at, seq, mine, max_draft, b_end=at)
                    break
        out.append(runs)
    return out


def replay_walk(runs: Sequence[int], draft: int) -> tuple[int, int]:
    """(forwards, draft tokens verified) to commit a response whose `draftable_runs` are `runs` when each
    forward verifies up to `draft` draft tokens: the prefill commits token 0; each forward after it verifies
    `draft` tokens where a match proposed a draft (its continuation may be shorter: counted whole) and
    commits min(run, draft) + 1."""
    if not runs:
        return 0, 0
    forwards, drafted, i = 1, 0, 1
    while i < len(runs):
        if draft and runs[i] >= 0:
            drafted += draft
        i += min(max(runs[i], 0), draft) + 1
        forwards += 1
    return forwards, drafted
