"""Edge calibration: how often the policy actually follows a drafted edge, by depth and match class.

The drafter's shares are optimistic (a continuation every history response took has share 1, yet a new
response leaves it with some probability at every token), so a node at depth k is worth
probs[j] * c_0 * ... * c_{k-1} accepted tokens, where c_d is the calibrated continuation factor out of
depth d (0 = the committed token). By depth because continuing is not memoryless: a response that has
followed its history for 10 tokens is copying a span and likely goes on, while the first edge is where most
drafts fail; one constant c (c**k) made long chains look worth far less than they are and kept the tail's
drafts short. Also by match class: a draft from a match of LONG_MATCH tokens or more is followed clearly
more often than one from a 2-token match (docs/notebook, bench spec at e908d1a).
"""

from __future__ import annotations

from rhymerl.histospec.drafter import Draft

# Edge calibration is kept apart for drafts from matches shorter than LONG_MATCH tokens and the rest.
LONG_MATCH = 7
MATCH_CLASSES = 2
DECAY = 0.99  # per verified draft: recent verifications count most


def match_class(match_len: int) -> int:
    """0: the draft's match was shorter than LONG_MATCH tokens; 1: it was not."""
    return int(match_len >= LONG_MATCH)


class EdgeCalibration:
    """Decayed counts, per match class and depth, of continuations the drafter predicted and the policy took."""

    def __init__(self, max_draft_tokens: int):
        self.num = [[0.0] * (max_draft_tokens + 1) for _ in range(MATCH_CLASSES)]  # continuations seen
        self.den = [[0.0] * (max_draft_tokens + 1) for _ in range(MATCH_CLASSES)]  # ... and predicted

    def factors(self, cls: int | None = None) -> list[float]:
        """c_d for d = 0..max_draft_tokens-1 for drafts of match class `cls` (None: all drafts pooled).
        Estimates are shrunk (weight of one observation) so that what is rarely verified borrows: pooled,
        each depth towards the one above it (depth 0 towards 0.5); a class, each depth towards the pooled
        estimate of that depth."""
        num = [sum(c) for c in zip(*self.num)]
        den = [sum(c) for c in zip(*self.den)]
        pooled, prior = [], 0.5
        for n, d in zip(num, den):
            prior = min((n + prior) / (d + 1.0), 1.0)
            pooled.append(prior)
        if cls is not None:
            pooled = [min((n + p) / (d + 1.0), 1.0) for n, d, p in zip(self.num[cls], self.den[cls], pooled)]
        return pooled[:-1]

    def discounts(self, cls: int | None = None) -> list[float]:
        """[max_draft_tokens + 1]: entry k = c_0 * ... * c_{k-1}, the factor on a depth-k node's share."""
        out = [1.0]
        for c in self.factors(cls):
            out.append(out[-1] * c)
        return out

    def update(self, draft: Draft, accepted_nodes: list[int], decay: float = DECAY) -> None:
        """Learn from one verified draft: at each node the walk reached, the drafter predicted the walk would
        continue with probability (sum of the children's shares); it did continue at every node but the last.
        `decay`: the weight left to what was counted before (1.0: every draft counts alike, as a replay of
        recorded responses wants, where no draft is more recent than another)."""
        cls = match_class(draft.match_len)
        num, den = self.num[cls], self.den[cls]
        for d, (predicted, continued) in enumerate(edge_events(draft, accepted_nodes)):
            num[d] = decay * num[d] + continued
            den[d] = decay * den[d] + predicted

    def state_dict(self) -> dict:
        return {"num": [list(r) for r in self.num], "den": [list(r) for r in self.den]}

    def load_state_dict(self, state: dict) -> None:
        self.num, self.den = [list(r) for r in state["num"]], [list(r) for r in state["den"]]


def edge_events(draft: Draft, accepted_nodes: list[int]) -> list[tuple[float, int]]:
    """Per depth d of the nodes a verification walk reached (the root at depth 0, then every accepted
    node): (predicted continuations, actual continuations). A reached node with drafted children predicts
    a continuation with the sum of their shares (child path probability / the node's); a leaf predicts
    nothing. The walk continued out of every reached node but the last."""
    share_sum: dict[int, float] = {}
    for j, (par, p) in enumerate(zip(draft.parents, draft.probs)):
        base = 1.0 if par < 0 else draft.probs[par]
        share_sum[par] = share_sum.get(par, 0.0) + (p / base if base > 0 else 0.0)
    reached = [-1] + accepted_nodes
    return [(share_sum.get(v, 0.0), int(d < len(accepted_nodes))) for d, v in enumerate(reached)]
