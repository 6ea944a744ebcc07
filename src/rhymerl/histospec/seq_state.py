"""A sequence's HistoSpec state in one engine (`Speculator.start` makes it, `propose` and `commit` use it):
its own suffix index, its siblings' shared one (`SiblingGroup`), its draft length and how long its drafts have
gone unused (`SeqSpec`), and what HistoSpec reads of an engine sequence (`DraftingSequence`, `tail`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from rhymerl.histospec.budget import PROBE_EVERY
from rhymerl.histospec.stats import SpecStats
from rhymerl.histospec.suffix_index import SuffixIndex


@dataclass
class SiblingGroup:
    """The responses of the sequences sharing a prompt in this batch, as one suffix index (one sequence per
    sibling), plus the tokens committed since the index was last read: the index is only read when
    drafting, so it catches up then (`flush`) and not after every step."""

    index: SuffixIndex = field(default_factory=SuffixIndex)
    unindexed: dict[int, list[int]] = field(default_factory=dict)  # sibling id -> tokens not in `index` yet

    def flush(self) -> None:
        for sid, tokens in self.unindexed.items():
            if tokens:
                self.index.extend(sid, tokens)
                tokens.clear()


@dataclass
class SeqSpec:
    """A sequence's speculation state: its own index, its place among its siblings, its draft length.
    Committed tokens reach `own` (and the group) only when the sequence drafts next: a sequence that
    finishes first, or a step where drafting is paused, never pays for indexing them."""

    own: SuffixIndex
    group: SiblingGroup
    sibling_id: int
    history: SuffixIndex | None
    length: int
    stats: SpecStats = field(default_factory=SpecStats)  # this request's (RequestOutput.spec)
    unindexed: list[int] = field(default_factory=list)  # committed tokens not in `own` yet
    idle: int = 0  # consecutive drafting steps that kept none of this sequence's draft (see Speculator.plan)

    def drafts_now(self) -> bool:
        """After PROBE_EVERY drafting steps in a row that kept nothing of its draft, a sequence drafts only
        every PROBE_EVERY-th time: at a high temperature most sequences match nothing useful, and drafting and
        indexing them at every step cost more than the few tokens the others' drafts gain."""
        return self.idle < PROBE_EVERY or self.idle % PROBE_EVERY == 0

    def flush(self) -> None:
        if self.unindexed:
            self.own.extend(0, self.unindexed)
            self.unindexed.clear()
        self.group.flush()


class DraftingSequence(Protocol):
    """What HistoSpec reads of an engine sequence (`rhymerl.engine.sequence.Sequence`); `spec` is its own."""

    group: object  # siblings share a group
    prompt_ids: list[int]
    output_ids: list[int]
    spec: SeqSpec | None


def tail(seq: DraftingSequence, n: int) -> list[int]:
    """The last n tokens of prompt + output, without copying the whole sequence."""
    out = seq.output_ids[-n:]
    return out if len(out) == n else seq.prompt_ids[-(n - len(out)):] + out
