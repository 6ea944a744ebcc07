"""Per-prompt rollout history for HistoSpec (docs/design.md, section 3).

For each prompt (keyed by a hash of its token ids) the store keeps the prompt and the responses of
its last `max_rollouts` rollouts with their rewards. Memory is bounded by a per-prompt and a total
token budget (prompt tokens included); whole prompts are evicted least-recently-used first. The
store is plain data (JSON) so it can be saved with every checkpoint and shipped to a rollout worker in
another process: every prompt carries a version that changes whenever its history does, `export(prompts)`
gives the slice a worker needs and `merge(slice)` brings a worker's replica up to date, touching only the
prompts whose version moved. The truth is the training loop's store; workers hold replicas.

Torch-free and index-free: HistoSpec's suffix indexes over these responses are built and cached by
`rhymerl.histospec.history_index.HistoryIndex`.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from rhymerl.atomic_file import atomic_write

_FORMAT = "rhymerl.history/1"


def prompt_key(prompt_ids: Sequence[int]) -> str:
    """Stable key of a prompt: blake2b (16 bytes, hex) of its token ids as little-endian int64.

    Explicit byte order and width keep the key identical across machines and runs (Python's own
    `hash` is salted per process), so a saved store finds its prompts after a resume.
    """
    data = struct.pack(f"<{len(prompt_ids)}q", *prompt_ids)
    return hashlib.blake2b(data, digest_size=16).hexdigest()


@dataclass
class Rollout:
    """One rollout of a prompt: its responses and their rewards (None when not known)."""

    responses: list[list[int]]
    rewards: list[float | None]


@dataclass
class _Entry:
    prompt: array
    rollouts: list[tuple[list[array], list[float | None]]] = field(default_factory=list)
    tokens: int = 0  # prompt + all stored responses
    version: int = 0  # the store's clock when this prompt's history last changed


class HistoryStore:
    """Responses of each prompt's last rollouts, with rewards, under token budgets.

    Args:
        max_rollouts: rollouts kept per prompt (K); older ones are dropped.
        max_tokens_per_prompt: budget for one prompt (its prompt tokens plus stored responses);
            over it, the oldest rollouts go first, then the newest rollout's last responses.
        max_total_tokens: budget for the whole store; over it, least-recently-used prompts are
            evicted whole. `record_rollout`, `responses`, `rollouts` and `version` count as uses.
    """

    def __init__(self, max_rollouts: int = 4, max_tokens_per_prompt: int = 1 << 16,
                 max_total_tokens: int = 1 << 24):
        if max_rollouts < 1:
            raise ValueError(f"max_rollouts must be >= 1, got {max_rollouts}")
        if max_tokens_per_prompt < 1 or max_total_tokens < 1:
            raise ValueError("token budgets must be >= 1")
        self.max_rollouts = max_rollouts
        self.max_tokens_per_prompt = max_tokens_per_prompt
        self.max_total_tokens = max_total_tokens
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._total = 0
        self._clock = 0  # bumped by every change of a prompt's history (its `version`)

    # ------------------------------------------------------------------ recording

    def record_rollout(self, prompt_ids: Sequence[int], responses: Sequence[Sequence[int]],
                       rewards: Sequence[float | None] | None = None) -> int:
        """Store one rollout of a prompt (its group's responses) and return how many responses were kept.

        Keeps the last `max_rollouts` rollouts, then applies the budgets (see the class doc). A
        prompt longer than its budget is not stored at all (returns 0); so is an empty rollout.
        """
        if rewards is not None and len(rewards) != len(responses):
            raise ValueError(f"{len(responses)} responses but {len(rewards)} rewards")
        rewards_list = [None if r is None else float(r) for r in rewards] if rewards is not None \
            else [None] * len(responses)
        budget = min(self.max_tokens_per_prompt, self.max_total_tokens)
        if not responses or len(prompt_ids) > budget:
            return 0
        key = prompt_key(prompt_ids)
        entry = self._entries.get(key)
        if entry is None:
            entry = _Entry(prompt=array("q", prompt_ids), tokens=len(prompt_ids))
            self._entries[key] = entry
            self._total += entry.tokens
        self._entries.move_to_end(key)
        self._clock += 1
        entry.version = self._clock  # its history changes: replicas and cached indexes see a new version
        stored = [array("q", r) for r in responses]
        entry.rollouts.append((stored, rewards_list))
        added = sum(len(r) for r in stored)
        entry.tokens += added
        self._total += added
        self._trim_entry(entry, budget)
        kept = len(entry.rollouts[-1][0]) if entry.rollouts and entry.rollouts[-1][0] is stored else 0
        if not entry.rollouts:
            self._drop(key)
        self._evict()
        return kept

    def _trim_entry(self, entry: _Entry, budget: int) -> None:
        def drop_rollout() -> None:
            responses, _ = entry.rollouts.pop(0)
            n = sum(len(r) for r in responses)
            entry.tokens -= n
            self._total -= n

        while len(entry.rollouts) > self.max_rollouts:
            drop_rollout()
        while entry.tokens > budget and len(entry.rollouts) > 1:
            drop_rollout()
        if entry.tokens > budget:
            # Only the newest rollout is left and it alone is too big: keep its first responses
            # (whole responses, so every stored response is a real one) while they fit.
            responses, rewards = entry.rollouts[-1]
            while entry.tokens > budget:
                n = len(responses.pop())
                rewards.pop()
                entry.tokens -= n
                self._total -= n
            if not responses:
                entry.rollouts.pop()

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key)
        self._total -= entry.tokens

    def _evict(self) -> None:
        while self._total > self.max_total_tokens:
            self._drop(next(iter(self._entries)))

    def clear(self) -> None:
        """Forget everything."""
        self._entries.clear()
        self._total = 0

    # ------------------------------------------------------------------ reading

    def _get(self, prompt: Sequence[int] | str) -> tuple[str, _Entry | None]:
        key = prompt if isinstance(prompt, str) else prompt_key(prompt)
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return key, entry

    def __contains__(self, prompt: Sequence[int] | str) -> bool:
        key = prompt if isinstance(prompt, str) else prompt_key(prompt)
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def responses(self, prompt: Sequence[int] | str) -> list[list[int]]:
        """All stored responses of a prompt (token ids, or its key), oldest rollout first; [] if none."""
        _, entry = self._get(prompt)
        if entry is None:
            return []
        return [r.tolist() for responses, _ in entry.rollouts for r in responses]

    def rollouts(self, prompt: Sequence[int] | str) -> list[Rollout]:
        """The stored rollouts of a prompt, oldest first, with their rewards; [] if none."""
        _, entry = self._get(prompt)
        if entry is None:
            return []
        return [Rollout([r.tolist() for r in responses], list(rewards))
                for responses, rewards in entry.rollouts]

    def keys(self) -> list[str]:
        """The keys of every stored prompt, least recently used first."""
        return list(self._entries)

    def prompt(self, key: str) -> list[int] | None:
        """The prompt stored under `key`, or None."""
        entry = self._entries.get(key)
        return None if entry is None else entry.prompt.tolist()

    def size(self) -> dict[str, int]:
        """Counts: prompts, rollouts, responses and tokens (prompt tokens included)."""
        rollouts = sum(len(e.rollouts) for e in self._entries.values())
        responses = sum(len(r) for e in self._entries.values() for r, _ in e.rollouts)
        return {"prompts": len(self._entries), "rollouts": rollouts, "responses": responses,
                "tokens": self._total}

    def version(self, prompt: Sequence[int] | str) -> int | None:
        """The prompt's version (changes whenever its history does), or None when it has none. A use."""
        _, entry = self._get(prompt)
        return None if entry is None else entry.version

    def stored(self, prompt: Sequence[int] | str) -> tuple[array, list[tuple[list[array], list]]] | None:
        """(prompt tokens, [(responses, rewards) per rollout, oldest first]) as stored, without copies, for
        building an index (`HistoryIndex`); None when the prompt has no history. Do not mutate. A use."""
        _, entry = self._get(prompt)
        return None if entry is None else (entry.prompt, entry.rollouts)

    # ------------------------------------------------------------------ shipping to workers

    def export(self, prompts: Iterable[Sequence[int] | str]) -> dict:
        """The slice of the store that rollouts of `prompts` draft from (those that have a history), with
        their versions: plain data, for a worker's replica (`merge`)."""
        items = {}
        for prompt in prompts:
            key = prompt if isinstance(prompt, str) else prompt_key(prompt)
            entry = self._entries.get(key)
            if entry is not None and key not in items:
                items[key] = _entry_state(key, entry)
        return {"format": _FORMAT, "prompts": list(items.values())}

    def merge(self, state: dict) -> int:
        """Bring this replica up to date with a slice from `export`: each prompt whose version differs from
        this store's is replaced (then re-trimmed to this store's budgets); equal versions are left alone,
        so their cached indexes stay valid. Returns how many prompts were replaced."""
        if state.get("format") != _FORMAT:
            raise ValueError(f"not a history store state (format {state.get('format')!r})")
        replaced = 0
        for item in state["prompts"]:
            key = prompt_key(item["prompt"])
            entry = self._entries.get(key)
            if entry is not None and entry.version == item["version"]:
                self._entries.move_to_end(key)
                continue
            if entry is not None:
                self._drop(key)
            for rollout in item["rollouts"]:
                self.record_rollout(item["prompt"], rollout["responses"], rollout["rewards"])
            if key in self._entries:
                self._entries[key].version = item["version"]
            replaced += 1
        return replaced

    # ------------------------------------------------------------------ persistence

    def state_dict(self) -> dict:
        """Plain JSON-able data: the configuration and every prompt, least recently used first."""
        return {
            "format": _FORMAT,
            "config": {"max_rollouts": self.max_rollouts,
                       "max_tokens_per_prompt": self.max_tokens_per_prompt,
                       "max_total_tokens": self.max_total_tokens},
            "clock": self._clock,
            "prompts": [_entry_state(key, e) for key, e in self._entries.items()],
        }

    def load_state_dict(self, state: dict) -> None:
        """Replace the contents with `state` (from `state_dict`).

        The store keeps its own configuration (like a module keeps its hyperparameters): the
        loaded history is re-trimmed to this store's budgets. Keys are recomputed from the prompts.
        """
        if state.get("format") != _FORMAT:
            raise ValueError(f"not a history store state (format {state.get('format')!r})")
        self.clear()
        for item in state["prompts"]:
            for rollout in item["rollouts"]:
                self.record_rollout(item["prompt"], rollout["responses"], rollout["rewards"])
            # record_rollout moved it to the most recent end: loading in order restores LRU order.
            entry = self._entries.get(prompt_key(item["prompt"]))
            if entry is not None and "version" in item:  # the versions replicas were sent go on holding
                entry.version = item["version"]
        self._clock = max(self._clock, state.get("clock", 0))

    def save(self, path: str | os.PathLike) -> None:
        """Write the store as JSON atomically (`atomic_write`)."""
        with atomic_write(path) as f:
            json.dump(self.state_dict(), f, separators=(",", ":"))

    def load(self, path: str | os.PathLike) -> None:
        """Replace the contents with the JSON file written by `save`."""
        with open(path, encoding="utf-8") as f:
            self.load_state_dict(json.load(f))

    def __repr__(self) -> str:
        s = self.size()
        return f"HistoryStore(prompts={s['prompts']}, rollouts={s['rollouts']}, tokens={s['tokens']})"


def _entry_state(key: str, e: _Entry) -> dict:
    return {"key": key, "prompt": e.prompt.tolist(), "version": e.version,
            "rollouts": [{"responses": [r.tolist() for r in responses], "rewards": list(rewards)}
                         for responses, rewards in e.rollouts]}
