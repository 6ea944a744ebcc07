"""HistoSpec's counters (drafted, accepted, by source, drafting time), for an engine or one request."""

from __future__ import annotations

from dataclasses import dataclass, field

from rhymerl.histospec.drafter import Draft


@dataclass
class SpecStats:
    """HistoSpec's work, for the whole engine (`Speculator.stats`) or for one request
    (`RequestOutput.spec`)."""

    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # draft tokens accepted
    accepted_by_source: dict = field(default_factory=lambda: {"history": 0, "siblings": 0, "self": 0})
    verify_steps: int = 0  # (sequence, step) pairs that verified a non-empty draft
    # time spent drafting and choosing the budget; for a request, its share: each drafting step's time
    # split evenly over the sequences that drafted in it
    draft_s: float = 0.0

    @property
    def accept_rate(self) -> float:
        return self.accepted / max(self.drafted, 1)

    @property
    def mean_accepted_len(self) -> float:
        """Accepted draft tokens per verified draft."""
        return self.accepted / max(self.verify_steps, 1)

    def add(self, draft: Draft, accepted: int) -> None:
        """Count one verified draft and how many of its tokens the policy accepted."""
        self.drafted += len(draft.tokens)
        self.accepted += accepted
        self.accepted_by_source[draft.source] += accepted
        self.verify_steps += 1

    def merge(self, other: "SpecStats") -> None:
        """Add another's counts to these (several workers' stats into one)."""
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.verify_steps += other.verify_steps
        self.draft_s += other.draft_s
        for src, n in other.accepted_by_source.items():
            self.accepted_by_source[src] = self.accepted_by_source.get(src, 0) + n
