"""Exhaustive invariant checks for SuffixIndex (tests only): quadratic to cubic in the tokens, small indexes only.

Each failed check raises AssertionError whose message starts with the invariant's name.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rhymerl.histospec.suffix_index import SuffixIndex


def _fail(name: str, detail: str) -> None:
    raise AssertionError(f"{name}: {detail}")


def check_suffix_index(index: SuffixIndex) -> None:
    """Check the automaton's structure, language, endpos classes, counts and per-sequence pointers."""
    nxt, link, ln, cnt, wt = index._next, index._link, index._len, index._cnt, index._wt
    seqs = [s.tolist() for s in index._seqs]
    n = len(ln)
    limit = index.max_count_len

    # 1. Structure.
    if not (len(nxt) == len(link) == n == len(cnt) == len(wt)):
        _fail("parallel-arrays", "per-state lists have different lengths")
    if ln[0] != 0 or link[0] != -1:
        _fail("root", f"root must have len 0 and link -1, has {ln[0]}, {link[0]}")
    for v in range(1, n):
        if not 0 <= link[v] < n:
            _fail("link-range", f"state {v} links to {link[v]}")
        if not ln[link[v]] < ln[v]:
            _fail("link-shorter", f"state {v} (len {ln[v]}) links to {link[v]} (len {ln[link[v]]})")
    for v in range(n):
        for c, u in nxt[v].items():
            if not 0 < u < n:
                _fail("transition-range", f"{v} --{c}--> {u}")
            if ln[u] < ln[v] + 1:
                _fail("transition-longer", f"{v} (len {ln[v]}) --{c}--> {u} (len {ln[u]})")
            # A shorter suffix followed by c is a suffix of the longer one followed by c, so its
            # state is a suffix-link ancestor of u (or u itself).
            if v:
                w = nxt[link[v]].get(c)
                if w is None:
                    _fail("transition-suffix-closed", f"{v} --{c}--> exists but its link {link[v]} has no {c}")
                a = u
                while a != -1 and a != w:
                    a = link[a]
                if a != w:
                    _fail("transition-suffix-closed", f"link({v}) --{c}--> {w} is not an ancestor of {u}")
    if sum(len(s) for s in seqs) != index._num_tokens:
        _fail("num-tokens", f"{index._num_tokens} != {sum(len(s) for s in seqs)}")

    # 2. Language: every substring of every sequence is accepted, lands in a state whose length
    #    range contains it, and nothing else is accepted (path count equals distinct substrings).
    endpos: dict[int, dict[int, set]] = {}   # state -> length -> {(seq, end)}
    distinct: dict[tuple, int] = {}          # substring -> state
    for s_id, seq in enumerate(seqs):
        for i in range(len(seq)):
            v = 0
            for j in range(i, len(seq)):
                u = nxt[v].get(seq[j])
                if u is None:
                    _fail("accepts-substrings", f"seq {s_id}[{i}:{j + 1}] is not accepted")
                v = u
                length = j - i + 1
                if not ln[link[v]] < length <= ln[v]:
                    _fail("state-length-range", f"seq {s_id}[{i}:{j + 1}] (len {length}) in state {v} "
                                                f"with range ({ln[link[v]]}, {ln[v]}]")
                endpos.setdefault(v, {}).setdefault(length, set()).add((s_id, j))
                key = tuple(seq[i:j + 1])
                if distinct.setdefault(key, v) != v:
                    _fail("deterministic", f"substring {key} reaches two states")
    paths = [0] * n
    paths[0] = 1
    for v in sorted(range(n), key=ln.__getitem__):
        for u in nxt[v].values():
            paths[u] += paths[v]
    for v in range(1, n):
        if paths[v] == 0:
            _fail("reachable", f"state {v} is unreachable")
        if paths[v] != ln[v] - ln[link[v]]:
            _fail("paths-equal-length-range", f"state {v}: {paths[v]} paths, range size {ln[v] - ln[link[v]]}")
    if sum(paths) - 1 != len(distinct):
        _fail("accepts-only-substrings", f"{sum(paths) - 1} accepted strings, {len(distinct)} substrings")

    # 3. Endpos classes: the strings of a state end at the same positions, no two states share a
    #    class (minimality), and counts/weights are exact for strings of at most `limit` tokens.
    classes: dict[frozenset, int] = {}
    for v in range(1, n):
        by_len = endpos[v]
        sets = {frozenset(e) for e in by_len.values()}
        if len(sets) != 1:
            _fail("endpos-class", f"strings of state {v} end at different positions")
        (ends,) = sets
        other = classes.setdefault(ends, v)
        if other != v:
            _fail("minimal", f"states {other} and {v} have the same end positions")
        if ln[link[v]] + 1 <= limit:
            if cnt[v] != len(ends):
                _fail("count", f"state {v}: count {cnt[v]}, occurs {len(ends)} times")
            w = math.fsum(index._weights[s] for s, _ in ends)
            if not math.isclose(wt[v], w, rel_tol=1e-9, abs_tol=1e-9):
                _fail("weight", f"state {v}: weight {wt[v]}, expected {w}")

    # 4. Per-sequence pointers.
    for s_id, seq in enumerate(seqs):
        last = index._last[s_id]
        if ln[last] != len(seq) or (seq and distinct[tuple(seq)] != last):
            _fail("last-state", f"seq {s_id}: last state {last} is not its whole prefix")
        dl = index._dlen[s_id]
        if dl != min(len(seq), limit):
            _fail("count-suffix-len", f"seq {s_id}: {dl} != min({len(seq)}, {limit})")
        ds = index._dstate[s_id]
        while dl and dl <= ln[link[ds]]:  # the lazy repair the next append does
            ds = link[ds]
        if dl and distinct[tuple(seq[len(seq) - dl:])] != ds:
            _fail("count-suffix-state", f"seq {s_id}: state {ds} does not hold its last {dl} tokens")
