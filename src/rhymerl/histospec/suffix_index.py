"""Incremental suffix automaton over several token sequences, with occurrence counts and weights.

The structure is a *generalised* suffix automaton: it recognises exactly the substrings of each
added sequence taken on its own, so a match never runs from the end of one sequence into the start
of another. Every state stands for a set of substrings that end at the same positions (the same
"endpos" set); for each state we keep how many positions that is (`count`) and the summed weight of
the sequences those positions belong to (`weight`). The tokens that follow a matched string x are
then the outgoing transitions of x's state, and the number of occurrences of x followed by t is the
count of the state reached by t.

Counts are maintained only for strings of at most `max_count_len` tokens. Keeping them exact for
every length would cost, per appended token, one update per state on the suffix-link chain, which
is as long as the sequence in a repeated-token loop ([5, 5, 5, ...]), i.e. quadratic time. Bounding
the length bounds that chain, so appending a token costs O(max_count_len) in the worst case and a
few steps on ordinary text. Drafting only reads short strings (a match window of a few tokens plus
a draft depth), so nothing is lost.

States are plain ints (0 is the root, the empty string). They stay valid while the index grows,
but the strings a state stands for may shrink when a later insertion splits it; `longest_match`,
`step` and `continuations` are meant to be used between mutations.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

# Token ids are stored as signed 64-bit ints: compact (8 bytes, no int objects) and any id fits.
_TOKEN_TYPECODE = "q"


class SuffixIndex:
    """Generalised suffix automaton over token sequences with per-sequence weights.

    Any sequence may be extended at any time (`extend`), not only the last one added: the
    automaton inserts each token after the state of its own sequence's current prefix, and
    per-sequence pointers are repaired lazily when insertions into other sequences split states.

    Args:
        max_count_len: occurrence counts and weights are exact for strings of at most this many
            tokens (see the module docstring); `longest_match` returns at most max_count_len - 1
            tokens, so the counts of the match's continuations are exact.
    """

    __slots__ = ("_next", "_link", "_len", "_cnt", "_wt",
                 "_seqs", "_weights", "_last", "_dstate", "_dlen", "_num_tokens", "max_count_len")

    def __init__(self, max_count_len: int = 64):
        if max_count_len < 1:
            raise ValueError(f"max_count_len must be >= 1, got {max_count_len}")
        self.max_count_len = max_count_len
        # Parallel per-state lists (cheaper in memory and faster to index than state objects).
        self._next: list[dict[int, int]] = [{}]  # token -> state
        self._link: list[int] = [-1]             # suffix link
        self._len: list[int] = [0]               # length of the longest string of the state
        self._cnt: list[int] = [0]               # occurrences (endpos size), exact if minlen <= max_count_len
        self._wt: list[float] = [0.0]            # summed weight of those occurrences
        # Per-sequence data.
        self._seqs: list[array] = []
        self._weights: list[float] = []
        self._last: list[int] = []    # state of the whole sequence so far (its longest string)
        # State holding the sequence's suffix of length _dlen = min(len, max_count_len): the start
        # of the suffix-link chain whose counts a new token must increment.
        self._dstate: list[int] = []
        self._dlen: list[int] = []
        self._num_tokens = 0

    # ------------------------------------------------------------------ sizes

    @property
    def num_tokens(self) -> int:
        """Total number of tokens in all sequences."""
        return self._num_tokens

    @property
    def num_sequences(self) -> int:
        """Number of sequences added."""
        return len(self._seqs)

    @property
    def num_states(self) -> int:
        """Number of automaton states, the root included (at most 2 * num_tokens + 1)."""
        return len(self._len)

    def sequence(self, seq_id: int) -> list[int]:
        """The tokens of sequence `seq_id` (a copy)."""
        self._check_id(seq_id)
        return self._seqs[seq_id].tolist()

    def weight(self, seq_id: int) -> float:
        """The weight sequence `seq_id` was added with."""
        self._check_id(seq_id)
        return self._weights[seq_id]

    # ------------------------------------------------------------------ mutation

    def add(self, tokens: Iterable[int], weight: float = 1.0) -> int:
        """Add a new sequence (possibly empty) and return its id (0, 1, 2, ... in order).

        Costs O(len(tokens)) amortised for the automaton, plus per token one count update per
        distinct occurrence class of its last `max_count_len` tokens (a few on ordinary text, at
        most max_count_len in a loop). `weight` (e.g. the response's reward) is summed into the
        weight of every occurrence that lies in this sequence.
        """
        seq_id = len(self._seqs)
        self._seqs.append(array(_TOKEN_TYPECODE))
        self._weights.append(float(weight))
        self._last.append(0)
        self._dstate.append(0)
        self._dlen.append(0)
        self._append(seq_id, tokens)
        return seq_id

    def extend(self, seq_id: int, tokens: Iterable[int]) -> None:
        """Append `tokens` to sequence `seq_id`, exactly as if they had been part of it from the start.

        Any sequence may be extended, in any interleaving with other sequences (siblings that are
        generated concurrently); the result is the same automaton as adding every sequence whole.
        Raises ValueError for an unknown `seq_id`.
        """
        self._check_id(seq_id)
        self._append(seq_id, tokens)

    def _check_id(self, seq_id: int) -> None:
        if not (isinstance(seq_id, int) and 0 <= seq_id < len(self._seqs)):
            raise ValueError(f"unknown sequence id {seq_id!r} (index has {len(self._seqs)} sequences)")

    def _append(self, seq_id: int, tokens: Iterable[int]) -> None:
        # Hot loop: everything is bound to locals; the structural part is the textbook online
        # generalised suffix automaton (with the "transition already exists" case, which is what
        # keeps sequences separate and the automaton minimal).
        nxt, link, ln, cnt, wt = self._next, self._link, self._len, self._cnt, self._wt
        seq = self._seqs[seq_id]
        start = len(seq)
        if isinstance(tokens, array) and tokens.typecode != _TOKEN_TYPECODE:
            tokens = tokens.tolist()  # array.extend refuses arrays of another item type
        seq.extend(tokens)
        w = self._weights[seq_id]
        limit = self.max_count_len
        last = self._last[seq_id]
        ds, dl = self._dstate[seq_id], self._dlen[seq_id]
        for i in range(start, len(seq)):
            c = seq[i]
            q = nxt[last].get(c)
            if q is not None:
                # The extended prefix already occurs (in another sequence): reuse its state, or
                # split off the part of it that is exactly one token longer than `last`.
                if ln[q] == ln[last] + 1:
                    cur = q
                else:
                    cur = len(ln)
                    nxt.append(dict(nxt[q]))
                    link.append(link[q])
                    ln.append(ln[last] + 1)
                    cnt.append(cnt[q])  # same endpos so far; the new position is added below
                    wt.append(wt[q])
                    link[q] = cur
                    p = last
                    while p != -1 and nxt[p].get(c) == q:
                        nxt[p][c] = cur
                        p = link[p]
            else:
                cur = len(ln)
                nxt.append({})
                link.append(0)
                ln.append(ln[last] + 1)
                cnt.append(0)
                wt.append(0.0)
                p = last
                while p != -1 and c not in nxt[p]:
                    nxt[p][c] = cur
                    p = link[p]
                if p != -1:
                    q = nxt[p][c]
                    if ln[p] + 1 == ln[q]:
                        link[cur] = q
                    else:
                        clone = len(ln)
                        nxt.append(dict(nxt[q]))
                        link.append(link[q])
                        ln.append(ln[p] + 1)
                        cnt.append(cnt[q])
                        wt.append(wt[q])
                        while p != -1 and nxt[p].get(c) == q:
                            nxt[p][c] = clone
                            p = link[p]
                        link[q] = clone
                        link[cur] = clone
            last = cur

            # Counts: the new position ends the sequence's suffixes of every length; the ones of
            # at most `limit` tokens live on the suffix-link chain starting at the state of the
            # length-min(len, limit) suffix. Splits (here or in other sequences) may have moved
            # that suffix into a clone, which is always a suffix-link ancestor: walk up to it.
            if dl:
                while dl <= ln[link[ds]]:
                    ds = link[ds]
            ds = nxt[ds][c]
            dl += 1
            if dl > limit:
                dl = limit
                while dl <= ln[link[ds]]:
                    ds = link[ds]
            v = ds
            while v:
                cnt[v] += 1
                wt[v] += w
                v = link[v]
        self._last[seq_id] = last
        self._dstate[seq_id] = ds
        self._dlen[seq_id] = dl
        self._num_tokens += len(seq) - start

    # ------------------------------------------------------------------ queries

    def longest_match(self, context: Sequence[int], max_window: int = 7, min_len: int = 2,
                      need_continuation: bool = True) -> tuple[int, int | None]:
        """Longest suffix of `context` that occurs in the index.

        Only the last `max_window` tokens are looked at, and never more than `max_count_len - 1`
        so that the counts of the match's continuations are exact.
        With `need_continuation` (the default, what drafting wants) the suffix must occur at least
        once followed by a token of the same sequence; without it, an occurrence at the very end
        of a sequence is enough. Returns `(length, state)`, or `(0, None)` when no suffix of at
        least `min_len` tokens qualifies.
        """
        if min_len < 1:
            raise ValueError(f"min_len must be >= 1, got {min_len}")
        window = min(max_window, self.max_count_len - 1, len(context))
        if window < min_len:
            return 0, None
        nxt, link, ln = self._next, self._link, self._len
        # Matching statistics: after each token, (v, n) is the longest suffix of the window read so
        # far that occurs, n its length, v its state.
        v, n = 0, 0
        for i in range(len(context) - window, len(context)):
            c = context[i]
            while v and c not in nxt[v]:
                v = link[v]
                n = ln[v]
            u = nxt[v].get(c)
            if u is None:
                v, n = 0, 0
            else:
                v, n = u, n + 1
        if need_continuation:
            # All strings of a state have the same followers, so step to shorter suffixes
            # (suffix links) until one has any.
            while v and not nxt[v]:
                v = link[v]
                n = ln[v]
        if n < min_len:
            return 0, None
        return n, v

    def step(self, state: int, token: int) -> int | None:
        """The state of (strings of `state`) + `token`, or None if that string never occurs."""
        return self._next[state].get(token)

    def continuations(self, state: int) -> dict[int, tuple[int, float]]:
        """Tokens that follow the strings of `state`: token -> (occurrences followed by it, their summed weight)."""
        cnt, wt = self._cnt, self._wt
        return {tok: (cnt[u], wt[u]) for tok, u in self._next[state].items()}

    def count(self, state: int) -> int:
        """Number of occurrences (end positions) of the strings of `state` (root: 0)."""
        return self._cnt[state]

    def total_weight(self, state: int) -> float:
        """Summed weight of the occurrences of the strings of `state`."""
        return self._wt[state]

    def state_len(self, state: int) -> int:
        """Length of the longest string `state` stands for."""
        return self._len[state]

    def find(self, tokens: Iterable[int]) -> int | None:
        """State of the string `tokens` (the root for an empty one), or None if it does not occur."""
        v, nxt = 0, self._next
        for t in tokens:
            v = nxt[v].get(t)
            if v is None:
                return None
        return v

    def __repr__(self) -> str:
        return (f"SuffixIndex(sequences={self.num_sequences}, tokens={self.num_tokens}, "
                f"states={self.num_states}, max_count_len={self.max_count_len})")
