"""Suffix indexes over a history store's responses, built on first use and cached per prompt version.

The store (`rhymerl.history.HistoryStore`) is plain data; drafting needs each prompt's responses as one
`SuffixIndex`. Building one costs about 2 us per token, so indexes are kept (a bounded LRU cache) until their
prompt's version changes.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence

from rhymerl.histospec.suffix_index import SuffixIndex
from rhymerl.history import HistoryStore, prompt_key


class HistoryIndex:
    """`index(prompt)`: a SuffixIndex over the prompt's stored responses (weight = reward, 1.0 when unknown).

    Args:
        store: the history to index.
        max_index_tokens: tokens in the cached indexes (LRU; the most recently used one is always kept). An
            index costs about 0.5 KB per token (Python dicts), so the default 2M tokens is about 1 GB; it is
            only needed while its prompt's group is being generated.
        index_prompt_tokens: each response is indexed with this many of the prompt's last tokens in front, so
            that the first response tokens can be drafted from the end of the prompt.
    """

    def __init__(self, store: HistoryStore, max_index_tokens: int = 1 << 21, index_prompt_tokens: int = 8):
        if max_index_tokens < 0 or index_prompt_tokens < 0:
            raise ValueError("max_index_tokens and index_prompt_tokens must be >= 0")
        self.store = store
        self.max_index_tokens = max_index_tokens
        self.index_prompt_tokens = index_prompt_tokens
        self._indexes: OrderedDict[str, tuple[int, SuffixIndex]] = OrderedDict()  # key -> (version, index)
        self._index_tokens = 0  # tokens in the cached indexes

    def index(self, prompt: Sequence[int] | str) -> SuffixIndex | None:
        """The prompt's index (token ids or its key), None when it has no history. Do not mutate it."""
        key = prompt if isinstance(prompt, str) else prompt_key(prompt)
        version = self.store.version(key)  # a use of the prompt in the store's LRU order
        cached = self._indexes.get(key)
        if cached is not None and cached[0] == version:
            self._indexes.move_to_end(key)
            return cached[1]
        if cached is not None:  # stale: the prompt's history changed (or it was evicted)
            del self._indexes[key]
            self._index_tokens -= cached[1].num_tokens
        if version is None:
            return None
        prompt_ids, rollouts = self.store.stored(key)
        index = SuffixIndex()
        tail = prompt_ids[-self.index_prompt_tokens:] if self.index_prompt_tokens else array("q")
        for responses, rewards in rollouts:
            for response, reward in zip(responses, rewards):
                sid = index.add(tail, 1.0 if reward is None else reward)
                index.extend(sid, response)
        self._indexes[key] = (version, index)
        self._index_tokens += index.num_tokens
        while self._index_tokens > self.max_index_tokens and len(self._indexes) > 1:
            self._index_tokens -= self._indexes.popitem(last=False)[1][1].num_tokens
        return index
