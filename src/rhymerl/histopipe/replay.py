"""How well a prompt's answers draft, read from its recorded tokens alone (docs/design.md, section 4, Pricing).

HistoPipe prices a request under HistoSpec by what its prompt's answers cost per token. Measured in the
calls (`RequestOutput.forwards`) that cost follows each worker's timing (HistoSpec's online correction of
its cost model, its pause when drafts stop paying by the clock), so one prompt ran at 1.07 to 2.35 tokens a
forward over four runs on the same tokens. Here it is counted from the tokens instead, which keyed sampling
makes the same in every run: each recorded response of the prompt is decoded again, token by token, by
HistoSpec's own drafter, budget and calibration, with the response's recorded tokens as the draws:

- the sources are HistoSpec's (`histospec.drafter.Drafter`, on `SuffixIndex`es): "history", the prompt's
  other recorded responses (leave-one-out: a new answer is drawn as the recorded ones were), each behind the
  prompt's last `SIBLING_PROMPT_TOKENS` tokens as `HistoryIndex` indexes them; "self", the prompt and the
  response's committed tokens. "siblings" is left out: the other recorded responses stand for the running
  group's answers, and whole, where the engine's siblings are only as far as they got;
- the drafter's settings are the speculator's: a `MATCH_WINDOW`-token window down to 2, trees of
  `max_draft` nodes at most, `MAX_BRANCHES` children a node, the longest match winning, ties to the source
  most certain of the next token;
- the nodes verified are those HistoSpec's budget keeps (`budget.uniform_cap`) for a full batch of `slots`
  rows drafting like this one, under the cost model (`CostModel.step`), each node valued at its path
  probability x the edge calibration's discount (`EdgeCalibration`, learnt from the replayed verifications
  as the engine learns from its own);
- a forward commits the draft's path the recorded response follows, plus one token.

Left out, as timing-driven: the online correction and the pause (`Speculator._pays`, against CPU time);
also each sequence's idle rounds (`SeqSpec.drafts_now`), which save drafting time, not forwards. Per
response the replay counts its forwards and its steps' cost in plain full-batch steps (`units`: each
forward's `CostModel.step` for `slots` rows drafting its kept width, over a plain step's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rhymerl.cost_model import CostModel
from rhymerl.histospec import budget
from rhymerl.histospec.calibration import EdgeCalibration, match_class
from rhymerl.histospec.drafter import Draft, Drafter
from rhymerl.histospec.speculator import MATCH_WINDOW, SIBLING_PROMPT_TOKENS
from rhymerl.histospec.suffix_index import SuffixIndex

MAX_BRANCHES = 4  # the speculator's default tree fan-out (`Speculator(max_branches=4)`)


@dataclass(frozen=True)
class Replayed:
    """One response replayed: its tokens, the forwards that committed them (the prefill's included), the
    draft tokens they verified, and their cost in plain full-batch steps (`units`: 1 a plain forward)."""

    tokens: int
    forwards: int
    drafted: int
    units: float


def accepted_path(draft: Draft, actual: Sequence[int]) -> list[int]:
    """The draft nodes the recorded tokens `actual` (the next ones to commit) follow from the root, in order:
    with keyed draws the engine's verification walk accepts exactly these (`histospec.verify`)."""
    children = {(p, t): i for i, (p, t) in enumerate(zip(draft.parents, draft.tokens))}
    path, node = [], -1
    for tok in actual:
        node = children.get((node, tok), -1)
        if node < 0:
            break
        path.append(node)
    return path


class Replay:
    """HistoSpec's drafting replayed over one prompt's recorded responses (module doc), under one cost model
    and batch size: `warm` teaches its calibration on the call's prompts, `prompt` then counts one prompt."""

    def __init__(self, cost: CostModel, slots: int, max_draft: int):
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots, self.max_draft = slots, max_draft
        self.drafter = Drafter(max_tokens=max_draft, max_depth=max_draft, max_branches=MAX_BRANCHES,
                               max_window=MATCH_WINDOW)
        self.calibration = EdgeCalibration(max(max_draft, 1))
        self.plain = cost.step(slots, slots)
        # a row's share of a full step in which every row verifies n draft tokens, the longest `longest`
        self.row_cost = lambda n, longest=0: cost.step(slots, slots, n * slots, longest) / slots

    def warm(self, prompt: Sequence[int], responses: Sequence[Sequence[int]]) -> None:
        """Teach the calibration how often the drafts of these responses are followed, depth by depth: each
        replayed with every draft verified whole (unbiased by the budget), every edge counted undecayed, so
        that the prompts warmed together weigh alike (a warm engine's calibration is its worker's, over all
        the prompts it ran)."""
        for response, history in zip(responses, self._histories(prompt, responses)):
            self._run(list(prompt), list(response), history, learn=True)

    def prompt(self, prompt: Sequence[int], responses: Sequence[Sequence[int]]) -> list[Replayed]:
        """Each response replayed against the others (its history) and itself, the budget valuing nodes by
        the calibration as `warm` left it (module doc)."""
        return [self._run(list(prompt), list(r), h) for r, h in zip(responses, self._histories(prompt, responses))]

    @staticmethod
    def _histories(prompt: Sequence[int], responses: Sequence[Sequence[int]]) -> list[SuffixIndex | None]:
        """Per response, the index of the others (leave-one-out), each behind the prompt's tail."""
        tail = list(prompt[-SIBLING_PROMPT_TOKENS:])
        out = []
        for j in range(len(responses)):
            history = SuffixIndex()
            for i, other in enumerate(responses):
                if i != j:
                    history.extend(history.add(tail), other)
            out.append(history if history.num_tokens else None)
        return out

    def _run(self, prompt: list[int], response: list[int], history: SuffixIndex | None,
             learn: bool = False) -> Replayed:
        """One response decoded again: the prefill commits its first token, then each forward commits the
        path of the kept draft the response follows and one token more. `learn`: every draft is kept whole
        and its edges counted into the calibration (`warm`)."""
        if not response:
            return Replayed(0, 0, 0, 0.0)
        own = SuffixIndex()
        own.add(prompt)
        own.extend(0, response[:1])
        at, forwards, drafted, units = 1, 1, 0, 1.0
        plain_rate = 1.0 / (self.plain / self.slots)
        while at < len(response):
            kept = Draft()
            if self.max_draft:
                context = (prompt + response[:at])[-MATCH_WINDOW:]
                draft = self.drafter.draft(context, history=history, own=own)
                if draft.tokens and learn:
                    kept = draft
                elif draft.tokens:
                    reach = self.calibration.discounts(match_class(draft.match_len))
                    values = [p * reach[k] for p, k in zip(draft.probs, draft.depths())]
                    order = sorted(range(len(values)), key=lambda i: (-values[i], i))
                    keep, _ = budget.uniform_cap([[values[i] for i in order]], self.row_cost, plain_rate)
                    kept = budget.prune(draft, set(order[:keep[0]]))
            path = accepted_path(kept, response[at:])
            if kept.tokens and learn:
                self.calibration.update(kept, path, decay=1.0)
            if kept.tokens:
                units += self.row_cost(len(kept), max(kept.depths())) / (self.plain / self.slots)
            else:
                units += 1.0
            n = min(len(path) + 1, len(response) - at)
            own.extend(0, response[at:at + n])
            at, forwards, drafted = at + n, forwards + 1, drafted + len(kept)
        return Replayed(len(response), forwards, drafted, units)

