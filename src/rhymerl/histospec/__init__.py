"""HistoSpec (docs/histospec.md): speculative decoding whose drafts come from each prompt's earlier responses.

- `suffix_index`: an incremental generalised suffix automaton over token sequences, with counts and weights.
- `drafter`: draft token trees from history, siblings and the sequence itself.
- `budget`: which draft nodes a step verifies (by the measured cost model), probe steps, draft-length rules.
- `calibration`: how often the policy follows a drafted edge, by depth and match class.
- `verify`: the acceptance rule (lossless) and the walk that applies it.
- `seq_state`: a sequence's speculation state (its indexes, draft length, idle count).
- `speculator`: the engine's two calls a step, `propose` and `commit`.

Torch-free. The engine imports it; it imports only the leaves `rhymerl.history` and `rhymerl.cost_model`.
"""

from rhymerl.histospec.drafter import Draft, Drafter
from rhymerl.histospec.speculator import Speculator
from rhymerl.histospec.stats import SpecStats
from rhymerl.histospec.suffix_index import SuffixIndex
from rhymerl.histospec.verify import Verified, accept, verify

__all__ = ["Draft", "Drafter", "SpecStats", "Speculator", "SuffixIndex", "Verified", "accept", "verify"]
