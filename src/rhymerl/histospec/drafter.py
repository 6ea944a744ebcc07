"""Draft trees for one running sequence, from history, siblings and the sequence itself (docs/histospec.md, "Drafts").

Three sources, most trusted first:

- "history":  the prompt's previous responses (`HistoryIndex.index`);
- "siblings": the current group's responses, finished or still running: a per-group SuffixIndex the
  engine feeds (`sid = group.add(prompt[-8:])` when a member starts, then `group.extend(sid, new)`
  after every step; the running sequence may be in it too: its own occurrence at the very end has
  no continuation and so never drives a draft);
- "self":     the sequence's own prompt + output (`own.add(prompt)`, then `own.extend(0, new)`).

The recent tokens are matched against each source (window `max_window` tokens down to `min_len`);
the source with the longest match wins; among equally long matches, the one most certain of the next
token (`next_token_certainty`), then the more trusted one. From the matched state
the draft tree grows best-first by path probability, where a child's share at a node is

    score(child) / sum of the scores of all children of the node,
    score = count                                   (reward_weighted=False)
    score = max(count + reward_alpha * weight,      (reward_weighted=True)
                MIN_REWARD_FACTOR * count)

count being how many occurrences of the path continue with the child's token and weight the summed
weight (reward) of their sequences. So with rewards in [0, 1] and alpha = 1, a branch taken only by
reward-1 responses counts double one taken only by reward-0 responses; with every weight equal the
shares are the plain count shares; negative rewards can shrink a branch to 10% of its count but
never remove it (it is still a likely continuation under the policy). Each node keeps at most
`max_branches` children (the best ones), the tree has at most `max_tokens` nodes and `max_depth`
levels, and no node is expanded past a token of `eos_token_ids` (the EOS itself may be drafted).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from heapq import heappop, heappush, nsmallest
from typing import TYPE_CHECKING

from rhymerl.histospec.suffix_index import SuffixIndex

if TYPE_CHECKING:
    from rhymerl.histospec.history_index import HistoryIndex

# A branch's score never drops below this fraction of its count under reward weighting.
MIN_REWARD_FACTOR = 0.1
SOURCES = ("history", "siblings", "self")


@dataclass
class Draft:
    """A draft token tree in topological order (every parent before its children).

    `parents[i]` is the index of token i's parent in `tokens`, or -1 when token i directly follows
    the sequence's last committed token. `probs[i]` is the estimated probability of the path from
    the root to token i (product of the branch shares). `source` is "history", "siblings" or
    "self" ("" for an empty draft); `match_len` the length of the context suffix that was matched.
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    source: str = ""
    match_len: int = 0
    probs: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        """Depth of each node (1 for children of the committed token)."""
        depths: list[int] = []
        for p in self.parents:
            depths.append(1 if p < 0 else depths[p] + 1)
        return depths

    def paths(self) -> list[list[int]]:
        """Token paths from the root to every leaf, in the order of the leaves."""
        has_child = [False] * len(self.tokens)
        for p in self.parents:
            if p >= 0:
                has_child[p] = True
        out = []
        for i, leaf in enumerate(has_child):
            if not leaf:
                path, j = [], i
                while j >= 0:
                    path.append(self.tokens[j])
                    j = self.parents[j]
                out.append(path[::-1])
        return out

    def is_chain(self) -> bool:
        """True when the tree is a single path (or empty)."""
        return all(p == i - 1 for i, p in enumerate(self.parents))


def next_token_certainty(index: SuffixIndex, state: int) -> float:
    """How sure `index` is of what follows the match `state`: the share of its most frequent continuation,
    smoothed as (top + 1) / (all + 2), so one occurrence gives 2/3 and ten that agree 11/12 (counts only,
    also when drafting is reward-weighted)."""
    counts = [index._cnt[u] for u in index._next[state].values()]
    return (max(counts, default=0) + 1) / (sum(counts) + 2)


class Drafter:
    """Proposes a draft tree for one running sequence (see the module docstring for the rules).

    Args:
        history: the HistoryIndex to look prompts up in when `draft` gets `prompt=` and no index.
        max_tokens, max_depth, max_branches: default tree budget (nodes), depth and fan-out;
            `max_branches=1` gives a chain.
        max_window, min_len: longest and shortest suffix of the context that is matched.
        reward_weighted, reward_alpha: use sequence weights (rewards) as a bonus on counts.
        eos_token_ids: tokens after which the walk stops.
    """

    def __init__(self, history: HistoryIndex | None = None, *, max_tokens: int = 32, max_depth: int = 32,
                 max_branches: int = 4, max_window: int = 7, min_len: int = 2,
                 reward_weighted: bool = False, reward_alpha: float = 1.0,
                 eos_token_ids: Iterable[int] = ()):
        if min_len < 1 or max_window < min_len:
            raise ValueError(f"need 1 <= min_len <= max_window, got {min_len}, {max_window}")
        if max_branches < 1:
            raise ValueError(f"max_branches must be >= 1, got {max_branches}")
        self.history = history
        self.max_tokens = max_tokens
        self.max_depth = max_depth
        self.max_branches = max_branches
        self.max_window = max_window
        self.min_len = min_len
        self.reward_weighted = reward_weighted
        self.reward_alpha = reward_alpha
        self.eos_token_ids = frozenset(eos_token_ids)

    def draft(self, context: Sequence[int], *, prompt: Sequence[int] | str | None = None,
              history: SuffixIndex | None = None, siblings: SuffixIndex | None = None,
              own: SuffixIndex | None = None, max_tokens: int | None = None,
              max_depth: int | None = None, max_branches: int | None = None) -> Draft:
        """Draft for a sequence whose tokens so far end with `context` (only its tail is read).

        `history` is the prompt's history index; when it is None and `prompt` (token ids or a
        `prompt_key`) is given, it is looked up in the store this Drafter was made with (hashing
        the prompt each call: pass the index itself in a hot loop). Any source may be None.
        The keyword budgets override the defaults for this call (the adaptive draft length).
        Returns an empty Draft when nothing matches or the budget is 0.
        """
        budget = self.max_tokens if max_tokens is None else max_tokens
        if budget <= 0:
            return Draft()
        if history is None and prompt is not None and self.history is not None:
            history = self.history.index(prompt)
        matches = []  # (length, state, index, source), most trusted source first
        for source, index in zip(SOURCES, (history, siblings, own)):
            if index is not None and index._num_tokens:
                n, state = index.longest_match(context, self.max_window, self.min_len)
                if n:
                    matches.append((n, state, index, source))
        if not matches:
            return Draft()
        longest = max(m[0] for m in matches)
        # Of the sources that match as long, the one most certain of the next token (`next_token_certainty`):
        # a response caught in a loop has seen its last 7 tokens followed by one thing again and again, while
        # the history may hold them followed by several. max() keeps the first of equals: the more trusted.
        best_len, best_state, best_index, best_source = max(
            (m for m in matches if m[0] == longest), key=lambda m: next_token_certainty(m[2], m[1]))
        depth = self.max_depth if max_depth is None else max_depth
        branches = self.max_branches if max_branches is None else max_branches
        # Counts are exact only for strings of at most max_count_len tokens (match + path).
        depth = min(depth, best_index.max_count_len - best_len)
        tokens, parents, probs = self._grow(best_index, best_state, budget, depth, max(1, branches))
        return Draft(tokens, parents, best_source if tokens else "", best_len if tokens else 0, probs)

    def _grow(self, index: SuffixIndex, root: int, budget: int, max_depth: int,
              branches: int) -> tuple[list[int], list[int], list[float]]:
        # Best-first: the heap holds candidate nodes (-path probability, push order, token, state,
        # parent index, depth); popping one commits it to the tree and pushes its best children.
        # Push order breaks probability ties, so siblings keep their score order.
        nxt, cnt, wt = index._next, index._cnt, index._wt
        eos = self.eos_token_ids
        weighted, alpha = self.reward_weighted, self.reward_alpha
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        if max_depth < 1:
            return tokens, parents, probs
        heap: list = []
        order = 0
        v, parent, prob, depth = root, -1, 1.0, 0
        while True:
            # Push the children of node (v, parent, prob, depth).
            children = nxt[v]
            if len(children) == 1:
                # The common case deep in a history match: a unique continuation, share 1.
                for tok, u in children.items():
                    heappush(heap, (-prob, order, tok, u, parent, depth + 1))
                    order += 1
            elif children:
                if weighted:
                    scored = []
                    for tok, u in children.items():
                        c = cnt[u]
                        s = c + alpha * wt[u]
                        floor = MIN_REWARD_FACTOR * c
                        scored.append((-(s if s > floor else floor), tok, u))
                else:
                    scored = [(-cnt[u], tok, u) for tok, u in children.items()]
                total = -sum(s for s, _, _ in scored)
                if total > 0:
                    top = nsmallest(branches, scored) if len(scored) > 2 * branches else sorted(scored)[:branches]
                    for s, tok, u in top:
                        if s < 0:
                            heappush(heap, (prob * s / total, order, tok, u, parent, depth + 1))
                            order += 1
            # Commit the best candidate.
            while heap:
                negp, _, tok, u, par, d = heappop(heap)
                i = len(tokens)
                tokens.append(tok)
                parents.append(par)
                probs.append(-negp)
                if len(tokens) >= budget:
                    return tokens, parents, probs
                if d < max_depth and tok not in eos and nxt[u]:
                    v, parent, prob, depth = u, i, -negp, d
                    break
            else:
                return tokens, parents, probs
