"""Lossless verification of draft trees (docs/design.md, section 6.2): the acceptance rule and the walk that applies it.

Let p be the policy's next-token distribution after temperature, top-k and top-p. A history draft is a point
mass, so the exact speculative-sampling rule is:

    at each tree node, draw the next token x from p (the engine's keyed draw for that output position);
    if x is a child of the node in the draft tree, accept it and continue from that child;
    otherwise x is the last token of this step: the bonus token.

Greedy decoding is the case x = argmax p. It is standard speculative sampling (accept draft d with
probability p(d), else sample from p without d) in its point-mass form, and multi-draft recursive rejection
sampling for a tree, so the output has exactly the policy's distribution. Because the draw at an output
position depends only on (seed, request, position), it is the very draw plain decoding makes there: a
speculative rollout is token-identical to a plain one with the same seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from rhymerl.histospec.drafter import Draft


def accept(children: dict[tuple[int, int], int], node: int, drawn: int) -> int | None:
    """The acceptance rule: the child of `node` whose token is `drawn` (accept it and go on from there), or
    None (`drawn` is the bonus token). `children` maps (parent node, token) -> node; node -1 is the
    sequence's last committed token."""
    return children.get((node, drawn))


@dataclass
class Verified:
    """One sequence's verified step: the accepted draft nodes along the path, the tokens to append (the
    accepted ones, then the bonus token) and their log-probs."""

    path: list[int]
    tokens: list[int]
    logprobs: list[float]


# draw(sequences, nodes, depths) -> (tokens, logprobs): the policy's keyed draw for each listed sequence at
# the logits row of its draft node (-1: its last committed token), `depths[k]` tokens past its committed end.
Draw = Callable[[list[int], list[int], list[int]], tuple[list[int], list[float]]]


def verify(drafts: list[Draft], draw: Draw) -> list[Verified]:
    """Walk every sequence's draft tree with `accept`, one tree level at a time for all of them, so that the
    engine samples only the rows the walks reach, in one call per level. A sequence without a draft takes
    one draw: plain decoding."""
    children = [{(p, t): j for j, (t, p) in enumerate(zip(d.tokens, d.parents))} for d in drafts]
    out = [Verified([], [], []) for _ in drafts]
    node = [-1] * len(drafts)
    live = list(range(len(drafts)))
    while live:
        tokens, logprobs = draw(live, [node[i] for i in live], [len(out[i].tokens) for i in live])
        still = []
        for i, x, lp in zip(live, tokens, logprobs):
            out[i].tokens.append(x)
            out[i].logprobs.append(lp)
            child = accept(children[i], node[i], x)
            if child is not None:
                out[i].path.append(child)
                node[i] = child
                still.append(i)
        live = still
    return out
