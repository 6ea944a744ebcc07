"""Continuous batching over a fixed number of slots (torch-free).

A slot is one row of the preallocated KV cache. A finished sequence frees its slot and the next waiting
request takes it in the very next step, so the batch stays full until the queue runs dry.
"""

from __future__ import annotations

import time
from collections import deque

from rhymerl.engine.sequence import Sequence, Status


class Scheduler:
    def __init__(self, num_slots: int, max_prefill_tokens: int):
        self.num_slots = num_slots
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # slot -> sequence
        self.free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest slot first

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Sequence]:
        """Admit waiting requests into free slots (within the prefill token budget), then return every
        running sequence, in slot order. The first admission is always allowed so a long prompt cannot
        starve."""
        budget = self.max_prefill_tokens
        admitted_any = False
        while self.waiting and self.free_slots:
            seq = self.waiting[0]
            if admitted_any and len(seq.prompt_ids) > budget:
                break
            self.waiting.popleft()
            budget -= len(seq.prompt_ids)
            admitted_any = True
            seq.slot = self.free_slots.pop()
            seq.status = Status.RUNNING
            seq.admitted = time.perf_counter()
            self.running[seq.slot] = seq
        return [self.running[s] for s in sorted(self.running)]

    def finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        del self.running[seq.slot]
        self.free_slots.append(seq.slot)
        self.free_slots.sort(reverse=True)

    def compact(self) -> list[tuple[Sequence, int]]:
        """When nothing waits, move the highest running sequences into the lowest free slots so that the
        running slots are 0..n-1: attention then reads exactly n cache rows, with no idle slot in between
        (a waiting request would fill the hole next step anyway). Returns (sequence, old slot) per move;
        the caller moves the cache rows."""
        moves = []
        while not self.waiting and self.free_slots and self.running:
            hole, top = min(self.free_slots), max(self.running)
            if hole > top:
                break
            seq = self.running.pop(top)
            self.free_slots.remove(hole)
            self.free_slots.append(top)
            self.free_slots.sort(reverse=True)
            seq.slot = hole
            self.running[hole] = seq
            moves.append((seq, top))
        return moves
