"""HistoSpec drafting, torch-free (DESIGN.md section 3).

- `SuffixIndex`: incremental generalised suffix automaton over token sequences, with occurrence
  counts and per-sequence weights (rewards).
- `HistoryStore`: each prompt's last rollouts with rewards, under token budgets, saved as JSON.
- `Drafter` / `Draft`: draft token trees from history, siblings and the sequence itself.
"""

from rhymerl.spec.drafter import Draft, Drafter
from rhymerl.spec.history import HistoryStore, Rollout, prompt_key
from rhymerl.spec.suffix_index import SuffixIndex

__all__ = ["Draft", "Drafter", "HistoryStore", "Rollout", "SuffixIndex", "prompt_key"]
